"""GPU tests (`pytest -m gpu tests/test_gpu.py`): what only a CUDA device exercises, against real components.

Device: `cuda` when a GPU is visible; else, with WSIDINO_GPU_TESTS_ON_CPU=1, the same tests on the CPU with tiny
shapes (a dry run: the code paths are exercised before a GPU is at hand; NCCL becomes gloo, tests that mean nothing
on a CPU skip); else every test skips. Tiny models throughout (the `tiny` recipe: `vit_test`, 64/32 px crops).

Each tolerance is stated where it is checked, with why. Nothing here imports prefect or mlflow (training runs set
tracking.enabled=false), so the file runs on a machine with only the core dependencies.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import DIST_SCRIPTS, REPO, WIDE, eval_backbone, load_dcp, pretrain_values, train_process
from wsidino_dev.ports import free_port

pytestmark = pytest.mark.gpu

ON_CPU = os.environ.get("WSIDINO_GPU_TESTS_ON_CPU") == "1"
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def device() -> torch.device:
    if CUDA:
        return torch.device("cuda", 0)
    if ON_CPU:
        return torch.device("cpu")
    pytest.skip("needs a CUDA GPU (or WSIDINO_GPU_TESTS_ON_CPU=1 for a dry run on the CPU)")


def cuda_only(device: torch.device, why: str) -> None:
    if device.type != "cuda":
        pytest.skip(f"CPU dry run: {why}")


# ------------------------------------------------------------------------------------------------- helpers


def tiny_cfg(tmp_path: Path, **overrides: Any):
    """The `tiny` pretrain recipe (+ tests.helpers.TINY_PRETRAIN); the store is never opened by these tests."""
    from dinov3_core.config import load_config
    from dinov3_core.train.config import PretrainConfig

    values = pretrain_values(tmp_path / "unused.zarr", tmp_path / "out", **overrides)
    return load_config(PretrainConfig, "tiny", values, stage="pretrain")


def ssl_model(cfg, device: torch.device):
    from dinov3_core.train.ssl_model import build_ssl_model

    torch.manual_seed(0)
    return build_ssl_model(cfg).model.to(device)


def step_inputs(cfg, device: torch.device, batch: int = 4):
    """Random crops and iBOT masks of the recipe's shapes (what `augment_step` and `IBOTMaskSampler` hand the step):
    global [S_g, B, 3, g, g], local [S_l, B, 3, l, l], masks bool [S_g·B, N] with 2-8 masked patches a crop."""
    from dinov3_core.data.augment import MultiCrops
    from dinov3_core.data.masking import IBOTMasks

    c = cfg.crops
    gen = torch.Generator().manual_seed(1)
    crops = MultiCrops(
        global_stack=torch.randn(c.n_global_crops, batch, 3, c.global_size, c.global_size, generator=gen),
        local_stack=torch.randn(c.n_local_crops, batch, 3, c.local_size, c.local_size, generator=gen),
    )
    n_patches = (c.global_size // 16) ** 2
    masks = torch.zeros(c.n_global_crops * batch, n_patches, dtype=torch.bool)
    for row in masks:
        k = int(torch.randint(2, 9, (1,), generator=gen))
        row[torch.randperm(n_patches, generator=gen)[:k]] = True
    crops = MultiCrops(crops.global_stack.to(device), crops.local_stack.to(device))
    return crops, IBOTMasks.from_masks(masks, c.n_global_crops).to(device)


def one_process_step(tmp_path: Path, device: torch.device) -> tuple[Any, Any, Any, Any]:
    """What `run_step` takes: the tiny recipe's seeded SSL model, a one-process `DistEnv` and random step inputs."""
    from dinov3_core.train.distributed import DistEnv

    cfg = tiny_cfg(tmp_path)
    crops, masks = step_inputs(cfg, device)
    return ssl_model(cfg, device), DistEnv(device=device), crops, masks


def loss_keys() -> tuple[str, ...]:
    from dinov3_core.train.ssl_model import LOSS_NAMES, SIGNAL_NAMES

    return (*LOSS_NAMES, *SIGNAL_NAMES)


