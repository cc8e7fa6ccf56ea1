"""Parity of pipeline parallelism (issue 14) with the unsplit step, 2 gloo ranks = 2 pipeline stages.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 tests/dist_scripts/pp_student.py

Every rank builds the same seeded `vit_test` student (+ DINO and iBOT heads) and EMA teacher and computes the
unsplit single-process reference step on the whole step batch: teacher targets (Sinkhorn once), `forward_loss`,
backward, per-submodule clipping, SGD, EMA. Then, for each case, a fresh copy of the same student is cut into 2
stages and trained one step through the trainer's own `Pipeline` (torch.distributed.pipelining) on the same batch
(2 crop sizes: global 64 px with iBOT masks, local 32 px): the teacher, cut at the same blocks, runs forward over
the whole step and the last stage computes the Sinkhorn targets once and the real DINO + iBOT (+ KoLeo) loss,
sliced per micro-batch. Parameters, gradients and the
teacher after the EMA must equal the reference within 1e-5 (fp32) with the loss scaled by 1/(GA × n_mb); a loss
left unscaled or scaled by GA only must NOT. The targets every micro-batch loss saw must equal the unsplit ones
exactly, while per-micro-batch Sinkhorn targets measurably drift. SGD is used because AdamW's first step is
invariant to a constant gradient scale (it would hide a scaling bug).

Rank 0 prints one JSON line per case and PP_STUDENT_OK; exits 1 on any failed expectation.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from dinov3_core.data.masking import IBOTMaskSampler
from dinov3_core.losses import SSLLossWeights
from dinov3_core.losses.weights import LossesConfig
from dinov3_core.models import HUB_SETTINGS, DINOHead, build_backbone
from dinov3_core.train.distributed import DistEnv
from dinov3_core.train.optim import clip_gradients
from dinov3_core.train.parallel_config import ParallelismConfig
from dinov3_core.train.pp import Pipeline, StepContext, clip_gradients_pp
from dinov3_core.train.pp_stages import split_model
from dinov3_core.train.ssl_model import SSLMetaArch

B, S_G, S_L, GLOBAL_PX, LOCAL_PX, PATCH = 4, 2, 3, 64, 32, 16
LR, MOMENTUM, TEMP, TOL = 0.5, 0.9, 0.07, 1e-5


def build_meta(koleo_weight: float, cls: type[SSLMetaArch] = SSLMetaArch) -> SSLMetaArch:
    torch.manual_seed(0)
    # Layer scale 1 so blocks matter; storage tokens and masked K bias as the released models; no RoPE
    # augmentation and no drop path: the reference and the pipeline must draw nothing random.
    kwargs = {**HUB_SETTINGS, "layerscale_init": 1.0, "pos_embed_rope_rescale_coords": None}
    backbone = build_backbone("vit_test", **kwargs)
    head = dict(out_dim=48, hidden_dim=32, bottleneck_dim=16)
    student = nn.ModuleDict(
        {"backbone": backbone, "dino_head": DINOHead(64, **head), "ibot_head": DINOHead(64, **head)}
    )
    teacher = copy.deepcopy(student)
    # Teacher ≠ student, so the EMA result depends on both; its prototype logits as spread as a trained teacher's
    # (std ≈ 1 instead of 0.02 at initialisation), so Sinkhorn depends on the batch as it does in training.
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.01 * torch.randn_like(p))
        for head in ("dino_head", "ibot_head"):
            teacher[head].last_layer.weight.mul_(50.0)
    weights = SSLLossWeights(LossesConfig(koleo_weight=koleo_weight), S_G, S_L)
    return cls(student, teacher, weights=weights).train()


def make_batch() -> tuple[torch.Tensor, torch.Tensor, object]:
    gen = torch.Generator().manual_seed(1)
    global_crops = torch.randn(S_G, B, 3, GLOBAL_PX, GLOBAL_PX, generator=gen)
    local_crops = torch.randn(S_L, B, 3, LOCAL_PX, LOCAL_PX, generator=gen)
    masks = IBOTMaskSampler(GLOBAL_PX // PATCH)(B, S_G, rng=0)
    return global_crops, local_crops, masks


def reference_step(meta: SSLMetaArch, batch, clip: float) -> dict:
    """The unsplit single-process step on the whole batch (n_micro = 1)."""
    global_crops, local_crops, masks = batch
    targets = meta.teacher_targets(global_crops, masks, n_micro=1, teacher_temp=TEMP)
    loss, parts = meta.forward_loss(global_crops, local_crops, masks, targets)
    loss.backward()
    norms = clip_gradients(meta.student, clip)
    grads = {n: p.grad.clone() for n, p in meta.student.named_parameters()}
    with torch.no_grad():
        for p in meta.student.parameters():
            p.add_(p.grad, alpha=-LR)
    meta.update_teacher(MOMENTUM)
    return {"loss": float(parts["total_loss"]), "norms": {k: float(v) for k, v in norms.items()}, "grads": grads}


class Recording(SSLMetaArch):
    """Records the teacher targets every micro-batch loss was computed against."""

    def loss_from_outputs(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.seen_targets.append(args[5])
        return super().loss_from_outputs(*args, **kwargs)


def pp_step(meta: SSLMetaArch, batch, *, schedule: str, n_mb: int, scale: str, clip: float, group, solo, ga: int = 1):
    """One optimizer step of the pipelined student and teacher through the trainer's own `Pipeline`; `scale` =
    "right" (1/(GA·n_mb)), "none" or "ga" (1/GA only): the last two must break parity."""
    rank, pp = dist.get_rank(group), dist.get_world_size(group)
    global_crops, local_crops, masks = batch
    p = ParallelismConfig(pp_degree=pp, pp_microbatch_size=B // (ga * n_mb), pp_schedule=schedule)
    env = DistEnv(rank, pp, 0, pp, torch.device("cpu"), None, pp_size=pp, pp_rank=rank, pp_group=group, dp_group=solo)
    meta.student = split_model(meta.student, p, rank)
    meta.teacher = split_model(meta.teacher, p, rank, features_only=True)
    grids = [(GLOBAL_PX // PATCH,) * 2, (LOCAL_PX // PATCH,) * 2]
    pipeline = Pipeline(meta, env, p, micro_batch=B // ga, accumulation=ga, grids=grids)
    stage = pipeline.stage
    # As the trainer: the teacher's stages over the whole step, Sinkhorn once on the last stage.
    targets = pipeline.teacher_targets(global_crops, masks, TEMP)
    koleo = pipeline.koleo_features(global_crops, local_crops, masks) if meta.needs_koleo else None
    n_total = ga * pipeline.n_mb
    loss_scale = {"right": 1.0 / n_total, "none": 1.0, "ga": 1.0 / ga}[scale]
    ctx = StepContext(global_crops, masks, targets, n_total, koleo, 0, loss_scale=loss_scale)
    parts = pipeline.run(ctx, local_crops)
    norms = clip_gradients_pp(stage, clip)
    grads = {n: q.grad.clone() for n, q in stage.named_parameters()}
    with torch.no_grad():
        for q in stage.parameters():
            q.add_(q.grad, alpha=-LR)
    meta.update_teacher(MOMENTUM)  # local: the teacher is cut at the same blocks
    loss = sum(float(x["total_loss"]) for x in parts) / n_total if parts else None
    if stage.is_last:
        assert len(parts) == n_total, len(parts)
    return {
        "stage": stage,
        "loss": loss,
        "norms": {k: float(v) for k, v in norms.items()},
        "grads": grads,
        "targets": targets,
    }


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def microbatch_sinkhorn_kl(meta: SSLMetaArch, batch, n_mb: int) -> float:
    """Mean KL(whole-step targets ‖ per-micro-batch targets): the drift a per-micro-batch teacher would cause."""
    global_crops, _, masks = batch
    whole = meta.teacher_targets(global_crops, masks, n_micro=1, teacher_temp=TEMP).dino  # [S_g, B, K]
    b = B // n_mb
    parts = [
        meta.teacher_targets(
            global_crops[:, m * b : (m + 1) * b], masks.microbatch(m, n_mb)[0], n_micro=1, teacher_temp=TEMP
        ).dino
        for m in range(n_mb)
    ]
    per_micro = torch.cat(parts, dim=1)
    return float((whole * (whole.clamp_min(1e-12).log() - per_micro.clamp_min(1e-12).log())).sum(-1).mean())


def main() -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))  # the PP group (here: everything; PP × FSDP would use a mesh dim)
    solo = [dist.new_group([r]) for r in range(world)][rank]  # Sinkhorn's "data-parallel" group: this rank alone
    batch = make_batch()
    results, failures = [], []
    cases = [
        # (schedule, PP micro-batches, loss scale, clip, koleo weight[, GA steps])
        ("GPipe", 2, "right", 0.0, 0.0),
        ("1F1B", 2, "right", 0.0, 0.0),
        ("1F1B", 4, "right", 0.0, 0.0),
        ("1F1B", 2, "none", 0.0, 0.0),  # must break parity (n_mb× the gradients)
        ("1F1B", 2, "right", 0.05, 0.0),  # cross-stage clipping active
        ("1F1B", 2, "right", 0.0, 0.1),  # KoLeo with the step's neighbour set from a forward-only PP pass
        ("1F1B", 2, "right", 0.0, 0.1, 2),  # PP × GA: 2 schedule steps of 2 micro-batches, loss × 1/4
        ("GPipe", 2, "right", 0.0, 0.0, 2),  # PP × GA with GPipe
        ("GPipe", 2, "ga", 0.0, 0.0, 2),  # PP × GA scaled by GA only: must break parity
        ("1F1B", 2, "none", 0.0, 0.0, 2),  # PP × GA unscaled: 4× the gradients
    ]
    for schedule, n_mb, scale, clip, koleo, *rest in cases:
        ga = rest[0] if rest else 1
        ref = build_meta(koleo)
        ref.dp_group = solo
        initial_student = copy.deepcopy(ref.student)
        ref_targets = ref.teacher_targets(batch[0], batch[2], n_micro=1, teacher_temp=TEMP)
        drift = microbatch_sinkhorn_kl(ref, batch, ga * n_mb)  # what a per-micro-batch teacher would have seen
        ref_out = reference_step(ref, batch, clip)

        meta = build_meta(koleo, cls=Recording)
        meta.seen_targets = []
        meta.dp_group = solo
        meta.student.load_state_dict(initial_student.state_dict())
        out = pp_step(meta, batch, schedule=schedule, n_mb=n_mb, scale=scale, clip=clip, group=group, solo=solo, ga=ga)
        stage = out["stage"]
        ref_params = dict(ref.student.named_parameters())
        mine = dict(stage.named_parameters())
        record = {
            "rank": rank,
            "schedule": schedule,
            "n_mb": n_mb,
            "ga": ga,
            "scale": scale,
            "clip": clip,
            "koleo": koleo,
            "stage_keys_subset": set(stage.state_dict()) <= set(ref.student.state_dict()),
            "n_stage_params": len(mine),
            "max_param_diff": max_diff(
                {k: v.detach() for k, v in mine.items()}, {k: ref_params[k].detach() for k in mine}
            ),
            "max_grad_diff": max_diff(out["grads"], ref_out["grads"]),
            "grad_ratio": float(
                sum(g.norm() ** 2 for g in out["grads"].values()) ** 0.5
                / sum(ref_out["grads"][k].norm() ** 2 for k in out["grads"]) ** 0.5
            ),
            "max_teacher_diff": max_diff(
                dict(meta.teacher.named_parameters()),
                {k: v for k, v in ref.teacher.named_parameters() if k in dict(meta.teacher.named_parameters())},
            ),
            "norms_pp": out["norms"],
            "norms_ref": ref_out["norms"],
            "loss_pp": out["loss"],
            "loss_ref": ref_out["loss"],
            "stage_keys": sorted(stage.state_dict()),
        }
        if out["targets"] is not None:  # last stage: the targets every micro-batch loss saw = the unsplit ones
            seen = torch.cat([t.dino for t in meta.seen_targets[-ga * n_mb :]], dim=1)
            record["max_target_diff"] = float((seen - ref_targets.dino).abs().max())
            record["per_microbatch_sinkhorn_kl"] = drift
        ok = record["max_param_diff"] < TOL and record["max_grad_diff"] < TOL and record["max_teacher_diff"] < TOL
        ok = ok and all(
            abs(out["norms"][k] - ref_out["norms"][k]) < 1e-4 * max(1, ref_out["norms"][k]) for k in ref_out["norms"]
        )
        if out["loss"] is not None:
            ok = ok and abs(out["loss"] - ref_out["loss"]) < 1e-5
        if "max_target_diff" in record and record["max_target_diff"] != 0.0:
            failures.append(f"rank {rank} {schedule}: the pipeline's teacher targets drift from the unsplit ones")
        if "per_microbatch_sinkhorn_kl" in record and record["per_microbatch_sinkhorn_kl"] < 1e-3:
            failures.append(f"rank {rank}: per-micro-batch Sinkhorn shows no drift; the test batch cannot tell")
        if scale == "right" and not ok:
            failures.append(f"rank {rank} {schedule} n_mb={n_mb} ga={ga} clip={clip} koleo={koleo}: no parity")
        if scale != "right" and ok:
            failures.append(f"rank {rank} {schedule} ga={ga}: loss scale {scale!r} kept parity (it must not)")
        results.append(record)
        dist.barrier()

    gathered: list = [None] * world
    dist.all_gather_object(gathered, (results, failures))
    if rank == 0:
        all_keys = set().union(*(set(r["stage_keys"]) for res, _ in gathered for r in res[:1]))
        ref_keys = set(build_meta(0.0).student.state_dict())
        for res, _ in gathered:
            for r in res:
                r["stage_keys_subset"] = bool(r["stage_keys_subset"])
                print(json.dumps({k: v for k, v in r.items() if k != "stage_keys"}), flush=True)
        flat = [f for _, fails in gathered for f in fails]
        if all_keys != ref_keys:
            flat.append(f"stage keys do not cover the student: missing {sorted(ref_keys - all_keys)}")
        print(json.dumps({"fqn_union_equals_student": all_keys == ref_keys}))
        if flat:
            print("\n".join(flat), file=sys.stderr)
        else:
            print("PP_STUDENT_OK")
        code = 1 if flat else 0
    else:
        code = 0
    codes = [code]
    dist.broadcast_object_list(codes, src=0)
    dist.destroy_process_group()
    return codes[0]


if __name__ == "__main__":
    sys.exit(main())
