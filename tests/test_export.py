"""export on the converted backbone of a real tiny pretrain run: real dynamo export, onnx checker, ONNX Runtime."""

from __future__ import annotations

from typing import Any

import onnx
import pytest
import torch

from dinov3_core.config import load_config
from dinov3_core.errors import WsidinoError
from dinov3_core.export.config import ExportConfig
from dinov3_core.export.onnx_export import FORBIDDEN_OPS, run_export
from dinov3_core.inference.backbone import BackboneFeatures, load_backbone
from dinov3_core.inference.onnx_runtime import ort_session
from tests.helpers import sqlite_uri


def test_export_is_dynamic_rope_in_graph_and_matches_pytorch(exported, converted) -> None:
    result = exported
    print(f"\nexport {result.export_seconds:.1f} s, {result.n_nodes} nodes, max abs error {result.max_abs_error:.2e}")
    assert result.max_abs_error < 1e-4
    assert {(r["batch"], r["height"], r["width"]) for r in result.parity} == {
        (1, 32, 64),
        (1, 64, 32),
        (3, 32, 64),
        (3, 64, 32),
    }
    errors = [e for r in result.parity for e in r["outputs"].values()]
    assert all(e["rel"] == pytest.approx(e["abs"] / e["scale"]) for e in errors) and result.max_rel_error < 1e-5
    proto = onnx.load(str(result.path))
    ops = {node.op_type for node in proto.graph.node}
    assert not ops & FORBIDDEN_OPS and {"Sin", "Cos", "Range"} <= ops  # RoPE computed in the graph
    onnx.checker.check_model(str(result.path), full_check=True)
    (inp,) = proto.graph.input
    dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    assert dims[1] == 3 and all(isinstance(d, str) for d in (dims[0], dims[2], dims[3])), dims
    assert [o.name for o in proto.graph.output] == ["cls", "patch_tokens"]

    # a shape not used at export or in the parity check: batch 2, 48 × 80
    session = ort_session(result.path)
    model = BackboneFeatures(load_backbone(converted)).eval()
    x = torch.randn(2, 3, 48, 80)
    cls, patch = session.run(None, {"pixel_values": x.numpy()})
    with torch.no_grad():
        ref_cls, ref_patch = model(x)
    assert patch.shape == (2, 3 * 5, 64)
    assert abs(cls - ref_cls.numpy()).max() < 1e-4 and abs(patch - ref_patch.numpy()).max() < 1e-4


def exported_by_the_runner(cfg: ExportConfig) -> Any:
    """The export stage as the CLI and Prefect run it: the runner's MLflow run is the one the model registers from
    (a bare `run_export` call opens none)."""
    from dinov3_core.runner import run_stage

    return run_stage("export", cfg, force=True).result


def test_pooled_fp16_external_data_and_mlflow_registration(converted, tmp_path) -> None:
    uri = sqlite_uri(tmp_path)
    values = {
        "weights": str(converted),
        "output": str(tmp_path / "onnx" / "pooled.onnx"),
        "pooled": True,
        "fp16": True,
        "external_data": "always",
        "parity_batches": [2],
        "tracking.enabled": True,
        "tracking.uri": uri,
        "tracking.experiment": "export-test",
    }
    result = exported_by_the_runner(load_config(ExportConfig, "default", values, stage="export"))
    assert result.outputs == ["pooled"] and result.max_abs_error < 1e-4
    assert result.data_path is not None and result.data_path.is_file()
    assert result.data_path.stat().st_size > 2 * result.path.stat().st_size  # the weights live beside the graph
    assert result.data_path.name == "pooled.onnx.data"
    onnx.checker.check_model(str(result.path))
    (out,) = ort_session(result.path).run(None, {"pixel_values": torch.randn(1, 3, 32, 32).numpy()})
    assert out.shape == (1, 128)
    assert result.fp16_path is not None and result.fp16_path.name == "pooled_fp16.onnx"
    onnx.checker.check_model(str(result.fp16_path))
    assert result.fp16_max_abs_error is not None and result.fp16_max_abs_error < 2e-2  # fp16 vs fp32 PyTorch

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    version = client.get_model_version_by_alias("wsidino-backbone", "candidate")
    assert str(version.version) == result.model_version
    # The version's page, beside MLflow's own "Promote model" and alias buttons, says which one moves @champion.
    card = (result.path.parent / "MODEL_CARD.md").read_text()
    for text in (card, version.description):
        promotion = text.split("## Promotion", 1)[1].split("\n## ", 1)[0]
        assert "moved only by wsidino's evaluate gate" in promotion and "evidence line" in promotion
        assert "by hand in the MLflow UI" in promotion and "bypasses that evaluation" in promotion
        assert "To roll back" in promotion and "set_registered_model_alias" in promotion
    run = client.get_run(version.run_id)
    assert run.info.status == "FINISHED" and float(run.data.metrics["max_abs_error"]) < 1e-4


