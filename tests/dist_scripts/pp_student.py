"""PROTOTYPE parity check of pipeline parallelism (issue 14), 2 gloo ranks = 2 pipeline stages.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node=2 tests/dist_scripts/pp_student.py

Every rank builds the same seeded `vit_test` student (+ DINO and iBOT heads) and EMA teacher and computes the
unsplit single-process reference step on the whole step batch: teacher targets (Sinkhorn once), `forward_loss`,
backward, per-submodule clipping, SGD, EMA. Then, for each case, a fresh copy of the same student is cut into 2
`StudentStage`s and trained one step with a `torch.distributed.pipelining` schedule on the same batch (2 crop
sizes: global 64 px with iBOT masks, local 32 px): the last stage computes the real DINO + iBOT (+ KoLeo) loss
from the step's precomputed teacher targets, sliced per micro-batch. Parameters, gradients and the replicated
teacher after the EMA must equal the reference within 1e-5 (fp32) when the loss is scaled by 1/(GA × n_mb); the
unscaled case must NOT (gradients n_mb times too large). SGD is used because AdamW's first step is invariant to
a constant gradient scale (it would hide a scaling bug).

Rank 0 prints one JSON line per case and PP_STUDENT_OK; exits 1 on any failed expectation.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from dinov3_core.data.masking import IBOTMaskSampler
from dinov3_core.losses import SSLLossWeights
from dinov3_core.losses.weights import LossesConfig
from dinov3_core.models import HUB_SETTINGS, DINOHead, build_backbone
from dinov3_core.train.optim import clip_gradients
from dinov3_core.train.pipeline_parallel import (
    StepContext,
    build_schedule,
    build_stage,
    check_pp_contract,
    clip_gradients_pp,
    make_loss_fn,
    stage_owners,
    update_teacher_pp,
)
from dinov3_core.train.ssl_model import SSLMetaArch

B, S_G, S_L, GLOBAL_PX, LOCAL_PX, PATCH = 4, 2, 3, 64, 32, 16
LR, MOMENTUM, TEMP, TOL = 0.5, 0.9, 0.07, 1e-5


def build_meta(koleo_weight: float) -> SSLMetaArch:
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
    # Teacher ≠ student, so the EMA result depends on both.
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.01 * torch.randn_like(p))
    weights = SSLLossWeights(LossesConfig(koleo_weight=koleo_weight), S_G, S_L)
    return SSLMetaArch(student, teacher, weights=weights).train()


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


def pp_step(
    meta: SSLMetaArch, batch, *, schedule: str, n_mb: int, scaled: bool, clip: float, group, ga: int = 1
) -> dict:
    rank, pp = dist.get_rank(group), dist.get_world_size(group)
    global_crops, local_crops, masks = batch
    stage_mod = build_stage(meta.student, rank, pp)
    grid = [(GLOBAL_PX // PATCH,) * 2, (LOCAL_PX // PATCH,) * 2]
    stage_mod.set_grids(grid)
    pipe_stage = PipelineStage(stage_mod, rank, pp, torch.device("cpu"), group=group)

    # The teacher is replicated: every PP rank runs it over the whole step (only the last stage uses the targets).
    targets = meta.teacher_targets(global_crops, masks, n_micro=1, teacher_temp=TEMP)
    koleo_features = None
    if meta.needs_koleo:  # the step's neighbour set: a forward-only pass of the pipelined student
        fwd_only = build_schedule(pipe_stage, schedule, n_mb, loss_fn=None)
        with torch.no_grad():
            out = fwd_only.step(global_crops, local_crops, masks.masks.view(S_G, B, -1))
        if stage_mod.is_last:
            cls = out[0]  # merged along dim 0: [n_mb × (S_g × b), D], micro-batch-major
            koleo_features = cls.view(n_mb, S_G, B // n_mb, -1).transpose(0, 1).reshape(S_G, B, -1)
    # Micro-batches of the whole step: GA chunks × PP micro-batches; the loss scale is 1/(GA × n_mb).
    ctx = StepContext(masks, targets, ga * n_mb, (1.0 / (ga * n_mb)) if scaled else 1.0, koleo_features)
    parts: dict = {}
    loss_fn = make_loss_fn(meta, stage_mod, lambda: ctx, parts) if stage_mod.is_last else None
    sched = build_schedule(pipe_stage, schedule, n_mb, loss_fn=loss_fn if stage_mod.is_last else _unused_loss)
    chunk = B // ga  # gradient accumulation: `ga` schedule steps per optimizer step, grads accumulate in .grad
    step_loss = 0.0
    for g in range(ga):
        images = slice(g * chunk, (g + 1) * chunk)
        if stage_mod.is_first:
            step_masks = masks.masks.view(S_G, B, -1)[:, images]
            sched.step(global_crops[:, images], local_crops[:, images], step_masks)
        elif stage_mod.is_last:
            losses: list = []
            # target = the chunk's image indices within the step: the loss slices masks / targets with them
            sched.step(target=torch.arange(B)[images], losses=losses)
            step_loss += float(sum(x.detach() for x in losses))  # scaled losses: they sum to the step loss
        else:
            sched.step()
    norms = clip_gradients_pp(stage_mod, clip, group)
    grads = {n: p.grad.clone() for n, p in stage_mod.named_parameters()}
    with torch.no_grad():
        for p in stage_mod.parameters():
            p.add_(p.grad, alpha=-LR)
    update_teacher_pp(meta.teacher, stage_mod, MOMENTUM, group, stage_owners(meta.student, pp))
    loss = sum(float(p["total_loss"]) for p in parts.values()) / (n_mb * ga) if parts else None
    if stage_mod.is_last:
        assert sorted(parts) == list(range(n_mb * ga)), sorted(parts)
        expected = loss if scaled else loss * n_mb * ga
        assert abs(step_loss - expected) < 1e-5, (step_loss, expected)
    return {"stage": stage_mod, "loss": loss, "norms": {k: float(v) for k, v in norms.items()}, "grads": grads}


def _unused_loss(output, target):  # non-last stages: the schedule needs a loss_fn to run backward at all
    raise AssertionError("only the last stage computes the loss")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main() -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))  # the PP group (here: everything; PP × FSDP would use a mesh dim)
    solo = [dist.new_group([r]) for r in range(world)][rank]  # Sinkhorn's "data-parallel" group: this rank alone
    batch = make_batch()
    results, failures = [], []
    cases = [
        # (schedule, n_mb, loss scaled?, clip, koleo weight[, GA steps])
        ("GPipe", 2, True, 0.0, 0.0),
        ("1F1B", 2, True, 0.0, 0.0),
        ("1F1B", 4, True, 0.0, 0.0),
        ("1F1B", 2, False, 0.0, 0.0),  # must break parity
        ("1F1B", 2, True, 0.05, 0.0),  # cross-stage clipping active
        ("1F1B", 2, True, 0.0, 0.1),  # KoLeo with the step's neighbour set from a forward-only PP pass
        ("1F1B", 2, True, 0.0, 0.1, 2),  # PP × GA: 2 schedule steps of 2 micro-batches, loss × 1/4
        ("GPipe", 2, False, 0.0, 0.0, 2),  # PP × GA unscaled: 4× the gradients
    ]
    for schedule, n_mb, scaled, clip, koleo, *rest in cases:
        ga = rest[0] if rest else 1
        check_pp_contract(
            local_batch=B // ga, microbatch_size=B // (n_mb * ga), pp_degree=world, schedule=schedule, depth=2
        )
        ref = build_meta(koleo)
        ref.dp_group = solo
        initial_student = copy.deepcopy(ref.student)
        ref_out = reference_step(ref, batch, clip)

        meta = build_meta(koleo)
        meta.dp_group = solo
        meta.student.load_state_dict(initial_student.state_dict())
        out = pp_step(meta, batch, schedule=schedule, n_mb=n_mb, scaled=scaled, clip=clip, group=group, ga=ga)
        stage = out["stage"]
        ref_params = dict(ref.student.named_parameters())
        mine = dict(stage.named_parameters())
        record = {
            "rank": rank,
            "schedule": schedule,
            "n_mb": n_mb,
            "ga": ga,
            "scaled": scaled,
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
            "max_teacher_diff": max_diff(dict(meta.teacher.named_parameters()), dict(ref.teacher.named_parameters())),
            "norms_pp": out["norms"],
            "norms_ref": ref_out["norms"],
            "loss_pp": out["loss"],
            "loss_ref": ref_out["loss"],
            "stage_keys": sorted(stage.state_dict()),
        }
        ok = record["max_param_diff"] < TOL and record["max_grad_diff"] < TOL and record["max_teacher_diff"] < TOL
        ok = ok and all(
            abs(out["norms"][k] - ref_out["norms"][k]) < 1e-4 * max(1, ref_out["norms"][k]) for k in ref_out["norms"]
        )
        if out["loss"] is not None:
            ok = ok and abs(out["loss"] - ref_out["loss"]) < 1e-5
        if scaled and not ok:
            failures.append(f"rank {rank} {schedule} n_mb={n_mb} clip={clip} koleo={koleo}: no parity")
        if not scaled and ok:
            failures.append(f"rank {rank} {schedule}: unscaled loss kept parity (it must not)")
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