def run_step(model, env, crops, masks, *, bf16: bool = False, step=None) -> tuple[dict[str, float], dict[str, Any]]:
    """One `forward_backward` (or `step`, a compiled wrapper of it) from zero gradients and a fixed seed; returns
    the per-term losses and the student's gradients (full tensors, fp32, on the CPU)."""
    from dinov3_core.train.step import forward_backward

    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # RoPE jitter and drop path draw from the global RNG (CUDA's too)
    kwargs = {"keys": loss_keys(), "n_micro": 1, "teacher_temp": 0.05, "koleo_base": 0, "bf16": bf16}
    values = (step or forward_backward)(model, None, env, crops, masks, **kwargs)
    losses = dict(zip((*loss_keys(), "entropy"), values.tolist(), strict=True))
    grads = {}
    for name, p in model.student.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().float().cpu()
    return losses, grads


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def init_world_of_one(device: torch.device) -> None:
    """An in-process world of one: NCCL on CUDA, gloo on the CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )


@pytest.fixture
def world_of_one(device: torch.device):
    assert not dist.is_initialized()
    init_world_of_one(device)
    try:
        yield
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------- 1. bf16 autocast


@pytest.mark.timeout(120)
def test_bf16_training_step_is_close_to_fp32(device, tmp_path) -> None:
    model, env, crops, masks = one_process_step(tmp_path, device)
    ref_losses, ref_grads = run_step(model, env, crops, masks, bf16=False)
    losses, grads = run_step(model, env, crops, masks, bf16=True)
    for key in ("dino_global_loss", "dino_local_loss", "ibot_loss", "koleo_loss", "total_loss"):
        assert math.isfinite(losses[key]), (key, losses)
        # bf16 keeps 8 mantissa bits (~4e-3 relative a rounding); the losses are sums of logs of softmaxes over 256
        # prototypes, where those roundings average out well under 3 %.
        assert losses[key] == pytest.approx(ref_losses[key], rel=3e-2, abs=1e-3), (key, losses, ref_losses)
    assert grads.keys() == ref_grads.keys()
    # Directions, not values: each module's whole gradient (concatenated) in bf16 points where fp32's does
    # (cosine > 0.98); every single tensor with a non-negligible gradient at least roughly (> 0.9).
    for module in ("backbone.", "dino_head.", "ibot_head."):
        names = [n for n in grads if n.startswith(module)]
        flat, ref = (torch.cat([g[n].flatten() for n in names]) for g in (grads, ref_grads))
        assert cosine(flat, ref) > 0.98, module
    for name, ref in ref_grads.items():
        if ref.norm() > 1e-6:
            assert cosine(grads[name], ref) > 0.9, name


# ------------------------------------------------------------------------------------------ 2. process groups


@pytest.mark.timeout(60)
def test_world_of_one_all_reduce(device, world_of_one) -> None:
    assert dist.get_backend() == ("nccl" if device.type == "cuda" else "gloo")
    x = torch.arange(4, dtype=torch.float32, device=device)
    dist.all_reduce(x)
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]  # exact: one rank sums nothing else
    parts = [torch.empty(4, device=device)]
    dist.all_gather(parts, x + 1)
    assert parts[0].tolist() == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.timeout(120)
def test_two_processes_all_reduce_and_fsdp2_on_one_device(device) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, str(DIST_SCRIPTS / "gpu_collectives.py")], cwd=REPO, env=env, capture_output=True, text=True, timeout=90
    )
    text = proc.stdout + proc.stderr
    if proc.returncode != 0 and "Duplicate GPU detected" in text:
        line = next(x for x in text.splitlines() if "Duplicate GPU detected" in x)
        pytest.skip(f"NCCL refuses two ranks on one GPU: {line.strip()[:300]}")
    # The error's last lines first: a report that keeps only the message's start still shows the cause.
    tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
    assert proc.returncode == 0, f"exit {proc.returncode}; stderr ends:\n{tail}\n--- stdout\n{proc.stdout[-3000:]}"
    results = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"rank"')]
    assert sorted(r["rank"] for r in results) == [0, 1], proc.stdout
    for r in results:
        assert r["backend"] == ("nccl" if device.type == "cuda" else "gloo"), r
        assert r["all_reduce"] == 3.0, r  # 1 + 2, exact in fp32
        assert r["param_types"] == ["DTensor"], r
        # fp32, sharded vs whole: only the reduction order of the gradient average differs (the reduce-scatter
        # averages two half-batch gradients); 1e-5 is ~100 ulps of these O(0.1) values. Same bound as the CPU test
        # (tests/test_models_fsdp.py). On CUDA the matmuls of a batch of 2 and of 4 may pick different kernels: 1e-4.
        tol = 1e-4 if device.type == "cuda" else 1e-5
        assert r["max_out_diff"] < tol, r
        assert r["max_grad_diff"] < tol, r


# ------------------------------------------------------------------------------------ 3. FSDP2, world of one


@pytest.mark.timeout(120)
def test_fsdp2_wrapped_student_matches_unwrapped(device, world_of_one, tmp_path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from dinov3_core.train.distributed import DistEnv, parallelize

    cfg = tiny_cfg(tmp_path)
    model = ssl_model(cfg, device)
    crops, masks = step_inputs(cfg, device)
    ref_losses, ref_grads = run_step(model, DistEnv(device=device), crops, masks)

    wrapped = ssl_model(cfg, device)
    env = DistEnv(device=device, mesh=init_device_mesh(device.type, (1,), mesh_dim_names=("dp",)))
    wrapped.student, wrapped.teacher = parallelize(
        wrapped.student, wrapped.teacher, env, bf16=False, activation_checkpointing=False, compile=False
    )
    assert {type(p).__name__ for p in wrapped.student.parameters()} == {"DTensor"}
    losses, grads = run_step(wrapped, env, crops, masks)
    # fp32, a world of one: FSDP2 only all-gathers / reduce-scatters over one rank (copies), so the arithmetic is
    # the unwrapped model's; 1e-5 leaves room for a different kernel choice on the flat-parameter views.
    for key, ref in ref_losses.items():
        assert losses[key] == pytest.approx(ref, rel=1e-5, abs=1e-6), key
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-5, msg=name)


# ------------------------------------------------------------------------------------------- 4. torch.compile


@pytest.mark.timeout(300)
def test_compiled_backbone_matches_eager(device) -> None:
    from dinov3_core.models import HUB_SETTINGS, build_backbone, compile_blocks

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_backbone("vit_test", **HUB_SETTINGS).eval().to(device)
    x = torch.randn(2, 3, 64, 96, device=device)
    per_block = compile_blocks(copy.deepcopy(model))
    with torch.no_grad():
        ref = model(x)
        # fp32: Inductor fuses and reorders reductions (layer norm, softmax, GEMM epilogues), so results differ from
        # eager by rounding only: 1e-4 absolute on outputs of unit scale (the CPU test of the whole model: 1e-5).
        torch.testing.assert_close(per_block(x), ref, rtol=1e-4, atol=1e-4)
        if device.type == "cuda":  # the whole model too (on the CPU: tests/test_models.py, marked slow)
            torch.testing.assert_close(torch.compile(model)(x), ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------- 5. activation checkpointing


@pytest.mark.timeout(120)
def test_activation_checkpointing_gives_the_same_gradients(device) -> None:
    from dinov3_core.models import HUB_SETTINGS, apply_activation_checkpointing, build_backbone

    torch.manual_seed(0)
    # Drop path 0.3 and RoPE jitter: recomputation must replay the same random draws (on CUDA: the CUDA RNG).
    base = build_backbone("vit_test", **{**HUB_SETTINGS, "drop_path_rate": 0.3}).train().to(device)
    gen = torch.Generator().manual_seed(1)
    x = [torch.randn(4, 3, 64, 64, generator=gen).to(device), torch.randn(4, 3, 32, 32, generator=gen).to(device)]
    grads = []
    for checkpointing in (False, True):
        model = apply_activation_checkpointing(copy.deepcopy(base), checkpointing)
        assert all(b.activation_checkpointing == checkpointing for b in model.blocks)
        torch.manual_seed(5)
        out = model(x, is_training=True)
        sum(o["x_norm_patchtokens"].square().mean() + o["x_norm_clstoken"].sin().mean() for o in out).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    # Recomputation replays the same kernels on the same inputs: bit-identical on the CPU (as in test_models.py).
    # On CUDA the backward's atomics-based kernels (e.g. index/scatter adds) need not sum in the same order from run
    # to run: 1e-6 absolute / 1e-5 relative, far below any error from a wrong replay (a different drop-path draw
    # changes gradients by O(1) relative).
    tol = {"rtol": 1e-5, "atol": 1e-6} if device.type == "cuda" else {"rtol": 0, "atol": 0}
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name, **tol)


# -------------------------------------------------------------------------------------------- 6. AdamW


@pytest.mark.timeout(120)
@pytest.mark.parametrize("impl", ["project", "foreach"])
def test_adamw_step_matches_the_single_tensor_reference(device, tmp_path, impl) -> None:
    """`build_optimizer`'s AdamW as the project builds it (fused: one kernel per parameter, on CPU and CUDA), and
    the same groups with foreach=True (torch's default when neither is asked for), against
    `torch.optim.AdamW(foreach=False)`."""
    from dinov3_core.train.optim import apply_schedules, build_optimizer, build_schedules

    cfg = tiny_cfg(tmp_path)
    student = ssl_model(cfg, device).student
    optimizer = build_optimizer(student, cfg)
    # Record what the project asks for, so a change shows up here.
    assert optimizer.defaults.get("fused") is True and all(g["fused"] for g in optimizer.param_groups)
    if impl == "foreach":  # the groups as built, without their per-group implementation keys (they would win)
        groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in optimizer.param_groups]
        optimizer = torch.optim.AdamW(groups, foreach=True)
        assert all(g["foreach"] and not g["fused"] for g in optimizer.param_groups)
    apply_schedules(optimizer, build_schedules(cfg, 8).at(3))
    ref_student = copy.deepcopy(student)
    ref_params = dict(ref_student.named_parameters())
    names = {id(p): n for n, p in student.named_parameters()}
    skip = ("params", "fused", "foreach")
    ref_groups = [
        {**{k: v for k, v in g.items() if k not in skip}, "params": [ref_params[names[id(p)]] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    reference = torch.optim.AdamW(ref_groups, foreach=False)
    assert not any(g["foreach"] or g["fused"] for g in reference.param_groups)
    init = {n: p.detach().clone() for n, p in student.named_parameters()}
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        for name, p in student.named_parameters():
            g = torch.randn(p.shape, generator=gen).to(device)
            p.grad, ref_params[name].grad = g, g.clone()
        optimizer.step()
        reference.step()
    moved = 0
    for name, p in student.named_parameters():
        # fp32: the multi-tensor and fused kernels compute the same update in another operation order (fused:
        # one kernel with its own sqrt/div sequence) → a few ulps a step; 3 steps of lr ~1e-3 on O(0.1) weights:
        # 1e-6 absolute, 1e-5 relative.
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=1e-5, atol=1e-6, msg=name)
        moved += int(not torch.equal(p.detach(), init[name]))
    assert moved == len(init)  # every weight stepped (random gradients everywhere)


# ------------------------------------------------------------------------------- 7. checkpoint and resume


def train(store: Path, out: Path, device: torch.device, **extra: Any) -> None:
    overrides = {
        "train.device": device.type,
        "train.batch_size_per_gpu": 8,
        "checkpointing.period": 2,
        "checkpointing.max_to_keep": 10,
        "evaluation.eval_period_iterations": 1000,
        **extra,
    }
    env = {"OMP_NUM_THREADS": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    train_process(store, out, env=env, timeout=240, **overrides)


@pytest.mark.timeout(600)
def test_resumed_training_ends_bit_exactly_like_an_uninterrupted_run(device, small_tile_store, tmp_path) -> None:
    """`python -m dinov3_core.train` (tiny recipe; on CUDA with its default precision, bf16 autocast) for 4
    iterations straight vs 2 + resume to 4: the last checkpoints' student, teacher and optimizer states are
    bit-identical. Each iteration reseeds from (seed, iteration, rank) and the loader restarts at the exact sample,
    so nothing but non-deterministic kernels could tell the runs apart."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(small_tile_store, straight, device, **{"train.stop_at": 4})
    train(small_tile_store, resumed, device, **{"train.stop_at": 2})
    assert (resumed / "ckpt" / "1").is_dir() and not (resumed / "ckpt" / "3").exists()
    train(small_tile_store, resumed, device, **{"train.stop_at": 4})
    want, got = load_dcp(straight / "ckpt" / "3"), load_dcp(resumed / "ckpt" / "3")
    from tests.helpers import flat_tensors

    want_t, got_t = flat_tensors(want), flat_tensors(got)
    assert want_t.keys() == got_t.keys()
    assert any(k.startswith("model.student.") for k in want_t) and any(k.startswith("model.teacher.") for k in want_t)
    init = load_dcp(straight / "ckpt" / "1")
    init_t = flat_tensors(init)
    assert any(not torch.equal(want_t[k], init_t[k]) for k in want_t if k.startswith("model.student."))
    # Bit-exact: the same kernels on the same inputs in the same order.
    differ = [k for k in want_t if not torch.equal(want_t[k], got_t[k])]
    assert not differ, {k: (want_t[k].float() - got_t[k].float()).abs().max().item() for k in differ[:10]}


@pytest.mark.timeout(300)
def test_a_real_cuda_out_of_memory_is_retried_at_a_smaller_micro_batch(device, small_tile_store, tmp_path) -> None:
    """The allocator capped at 512 MiB above what the run holds before its first forward (`tests.gpu_hooks`): a
    micro-batch of 64 images of 224 + 96 px crops through a 192-wide backbone needs about 1 GiB, so CUDA itself
    raises out of memory; the run re-plans down and finishes."""
    cuda_only(device, "needs the CUDA caching allocator to run out")
    out = tmp_path / "capped"
    # The hooks cap the allocator in the training process; one with its default thread count, like a GPU job.
    env = {"WSIDINO_HOOKS": "tests.gpu_hooks", "WSIDINO_TEST_CUDA_HEADROOM_MB": "512"}
    train_process(
        small_tile_store,
        out,
        env=env,
        timeout=240,
        **{
            "train.device": "cuda",
            "train.global_batch_size": 64,
            "train.batch_size_per_gpu": 64,
            "train.stop_at": 2,
            **WIDE,
            "checkpointing.period": 100,
        },
    )
    rows = [json.loads(line) for line in (out / "training_metrics.json").read_text().splitlines()]
    replans = [r for r in rows if r.get("event") == "memory_replan"]
    assert replans and all("out of device memory in iteration 0" in r["why"] for r in replans), replans
    steps = [r for r in rows if "event" not in r]
    assert [r["iteration"] for r in steps] == [0, 1] and steps[-1]["micro_batch_size"] < 64


# ------------------------------------------------------------------------------------------- 8. extract


@pytest.mark.timeout(300)
def test_extract_on_cuda_gives_the_cpu_features(device, stage_extract_store, tmp_path) -> None:
    """The CUDA path (tiles pinned, copied non-blocking, normalised and averaged on the GPU) vs the CPU path."""
    # On the CPU dry run both sides are the CPU: that proves this test's own code, not the CUDA path.
    import zarr

    from dinov3_core.config import load_config
    from dinov3_core.extract.config import ExtractConfig
    from dinov3_core.extract.extract import run_extract

    model = eval_backbone(tmp_path / "model", "vit_test")
    roots = {}
    for side, dev in (("test", device.type), ("cpu", "cpu")):
        values = {
            "store": str(stage_extract_store),
            "model": str(model),
            "output": str(tmp_path / f"{side}.zarr"),
            "backend": "torch",
            "device": dev,
            "batch_size": 16,
            "pca_map": False,
            "progress": False,
            "tracking.enabled": False,
        }
        result = run_extract(load_config(ExtractConfig, "default", values, stage="extract"))
        assert result.tiles > 0
        roots[side] = zarr.open_group(str(result.output), mode="r")
    slides = list(roots["cpu"]["slides"].group_keys())
    assert slides and sorted(slides) == sorted(roots["test"]["slides"].group_keys())
    for sid in slides:
        for key in ("cls", "mean_patch"):
            got = torch.from_numpy(roots["test"]["slides"][sid][key][:]).float()
            want = torch.from_numpy(roots["cpu"]["slides"][sid][key][:]).float()
            assert got.shape == want.shape and got.shape[0] > 0
            # fp32 on both, but the GPU's patch-embedding convolution runs in TF32 (cuDNN's default: 10-bit
            # mantissa, ~5e-4 relative a product) and GEMMs pick other reduction orders: per-tile cosine > 0.9999
            # and 1e-2 of the features' scale absolute. A wrong normalisation or a copy read before it finished
            # (the non-blocking path) would change features by O(1).
            assert F.cosine_similarity(got, want, dim=1).min() > 0.9999, (sid, key)
            assert (got - want).abs().max() < 1e-2 * want.abs().max(), (sid, key)


# ------------------------------------------------------------------------------------- 9. the memory watch


@pytest.mark.timeout(60)
def test_memory_watch_sees_gpu_allocations_and_pressure(device) -> None:
    cuda_only(device, "the CUDA branch reads the caching allocator (the host branch: tests/test_memory_watch.py)")
    from dinov3_core.train.memory_watch import (
        MIB,
        MemoryWatch,
        device_peak_bytes,
        pressure_limits,
        release_freed_memory,
    )

    release_freed_memory()
    device_peak_bytes(device)  # resets the high-water mark
    size = 256 * MIB
    block = torch.empty(size, dtype=torch.uint8, device=device)
    # Reserved memory ≥ what is allocated (the caching allocator rounds up): exact lower bound.
    assert device_peak_bytes(device) >= size
    del block
    release_freed_memory()
    # A reset sets the high-water mark to what is reserved at that moment: the read above happened with the block
    # alive, so this window still counts it. The next window, after the block went back to the driver, does not.
    assert device_peak_bytes(device) >= size
    assert device_peak_bytes(device) < size

    # An explicit 128 MiB budget: a window holding a 256 MiB tensor is device pressure, twice in a row is a decision.
    limits = pressure_limits(
        budget_bytes=128 * MIB, explicit_budget=True, device=device, local_world_size=1, threshold=1.0
    )
    assert limits.device_mb == pytest.approx(128.0)
    watch = MemoryWatch(limits, patience=2, device=device, distributed=False)
    block = torch.ones(size, dtype=torch.uint8, device=device)
    window, decision = watch.check()
    assert window.device_mb >= 256 and decision is None  # one window is a spike, not pressure
    window, decision = watch.check()
    assert decision is not None and decision[0] == "device" and "GPU memory" in decision[1], decision
    del block
    release_freed_memory()
    watch.check()  # the window in which the block was freed still saw it (see above)
    window, decision = watch.check()
    assert window.device_mb < 128 and decision is None

    # No explicit budget: 95 % of the card binds.
    total = torch.cuda.get_device_properties(device).total_memory
    default = pressure_limits(budget_bytes=0, explicit_budget=False, device=device, local_world_size=1, threshold=1.0)
    assert default.device_mb == pytest.approx(0.95 * total / MIB)


# ------------------------------------------- 4b. the whole step compiled (last: the slowest to compile on a GPU)


@pytest.mark.timeout(400)
def test_compiled_training_step_matches_eager(device, tmp_path) -> None:
    from dinov3_core.train.step import forward_backward

    model, env, crops, masks = one_process_step(tmp_path, device)
    ref_losses, ref_grads = run_step(model, env, crops, masks)
    # Graph capture first (Dynamo + AOT autograd, eager kernels), then Inductor's kernels. forward_backward's own frame
    # runs eagerly (Tensor.backward() in its micro-batch loop is a graph break Dynamo cannot resume in a loop); what is
    # compiled is what it calls: teacher_targets (teacher, heads, Sinkhorn) and forward_loss (student, heads, losses;
    # its backward through AOT autograd). fp32: aot_eager runs eager's kernels → 1e-5 relative; Inductor fuses and
    # reorders reductions → 1e-4 relative on the losses. Gradients: Inductor's are as close to an fp64 run of the step
    # as eager's are (mask_token: 8e-5 vs 9e-5 relative L2, 2026-11-27, CPU), but eager and Inductor differ by up to
    # 1e-3 absolute on mask_token (|g| up to 11: its gradient sums the iBOT loss over every masked patch), so the
    # absolute tolerance scales with each gradient's largest entry; a wrong gradient is off by its own size.
    for backend, rel in (("aot_eager", 1e-5), ("inductor", 1e-4)):
        torch._dynamo.reset()
        compiled = torch.compile(forward_backward, backend=backend)
        losses, grads = run_step(model, env, crops, masks, step=compiled)
        for method in (type(model).teacher_targets, type(model).forward_loss):  # compiled as a whole, not piecemeal
            code = inspect.unwrap(method).__code__
            assert torch._dynamo.eval_frame._debug_get_cache_entry_list(code), (backend, method.__name__)
        for key, ref in ref_losses.items():
            assert losses[key] == pytest.approx(ref, rel=rel, abs=1e-6), (backend, key)
        for name, ref in ref_grads.items():
            atol = 1e-3 * float(ref.abs().max()) + 1e-7
            torch.testing.assert_close(grads[name], ref, rtol=1e-3, atol=atol, msg=f"{backend} {name}")
