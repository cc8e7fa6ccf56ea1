"""The backbone as a Hugging Face model: the export stage writes it beside the ONNX file, transformers loads it
offline (`AutoModel.from_pretrained`) and gives this project's CLS and patch features; a model that does not match
fails naming the first differing layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dinov3_core.config import load_config
from dinov3_core.export.config import ExportConfig
from dinov3_core.inference.backbone import BackboneFeatures, load_backbone
from dinov3_core.runner import run_stage

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]')")


@pytest.fixture(scope="module")
def hf_export(converted: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("hf") / "model" / "model.onnx"
    values = {
        "weights": str(converted),
        "output": str(out),
        "huggingface": True,
        "parity_sizes": [32],
        "parity_batches": [1],
        "tracking.enabled": False,
    }
    outcome = run_stage("export", load_config(ExportConfig, "default", values, stage="export"))
    return {"dir": out.parent / "hf", "outcome": outcome, "weights": converted}


def test_the_export_stage_writes_a_model_transformers_loads_offline(hf_export: dict) -> None:
    from transformers import AutoModel

    hf_dir, outcome = hf_export["dir"], hf_export["outcome"]
    assert {p.name for p in hf_dir.iterdir()} == {
        "config.json",
        "model.safetensors",
        "README.md",
        "wsidino_parity.json",
    }
    assert (hf_dir / "README.md").read_text() == (hf_dir.parent / "MODEL_CARD.md").read_text()
    assert outcome.manifest.outputs["huggingface"].endswith("hf/model.safetensors")
    assert outcome.manifest.summary["hf_max_rel_error"] < 1e-5

    model = AutoModel.from_pretrained(hf_dir, local_files_only=True).eval()
    assert type(model).__name__ == "DINOv3ViTModel"
    ours = BackboneFeatures(load_backbone(hf_export["weights"])).eval()
    x = torch.randn(3, 3, 48, 80, generator=torch.Generator().manual_seed(1))  # a shape the check did not use
    model.rope_embeddings.inv_freq = 1 / torch.tensor(model.config.wsidino_rope_periods)  # the line in docs/stages.md
    with torch.no_grad():
        tokens = model(pixel_values=x).last_hidden_state
        cls, patch = ours(x)
    skip = 1 + model.config.num_register_tokens
    assert tokens.shape == (3, skip + 3 * 5, cls.shape[-1])
    assert float((tokens[:, 0] - cls).abs().max()) < 1e-4 + 1e-5 * float(cls.abs().max())
    assert float((tokens[:, skip:] - patch).abs().max()) < 1e-4 + 1e-5 * float(patch.abs().max())
    figures = json.loads((hf_dir / "wsidino_parity.json").read_text())
    assert figures["max_rel_error"] <= figures["as_loaded_rel_error"] + 1e-9


def test_a_model_that_differs_is_named_by_its_first_differing_layer(hf_export: dict) -> None:
    from transformers import AutoModel

    from dinov3_core.export.hf_export import HFExportError, _compare

    model = AutoModel.from_pretrained(hf_export["dir"], local_files_only=True).eval()
    model.rope_embeddings.inv_freq = 1 / torch.tensor(model.config.wsidino_rope_periods)
    ours = BackboneFeatures(load_backbone(hf_export["weights"])).eval()
    fields = model.config.to_dict()
    _compare(model, ours, fields, 1e-4, 1e-5)  # as written: within the gate
    last = model.config.num_hidden_layers - 1
    with torch.no_grad():
        model.model.layer[last].layer_scale2.lambda1 += 0.5  # what a wrong key mapping of one layer would do
    with pytest.raises(HFExportError, match=rf"first differing output: layer {last} "):
        _compare(model, ours, fields, 1e-4, 1e-5)
