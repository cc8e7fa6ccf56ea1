"""The gram stage as one plain function, `run_gram(cfg) -> GramResult`, built on the pretraining `Trainer`.

    cfg = load_config(GramConfig, "tiny", {"pretrain_dir": "out/pt", "data.stores": ["out/tiles.zarr"],
                                           "output_dir": "out/gram"}, stage="gram")
    result = run_gram(cfg)

What it adds to pretraining (docs/reference/dinov3.md#losses, #gram-teacher), all counted from the gram stage's own
iteration 0:

* start: the pretraining run's latest DCP checkpoint (student, EMA teacher, optimizer state; not its iteration
  nor sampler position) when `output_dir/ckpt` is empty; afterwards it resumes from its own `ckpt/`;
* the gram teacher: `gram.teacher_path`, or the eval checkpoint chosen by `gram.teacher_policy`
  (`dinov3_core.gram.teacher`); the choice is kept in `gram_teacher_selection.json` and reused on resume;
* the gram loss `GramLoss(student global-crop x_norm_patchtokens, gram teacher's on the same crops)` times
  w(it) (linear 0 → gram.loss_weight over gram.warmup_iterations), and the local DINO weight schedule
  (linear losses.local_loss_weight → gram.local_weight_end over gram.local_weight_iterations);
* refreshes of the gram teacher from the EMA teacher (`gram.rep_update`); the gram teacher's weights are part
  of each checkpoint (`train_state.gram_teacher.*`), the refresh count is recounted from the iteration.

Metrics: `gram_loss`, `gram_loss_weight`, `dino_local_loss_weight`, `gram_updates` in training_metrics.json.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dinov3_core import tracking
from dinov3_core.config import ConfigError, load_config
from dinov3_core.errors import WsidinoError
from dinov3_core.gram import teacher as T
from dinov3_core.gram.config import GramConfig, validate_gram
from dinov3_core.losses.gram import GramLoss, resize_patch_tokens
from dinov3_core.models import PRESETS, RELEASED
from dinov3_core.models.adaptation import has_lora, lora_scalings, merge_lora_state_dict
from dinov3_core.models.released import backbone_state_dict
from dinov3_core.train import checkpoint as ckpt
from dinov3_core.train import health_probe as HP
from dinov3_core.train.config import PretrainConfig
from dinov3_core.train.distributed import DistEnv, gather_pp_state
from dinov3_core.train.loop import Trainer
from dinov3_core.train.param_groups import clean_param_name
from dinov3_core.train.pretrain import MLFLOW_METRICS, curated_params, mlflow_values, train_and_log, training_process
from dinov3_core.train.result import PretrainResult
from dinov3_core.train.schedules import WarmupCosineSchedule, linear_warmup_cosine
from dinov3_core.train.ssl_model import SSLMetaArch
from dinov3_core.train.step_batches import StepBatch
from dinov3_core.train.trainer_setup import load_weights

__all__ = ["GramResult", "GramSchedules", "run_gram"]

logger = logging.getLogger(__name__)

GRAM_METRICS = ("gram_loss", "gram_loss_weight", "dino_local_loss_weight", "gram_updates")


@dataclass
class GramResult(PretrainResult):
    teacher_selection: dict[str, Any] | None = None  # TeacherSelection.to_dict() (for a Prefect artifact)
    gram_updates: int = 0  # gram-teacher refreshes so far (stage total)


# ---------------------------------------------------------------------------------------------- schedules


@dataclass(frozen=True)
class GramSchedules:
    """Stage-relative schedules: `at(it)` with `it` = iterations since the gram stage's start."""

    weight: WarmupCosineSchedule
    local_weight: WarmupCosineSchedule
    rep_update: bool
    update_frequency: int
    first_update: int
    max_updates: int | None

    @classmethod
    def from_config(cls, cfg: GramConfig, total: int) -> GramSchedules:
        g = cfg.gram
        n = max(total, g.warmup_iterations, g.local_weight_iterations, 1)
        local_start = cfg.losses.local_loss_weight
        local_end = local_start if g.local_weight_end is None else g.local_weight_end
        return cls(
            weight=linear_warmup_cosine(0.0, g.loss_weight, g.loss_weight, g.warmup_iterations, n),
            local_weight=linear_warmup_cosine(local_start, local_end, local_end, g.local_weight_iterations, n),
            rep_update=g.rep_update,
            update_frequency=g.update_frequency,
            first_update=g.first_update,
            max_updates=g.max_updates,
        )

    def update_due(self, iteration: int, done: int) -> bool:
        """Refresh the gram teacher after stage iteration `iteration`, `done` refreshes so far?"""
        n = iteration + 1
        if not self.rep_update or n < max(self.first_update, 1) or (n - self.first_update) % self.update_frequency:
            return False
        return self.max_updates is None or done < self.max_updates

    def updates_before(self, start: int) -> int:
        """Refreshes an uninterrupted run made in iterations [0, start) (recount on resume)."""
        if not self.rep_update or start < 1:
            return 0
        lo = max(self.first_update, 1)
        if start < lo:
            count = 0
        else:  # n in [lo, start] with (n - first) % freq == 0
            first_n = lo + (-(lo - self.first_update)) % self.update_frequency
            count = 0 if first_n > start else (start - first_n) // self.update_frequency + 1
        return count if self.max_updates is None else min(count, self.max_updates)


