"""Pretrain stage building blocks without a training run: sampler, split-invariant randomness, schedules and
param groups, memory estimator, configs, launch helpers."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from dinov3_core.config import ConfigError, load_config
from dinov3_core.data.augment import MultiCropAugmentation
from dinov3_core.data.masking import IBOTMaskSampler
from dinov3_core.errors import WsidinoError
from dinov3_core.models import DINOHead, backbone_kwargs, build_backbone
from dinov3_core.train import config as C
from dinov3_core.train import model_config as MC
from dinov3_core.train.batch_plan import plan_batch
from dinov3_core.train.distributed import choose_device
from dinov3_core.train.memory import estimate_memory, measure_activation_bytes, model_shape
from dinov3_core.train.memory_terms import backbone_activation_bytes, head_row_elements
from dinov3_core.train.optim import apply_schedules, build_optimizer, build_schedules
from dinov3_core.train.sampler import SamplerState, StepKey, StepSampler
from dinov3_core.train.ssl_model import build_ssl_model
from dinov3_core.train.step_batches import augment_step, rank_masks

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(**overrides: object) -> C.PretrainConfig:
    values = {"data.stores": ["unused.zarr"], "output_dir": "unused", **overrides}
    return load_config(C.PretrainConfig, "tiny", values, stage="pretrain")


# ------------------------------------------------------------------------------------------------ sampler


def test_sampler_shards_the_single_process_stream_and_covers_each_epoch() -> None:
    n, batch = 23, 6  # 23 tiles: step batches straddle epoch boundaries
    single = list(StepSampler(n, batch, seed=5, stop_iteration=12))
    ranks = [list(StepSampler(n, batch, rank=r, world_size=3, seed=5, stop_iteration=12)) for r in range(3)]
    for it, key in enumerate(single):
        parts = [ranks[r][it] for r in range(3)]
        assert [p.rank_offset for p in parts] == [0, 2, 4]
        np.testing.assert_array_equal(np.concatenate([p.indices for p in parts]), key.indices)
    stream = np.concatenate([k.indices for k in single])  # 72 samples = 3 full epochs + 3
    for epoch in range(3):
        assert sorted(stream[epoch * n : (epoch + 1) * n].tolist()) == list(range(n))
    assert not np.array_equal(stream[:n], stream[n : 2 * n])  # a new permutation per epoch
    other_seed = np.concatenate([k.indices for k in StepSampler(n, batch, seed=6, stop_iteration=12)])
    assert not np.array_equal(stream, other_seed)


def test_sampler_resumes_at_the_exact_next_sample_on_any_world_size() -> None:
    n, batch = 23, 6
    full = list(StepSampler(n, batch, seed=1, stop_iteration=10))
    state = StepSampler(n, batch, seed=1, stop_iteration=10).state_after(3)  # trained 0…3
    assert (state.epoch, state.position, state.consumed_samples) == (1, 1, 24)
    restored = SamplerState.from_dict(state.to_dict(), n)
    for world in (1, 2):
        resumed = [
            list(
                StepSampler(
                    n,
                    batch,
                    rank=r,
                    world_size=world,
                    seed=1,
                    start_iteration=4,
                    start_sample=restored.consumed_samples,
                    stop_iteration=10,
                )
            )
            for r in range(world)
        ]
        for i, key in enumerate(full[4:]):
            got = np.concatenate([resumed[r][i].indices for r in range(world)])
            np.testing.assert_array_equal(got, key.indices)
            assert resumed[0][i].iteration == key.iteration


def test_sampler_refuses_fewer_tiles_than_a_global_batch() -> None:
    with pytest.raises(WsidinoError, match="fewer than one global batch"):
        StepSampler(5, 8, stop_iteration=1)


# ------------------------------------------------------------------------------------- split invariance


def test_ibot_masks_do_not_depend_on_the_rank_split() -> None:
    sampler = IBOTMaskSampler(4)  # 4×4 patch grid
    global_batch, n_global = 8, 2
    key = StepKey(0, 40, 0, global_batch, np.arange(global_batch))
    whole = rank_masks(sampler, key, seed=3, n_global_crops=n_global)  # [S_g·8, 16] crop-major
    halves = [
        rank_masks(sampler, StepKey(0, 40, off, global_batch, np.arange(4)), seed=3, n_global_crops=n_global)
        for off in (0, 4)
    ]
    # Crop-major per rank: rows c·4 + i of rank r are rows c·8 + 4r + i of the whole step.
    rebuilt = np.concatenate([h.reshape(n_global, 4, -1) for h in halves], axis=1).reshape(n_global * 8, -1)
    np.testing.assert_array_equal(rebuilt, whole)
    counts = whole.sum(axis=1)
    assert (counts > 0).sum() == int(n_global * global_batch * sampler.mask_probability)  # official: half masked
    expected = sorted(int(16 * r) for r in np.linspace(0.1, 0.5, 9)[1:])
    assert sorted(counts[counts > 0].tolist()) == expected
    other_step = rank_masks(sampler, StepKey(1, 48, 0, global_batch, np.arange(8)), seed=3, n_global_crops=n_global)
    assert not np.array_equal(other_step, whole)


@pytest.mark.parametrize("group", [1, 2])
def test_crops_do_not_depend_on_the_rank_split(group: int) -> None:
    augmentation = MultiCropAugmentation(tiny().crops)
    images = torch.randint(0, 256, (4, 64, 64, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    whole = augment_step(augmentation, images, seed=7, first_sample=100, rank_offset=0, group_size=group)
    parts = [
        augment_step(augmentation, images[o : o + 2], seed=7, first_sample=100, rank_offset=o, group_size=group)
        for o in (0, 2)
    ]
    torch.testing.assert_close(torch.cat([p.global_stack for p in parts], 1), whole.global_stack, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([p.local_stack for p in parts], 1), whole.local_stack, rtol=0, atol=0)
    assert whole.global_stack.shape == (2, 4, 3, 64, 64) and whole.local_stack.shape == (2, 4, 3, 32, 32)
    later = augment_step(augmentation, images, seed=7, first_sample=108, rank_offset=0, group_size=group)
    assert not torch.equal(later.global_stack, whole.global_stack)


# ------------------------------------------------------------------------------ schedules, param groups


def test_schedules_and_param_groups_follow_the_config() -> None:
    cfg = tiny(**{"optim.freeze_last_layer_epochs": 1, "optim.warmup_epochs": 1})
    schedules = build_schedules(cfg, global_batch=1024)
    peak = 1e-3 * 4.0  # sqrt_wrt_1024 at B = 1024
    assert schedules.at(0).lr == 0.0 and schedules.at(5).lr == pytest.approx(peak)
    assert schedules.at(4).last_layer_lr == 0.0 and schedules.at(5).last_layer_lr == schedules.at(5).lr
    assert schedules.at(0).teacher_temp == pytest.approx(0.04) and schedules.at(19).teacher_temp == pytest.approx(0.07)
    assert schedules.at(0).momentum == pytest.approx(0.992) and schedules.at(19).momentum == pytest.approx(1.0)
    assert schedules.at(0).wd == pytest.approx(0.04) and schedules.at(19).wd == pytest.approx(0.4)

    model = build_ssl_model(cfg).model
    optimizer = build_optimizer(model.student, cfg)
    apply_schedules(optimizer, schedules.at(2))
    names = {id(p): n for n, p in model.student.named_parameters()}
    by_name = {names[id(p)]: g for g in optimizer.param_groups for p in g["params"]}
    assert set(by_name) == set(names.values())  # every student parameter is optimised, no teacher one
    assert by_name["dino_head.last_layer.weight"]["lr"] == 0.0  # frozen during the first epoch
    blocks = model.student["backbone"].n_blocks
    lr = schedules.at(2).lr
    assert by_name["backbone.blocks.1.mlp.fc1.weight"]["lr"] == pytest.approx(lr * 0.9 ** (blocks - 1))
    assert by_name["backbone.patch_embed.proj.weight"]["lr"] == pytest.approx(lr * 0.9 ** (blocks + 1) * 0.2)
    assert by_name["backbone.blocks.0.norm1.weight"]["weight_decay"] == 0.0
    assert by_name["backbone.blocks.0.attn.qkv.bias"]["weight_decay"] == 0.0
    assert by_name["backbone.blocks.0.attn.qkv.weight"]["weight_decay"] == pytest.approx(schedules.at(2).wd)


# ------------------------------------------------------------------------------------ memory estimator


@pytest.mark.parametrize(("arch", "global_size", "local_size"), [("vit_test", 64, 32), ("vit_small", 96, 48)])
def test_activation_estimate_matches_measured_saved_tensors(arch: str, global_size: int, local_size: int) -> None:
    torch.manual_seed(0)
    cfg = tiny(**{"student.arch": arch, "crops.global_size": global_size, "crops.local_size": local_size})
    shape = model_shape(cfg)
    backbone = build_backbone(arch).train()
    b = 2
    patches = (global_size // 16) ** 2
    masks = torch.zeros(2 * b, patches, dtype=torch.bool)
    masks[::2, : patches // 3] = True
    xs = [torch.randn(2 * b, 3, global_size, global_size), torch.randn(2 * b, 3, local_size, local_size)]
    measured = measure_activation_bytes(backbone, lambda: backbone(xs, masks=[masks, None], is_training=True))
    estimated = b * backbone_activation_bytes(cfg, shape, bf16=False, checkpointing=False)
    assert 0.85 < estimated / measured < 1.3, (estimated, measured)

    head = DINOHead(shape.embed_dim, **MC.head_kwargs(cfg.heads.dino))
    rows = torch.randn(10, shape.embed_dim, requires_grad=True)
    measured = measure_activation_bytes(head, lambda: torch.log_softmax(head(rows) / 0.1, dim=-1))
    estimated = 4 * 10 * head_row_elements(shape, cfg.heads.dino.n_prototypes)
    assert 0.85 < estimated / measured < 1.3, (estimated, measured)


def test_batch_plan_fits_the_budget_and_keeps_the_global_batch() -> None:
    cfg = tiny(**{"train.global_batch_size": 64, "train.batch_size_per_gpu": "auto"})
    shape = model_shape(cfg)

    def total(micro: int, world: int) -> int:
        kw = {"micro_batch": micro, "step_batch": 64 // world, "world_size": world, "device_type": "cpu"}
        return estimate_memory(cfg, shape, **kw).total

    budget = (total(16, 1) + total(32, 1)) // 2  # room for 16 images of activations, not 32
    plan = plan_batch(cfg, shape, world_size=1, budget_bytes=budget, device_type="cpu")
    assert (plan.micro_batch, plan.accumulation_steps) == (16, 4)
    assert plan.estimate.total <= budget
    roomy = plan_batch(cfg, shape, world_size=2, budget_bytes=total(32, 2), device_type="cpu")
    assert (roomy.micro_batch, roomy.accumulation_steps, roomy.global_batch) == (32, 1, 64)
    assert total(2, 1) > total(1, 1)  # activations grow with the micro-batch
    with pytest.raises(WsidinoError, match="does not fit"):
        plan_batch(cfg, shape, world_size=1, budget_bytes=total(1, 1) - 1, device_type="cpu")
    with pytest.raises(WsidinoError, match="divisible"):
        plan_batch(cfg, shape, world_size=3, budget_bytes=budget, device_type="cpu")


def test_memory_estimate_counts_sharding_and_accumulation() -> None:
    cfg = C.PretrainConfig(output_dir="o")
    shape = model_shape(cfg, backbone_kwargs("vitb16"))
    one = estimate_memory(cfg, shape, micro_batch=32, step_batch=32, world_size=1, device_type="cuda")
    eight = estimate_memory(cfg, shape, micro_batch=32, step_batch=32, world_size=8, device_type="cuda")
    accum = estimate_memory(cfg, shape, micro_batch=32, step_batch=64, world_size=8, device_type="cuda")
    assert eight.optimizer * 8 == pytest.approx(one.optimizer, rel=1e-6)  # AdamW state is sharded
    assert accum.grads == one.grads  # unsharded gradients are kept while accumulating under FSDP
    assert accum.step_buffers > eight.step_buffers  # targets and crops of the whole step
    checkpointed = C.PretrainConfig(output_dir="o")
    checkpointed.train.activation_checkpointing = True
    ac = estimate_memory(checkpointed, shape, micro_batch=32, step_batch=32, world_size=8, device_type="cuda")
    assert ac.activations < eight.activations / 2


# Peak allocated GPU memory of real runs (benchmarks/gpu_check.py, official crops, 4,096-prototype heads, bf16; H100
# 2026-11-26, H200 2026-11-27; docs/benchmarks.md): (recipe, compile, activation checkpointing, micro, global, GiB).
MEASURED_CUDA_PEAKS = [
    ("vitl16", True, True, 256, 256, 30.97),
    ("vitl16", False, True, 256, 256, 32.97),
    ("vitl16", True, False, 64, 256, 47.55),
    ("vitb16", True, False, 256, 256, 71.54),
    ("vitb16", False, False, 256, 256, 83.12),
    ("vits16", True, False, 512, 512, 80.17),
    ("vits16", False, False, 512, 512, 80.13),
    ("vitb16", "step", False, 256, 256, 71.01),
    ("vits16", "step", False, 512, 512, 78.68),
]


@pytest.mark.parametrize(("arch", "compiled", "ac", "micro", "batch", "peak_gib"), MEASURED_CUDA_PEAKS)
def test_memory_estimate_matches_measured_gpu_peaks(
    arch: str, compiled: bool | str, ac: bool, micro: int, batch: int, peak_gib: float
) -> None:
    """Within 5 % of every measured GPU run: an under-estimate is an out-of-memory crash on a full card (ViT-S/16's
    was), an over-estimate a micro-batch smaller than the card allows. Most rows fit the constants (in-sample); compiled
    ViT-S was predicted before it ran."""
    values = {
        "data.stores": ["s"],
        "output_dir": "o",
        "heads.dino.n_prototypes": 4096,
        "heads.ibot.n_prototypes": 4096,
        "student.pretrained_weights": None,
        "data.num_workers": 10,
        "train.activation_checkpointing": ac,
        "train.compile": compiled,
        "train.global_batch_size": batch,
        "train.batch_size_per_gpu": "auto",
    }
    cfg = load_config(C.PretrainConfig, f"{arch}-continued", values, stage="pretrain")
    est = estimate_memory(cfg, model_shape(cfg), micro_batch=micro, step_batch=batch, world_size=1, device_type="cuda")
    assert est.total / 2**30 == pytest.approx(peak_gib, rel=0.05), est.describe()


# ------------------------------------------------------------------------------------- config, launch


def test_named_configs_load_and_validate() -> None:
    C.validate(tiny())
    with pytest.raises(ConfigError, match=r"student\.pretrained_weights"):
        load_config(C.PretrainConfig, "vitb16-continued", {"data.stores": ["s"], "output_dir": "o"}, stage="pretrain")
    cfg = load_config(
        C.PretrainConfig,
        "vitb16-continued",
        {"data.stores": ["s"], "output_dir": "o", "student.pretrained_weights": "w.pth"},
        stage="pretrain",
    )
    C.validate(cfg)
    assert cfg.train.batch_size_per_gpu == "auto" and cfg.train.global_batch_size == 1024
    assert cfg.student.arch == "vitb16" and cfg.crops.global_size == 224


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"data.stores": []}, "data.stores is empty"),
        ({"crops.global_size": 60}, "not a multiple of the patch size"),
        ({"train.batch_size_per_gpu": "big"}, r"train\.batch_size_per_gpu: must be a positive integer or 'auto'"),
        ({"train.batch_size_per_gpu": "auto"}, r"train\.batch_size_per_gpu: auto needs global_batch_size"),
        ({"optim.warmup_epochs": 10}, "warmup iterations"),
        # Checked by the sections themselves (`__post_init__`) while the config is loaded:
        ({"crops.n_local_crops": 0}, r"crops\.n_local_crops: must be >= 1"),
        ({"crops.blur_p_global": [1.0]}, r"crops\.blur_p_global: needs one probability per global crop \(2\)"),
        ({"crops.hed_p": 1.5}, r"crops\.hed_p: must be in \[0, 1\], got 1\.5"),
        ({"crops.mask_ratio": [0.5, 0.1]}, r"crops\.mask_ratio: must satisfy 0 <= min < max <= 1"),
        ({"crops.rng_group_size": 0}, r"crops\.rng_group_size: must be >= 1, got 0"),
        ({"losses.sinkhorn_iterations": 0}, r"losses\.sinkhorn_iterations: must be >= 1"),
        ({"teacher.warmup_teacher_temp_epochs": -1}, r"teacher\.warmup_teacher_temp_epochs: must be >= 0"),
        ({"checkpointing.keep_every": 0}, r"checkpointing\.keep_every: must be >= 1 or null"),
        ({"train.compile": "steps"}, r"train\.compile: must be true, false or 'step', got 'steps'"),
    ],
)
def test_config_errors_name_the_key(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        C.validate(tiny(**overrides))


def test_training_job_argv(tmp_path) -> None:
    """The one torchrun launcher builds every training command: the resolved config file, standalone or c10d."""
    from dinov3_core.launch import torchrun_argv
    from dinov3_core.launch.job import LAUNCH_CONFIG
    from dinov3_core.launch.training import LaunchSettings
    from dinov3_core.stages import get_stage

    cfg = tiny(output_dir=str(tmp_path / "run"))
    job = get_stage("pretrain").torchrun_job(cfg, LaunchSettings(nproc_per_node=4), env={"MLFLOW_RUN_ID": "r1"})
    cmd = torchrun_argv(job)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and "--nproc-per-node=4" in cmd
    saved = tmp_path / "run" / LAUNCH_CONFIG
    assert cmd[-4:] == ["-m", "dinov3_core.train", "--config", str(saved.resolve())]
    assert load_config(C.PretrainConfig, saved, {}) == cfg  # every rank loads exactly this config
    multi = torchrun_argv(
        get_stage("gram").torchrun_job(cfg, LaunchSettings(nproc_per_node=8, nnodes=2, rdzv_endpoint="head:29400"))
    )
    assert "--standalone" not in multi and "dinov3_core.gram" in multi
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=head:29400", "--rdzv-id=wsidino-gram-run"} <= set(
        multi
    )
    assert f"--log-dir={tmp_path / 'run' / 'torchrun_logs'}" in multi
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        LaunchSettings(nproc_per_node=8, nnodes=2)


def test_device_choice_refuses_more_processes_than_gpus() -> None:
    assert choose_device("auto", 0, 2, gpu_count=0).type == "cpu"
    assert choose_device("cpu", 0, 8, gpu_count=2).type == "cpu"
    assert choose_device("auto", 1, 2, gpu_count=2) == torch.device("cuda", 1)
    with pytest.raises(WsidinoError, match="4 processes per node but only 2 GPU"):
        choose_device("auto", 3, 4, gpu_count=2)
    with pytest.raises(WsidinoError, match="no CUDA GPU"):
        choose_device("cuda", 0, 1, gpu_count=0)


def test_a_training_log_line_has_count_rate_and_eta() -> None:
    from dinov3_core.train.metrics import progress_line

    record = {"iteration": 9, "lr": 1e-3, "images_per_s": 64.0, "iter_time": 0.5, "rss_mb": 100.0}
    line = progress_line(record, 1000)
    assert line.startswith("it 9/1000 ") and "64.0 img/s" in line
    assert "eta 0:08:15" in line  # 990 iterations left at 0.5 s each
    assert "\r" not in line


def test_the_eta_counts_to_stop_at_not_to_the_schedules_end() -> None:
    """A 50-iteration run of a 1000-iteration schedule (train.stop_at=50) ends at 50: its ETA is 40 iterations."""
    from dinov3_core.train.metrics import progress_line

    record = {"iteration": 9, "lr": 1e-3, "images_per_s": 64.0, "iter_time": 0.5, "rss_mb": 100.0}
    line = progress_line(record, 1000, 50)
    assert line.startswith("it 9/1000 (stops at 50) ")
    assert "eta 0:00:20" in line  # 40 iterations left at 0.5 s each
    assert "(stops at" not in progress_line(record, 1000, 1000)  # stop_at at the schedule's end: no note


def test_checkpoints_with_the_older_optimizer_layout_still_resume(tmp_path) -> None:
    """Checkpoints store the optimizer's param groups per parameter since pipeline parallelism (each stage has its
    own groups); one written with the earlier list of groups still loads, values and AdamW state intact."""
    import torch.distributed.checkpoint as dcp

    from dinov3_core.train import checkpoint as ckpt
    from dinov3_core.train.distributed import DistEnv

    def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        cfg = tiny()
        torch.manual_seed(0)
        model = build_ssl_model(cfg).model
        optimizer = build_optimizer(model.student, cfg)
        for group in optimizer.param_groups:
            group["lr"] = 1e-3
        for p in model.student.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        return model, optimizer

    model, optimizer = trained()
    for flat, name in ((False, "old"), (True, "new")):
        path = tmp_path / name
        dcp.save(ckpt._full_state(model, optimizer, {"iteration": 3}, flat=flat), checkpoint_id=str(path))
        assert ckpt._has_flat_optimizer(path) is flat
        fresh = build_ssl_model(tiny()).model
        fresh_optimizer = build_optimizer(fresh.student, tiny())
        state = ckpt.load_checkpoint(path, fresh, fresh_optimizer, {"iteration": -1}, DistEnv())
        assert state["iteration"] == 3
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
        before, after = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
        assert before.keys() == after.keys() and all(
            torch.equal(before[i]["exp_avg"], after[i]["exp_avg"]) for i in before
        )
