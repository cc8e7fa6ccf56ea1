"""Memory estimate and batch plan under pipeline parallelism (`pp_memory`, issue 14): per-stage weights, schedules'
activations in flight, data-parallel sharding, contract-aware plans, and calibration against real stages."""

from __future__ import annotations

import copy

import pytest
from torch import nn

from dinov3_core.config import load_config
from dinov3_core.errors import WsidinoError
from dinov3_core.models import DINOHead, backbone_kwargs
from dinov3_core.train import config as C
from dinov3_core.train import model_config as MC
from dinov3_core.train.batch_plan import plan_batch
from dinov3_core.train.memory import estimate_memory, model_shape, shape_of
from dinov3_core.train.memory_terms import GIB, SAFETY, activation_bytes_per_image, loader_bytes, step_buffer_bytes
from dinov3_core.train.parallel_config import check_pipeline_contract, pipeline_microbatches, split_blocks
from dinov3_core.train.pp_memory import pp_stage_estimates
from dinov3_core.train.pp_stages import PPStage
from dinov3_core.train.ssl_model import build_ssl_model

pytestmark = pytest.mark.usefixtures("one_thread")

DEPTH4 = {"student.backbone_overrides": {"depth": 4}}


def tiny(**overrides: object) -> C.PretrainConfig:
    values = {"data.stores": ["unused.zarr"], "output_dir": "unused", **overrides}
    return load_config(C.PretrainConfig, "tiny", values, stage="pretrain")


def vitb(**parallelism: object) -> tuple[C.PretrainConfig, object]:
    cfg = C.PretrainConfig(output_dir="o")
    for key, value in parallelism.items():
        setattr(cfg.parallelism, key, value)
    return cfg, model_shape(cfg, backbone_kwargs("vitb16"))


def heads_and_norm_params(cfg: C.PretrainConfig, embed_dim: int) -> int:
    """Built independently of `shape_of`'s name matching: both heads plus the final LayerNorm (weight, bias)."""
    heads = [DINOHead(embed_dim, **MC.head_kwargs(h)) for h in (cfg.heads.dino, cfg.heads.ibot)]
    return sum(p.numel() for h in heads for p in h.parameters()) + 2 * embed_dim


def test_pp_degree_1_is_the_unpipelined_estimate_by_hand() -> None:
    cfg = tiny(**{"train.global_batch_size": 32})
    shape = model_shape(cfg)
    p, t = shape.student_params, shape.trainable_params
    est = estimate_memory(cfg, shape, micro_batch=4, step_batch=16, world_size=2, device_type="cpu")
    assert est.stage is None and "pipeline" not in est.describe()
    assert (est.weights, est.optimizer, est.teacher) == (int(4 * p / 2), int(8 * t / 2), int(4 * p / 2))
    assert est.grads == 4 * t  # accumulating under FSDP: unsharded gradients kept
    per_image = activation_bytes_per_image(cfg, shape, bf16=False, checkpointing=False)
    assert est.activations == int(SAFETY * 4 * per_image)
    assert est.step_buffers == int(step_buffer_bytes(cfg, shape, 16, 2))
    assert est.loader == int(loader_bytes(cfg, 16, 224))
    # the same configuration with a 2-stage pipeline is a different (per-stage) estimate
    cfg.parallelism.pp_degree = 2
    piped = estimate_memory(cfg, shape, micro_batch=4, step_batch=16, world_size=2, device_type="cpu")
    assert piped.stage is not None and piped.weights != est.weights


def test_two_stages_hold_half_the_blocks_each_and_the_last_the_heads() -> None:
    cfg, shape = vitb(pp_degree=2)
    one, _ = vitb()
    unsplit = estimate_memory(one, shape, micro_batch=32, step_batch=32, world_size=1, device_type="cuda")
    kw = {"micro_batch": 32, "step_batch": 32, "world_size": 2, "device_type": "cuda"}
    first, last = pp_stage_estimates(cfg, shape, **kw)
    tail = heads_and_norm_params(cfg, shape.embed_dim)
    blocks = shape.student_params - tail  # the embedding (~0.6 M) counts with the blocks here
    assert first.weights == pytest.approx(4 * blocks / 2, rel=0.01)
    assert last.weights == pytest.approx(4 * (blocks / 2 + tail), rel=0.01)
    assert first.weights + last.weights == pytest.approx(unsplit.weights, rel=1e-6)
    assert first.optimizer + last.optimizer == pytest.approx(unsplit.optimizer, rel=1e-6)
    assert (first.teacher, last.teacher) == (first.weights, last.weights)  # cut like the student (dp 1)
    assert first.teacher + last.teacher == pytest.approx(4 * shape.teacher_params, rel=1e-6)
    assert first.activations < unsplit.activations / 4  # half the blocks for 2 of 4 PP micro-batches (1F1B)
    assert last.step_buffers > first.step_buffers  # teacher targets live on the last stage
    worst = estimate_memory(cfg, shape, **kw)
    assert worst.stage == 1 and worst.total == max(first.total, last.total)
    assert "pipeline stage 1" in worst.describe()


