"""The DINOv3 SSL meta-architecture: student and EMA teacher, each `ModuleDict(backbone, dino_head, ibot_head)`.

One optimizer step over a rank's step batch of B images, split into n micro-batches of b = B/n:

1. `teacher_targets` — teacher forward on every micro-batch (no grad), then Sinkhorn-Knopp ONCE over the whole
   step (all-reduced over ranks), so micro-batching does not change the targets
   (docs/reference/distributed.md#sinkhorn-per-step);
2. `student_step_features` — with n > 1, a no-grad student pass gives the step's KoLeo neighbour set;
3. `forward_loss` per micro-batch, on the targets' slice; the caller scales by 1/n and calls backward;
4. `update_teacher` — θ_t ← m·θ_t + (1−m)·θ_s after the optimizer step.

State-dict keys are the official ones: `student.backbone.*`, `student.dino_head.*`, `teacher.*`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dinov3_core.data.masking import IBOTMasks
from dinov3_core.errors import WsidinoError
from dinov3_core.losses import (
    DINOLoss,
    KoLeoLoss,
    SSLLossWeights,
    dino_teacher_targets,
    ibot_teacher_targets,
    iBOTPatchLoss,
)
from dinov3_core.models import DINOHead, ReleasedWeightsError, build_backbone, build_student_teacher_from_released
from dinov3_core.models.adaptation import apply_adaptation, lora_state_dict
from dinov3_core.train import config as C
from dinov3_core.train import model_config as MC

LOSS_NAMES = ("dino_global_loss", "dino_local_loss", "ibot_loss", "koleo_loss", "total_loss")
# Per-step signals averaged like the losses (over micro-batches and ranks): dinov3_core.train.health.
SIGNAL_NAMES = ("agreement",)
SUBMODULES = ("backbone", "dino_head", "ibot_head")


@dataclass(frozen=True)
class TeacherTargets:
    dino: Tensor  # [S_g, B, K] Sinkhorn targets of the step's global crops
    ibot: Tensor  # [M, K] Sinkhorn targets of the step's masked patches (IBOTMasks.mask_indices order)


class SSLMetaArch(nn.Module):
    """Student + EMA teacher and the DINO / iBOT / KoLeo objective (docs/reference/dinov3.md#losses)."""

    def __init__(
        self,
        student: nn.ModuleDict,
        teacher: nn.ModuleDict,
        *,
        weights: SSLLossWeights,
    ) -> None:
        super().__init__()
        losses = weights.losses
        self.student = student
        self.teacher = teacher.requires_grad_(False)
        self.weights = weights
        self.sinkhorn_iterations = losses.sinkhorn_iterations
        self.local_loss_weight = losses.local_loss_weight  # λ_local: the gram stage sets it per iteration
        self.koleo_scope = losses.koleo_scope
        self.dino_loss = DINOLoss(losses.student_temp)
        self.ibot_loss = iBOTPatchLoss(losses.student_temp)
        self.koleo_loss = KoLeoLoss()
        # Sinkhorn's all-reduce group: None = the default world (FSDP / DDP); under pipeline parallelism the
        # data-parallel group only (PP peers hold the same images: pp).
        self.dp_group: dist.ProcessGroup | None = None

    def train(self, mode: bool = True) -> SSLMetaArch:
        """The teacher always stays in eval mode (no drop path, no RoPE jitter), as upstream."""
        super().train(mode)
        self.teacher.eval()
        return self

    @property
    def needs_koleo(self) -> bool:
        return self.weights.losses.koleo_weight != 0.0

    # ------------------------------------------------------------------------------------------ teacher

    @torch.no_grad()
    def teacher_targets(
        self,
        global_crops: Tensor,
        masks: IBOTMasks,
        *,
        n_micro: int,
        teacher_temp: float | Tensor,
        splits: Sequence[tuple[IBOTMasks, Tensor]] | None = None,
    ) -> TeacherTargets:
        """Teacher forward on the step's global crops, micro-batch by micro-batch, then Sinkhorn once.

        Args:
            global_crops: [S_g, B, 3, H, W] the rank's whole step batch.
            masks: the step's `IBOTMasks` (student masks: the teacher sees unmasked crops and is read at the
                masked positions).
            splits: `masks.microbatch(m, n_micro)` for each m, if the caller has them (`microbatch_splits`).
        """
        n_crops, batch = global_crops.shape[:2]
        b = batch // n_micro
        cls_logits: list[Tensor] = []
        patch_logits: list[tuple[Tensor, Tensor]] = []
        splits = splits or microbatch_splits(masks, n_micro)
        for m in range(n_micro):
            micro_masks, positions = splits[m]
            out = self.teacher["backbone"](global_crops[:, m * b : (m + 1) * b].flatten(0, 1), is_training=True)
            cls_logits.append(self.teacher["dino_head"](out["x_norm_clstoken"]).view(n_crops, b, -1))
            masked = out["x_norm_patchtokens"].flatten(0, 1)[micro_masks.mask_indices]
            patch_logits.append((positions, self.teacher["ibot_head"](masked)))
        dino = torch.cat(cls_logits, dim=1)
        if n_micro == 1:
            ibot = patch_logits[0][1]
        else:
            ibot = dino.new_empty(masks.n_masked_patches, patch_logits[0][1].shape[-1], dtype=patch_logits[0][1].dtype)
            for positions, logits in patch_logits:
                ibot[positions] = logits
        return self._sinkhorn(dino, ibot, teacher_temp)

    @torch.no_grad()
    def targets_from_features(
        self, cls: Tensor, patch: Tensor, masks: IBOTMasks, *, teacher_temp: float | Tensor
    ) -> TeacherTargets:
        """`teacher_targets` from the teacher backbone's outputs of the whole step (a pipelined teacher's last
        stage): cls [S_g, B, D] and patch tokens [S_g·B, N, D], crop-major; heads, then Sinkhorn once."""
        n_crops, batch = cls.shape[:2]
        dino = self.teacher["dino_head"](cls.flatten(0, 1)).view(n_crops, batch, -1)
        ibot = self.teacher["ibot_head"](patch.flatten(0, 1)[masks.mask_indices])
        return self._sinkhorn(dino, ibot, teacher_temp)

    def _sinkhorn(self, dino: Tensor, ibot: Tensor, teacher_temp: float | Tensor) -> TeacherTargets:
        """Sinkhorn-Knopp over the step's DINO [S_g, B, K] and iBOT [M, K] logits, across the data-parallel group."""
        return TeacherTargets(
            dino=dino_teacher_targets(dino, teacher_temp, n_iterations=self.sinkhorn_iterations, group=self.dp_group),
            ibot=ibot_teacher_targets(ibot, teacher_temp, n_iterations=self.sinkhorn_iterations, group=self.dp_group),
        )

    # ------------------------------------------------------------------------------------------ student

    @torch.no_grad()
    def student_step_features(
        self,
        global_crops: Tensor,
        masks: IBOTMasks,
        *,
        n_micro: int,
        splits: Sequence[tuple[IBOTMasks, Tensor]] | None = None,
    ) -> Tensor:
        """Student CLS features of the step's global crops [S_g, B, D] (no grad): the KoLeo neighbour set.

        With `koleo_scope="global"` they are all-gathered over ranks ([S_g, B·world, D], rank order). Exact
        when the student forward is deterministic (drop_path 0, no RoPE jitter); approximate otherwise.
        """
        n_crops, batch = global_crops.shape[:2]
        b = batch // n_micro
        feats = []
        splits = splits or microbatch_splits(masks, n_micro)
        for m in range(n_micro):
            micro_masks, _ = splits[m]
            x = global_crops[:, m * b : (m + 1) * b].flatten(0, 1)
            out = self.student["backbone"](x, masks=micro_masks.masks, is_training=True)
            feats.append(out["x_norm_clstoken"].view(n_crops, b, -1))
        return self._maybe_gather(torch.cat(feats, dim=1))

    def forward_loss(
        self,
        global_crops: Tensor,
        local_crops: Tensor,
        masks: IBOTMasks,
        targets: TeacherTargets,
        *,
        koleo_features: Tensor | None = None,
        koleo_offset: int = 0,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Weighted loss of one micro-batch (normalised by its own size: scale by 1/n_micro before backward).

        Args:
            global_crops, local_crops: [S_g, b, 3, H, W], [S_l, b, 3, h, w].
            masks: the micro-batch's masks (`IBOTMasks.microbatch`).
            targets: the micro-batch's slice of the step targets (`dino` [S_g, b, K], `ibot` [M_micro, K]).
            koleo_features: the step's neighbour set (`student_step_features`); None: this micro-batch is
                the whole rank step, gathered over ranks here if `koleo_scope="global"`.
            koleo_offset: first row of this micro-batch in `koleo_features`.
        Returns:
            (total loss with gradient, detached per-term losses keyed by `LOSS_NAMES`, and `SIGNAL_NAMES`).
        """
        out_global, out_local = self.student["backbone"](
            [global_crops.flatten(0, 1), local_crops.flatten(0, 1)], masks=[masks.masks, None], is_training=True
        )
        cls_global = out_global["x_norm_clstoken"]  # [S_g·b, D]
        # One DINO-head call for global and local CLS tokens (one FSDP all-gather, one launch per layer).
        dino_logits = self.student["dino_head"](torch.cat([cls_global, out_local["x_norm_clstoken"]]))
        return self.loss_from_outputs(
            global_crops,
            cls_global,
            dino_logits,
            out_global["x_norm_patchtokens"],
            masks,
            targets,
            koleo_features=koleo_features,
            koleo_offset=koleo_offset,
        )

    def loss_from_outputs(
        self,
        global_crops: Tensor,
        cls_global: Tensor,
        dino_logits: Tensor,
        patch_global: Tensor,
        masks: IBOTMasks,
        targets: TeacherTargets,
        *,
        koleo_features: Tensor | None = None,
        koleo_offset: int = 0,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The micro-batch loss from the student's outputs: what `forward_loss` does after the backbone and the
        DINO head, and what the last pipeline stage computes (`pp`). Stages that add terms (gram
        anchoring) override this one method, so they work with and without pipeline parallelism.

        global_crops [S_g, b, 3, H, W]; cls_global [S_g·b, D]; dino_logits [(S_g+S_l)·b, K] (crop-major, globals
        first); patch_global [S_g·b, N, D], the normed patch tokens of the (masked) global crops.
        """
        n_global, b = global_crops.shape[:2]
        n_local = dino_logits.shape[0] // b - n_global
        dino_global, dino_local = dino_logits.split([n_global * b, n_local * b])
        masked_tokens = patch_global.flatten(0, 1)[masks.mask_indices]
        ibot_logits = self.student["ibot_head"](masked_tokens)  # called even when empty: FSDP collectives
        losses = {
            "dino_global_loss": self.dino_loss(dino_global.view(n_global, b, -1), targets.dino, ignore_diagonal=True),
            "agreement": dino_agreement(dino_global.detach().view(n_global, b, -1), targets.dino),
            "dino_local_loss": self.dino_loss(dino_local.view(n_local, b, -1), targets.dino),
            "ibot_loss": self.ibot_loss(ibot_logits, targets.ibot, masks.masks_weight, masks.n_crops),
        }
        if self.needs_koleo:
            features = cls_global.view(n_global, b, -1)
            if koleo_features is None and self.koleo_scope == "global" and _world(self.dp_group) > 1:
                koleo_features, koleo_offset = self._maybe_gather(features.detach()), dist.get_rank(self.dp_group) * b
            losses["koleo_loss"] = self.koleo_loss(features, step_features=koleo_features, offset=koleo_offset)
        else:
            losses["koleo_loss"] = dino_global.new_zeros((), dtype=torch.float32)
        total = self.weights.total(
            dino_global=losses["dino_global_loss"],
            dino_local=losses["dino_local_loss"],
            koleo=losses["koleo_loss"],
            ibot=losses["ibot_loss"],
            dino_local_weight=self.local_loss_weight,
        )
        losses["total_loss"] = total
        return total, {k: v.detach().float() for k, v in losses.items()}

    def _maybe_gather(self, features: Tensor) -> Tensor:
        world = _world(self.dp_group)
        if self.koleo_scope != "global" or world == 1:
            return features
        parts = [torch.empty_like(features) for _ in range(world)]
        dist.all_gather(parts, features.contiguous(), group=self.dp_group)
        return torch.cat(parts, dim=1)

    # ------------------------------------------------------------------------------------------------ EMA

    @torch.no_grad()
    def update_teacher(self, momentum: float) -> None:
        """θ_t ← m·θ_t + (1−m)·θ_s on parameters (buffers are constant), on local shards under FSDP.

        Only the pairs whose student parameter trains: frozen ones (LoRA base weights, frozen blocks) are equal
        in both and never change, so averaging them would only cost time."""
        # By name: under pipeline parallelism the student is one stage, the teacher whole (same names).
        teacher_params = dict(self.teacher.named_parameters())
        pairs = [(_local(teacher_params[n]), _local(s)) for n, s in self.student.named_parameters() if s.requires_grad]
        if not pairs:
            return
        teacher, student = (list(x) for x in zip(*pairs, strict=True))
        torch._foreach_mul_(teacher, momentum)
        torch._foreach_add_(teacher, student, alpha=1.0 - momentum)


@torch.compiler.disable  # host-side bookkeeping: under torch.compile only data-dependent graph breaks to compile
def microbatch_splits(masks: IBOTMasks, n_micro: int) -> list[tuple[IBOTMasks, Tensor]]:
    """`masks.microbatch(m, n_micro)` for every m. Computed once a step by the caller and handed to the teacher, the
    KoLeo pass and the student loop: the boolean indexing in it has a data-dependent shape, a graph break inside
    their loops that would make Dynamo run the whole method eagerly (whole-step torch.compile)."""
    return [masks.microbatch(m, n_micro) for m in range(n_micro)]


def dino_agreement(student_logits: Tensor, teacher_probs: Tensor) -> Tensor:
    """Share of (image, student crop i, teacher crop j ≠ i) pairs — the DINO global loss's pairs — whose student
    argmax is the teacher target's argmax. Two argmaxes over [S_g, b, K]: negligible beside the head itself."""
    s = student_logits.argmax(-1)  # [S_g, b]
    t = teacher_probs.argmax(-1)
    same = (s[:, None] == t[None]).float()  # [S_s, S_t, b]
    n = s.shape[0]
    if n == 1:
        return same.mean()
    # Masked sum / count, not same[off].mean(): the same value (sums of 0/1 are exact), without boolean indexing's
    # data-dependent shape (a graph break under torch.compile).
    off = ~torch.eye(n, dtype=torch.bool, device=s.device)[..., None]
    return torch.where(off, same, 0.0).sum() / (n * (n - 1) * same.shape[-1])


def _local(p: Tensor) -> Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _world(group: dist.ProcessGroup | None = None) -> int:
    """Processes in `group` (None: the default world); 1 without a process group."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


# ----------------------------------------------------------------------------------------------- building


@dataclass
class BuiltModel:
    model: SSLMetaArch
    arch: str  # label: preset / released name, or "inferred from the file"
    backbone_kwargs: dict


def adapt(student: nn.ModuleDict, teacher: nn.ModuleDict, s: MC.StudentConfig) -> None:
    """`student.freeze_blocks` / `student.lora` on the student backbone, and the same LoRA structure on the teacher's
    with the student's adapter tensors copied in: both start identical (LoRA B is zero, so equal to the base model)
    and the EMA then runs on the same parameterisation. Heads always train fully."""
    settings = {"freeze_blocks": s.freeze_blocks, "freeze_patch_embed": s.freeze_patch_embed, "lora": s.lora}
    apply_adaptation(student["backbone"], **settings)
    if s.lora.rank > 0:
        apply_adaptation(teacher["backbone"], **settings)
        loaded = teacher["backbone"].load_state_dict(lora_state_dict(student["backbone"]), strict=False)
        assert not loaded.unexpected_keys, loaded.unexpected_keys  # same structure: every adapter has its twin
    teacher.requires_grad_(False)


def build_ssl_model(cfg: C.PretrainConfig, meta_arch: type[SSLMetaArch] | None = None) -> BuiltModel:
    """Student + teacher (identical at start) on CPU: fresh, or warm-started from a released backbone.

    Call under the same `torch.manual_seed` on every rank: FSDP shards each rank's full copy.
    """
    dino_kwargs, ibot_kwargs = MC.head_kwargs(cfg.heads.dino), MC.head_kwargs(cfg.heads.ibot)
    overrides = MC.backbone_overrides(cfg)
    if cfg.student.pretrained_weights:
        path = cfg.student.pretrained_weights
        try:
            warm = build_student_teacher_from_released(
                path,
                dino_kwargs,
                ibot_kwargs,
                arch=None if cfg.student.arch == "auto" else cfg.student.arch,
                student_overrides=overrides,
            )
        except FileNotFoundError:
            raise WsidinoError(
                f"student.pretrained_weights: file not found: {path}; give the path of a released DINOv3 "
                "backbone (.pth) or of an eval teacher_checkpoint.pth"
            ) from None
        except ReleasedWeightsError as err:
            raise WsidinoError(
                f"student.pretrained_weights={path} does not fit student.arch={cfg.student.arch!r}:\n{err}\n"
                "Set student.arch to the file's architecture (e.g. vitb16 for dinov3_vitb16_*.pth), or "
                "student.arch=auto to read it from the file."
            ) from None
        student, teacher, kwargs, arch = warm.student, warm.teacher, warm.backbone_kwargs, warm.arch
    else:
        try:
            backbone = build_backbone(cfg.student.arch, **overrides)
        except (ValueError, TypeError) as err:
            raise WsidinoError(f"student.arch / student.backbone_overrides: {err}") from None
        dim = backbone.embed_dim
        student = nn.ModuleDict(
            {"backbone": backbone, "dino_head": DINOHead(dim, **dino_kwargs), "ibot_head": DINOHead(dim, **ibot_kwargs)}
        )
        teacher = copy.deepcopy(student)
        for block in teacher["backbone"].blocks:
            block.sample_drop_ratio = 0.0
        kwargs, arch = dict(overrides), cfg.student.arch
    adapt(student, teacher, cfg.student)
    model = (meta_arch or SSLMetaArch)(
        student,
        teacher,
        weights=SSLLossWeights(cfg.losses, cfg.crops.n_global_crops, cfg.crops.n_local_crops),
    ).train()
    return BuiltModel(model, arch, kwargs)