def test_rerunning_export_with_unchanged_weights_registers_no_new_version(converted, tmp_path) -> None:
    from mlflow import MlflowClient

    uri = sqlite_uri(tmp_path)
    values = {
        "weights": str(converted),
        "parity_sizes": [32],
        "parity_batches": [1],
        "register_name": "rerun-test",
        "tracking.uri": uri,
        "tracking.experiment": "export-rerun",
    }
    first = exported_by_the_runner(
        load_config(ExportConfig, "default", {**values, "output": str(tmp_path / "a.onnx")}, stage="export")
    )
    again = exported_by_the_runner(
        load_config(ExportConfig, "default", {**values, "output": str(tmp_path / "b.onnx")}, stage="export")
    )
    assert (first.reused_version, again.reused_version) == (False, True)
    assert again.model_version == first.model_version
    client = MlflowClient(tracking_uri=uri)
    assert len(client.search_model_versions("name='rerun-test'")) == 1
    pooled = exported_by_the_runner(
        load_config(
            ExportConfig, "default", {**values, "output": str(tmp_path / "c.onnx"), "pooled": True}, stage="export"
        )
    )
    assert not pooled.reused_version and pooled.model_version != first.model_version  # another graph: a version


def test_timeout_and_bad_weights_give_clear_errors(converted, tmp_path) -> None:
    values = {"weights": str(converted), "output": str(tmp_path / "m.onnx"), "timeout_s": 0.5}
    with pytest.raises(WsidinoError, match="timeout_s"):
        run_export(load_config(ExportConfig, "default", values, stage="export"))
    assert not (tmp_path / "m.onnx").exists()
    with pytest.raises(WsidinoError, match="not found"):
        run_export(load_config(ExportConfig, "default", {**values, "weights": str(tmp_path / "x.pth")}, stage="export"))
    bad = tmp_path / "bad.pth"
    torch.save({"foo": torch.zeros(1)}, bad)
    with pytest.raises((WsidinoError, ValueError)):
        run_export(load_config(ExportConfig, "default", {**values, "weights": str(bad)}, stage="export"))


def test_the_parity_gate_is_relative_to_the_output_scale(converted, tmp_path) -> None:
    """Weights whose outputs are 10,000× larger (a scaled final LayerNorm) have 10,000× larger absolute errors in
    fp32: the gate, relative to each output's scale, passes them; an absolute-only gate (parity_rtol=0) cannot."""
    import shutil

    state = torch.load(converted, map_location="cpu", weights_only=True)
    state = {k: v * 1e4 if k in ("norm.weight", "norm.bias") else v for k, v in state.items()}
    scaled = tmp_path / "scaled" / "backbone.pth"
    scaled.parent.mkdir()
    torch.save(state, scaled)
    shutil.copy(converted.parent / "config.yaml", scaled.parent / "config.yaml")
    values = {
        "weights": str(scaled),
        "output": str(tmp_path / "scaled.onnx"),
        "parity_sizes": [32],
        "parity_batches": [2],
        "tracking.enabled": False,
    }
    result = run_export(load_config(ExportConfig, "default", values, stage="export"))
    scales = [e["scale"] for r in result.parity for e in r["outputs"].values()]
    assert min(scales) > 1e3 and result.max_rel_error < 1e-5 < result.max_abs_error / 1e3
    with pytest.raises(WsidinoError, match="parity_rtol=0"):
        run_export(load_config(ExportConfig, "default", {**values, "parity_rtol": 0.0}, stage="export"))


def test_a_long_model_card_is_cut_at_a_section_for_the_registry() -> None:
    from dinov3_core.export.model_card import registry_description

    card = "# Model\n\nintro\n\n## Training\n" + "| a | b |\n" * 300 + "\n## Evaluation\n" + "| c | d |\n" * 300
    short = registry_description(card, limit=5000)
    assert len(short) <= 5000 and short.startswith("# Model\n\nintro\n\n## Training\n")
    assert "## Evaluation" not in short and "| c | d |" not in short and short.endswith("beside the model file._\n")
    assert registry_description("# small card\n") == "# small card\n"
    one_section = "# Model\n" + "| a | b |\n" * 1000  # no section boundary: cut at a line, never inside one
    assert registry_description(one_section).split("\n\n_The registry")[0].endswith("| a | b |")
