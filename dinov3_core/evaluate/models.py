"""The models an evaluation compares: the candidate, the registry's champion and a baseline.

* **candidate**: the model file given (this pipeline's `model.onnx` or `backbone.pth`); its registry version is
  read from the export stage's manifest when it was registered;
* **champion**: `<register_name>@champion` in the MLflow registry, downloaded once per version into the
  evaluation's model cache;
* **baseline**: the released weights the training started from (followed through the stage manifests: export →
  convert → the training run's config), else the candidate's architecture at its initialisation (fixed seed).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dinov3_core import checksums, tracking
from dinov3_core import manifest as mf
from dinov3_core.evaluate.config import EvaluateConfig, EvaluateError
from dinov3_core.evaluate.summary import PROMOTION_TAG, set_by_gate
from dinov3_core.export.summary import ONNX_SHA_TAG, ExportSummary

logger = logging.getLogger(__name__)

INIT_SEED = 0


@dataclass
class ModelUnderTest:
    role: str  # candidate | champion | baseline
    path: Path
    description: str
    version: str | None = None  # registry version, when registered

    def as_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "description": self.description, "version": self.version}


def candidate_model(cfg: EvaluateConfig) -> ModelUnderTest:
    path = Path(cfg.candidate)
    producer = mf.producer_manifest(path)
    version = None
    if producer is not None and producer.stage == "export":
        export = ExportSummary.from_json(producer.summary)
        version = export.model_version if export.registered_model == cfg.register_name else None
    note = f"registry {cfg.register_name} v{version}" if version else "not registered"
    return ModelUnderTest("candidate", path, f"{path.name} ({note})", str(version) if version else None)


def champion_state(cfg: EvaluateConfig) -> mf.StateInput | None:
    """The registry's `@champion` as a stage input: an evaluation reruns when the champion it faced was replaced."""
    if not cfg.champion or not cfg.tracking.enabled:
        return None
    # deferred: importing mlflow is slow (docs/benchmarks.md, tile stage), paid only when tracking
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking))
        version = str(client.get_model_version_by_alias(cfg.register_name, "champion").version)
    except MlflowException:
        version = "none"
    return mf.StateInput(f"models:/{cfg.register_name}@champion", version)


def champion_model(cfg: EvaluateConfig, cache: Path, warnings: list[str]) -> ModelUnderTest | None:
    """The registry's champion (downloaded into `cache/champion-v<version>/`), or None when there is none."""
    if not cfg.champion or not cfg.tracking.enabled:
        return None
    # deferred: importing mlflow is slow (docs/benchmarks.md, tile stage), paid only when tracking
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking))
    try:
        registered = client.get_model_version_by_alias(cfg.register_name, "champion")
    except MlflowException:
        return None  # no registered model, or no champion yet: the first model's gate is the baseline
    number, tags = str(registered.version), dict(registered.tags or {})
    if not set_by_gate(tags):
        warnings.append(
            f"@champion of {cfg.register_name} is v{number}, which wsidino's gate never promoted (its "
            f"{PROMOTION_TAG} tag is {tags.get(PROMOTION_TAG)!r}): the alias was moved by hand or by another tool; "
            "the candidate is compared with it anyway (move @champion back to a promoted version to undo)"
        )
    target = cache / f"champion-v{number}"
    onnx = sorted(target.rglob("*.onnx")) if target.is_dir() else []
    if not onnx:
        import mlflow.artifacts

        tmp = cache / f".champion-v{number}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            mlflow.artifacts.download_artifacts(
                artifact_uri=f"models:/{cfg.register_name}/{number}",
                dst_path=str(tmp),
                tracking_uri=tracking.tracking_uri(cfg.tracking),
            )
        except Exception as err:  # an unreachable artifact store must not promote by accident: no champion → warn
            warnings.append(f"champion v{number} of {cfg.register_name} could not be downloaded ({err})")
            return ModelUnderTest("champion", Path("unavailable"), "download failed", str(number))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        onnx = sorted(target.rglob("*.onnx"))
    if not onnx:
        warnings.append(f"champion v{number} of {cfg.register_name} has no ONNX file in its artifacts")
        return ModelUnderTest("champion", Path("unavailable"), "no ONNX artifact", str(number))
    registered_sha = tags.get(ONNX_SHA_TAG)
    if registered_sha and checksums.sha256(onnx[0]) != registered_sha:  # never compare with a replaced file
        warnings.append(
            f"champion v{number} of {cfg.register_name}: its model file {onnx[0]} is not the registered one "
            f"({ONNX_SHA_TAG} differs): it was replaced or damaged in the artifact store; it is left out"
        )
        return ModelUnderTest("champion", Path("unavailable"), "file differs from the registered one", str(number))
    return ModelUnderTest("champion", onnx[0], f"registry {cfg.register_name} v{number}", str(number))


