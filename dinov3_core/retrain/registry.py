"""The registry side of a cycle: who is `@champion`, where its files are, and the tags a cycle's model version
carries. Every registry call goes through `_client`, so an unreachable registry fails the cycle before it trains,
with the URI in the message (nothing half-promoted)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dinov3_core import checksums, tracking
from dinov3_core.retrain.config import RetrainConfig, RetrainError

CYCLE_TAG = "wsidino.cycle"
SNAPSHOT_TAG = "wsidino.snapshot"
WEIGHTS_TAG = "wsidino.weights"  # set by the export stage: the backbone.pth the ONNX model was exported from


@dataclass
class Champion:
    version: str
    tags: dict[str, str]
    source: str  # the version's artifact source (models:/… or runs:/…)

    @property
    def cycle(self) -> str | None:
        return self.tags.get(CYCLE_TAG)

    @property
    def weights(self) -> Path | None:
        w = self.tags.get(WEIGHTS_TAG)
        return Path(w) if w else None

    @property
    def onnx(self) -> Path | None:
        """The ONNX file beside the champion's weights (the export stage writes model/model.onnx beside
        model/backbone.pth)."""
        if self.weights is None:
            return None
        candidate = self.weights.parent / "model.onnx"
        return candidate if candidate.is_file() else None

    def verified(self, path: Path, tag: str) -> Path:
        """`path` (the champion's weights or ONNX file on this machine) if its SHA-256 is the one the version was
        registered with; a version registered before the tag existed is taken as it is."""
        expected = self.tags.get(tag)
        if expected and checksums.sha256(path) != expected:
            raise RetrainError(
                f"{path} is not the file champion v{self.version} was registered with (its SHA-256 differs from the "
                f"version's {tag} tag); restore it, or move @champion to a version whose files are intact"
            )
        return path

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "cycle": self.cycle, "weights": str(self.weights) if self.weights else None}


def _client(cfg: RetrainConfig) -> Any:
    # deferred: importing mlflow is slow (docs/benchmarks.md, tile stage), paid only when tracking
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking))


def _unreachable(cfg: RetrainConfig, err: Exception) -> RetrainError:
    return RetrainError(
        f"the MLflow registry at {tracking.tracking_uri(cfg.tracking)} cannot be reached ({type(err).__name__}: "
        f"{str(err)[:300]}); the cycle stopped before training and nothing was promoted. Check tracking.uri / "
        "$MLFLOW_TRACKING_URI and rerun (the cycle resumes)"
    )


def champion(cfg: RetrainConfig) -> Champion | None:
    """The registry's `<register_name>@champion`, or None when there is no registered model or no champion."""
    # deferred: importing mlflow is slow (docs/benchmarks.md, tile stage), paid only when tracking
    from mlflow.exceptions import MlflowException

    if not cfg.tracking.enabled:
        return None
    try:
        version = _client(cfg).get_model_version_by_alias(cfg.register_name, "champion")
    except MlflowException as err:
        if _is_missing(err):
            return None
        raise _unreachable(cfg, err) from None
    except Exception as err:  # connection refused, DNS, a locked database …
        raise _unreachable(cfg, err) from None
    return Champion(str(version.version), dict(version.tags or {}), str(version.source))


def _is_missing(err: Exception) -> bool:
    code = getattr(err, "error_code", "")
    return code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE") or "not found" in str(err).lower()


def check_reachable(cfg: RetrainConfig) -> None:
    """Fail now, before tiling and training, when the registry is down (the gate could not run anyway)."""
    if not cfg.tracking.enabled:
        return
    try:
        _client(cfg).search_registered_models(max_results=1)
    except Exception as err:
        raise _unreachable(cfg, err) from None


def tag_version(cfg: RetrainConfig, version: str, tags: dict[str, str]) -> None:
    client = _client(cfg)
    for key, value in tags.items():
        client.set_model_version_tag(cfg.register_name, version, key, value)


__all__ = ["CYCLE_TAG", "SNAPSHOT_TAG", "WEIGHTS_TAG", "Champion", "champion", "check_reachable", "tag_version"]