def test_gpipe_holds_every_micro_batch_1f1b_only_those_in_flight() -> None:
    kw = {"step_batch": 32, "world_size": 2, "device_type": "cuda"}
    gpipe_cfg, shape = vitb(pp_degree=2, pp_schedule="GPipe", pp_microbatch_size=4)
    ofob_cfg, _ = vitb(pp_degree=2, pp_schedule="1F1B", pp_microbatch_size=4)
    assert pipeline_microbatches(gpipe_cfg.parallelism, 32) == 8  # n_mb 8 > 2 stages
    gpipe = pp_stage_estimates(gpipe_cfg, shape, micro_batch=32, **kw)
    ofob = pp_stage_estimates(ofob_cfg, shape, micro_batch=32, **kw)
    assert gpipe[0].activations == pytest.approx(4 * ofob[0].activations, rel=1e-6)  # 8 vs 2 in flight
    assert gpipe[1].activations == pytest.approx(8 * ofob[1].activations, rel=1e-6)  # 8 vs 1 (+ heads)
    assert ofob[0].activations > ofob[1].activations * 1.2  # 1F1B: the first stage holds the most blocks' work
    assert estimate_memory(gpipe_cfg, shape, micro_batch=32, **kw).activations > (
        estimate_memory(ofob_cfg, shape, micro_batch=32, **kw).activations
    )
    # n_mb == stages: the first stage holds every micro-batch under either schedule
    few = [pp_stage_estimates(c, shape, micro_batch=8, **kw)[0] for c in (gpipe_cfg, ofob_cfg)]
    assert few[0].activations == few[1].activations


def test_data_parallel_degree_shards_each_stage() -> None:
    cfg, shape = vitb(pp_degree=2, pp_schedule="GPipe")
    kw = {"micro_batch": 1, "step_batch": 1, "device_type": "cuda"}  # one PP micro-batch: FSDP reshards
    dp1, dp4 = pp_stage_estimates(cfg, shape, world_size=2, **kw), pp_stage_estimates(cfg, shape, world_size=8, **kw)
    for a, b in zip(dp1, dp4, strict=True):
        assert b.weights == pytest.approx(a.weights / 4, abs=1)
        assert b.grads == pytest.approx(a.grads / 4, abs=1)
        assert b.optimizer == pytest.approx(a.optimizer / 4, abs=1)
        assert b.teacher == pytest.approx(a.teacher / 4, abs=1)
    # several PP micro-batches under FSDP: gradients (and bf16 weights) stay unsharded until the last backward
    cfg.parallelism.pp_microbatch_size = 1
    many = pp_stage_estimates(cfg, shape, world_size=8, micro_batch=4, step_batch=4, device_type="cuda")
    assert many[0].grads == dp1[0].grads and many[0].weights > dp1[0].weights / 2


