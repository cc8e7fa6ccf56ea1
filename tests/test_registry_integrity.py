"""The registry cannot be swapped under the gate silently (a real MLflow registry on SQLite, real exports):

- `@champion` moved by hand to a version the gate never promoted is reported by evaluate, and a retraining cycle
  does not build on it unless told to;
- the champion's registered file is hash-checked when evaluate uses it, and a candidate registered as the champion's
  version must be that version's file;
- a backbone saved again with the same tensors (other bytes) reuses its registered version.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dinov3_core.config import load_config
from dinov3_core.evaluate.config import EvaluateConfig, EvaluateError
from dinov3_core.evaluate.models import candidate_model, champion_model, check_same_file
from dinov3_core.retrain import registry
from dinov3_core.retrain.config import RetrainError, load_retrain_config
from dinov3_core.retrain.warm_start import decide_warm_start
from tests.helpers import eval_backbone, export_registered, sqlite_uri

NAME = "registry-integrity"


@pytest.fixture(scope="module")
def registered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two exported and registered versions of vit_test backbones; no gate ever ran on them."""
    root = tmp_path_factory.mktemp("registry")
    uri = sqlite_uri(root)
    a = eval_backbone(root / "a", "vit_test")
    b = eval_backbone(root / "b", "vit_test", colour_blind=True)
    onnx_a, version_a = export_registered(a, NAME, uri)
    onnx_b, version_b = export_registered(b, NAME, uri)
    return {"root": root, "uri": uri, "a": a, "onnx_a": onnx_a, "va": version_a, "onnx_b": onnx_b, "vb": version_b}


def evaluate_config(setup: dict[str, Any], candidate: Path) -> EvaluateConfig:
    values = {
        "store": "unused.zarr",
        "candidate": str(candidate),
        "output": str(setup["root"] / "evaluation"),
        "register_name": NAME,
        "tracking.uri": setup["uri"],
    }
    return load_config(EvaluateConfig, None, values)


def move_champion_by_hand(setup: dict[str, Any], version: str) -> None:
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=setup["uri"]).set_registered_model_alias(NAME, "champion", version)


def test_a_champion_moved_by_hand_is_reported_by_evaluate(registered: dict[str, Any], tmp_path: Path) -> None:
    move_champion_by_hand(registered, registered["vb"])
    warnings: list[str] = []
    champion = champion_model(evaluate_config(registered, registered["onnx_a"]), tmp_path / "cache", warnings)
    assert champion is not None and champion.version == registered["vb"] and champion.path.is_file()
    (said,) = warnings
    assert f"is v{registered['vb']}, which wsidino's gate never promoted" in said and "moved by hand" in said


def test_a_replaced_champion_file_is_left_out(registered: dict[str, Any], tmp_path: Path) -> None:
    """The artifact store's copy of the champion replaced by other bytes: evaluate never compares with it."""
    move_champion_by_hand(registered, registered["vb"])
    artifacts = [p for p in (registered["root"]).rglob("mlartifacts/**/*.onnx")] or [
        p for p in Path(registered["uri"].removeprefix("sqlite:///")).parent.rglob("*.onnx") if "mlartifacts" in str(p)
    ]
    stored = [p for p in artifacts if p.read_bytes() == registered["onnx_b"].read_bytes()]
    assert stored, artifacts
    original = stored[0].read_bytes()
    try:
        stored[0].write_bytes(original[:-8] + b"tampered")
        warnings: list[str] = []
        champion = champion_model(evaluate_config(registered, registered["onnx_a"]), tmp_path / "cache", warnings)
        assert champion is not None and not champion.path.is_file()
        assert any("is not the registered one" in w for w in warnings), warnings
    finally:
        stored[0].write_bytes(original)


def test_a_candidate_registered_as_the_champion_must_be_its_file(registered: dict[str, Any], tmp_path: Path) -> None:
    move_champion_by_hand(registered, registered["va"])
    cfg = evaluate_config(registered, registered["onnx_a"])
    champion = champion_model(cfg, tmp_path / "cache", [])
    candidate = candidate_model(cfg)
    assert champion is not None and candidate.version == champion.version
    check_same_file(candidate, champion, cfg)  # the same file: nothing raised
    replaced = tmp_path / "model.onnx"
    replaced.write_bytes(registered["onnx_b"].read_bytes())
    with pytest.raises(EvaluateError, match="is not that version's file"):
        check_same_file(type(candidate)("candidate", replaced, "", candidate.version), champion, cfg)


def test_a_cycle_does_not_build_on_a_champion_the_gate_never_promoted(registered: dict[str, Any]) -> None:
    move_champion_by_hand(registered, registered["va"])
    values = ["slides=s", f"root={registered['root'] / 'retrain'}", f"register_name={NAME}"]
    cfg = load_retrain_config("tiny", [*values, f"tracking.uri={registered['uri']}", "pretrain.student.arch=vit_test"])
    champion = registry.champion(cfg)
    assert champion is not None and champion.version == registered["va"]
    pretrain = type("Pretrain", (), {"student": type("S", (), {"arch": "auto"})()})()  # auto: no shape check
    with pytest.raises(RetrainError, match="never promoted"):
        decide_warm_start(cfg, champion, pretrain)
    cfg.trust_unvetted_champion = True
    chosen = decide_warm_start(cfg, champion, pretrain)
    assert chosen.source == "champion" and chosen.unvetted and chosen.version == registered["va"]


def test_the_same_weights_saved_again_reuse_their_version(registered: dict[str, Any], tmp_path: Path) -> None:
    again = tmp_path / "again" / "backbone.pth"
    again.parent.mkdir()
    state = torch.load(registered["a"], weights_only=True)
    torch.save(dict(reversed(list(state.items()))), again)  # the same tensors, other bytes
    assert again.read_bytes() != registered["a"].read_bytes()
    (again.parent / "config.yaml").write_bytes((registered["a"].parent / "config.yaml").read_bytes())
    _, version = export_registered(again, NAME, registered["uri"])
    assert version == registered["va"]