# ------------------------------------------------------------------------------------------ model + trainer


class GramMetaArch(SSLMetaArch):
    """`SSLMetaArch` plus the gram term. The gram teacher is held outside the module tree (`attach_gram`), so the
    checkpoint `model.*` keys are the pretraining ones."""

    def attach_gram(self, gram: _GramState) -> None:
        object.__setattr__(self, "_gram", gram)  # not a registered submodule: no state_dict, no FSDP wrapping

    def loss_from_outputs(  # type: ignore[override]
        self,
        global_crops: Tensor,
        cls_global: Tensor,
        dino_logits: Tensor,
        patch_global: Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The SSL terms plus the gram term on the student's patch tokens (with and without a pipeline: this is
        also the last pipeline stage's loss)."""
        total, parts = super().loss_from_outputs(global_crops, cls_global, dino_logits, patch_global, *args, **kwargs)
        gram: _GramState | None = getattr(self, "_gram", None)
        if gram is None:  # used before the trainer attached the gram teacher (e.g. by the memory estimator)
            return total, parts
        student = patch_global  # [S_g·b, P, D] (masked crops, as upstream)
        with torch.no_grad():
            crops = global_crops.flatten(0, 1)
            if gram.crop_size and gram.crop_size != crops.shape[-1]:
                crops = F.interpolate(crops, size=(gram.crop_size,) * 2, mode="bicubic", align_corners=False)
            target = gram.teacher(crops, is_training=True)["x_norm_patchtokens"]
            if target.shape[1] != student.shape[1]:  # teacher grid → student grid, before normalisation
                side_t, side_s = math.isqrt(target.shape[1]), math.isqrt(student.shape[1])
                target = resize_patch_tokens(target, (side_t, side_t), (side_s, side_s)).to(student.dtype)
        loss = (
            gram.loss(student, target)
            if gram.loss.img_level
            else gram.loss(student.flatten(0, 1), target.flatten(0, 1))
        )
        total = total + gram.weight * loss
        parts["gram_loss"] = loss.detach().float()
        parts["total_loss"] = total.detach().float()
        return total, parts


@dataclass
class _GramState:
    teacher: nn.Module
    loss: GramLoss
    weight: float = 0.0
    crop_size: int | None = None  # gram teacher input size (upsampled student global crops); None: as they are


class GramTrainer(Trainer):
    """The pretraining `Trainer` with the gram teacher, loss, schedules and refreshes."""

    meta_arch = GramMetaArch
    stage = "gram"
    extra_loss_names = ("gram_loss",)  # averaged over micro-batches and processes with the other terms

    def __init__(self, cfg: GramConfig, env: DistEnv, gram_teacher: nn.Module) -> None:
        g = cfg.gram
        patch = int(getattr(gram_teacher, "patch_size", 16))
        if g.teacher_crop_size and g.teacher_crop_size % patch:
            raise ConfigError(
                f"gram.teacher_crop_size={g.teacher_crop_size} is not a multiple of the patch size {patch}"
            )
        self.gram = _GramState(
            teacher=gram_teacher.to(env.device).requires_grad_(False).eval(),
            loss=GramLoss(
                normalize=g.normalized,
                img_level=g.img_level,
                remove_neg=g.remove_neg,
                remove_only_teacher_neg=g.remove_only_teacher_neg,
            ),
            crop_size=g.teacher_crop_size,
        )
        super().__init__(cfg, env)  # resumes (gram teacher included: train_state) from output_dir/ckpt if any
        self.model.attach_gram(self.gram)
        self.gram_schedules = GramSchedules.from_config(cfg, self.total_iterations)
        if self.resumed_from is None and cfg.pretrain_dir:
            self._start_from_pretraining(Path(cfg.pretrain_dir))
        self.gram_updates = self.gram_schedules.updates_before(self.start_iteration)

    def _start_from_pretraining(self, pretrain_dir: Path) -> None:
        latest = ckpt.latest_intact_checkpoint(pretrain_dir / ckpt.CKPT_DIR)  # a damaged one is named and skipped
        if latest is None and ckpt.complete_checkpoints(pretrain_dir / ckpt.CKPT_DIR):
            raise WsidinoError(
                f"no checkpoint in {pretrain_dir / ckpt.CKPT_DIR} is intact (the damaged or unverifiable ones are "
                "named in the warnings): rerun that pretraining, or point pretrain_dir at another run"
            )
        if latest is None:
            raise WsidinoError(
                f"no training checkpoint in {pretrain_dir / ckpt.CKPT_DIR}: pretrain_dir must be a pretraining "
                "output_dir with ckpt/<it>/ (or set pretrain_dir=null and student.pretrained_weights)"
            )
        ckpt.check_compatible(latest, self.layout)  # the whole model: a pipeline stage holds only some keys
        load_weights(latest, self.model, self.optimizer, self.env)  # the stage's own train state starts at 0
        logger.info("gram stage starts from %s (student, teacher, optimizer); stage iteration 0", latest)

    def inherited_probe(self, cfg: PretrainConfig) -> Path | None:
        """The pretraining run's probe: slides it held out stay out of gram anchoring too."""
        return Path(cfg.pretrain_dir) / HP.PROBE_FILE if getattr(cfg, "pretrain_dir", None) else None

    def train_state(self, iteration: int, sampler: Any) -> dict[str, Any]:
        state = super().train_state(iteration, sampler)
        state["gram_teacher"] = self.gram.teacher.state_dict()  # loaded in place on resume
        return state

    def train_step(self, iteration: int, batch: StepBatch) -> dict[str, float]:
        weight = self.gram_schedules.weight(iteration)
        local = self.gram_schedules.local_weight(iteration)
        self.gram.weight, self.model.local_loss_weight = weight, local
        values = super().train_step(iteration, batch)
        if self.gram_schedules.update_due(iteration, self.gram_updates):
            self.refresh_gram_teacher(iteration)
        values.update(
            gram_loss_weight=weight,
            dino_local_loss_weight=local,
            gram_updates=float(self.gram_updates),
        )
        return values

    @torch.no_grad()
    def refresh_gram_teacher(self, iteration: int) -> None:
        """Copy the EMA teacher's backbone into the gram teacher (all ranks: gathers under FSDP). A LoRA teacher is
        merged on the way (the gram teacher is a plain backbone, released key layout)."""
        teacher = self.model.teacher["backbone"]
        if self.env.pp_size > 1:  # each process holds one pipeline stage of it
            state = {clean_param_name(k): v for k, v in gather_pp_state(teacher, self.env, everywhere=True).items()}
        else:
            state = backbone_state_dict(teacher)
        if has_lora(teacher):
            state = merge_lora_state_dict(state, lora_scalings(teacher))
        self.gram.teacher.load_state_dict(state, strict=True)
        self.gram_updates += 1
        logger.info(
            "gram teacher refreshed from the EMA teacher after stage iteration %d (#%d)", iteration, self.gram_updates
        )


# ------------------------------------------------------------------------------------------------- stage


def prepare_config(cfg: GramConfig) -> GramConfig:
    """A copy of `cfg` with the model sections of the pretraining run (`inherit_model`), checked."""
    cfg = copy.deepcopy(cfg)
    if cfg.pretrain_dir and cfg.inherit_model:
        path = Path(cfg.pretrain_dir) / "config.yaml"
        if not path.is_file():
            raise ConfigError(
                f"{path} not found: pretrain_dir must be a pretraining output_dir (or inherit_model=false)"
            )
        pre = load_config(PretrainConfig, path)
        cfg.student, cfg.heads = pre.student, pre.heads
        if not cfg.data.stores:  # the tiles the run was pretrained on, unless others are given
            cfg.data.stores = list(pre.data.stores)
        if cfg.student.arch == "auto":  # the warm start read it from its file; the checkpoint recorded what it found
            cfg.student.arch = _resolved_arch(Path(cfg.pretrain_dir), path)
        cfg.student.pretrained_weights = None  # the weights come from the DCP checkpoint
    validate_gram(cfg)
    return cfg


def _resolved_arch(pretrain_dir: Path, config_path: Path) -> str:
    """The architecture a `student.arch=auto` pretraining run resolved from its weights file: its checkpoint's
    meta.json names it when the file matched a released or preset architecture."""
    latest = ckpt.latest_checkpoint(pretrain_dir / ckpt.CKPT_DIR)
    arch = ckpt.read_meta(latest).get("arch") if latest is not None else None
    if arch in RELEASED or arch in PRESETS:
        return str(arch)
    raise ConfigError(
        f"{config_path}: student.arch=auto and its checkpoint does not name a known architecture ({arch!r}); set "
        "student.arch to the concrete arch and inherit_model=false"
    )


def choose_teacher(cfg: GramConfig, *, write: bool, device: torch.device | str = "cpu") -> T.TeacherSelection | None:
    """The gram teacher file: explicit, previously chosen (resume), or by policy. None: use student weights."""
    g, out = cfg.gram, Path(cfg.output_dir)
    if g.teacher_path:
        return None
    previous = out / T.SELECTION_FILE
    if previous.is_file() and ckpt.latest_checkpoint(out / ckpt.CKPT_DIR) is not None:
        data = json.loads(previous.read_text())
        cands = [T.Candidate(c["iteration"], Path(c["path"])) for c in data["candidates"]]
        chosen = T.Candidate(data["chosen"]["iteration"], Path(data["chosen"]["path"]))
        return T.TeacherSelection(
            data["policy"], cands, chosen, target_iteration=data.get("target_iteration"), path=previous
        )
    if not cfg.pretrain_dir:
        return None
    return T.select_gram_teacher(
        cfg.pretrain_dir,
        g.teacher_policy,
        iteration=g.teacher_iteration,
        fraction=g.teacher_fraction,
        stores=cfg.data.stores,
        n_tiles=g.selection_tiles,
        output_dir=out if write else None,
        log_mlflow=False,
        device=device,
    )


def run_gram(cfg: GramConfig, mlflow_run_id: str | None = None) -> GramResult:
    """Train (or resume) the gram stage per `cfg`; one process here, or every rank under torchrun. Rank 0 logs into
    the MLflow run `mlflow_run_id` names (the stage runner's), else into a run of its own."""
    cfg = prepare_config(cfg)
    with training_process(cfg) as env:
        selection = choose_teacher(cfg, write=env.is_main, device=env.device)
        teacher_file = cfg.gram.teacher_path or (selection.chosen.path if selection else cfg.student.pretrained_weights)
        gram_teacher = T.load_gram_teacher(teacher_file)  # type: ignore[arg-type]
        with contextlib.closing(GramTrainer(cfg, env, gram_teacher)) as trainer:
            with _mlflow_run(cfg, trainer, selection, mlflow_run_id) as run:
                base = train_and_log(trainer, run, _log_to_mlflow)
            return GramResult(
                **vars(base),
                teacher_selection=selection.to_dict() if selection else None,
                gram_updates=trainer.gram_updates,
            )


@contextlib.contextmanager
def _mlflow_run(
    cfg: GramConfig, trainer: GramTrainer, selection: T.TeacherSelection | None, run_id: str | None
) -> Iterator[Any]:
    if not trainer.env.is_main or not cfg.tracking.enabled:
        yield None
        return
    params = {
        **curated_params(cfg, trainer),
        "pretrain_dir": cfg.pretrain_dir,
        "gram_loss_weight": cfg.gram.loss_weight,
        "gram_warmup_iterations": cfg.gram.warmup_iterations,
        "gram_img_level": cfg.gram.img_level,
        "gram_rep_update": cfg.gram.rep_update,
        "gram_update_frequency": cfg.gram.update_frequency,
    }
    tags = {"wsidino.stage": "gram", "wsidino.output_dir": str(Path(cfg.output_dir).resolve())}
    with tracking.stage_run(cfg.tracking, "gram", params=params, tags=tags, run_id=run_id) as run:
        tracking.log_artifact(Path(cfg.output_dir) / "config.yaml")
        if selection is not None:
            T._log_selection(selection)
        yield run


def _log_to_mlflow(record: dict[str, Any]) -> None:
    tracking.log_metrics(mlflow_values(record, (*MLFLOW_METRICS, *GRAM_METRICS)), step=int(record["iteration"]))