def test_a_frozen_student_does_not_share_the_teacher_under_pp() -> None:
    cfg = tiny(**{"student.freeze_blocks": 1, "student.freeze_patch_embed": True})
    shape = model_shape(cfg)
    assert shape.trainable_params < shape.student_params
    kw = {"micro_batch": 4, "step_batch": 4, "world_size": 1, "device_type": "cpu"}
    assert estimate_memory(cfg, shape, **kw).teacher == 4 * shape.trainable_params  # one process: shared
    cfg.parallelism.pp_degree = 2
    stages = pp_stage_estimates(cfg, shape, **{**kw, "world_size": 2})
    assert sum(s.teacher for s in stages) == 4 * shape.teacher_params  # cut in stages, not shared
    assert all(s.teacher == 4 * (s.weights // 4) for s in stages)
    assert stages[0].activations == 0  # the frozen first block saves nothing for backward


def test_plan_batch_splits_the_global_batch_over_data_parallel_processes_only() -> None:
    cfg = tiny(**{"train.global_batch_size": 36, "train.batch_size_per_gpu": "auto", "parallelism.pp_degree": 2})
    shape = model_shape(cfg)
    plan = plan_batch(cfg, shape, world_size=4, budget_bytes=64 * GIB, device_type="cpu")
    assert plan.estimate.step_batch == 18  # 36 / dp 2, not / 4 processes
    assert (plan.micro_batch, plan.accumulation_steps, plan.global_batch) == (18, 1, 36)
    check_pipeline_contract(cfg.parallelism, world_size=4, micro_batch=plan.micro_batch, depth=shape.depth)
    with pytest.raises(WsidinoError, match="data-parallel degree 2"):
        cfg.train.global_batch_size = 35
        plan_batch(cfg, shape, world_size=4, budget_bytes=64 * GIB, device_type="cpu")


def test_plan_batch_tries_only_micro_batches_the_pipeline_accepts() -> None:
    values = {"train.global_batch_size": 64, "train.batch_size_per_gpu": "auto", **DEPTH4}
    cfg = tiny(**values, **{"parallelism.pp_degree": 2, "parallelism.pp_microbatch_size": 4})
    shape = model_shape(cfg)

    def total(micro: int) -> int:
        return estimate_memory(cfg, shape, micro_batch=micro, step_batch=32, world_size=4, device_type="cpu").total

    # 1F1B holds at most 2 PP micro-batches of 4 images: the micro-batch no longer sets the activations
    assert total(8) == total(16) == total(32)
    plan = plan_batch(cfg, shape, world_size=4, budget_bytes=total(32), device_type="cpu")
    assert (plan.micro_batch, plan.accumulation_steps, plan.global_batch) == (32, 1, 64)
    # it needs 2 PP micro-batches of 4: 8 is the smallest micro-batch it may try, though 4, 2 or 1 divide 32
    with pytest.raises(WsidinoError, match="even with micro-batch 8"):
        plan_batch(cfg, shape, world_size=4, budget_bytes=total(8) - 1, device_type="cpu")

    cfg.parallelism.pp_schedule = "GPipe"  # every PP micro-batch in flight: activations grow with the micro-batch
    assert total(4) < total(8) < total(16) < total(32)
    plan = plan_batch(cfg, shape, world_size=4, budget_bytes=total(16), device_type="cpu")
    assert (plan.micro_batch, plan.accumulation_steps) == (16, 2)
    for micro in (16, 8):
        check_pipeline_contract(cfg.parallelism, world_size=4, micro_batch=micro, depth=shape.depth)
    plan = plan_batch(cfg, shape, world_size=4, budget_bytes=total(16) - 1, device_type="cpu")
    assert (plan.micro_batch, plan.accumulation_steps) == (8, 4)
    with pytest.raises(WsidinoError, match="even with micro-batch 4"):  # 2 and 1 are no multiples of 4
        plan_batch(cfg, shape, world_size=4, budget_bytes=total(4) - 1, device_type="cpu")
    cfg.parallelism.pp_microbatch_size = 64  # larger than the per-process step batch of 32
    with pytest.raises(WsidinoError, match="no micro-batch dividing the per-process step batch 32"):
        plan_batch(cfg, shape, world_size=4, budget_bytes=64 * GIB, device_type="cpu")


def stage_names(student: nn.ModuleDict, stage: int, ranges: list[range]) -> list[str]:
    """Parameter names a stage holds: its blocks, the embedding on the first, norms and heads on the last."""
    blocks = {f"backbone.blocks.{i}." for i in ranges[stage]}
    first = ("backbone.patch_embed.", "backbone.cls_token", "backbone.storage_tokens", "backbone.mask_token")
    last = ("backbone.norm.", "backbone.cls_norm.", "backbone.local_cls_norm.", "dino_head.", "ibot_head.")
    return [
        n
        for n, _ in student.named_parameters()
        if any(n.startswith(b) for b in blocks)
        or (stage == 0 and n.startswith(first))
        or (stage == len(ranges) - 1 and n.startswith(last))
    ]


@pytest.mark.parametrize(
    ("overrides", "pp"),
    [
        ({}, {"pp_degree": 2}),
        ({}, {"pp_degree": 3}),
        ({"student.freeze_blocks": 1}, {"pp_degree": 2, "pp_split": [1, 3]}),
    ],
)
def test_stage_parameter_bytes_match_the_real_stages(overrides: dict, pp: dict) -> None:
    cfg = tiny(**DEPTH4, **overrides, **{f"parallelism.{k}": v for k, v in pp.items()})
    student = build_ssl_model(cfg).model.student
    shape = shape_of(student, cfg)
    assert shape.depth == 4 and shape.student_params == sum(p.numel() for p in student.parameters())
    ranges = split_blocks(cfg.parallelism, shape.depth)
    kw = {"micro_batch": 6, "step_batch": 6, "world_size": cfg.parallelism.pp_degree, "device_type": "cpu"}
    estimates = pp_stage_estimates(cfg, shape, **kw)
    params = dict(student.named_parameters())
    for s, est in enumerate(estimates):
        names = stage_names(student, s, ranges)
        real = PPStage(copy.deepcopy(student), s, len(ranges), ranges[s])  # the split is in place
        assert sorted(n for n, _ in real.named_parameters()) == sorted(names)  # the FQNs are kept
        held = sum(p.numel() for p in real.parameters())
        assert est.weights == 4 * held  # dp 1: the stage's fp32 weights
        assert est.optimizer == 8 * sum(params[n].numel() for n in names if params[n].requires_grad)
    worst = estimate_memory(cfg, shape, **kw)
    assert worst.total == max(e.total for e in estimates) and worst == estimates[worst.stage]
    assert sum(e.weights for e in estimates) == 4 * shape.student_params