def check_same_file(candidate: ModelUnderTest, champion: ModelUnderTest, cfg: EvaluateConfig) -> None:
    """The candidate is registered as the champion's version: its file must be that version's, byte for byte."""
    if champion.path.is_file() and checksums.sha256(candidate.path) != checksums.sha256(champion.path):
        raise EvaluateError(
            f"{candidate.path} is registered as {cfg.register_name} v{candidate.version} (@champion) but is not "
            f"that version's file ({champion.path} differs): it was replaced or damaged since the export; export "
            "it again (wsidino export --force) before evaluating"
        )


def _weights_of(model: Path) -> Path | None:
    """The backbone.pth a model came from: itself, or the export stage's input."""
    if model.suffix != ".onnx":
        return model
    producer = mf.producer_manifest(model)
    if producer is None or "weights" not in producer.inputs:
        return None
    weights = Path(producer.inputs["weights"]["path"])
    return weights if weights.is_file() else None


def _run_config(run_dir: Path) -> dict[str, Any]:
    for name in ("launch_config.yaml", "config.yaml"):
        if (run_dir / name).is_file():
            return yaml.safe_load((run_dir / name).read_text()) or {}
    return {}


def started_from(candidate: Path) -> Path | None:
    """The released weights the candidate's training started from, followed through the stage manifests."""
    weights = _weights_of(candidate)
    producer = mf.producer_manifest(weights) if weights is not None else None
    if producer is None or producer.stage != "convert" or "checkpoint" not in producer.inputs:
        return None
    run = Path(producer.inputs["checkpoint"]["path"])
    run = run if (run / "ckpt").is_dir() else run.parent.parent  # a ckpt/<it>/ directory → its run
    for _ in range(3):  # gram run → its pretraining run → …
        doc = _run_config(run)
        released = (doc.get("student") or {}).get("pretrained_weights")
        if released and Path(released).is_file():
            return Path(released)
        if not doc.get("pretrain_dir"):
            return None
        run = Path(doc["pretrain_dir"])
    return None


def baseline_model(
    cfg: EvaluateConfig, candidate: ModelUnderTest, cache: Path, warnings: list[str]
) -> ModelUnderTest | None:
    choice = cfg.baseline
    if choice is None:
        return None
    if choice not in ("auto", "init"):
        path = Path(choice)
        if not path.is_file():
            raise EvaluateError(f"baseline={choice}: no such weights file; give a released backbone .pth, auto or init")
        return ModelUnderTest("baseline", path, f"{path.name} (given)")
    if choice == "auto":
        released = started_from(candidate.path)
        if released is not None:
            return ModelUnderTest("baseline", released, f"{released.name} (released weights training started from)")
    weights = _weights_of(candidate.path)
    if weights is None:
        warnings.append(
            f"no baseline: {candidate.path} has no backbone.pth on record (export manifest) to take the "
            "architecture from; give baseline=<weights file>"
        )
        return None
    return ModelUnderTest(
        "baseline", init_backbone(weights, cache), "candidate architecture at initialisation (seed 0)"
    )


def init_backbone(weights: Path, cache: Path) -> Path:
    """The architecture of `weights` with freshly initialised parameters (fixed seed), as a loadable backbone.pth
    (with its arch config beside it). Written once per architecture; the same bytes every time."""
    # deferred: torch is slow to import; champion_state here runs in the light stage specs
    import torch

    from dinov3_core.inference.backbone import ARCH_FILE, load_backbone
    from dinov3_core.models.released import save_backbone

    arch = weights.parent / ARCH_FILE
    key = mf.file_fingerprint(arch).split(":")[1][:12] if arch.is_file() else mf.file_fingerprint(weights)[5:17]
    target = cache / f"baseline-init-{key}" / "backbone.pth"
    if target.is_file():
        return target
    model = load_backbone(weights)
    with torch.random.fork_rng():
        torch.manual_seed(INIT_SEED)
        model.init_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    if arch.is_file():
        shutil.copyfile(arch, target.parent / ARCH_FILE)
    save_backbone(model, target)
    return target


__all__ = ["ModelUnderTest", "baseline_model", "candidate_model", "champion_model", "init_backbone", "started_from"]
