"""Which checkpoint becomes the gram teacher, and loading it (docs/reference/dinov3.md#gram-teacher).

    candidates = find_eval_checkpoints("runs/pretrain")           # [(iteration, eval/.../teacher_checkpoint.pth)]
    sel = select_gram_teacher("runs/pretrain", "best_dense", stores=["out/tiles.zarr"], output_dir="runs/gram")
    backbone = load_gram_teacher(sel.chosen.path)                # strict, weights_only

Policies:

* `latest` — the highest-iteration eval checkpoint;
* `iteration` — the candidate nearest to `iteration`, or to `fraction` × the pretraining run's total iterations
  (read from its `config.yaml`; the 0-based target is round(fraction·total) − 1, so 1.0 is the last
  iteration); equal distance → the earlier one;
* `best_dense` — every candidate is scored on held-out tiles (`n_tiles` tiles evenly spaced over the tile
  store, independent of the training sampler) with a dense-feature quality measure:

  - `effective_rank`: exp(entropy of the normalised singular values) of the centred patch-feature matrix
    [tiles·patches, D], divided by min(rows, D) → (0, 1]; collapsed features score near 0;
  - `agreement`: mean cosine between the patch tokens of a tile and the corresponding tokens of the same tile
    flipped and rotated by 90° (the token grid is mapped back, so correspondence is exact);
  - `score = effective_rank × max(agreement, 0)`: a teacher must both spread its patch features and keep them
    stable under geometry that does not change tissue content. Highest score wins; ties → the earliest.

The selection (candidates, scores, choice) is written to `<output_dir>/gram_teacher_selection.json`, logged to
the active MLflow run when there is one, and returned (`TeacherSelection.to_dict()` for a Prefect artifact).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dinov3_core import tracking
from dinov3_core.config import load_config
from dinov3_core.data import TileDataset
from dinov3_core.errors import WsidinoError
from dinov3_core.models.released import (
    ReleasedWeightsError,
    _build_and_load,
    resolve_arch,
    unwrap_backbone_state_dict,
)
from dinov3_core.train.config import PretrainConfig, total_iterations
from dinov3_core.train.label_free import effective_rank  # one implementation: training health, evaluate

logger = logging.getLogger(__name__)

Policy = Literal["latest", "iteration", "best_dense"]
POLICIES = ("latest", "iteration", "best_dense")
SELECTION_FILE = "gram_teacher_selection.json"
EVAL_DIR = "eval"
EVAL_FILE = "teacher_checkpoint.pth"
_EVAL_NAME = re.compile(r"^training_(\d+)$")
_TRAINING_KEYS = ("optimizer", "student", "train_state", "model_ema")


class GramTeacherError(WsidinoError):
    """No usable gram teacher: nothing to choose from, or a file that is not a teacher."""


@dataclass(frozen=True)
class Candidate:
    iteration: int
    path: Path


@dataclass
class TeacherSelection:
    policy: str
    candidates: list[Candidate]
    chosen: Candidate
    scores: dict[int, dict[str, float]] = field(default_factory=dict)  # iteration → measures (best_dense)
    target_iteration: int | None = None  # the `iteration` policy's target
    path: Path | None = None  # the selection JSON written

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "target_iteration": self.target_iteration,
            "chosen": {"iteration": self.chosen.iteration, "path": str(self.chosen.path)},
            "candidates": [
                {"iteration": c.iteration, "path": str(c.path), **self.scores.get(c.iteration, {})}
                for c in self.candidates
            ],
        }


# ---------------------------------------------------------------------------------------------- finding


def find_eval_checkpoints(pretrain_dir: str | os.PathLike[str]) -> list[Candidate]:
    """Eval teacher checkpoints `<pretrain_dir>/eval/training_<it>/teacher_checkpoint.pth`, oldest first."""
    root = Path(pretrain_dir) / EVAL_DIR
    found = []
    if root.is_dir():
        for d in root.iterdir():
            m = _EVAL_NAME.match(d.name)
            if m and (d / EVAL_FILE).is_file():
                found.append(Candidate(int(m.group(1)), d / EVAL_FILE))
    return sorted(found, key=lambda c: c.iteration)


def _require_candidates(pretrain_dir: str | os.PathLike[str]) -> list[Candidate]:
    found = find_eval_checkpoints(pretrain_dir)
    if not found:
        root = Path(pretrain_dir) / EVAL_DIR
        raise GramTeacherError(
            f"no eval teacher checkpoints in {root} (expected training_<it>/{EVAL_FILE}): point --pretrain-dir at "
            "a pretraining output_dir that has eval checkpoints (evaluation.eval_period_iterations; one is always "
            "written when training stops), or give a teacher file directly"
        )
    return found


def pretrain_total_iterations(pretrain_dir: str | os.PathLike[str]) -> int:
    """The pretraining schedule length (optim.epochs × train.epoch_length) from its `config.yaml`."""
    path = Path(pretrain_dir) / "config.yaml"
    if not path.is_file():
        raise GramTeacherError(
            f"{path} not found: the fraction policy needs the pretraining run's config.yaml; give an absolute "
            "iteration instead (gram.teacher_iteration)"
        )
    return total_iterations(load_config(PretrainConfig, path))


def nearest(candidates: Sequence[Candidate], target: int) -> Candidate:
    """Candidate nearest to `target`; ties → the earlier one."""
    return min(candidates, key=lambda c: (abs(c.iteration - target), c.iteration))


# ---------------------------------------------------------------------------------------------- loading


def _eval_suggestion(ckpt_dir: Path) -> str:
    """The eval teacher file matching a training checkpoint `…/ckpt/<it>/`, if present."""
    name = ckpt_dir.name.removesuffix("_keep")
    if name.isdigit():
        candidate = ckpt_dir.parent.parent / EVAL_DIR / f"training_{name}" / EVAL_FILE
        if candidate.is_file():
            return f"use {candidate} instead (the EMA teacher of the same iteration)"
        others = find_eval_checkpoints(ckpt_dir.parent.parent)
        if others:
            return f"no eval checkpoint exists for iteration {name}; use one of: " + ", ".join(
                str(c.path) for c in others[-3:]
            )
    return f"use an eval checkpoint eval/training_<it>/{EVAL_FILE} of the pretraining run, or a released backbone"


def load_gram_teacher(
    path: str | os.PathLike[str], arch: str | None = None, *, device: torch.device | str = "cpu"
) -> nn.Module:
    """The gram teacher backbone (eval mode, frozen) from an eval `teacher_checkpoint.pth` (`teacher.backbone.*`)
    or a released / converted backbone file; loaded with `weights_only=True` and strictly.

    Training checkpoints (a DCP directory `ckpt/<it>/`, or a file holding optimizer / student state) are
    refused with the file to use instead (upstream fails there with "Missing key model.backbone.cls_token").
    """
    path = Path(path)
    if path.is_dir():
        if (path / ".metadata").is_file():
            raise GramTeacherError(
                f"{path} is a training checkpoint (DCP directory), not a gram teacher: {_eval_suggestion(path)}"
            )
        raise GramTeacherError(f"{path} is a directory; give a teacher_checkpoint.pth or a backbone .pth file")
    if not path.is_file():
        raise GramTeacherError(f"gram teacher file not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling errors come in many types
        raise GramTeacherError(f"{path}: cannot be read as a weights file ({type(err).__name__}: {err})") from None
    if isinstance(obj, dict):
        flat_keys = set(obj)
        if isinstance(obj.get("model"), dict):
            flat_keys |= {k.split(".")[0] for k in obj["model"]}
        if flat_keys & set(_TRAINING_KEYS):
            ckpt_dir = path.parent if path.parent.name.removesuffix("_keep").isdigit() else path
            raise GramTeacherError(
                f"{path} is a training checkpoint (holds {sorted(flat_keys & set(_TRAINING_KEYS))}), not a gram "
                f"teacher: {_eval_suggestion(ckpt_dir)}"
            )
    try:
        sd = unwrap_backbone_state_dict(obj, source=str(path))
        label, kwargs = resolve_arch(sd, arch, str(path))
        model = _build_and_load(sd, kwargs, str(path), label, device)
    except (ReleasedWeightsError, ValueError, RuntimeError) as err:
        raise GramTeacherError(f"{path} cannot be loaded as a gram teacher backbone: {err}") from None
    return model.requires_grad_(False).eval()


# ------------------------------------------------------------------------------------------ dense score


@torch.no_grad()
def patch_features(backbone: nn.Module, images: Tensor) -> Tensor:
    """`x_norm_patchtokens` [B, P, D] of float images [B, 3, H, W] (ImageNet-normalised by the caller)."""
    return backbone(images, is_training=True)["x_norm_patchtokens"].float()


def _transform_grid(tokens: Tensor, side: int) -> Tensor:
    """Token grid of the transformed image mapped back onto the original grid (inverse of flip ∘ rot90)."""
    b, _, d = tokens.shape
    grid = tokens.view(b, side, side, d)
    grid = torch.rot90(grid, k=-1, dims=(1, 2))  # undo rot90(k=1)
    grid = torch.flip(grid, dims=(2,))  # undo horizontal flip
    return grid.reshape(b, side * side, d)


def dense_scores(backbone: nn.Module, images: Tensor) -> dict[str, float]:
    """`effective_rank`, `agreement`, `score` of `backbone` on [B, 3, H, W] images (see the module docstring)."""
    patch = int(getattr(backbone, "patch_size", 16))
    return dense_scores_of(lambda x: patch_features(backbone, x), images, patch)


def dense_scores_of(patch_tokens: Callable[[Tensor], Tensor], images: Tensor, patch: int) -> dict[str, float]:
    """The same scores for any feature extractor (an ONNX model in the evaluate stage): `patch_tokens` maps
    [B, 3, S, S] images to [B, (S / patch)², D] patch tokens."""
    side = images.shape[-1] // patch
    view = torch.rot90(torch.flip(images, dims=(-1,)), k=1, dims=(-2, -1))
    a = patch_tokens(images)
    b = _transform_grid(patch_tokens(view), side)
    # A cosine of (near-)identical tokens rounds to 1 + 1 ulp in fp32: clamp, so the reported value is a cosine.
    agreement = float(F.cosine_similarity(a, b, dim=-1).clamp(-1.0, 1.0).mean())
    erank = effective_rank(a.reshape(-1, a.shape[-1]))
    return {"effective_rank": erank, "agreement": agreement, "score": erank * max(agreement, 0.0)}


def held_out_images(stores: Sequence[str], n_tiles: int, size: int | None, patch_size: int) -> Tensor:
    """`n_tiles` tiles evenly spaced over the stores (deterministic), centre-cropped to a multiple of the patch
    size (`size`, or the largest that fits), as ImageNet-normalised float [N, 3, S, S]."""
    try:
        tiles = TileDataset(list(stores))
    except ValueError as err:
        raise GramTeacherError(f"gram.selection stores {list(stores)}: {err}") from None
    n = min(n_tiles, len(tiles))
    idx = np.unique(np.linspace(0, len(tiles) - 1, n).round().astype(np.int64))
    arr = torch.from_numpy(tiles.read_batch(idx)).permute(0, 3, 1, 2).float() / 255.0
    t = tiles.tile_size
    s = size or (t // patch_size) * patch_size
    if s > t or s % patch_size:
        raise GramTeacherError(f"selection crop size {s} must be a multiple of {patch_size} and <= tile size {t}")
    o = (t - s) // 2
    arr = arr[:, :, o : o + s, o : o + s]
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    return (arr - mean) / std


# ------------------------------------------------------------------------------------------------ select


def select_gram_teacher(
    pretrain_dir: str | os.PathLike[str],
    policy: Policy = "latest",
    *,
    iteration: int | None = None,
    fraction: float | None = None,
    stores: Sequence[str] = (),
    n_tiles: int = 32,
    crop_size: int | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    log_mlflow: bool = True,
    device: torch.device | str = "cpu",
) -> TeacherSelection:
    """Pick the gram teacher among the pretraining run's eval checkpoints (policies: module docstring)."""
    if policy not in POLICIES:
        raise GramTeacherError(f"gram teacher policy {policy!r} unknown; use one of {', '.join(POLICIES)}")
    candidates = _require_candidates(pretrain_dir)
    scores: dict[int, dict[str, float]] = {}
    target = None
    if policy == "latest":
        chosen = candidates[-1]
    elif policy == "iteration":
        if (iteration is None) == (fraction is None):
            raise GramTeacherError("the `iteration` policy needs exactly one of an iteration or a fraction")
        if fraction is not None:
            if not 0.0 <= fraction <= 1.0:
                raise GramTeacherError(f"gram teacher fraction must be in [0, 1], got {fraction}")
            target = round(fraction * pretrain_total_iterations(pretrain_dir)) - 1
        else:
            target = int(iteration)  # type: ignore[arg-type]
        chosen = nearest(candidates, max(target, 0))
    else:
        if not stores:
            raise GramTeacherError("the best_dense policy needs tile stores to score on (data.stores)")
        images: Tensor | None = None
        for c in candidates:
            backbone = load_gram_teacher(c.path, device=device)
            if images is None:
                images = held_out_images(stores, n_tiles, crop_size, int(backbone.patch_size)).to(device)
            scores[c.iteration] = dense_scores(backbone, images)
            logger.info("gram teacher candidate %d: %s", c.iteration, scores[c.iteration])
            del backbone
        best = max(scores[c.iteration]["score"] for c in candidates)
        chosen = next(c for c in candidates if scores[c.iteration]["score"] == best)  # ties → earliest
    selection = TeacherSelection(policy, candidates, chosen, scores, target)
    logger.info("gram teacher (%s): iteration %d, %s", policy, chosen.iteration, chosen.path)
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        selection.path = out / SELECTION_FILE
        selection.path.write_text(json.dumps(selection.to_dict(), indent=2))
    if log_mlflow:
        _log_selection(selection)
    return selection


def _log_selection(selection: TeacherSelection) -> None:
    """Params, per-candidate metrics (step = iteration) and the JSON artifact, into the active MLflow run."""
    try:
        # deferred: mlflow is slow to import, paid only when tracking
        import mlflow
    except ImportError:  # pragma: no cover
        return
    if mlflow.active_run() is None:
        return

    tracking.log_params(
        {
            "gram_teacher_policy": selection.policy,
            "gram_teacher_iteration": selection.chosen.iteration,
            "gram_teacher_path": str(selection.chosen.path),
            "gram_teacher_candidates": len(selection.candidates),
        }
    )
    for it, values in selection.scores.items():
        tracking.log_metrics({f"gram_teacher_{k}": v for k, v in values.items()}, step=it)
    if selection.path is not None:
        tracking.log_artifact(selection.path)


__all__ = [
    "POLICIES",
    "SELECTION_FILE",
    "Candidate",
    "GramTeacherError",
    "TeacherSelection",
    "dense_scores",
    "effective_rank",
    "find_eval_checkpoints",
    "load_gram_teacher",
    "nearest",
    "select_gram_teacher",
]
