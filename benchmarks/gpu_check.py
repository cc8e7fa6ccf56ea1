"""The GPU path in one run: correctness tests, training and extraction throughput, memory estimate vs measured.

    python benchmarks/gpu_check.py --output DIR              # on a machine with one NVIDIA GPU (≤ 8 minutes)
    python benchmarks/gpu_check.py --dry-run --output DIR    # the same code on CPU with tiny shapes (CI runs it)
    make gpu-check                                           # the first line, into bench-output/gpu-check

Writes DIR/gpu_check.json and DIR/gpu_check.md after every section, so a run stopped by its time limit still
leaves what it measured. Each section runs in its own subprocess with the time that is left (`--budget-s`); what
does not fit is reported as skipped, never silently dropped. Sections, most important first:

1. deps: the core's Python packages (no Prefect or MLflow on this path: checked), with what is missing named;
2. env: device, driver, torch / CUDA / NCCL versions and the measured bf16 matmul rate (the MFU yardstick);
3. tests: `pytest -m gpu tests/test_gpu.py` (bf16 vs fp32 step, NCCL, FSDP2, torch.compile, activation
   checkpointing, fused AdamW, bit-exact checkpoint resume, pinned-memory extraction, the memory watch);
4. store: a real tile store (sample slides → the tile stage, 224 px at 0.5 µm/px) for the next two;
5. train: the shipped `vit{s,b,l}16-continued` recipes at the official crops (2×224² + 8×96²) with 4,096-prototype
   heads, bf16, compile per block, whole step (`train.compile=step`) and off, the micro-batch the memory estimator
   picks (`train.batch_size_per_gpu=auto`): img/s, step time, MFU (FLOPs counted from the model:
   `dinov3_core.train.flops`), peak memory vs the estimate;
6. extract: a ViT-B/16 over the store (JPEG decode included) in bf16 and fp16, and the model alone.

Without internet on the GPU machine, the packages it lacks travel as wheels: docs/gpu-check.md has the list.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30

# Import name → distribution, for the message that names what is missing.
CORE_PACKAGES = {
    "torch": "torch",
    "numpy": "numpy",
    "zarr": "zarr",
    "numcodecs": "numcodecs",
    "donfig": "donfig",
    "google_crc32c": "google-crc32c",
    "omegaconf": "omegaconf",
    "imagecodecs": "imagecodecs",
    "simplejpeg": "simplejpeg",
    "tifffile": "tifffile",
    "openslide": "openslide-python (+ openslide-bin)",
    "PIL": "pillow",
    "scipy": "scipy",
    "shapely": "shapely",
    "yaml": "pyyaml",
    "psutil": "psutil",
    "tqdm": "tqdm",
    "pytest": "pytest",
}
ORCHESTRATION = ("prefect", "mlflow")
# Dense bf16 tensor-core peak of the data sheets (TFLOP/s), for MFU against the spec beside the measured matmul.
SPEC_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.0, "L4": 121.0}


# ----------------------------------------------------------------------------------------------- sections (children)


def section_deps(p: dict[str, Any]) -> dict[str, Any]:
    missing: list[str] = []
    versions: dict[str, str] = {}
    for name, dist in CORE_PACKAGES.items():
        try:
            versions[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as e:  # absent, or there but not importable (another ABI's wheel, a library it lacks)
            absent = isinstance(e, ModuleNotFoundError) and e.name == name
            why = "" if absent else f": {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            missing.append(f"{name} ({dist}){why}")
    leaked: list[str] = []
    if not missing:  # the core's training and extraction path must not pull the orchestration stack in
        import dinov3_core.extract.extract
        import dinov3_core.train.loop
        import dinov3_core.train.pretrain  # noqa: F401

        leaked = sorted({m.split(".")[0] for m in sys.modules} & set(ORCHESTRATION))
    return {"missing": missing, "versions": versions, "orchestration_imported": leaked}


def section_env(p: dict[str, Any]) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cpu_cores": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            sm_count=props.multi_processor_count,
            memory_gib=props.total_memory / GIB,
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            capability=f"{props.major}.{props.minor}",
        )
        with contextlib.suppress(Exception):
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            info["nvidia_smi"] = smi.stdout.strip()
        info["bf16_matmul_tflops"] = matmul_tflops("cuda", 8192, 20)
        info["spec_bf16_tflops"] = next((v for k, v in SPEC_BF16_TFLOPS.items() if k in props.name), None)
    else:
        info.update(device=f"CPU ({platform.processor() or platform.machine()})")
        info["bf16_matmul_tflops"] = matmul_tflops("cpu", 512, 3)
        info["spec_bf16_tflops"] = None
    return info


def matmul_tflops(device: str, n: int, iters: int) -> float:
    """A square bf16 matrix product's rate: what the chip reaches on the work a ViT is made of."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def section_tests(p: dict[str, Any]) -> dict[str, Any]:
    """The GPU tests, verbose into a log: a run stopped by the time limit still says which tests passed, and which
    one was running (the first H100 run lost all of them to one 120 s limit)."""
    work = Path(p["work"])
    work.mkdir(parents=True, exist_ok=True)
    junit, log = work / "gpu-tests.xml", work / "gpu-tests.log"
    junit.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["PYTHONUNBUFFERED"] = "1"  # each line in the log as it happens (a killed run keeps what it wrote)
    if p["dry_run"]:
        env["WSIDINO_GPU_TESTS_ON_CPU"] = "1"  # the same tests on CPU, tiny shapes (tests/test_gpu.py)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-v",
        "-p",
        "no:cacheprovider",
        "--junitxml",
        str(junit),
        "-o",
        "addopts=",
        "tests/test_gpu.py",
    ]
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            returncode: int | str = proc.wait(timeout=p["timeout_s"])
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            returncode = "timeout"
    text = log.read_text(errors="replace")
    result: dict[str, Any] = {
        "seconds": time.perf_counter() - start,
        "returncode": returncode,
        "summary": (text.strip().splitlines() or [""])[-1],
        "tests": [],
    }
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome, message, detail = "passed", "", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome, message = child.tag, (child.get("message") or "")[:400]
                    # The traceback's end names the cause; the report keeps it whole enough to fix from.
                    detail = (child.text or "")[-6000:] if child.tag != "skipped" else ""
            result["tests"].append(
                {
                    "name": case.get("name"),
                    "outcome": outcome,
                    "seconds": float(case.get("time", 0)),
                    "message": message,
                    "detail": detail,
                }
            )
    else:  # stopped: the verbose lines say what finished, and the last test started without an outcome is the one
        for line in text.splitlines():
            if line.startswith("tests/test_gpu.py::"):
                name, _, rest = line.partition(" ")
                outcome = rest.split()[0].lower() if rest.strip() else "running when stopped"
                result["tests"].append(
                    {"name": name.split("::", 1)[1], "outcome": outcome, "seconds": 0.0, "message": ""}
                )
        result["summary"] = f"stopped after {p['timeout_s']:.0f} s"
    if returncode not in (0, 5):  # 5: nothing collected
        result["output_tail"] = text[-4000:]
    return result


def section_store(p: dict[str, Any]) -> dict[str, Any]:
    from dinov3_core.config import load_config
    from dinov3_core.data.tile_dataset import TileDataset
    from dinov3_core.tiling.config import TileConfig
    from dinov3_core.tiling.engine import run_tile
    from wsidino_dev.sample_slides import make_sample_slides

    root = Path(p["work"]) / "store"
    store = root / "tiles.zarr"
    start = time.perf_counter()
    if not (store / "manifest.json").exists():
        slides = make_sample_slides(root / "slides", p["preset"], negatives=False)
        values = {
            "input": str(root / "slides"),
            "output": str(store),
            "tile_size": p["tile_size"],
            "stride": p["stride"],
            "mpp": 0.5,
            "progress": False,
            "tracking.enabled": False,
        }
        run_tile(load_config(TileConfig, None, values))
        del slides
    tiles = len(TileDataset(store, image_format="numpy"))
    return {"path": str(store), "tiles": tiles, "tile_size": p["tile_size"], "seconds": time.perf_counter() - start}


def section_train(p: dict[str, Any]) -> dict[str, Any]:
    import torch

    from dinov3_core.config import load_config
    from dinov3_core.train import config as C
    from dinov3_core.train.flops import step_flops_per_image
    from dinov3_core.train.memory import memory_budget_bytes, model_shape, plan_batch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # only asks the driver: no context yet
    out = Path(p["work"]) / f"train-{p['name']}"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time: a rerun would resume (and time nothing)
    values = {
        "data.stores": [p["store"]],
        "output_dir": str(out),
        "tracking.enabled": False,
        "train.global_batch_size": p["global_batch"],
        "train.batch_size_per_gpu": "auto",
        "train.compile": p["compile"],
        "train.stop_at": p["iterations"],
        "train.epoch_length": p["iterations"],
        "train.log_period": 1,
        "optim.epochs": 1,
        "optim.warmup_epochs": 0,
        "optim.freeze_last_layer_epochs": 0,
        "teacher.warmup_teacher_temp_epochs": 0,
        "checkpointing.period": 10**6,
        "evaluation.eval_period_iterations": 0,
        "health.policy": "off",
        "health.probe_tiles": 0,
        **p["overrides"],
    }
    cfg = load_config(C.PretrainConfig, p["recipe"], values, stage="pretrain")
    argv = [
        sys.executable,
        "-m",
        "dinov3_core.train",
        "--config",
        p["recipe"],
        *(f"{k}={json.dumps(v)}" for k, v in values.items()),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=p["timeout_s"])
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"training exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "training_metrics.json").read_text().splitlines()]
    # After the run: this process's CUDA context and the FLOP count's model would otherwise take the run's memory.
    budget = memory_budget_bytes(cfg, device, 1)
    plan = plan_batch(
        cfg, model_shape(cfg), world_size=1, budget_bytes=budget, device_type=device.type, tile_size=p["tile_size"]
    )
    flops = step_flops_per_image(cfg, device)
    warm = p["warmup_iterations"]
    timed = [r for r in rows if r["iteration"] >= warm] or rows
    step = statistics.median(r["iter_time"] for r in timed)
    images_per_s = cfg.train.global_batch_size / step
    peak_mb = max(r["peak_memory_mb"] for r in rows)
    est = plan.estimate.total
    return {
        "arch": cfg.student.arch,
        "compile": p["compile"],
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "precision": "bf16" if device.type == "cuda" else "fp32",
        "global_batch": cfg.train.global_batch_size,
        "micro_batch": plan.micro_batch,
        "accumulation_steps": plan.accumulation_steps,
        "crops": f"{cfg.crops.n_global_crops}x{cfg.crops.global_size}+{cfg.crops.n_local_crops}x{cfg.crops.local_size}",
        "prototypes": cfg.heads.dino.n_prototypes,
        "images_per_s": images_per_s,
        "step_s": step,
        "data_s": statistics.median(r["data_time"] for r in timed),
        "first_iteration_s": rows[0]["iter_time"],
        "gflop_per_image": flops / 1e9,
        "achieved_tflops": flops * images_per_s / 1e12,
        "peak_allocated_gib": peak_mb / 1024,
        "estimated_gib": est / GIB,
        "estimate_error": (est / GIB - peak_mb / 1024) / (peak_mb / 1024),
        "estimate": plan.estimate.describe(),
        "iterations": len(rows),
        "timed_iterations": len(timed),
        "wall_s": wall,
    }


def section_extract(p: dict[str, Any]) -> dict[str, Any]:
    import torch
    import yaml

    from dinov3_core.config import load_config
    from dinov3_core.data.tile_dataset import TileDataset
    from dinov3_core.extract.config import ExtractConfig
    from dinov3_core.extract.extract import run_extract
    from dinov3_core.inference.backbone import INFERENCE_OVERRIDES
    from dinov3_core.models import backbone_kwargs, build_backbone, save_backbone

    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(p["work"]) / "extract"
    shutil.rmtree(root, ignore_errors=True)  # a finished output is skipped by run_extract: time a fresh one
    torch.manual_seed(0)
    model = build_backbone(p["arch"], **INFERENCE_OVERRIDES).eval()
    weights = save_backbone(model, root / "model" / "backbone.pth")
    (root / "model" / "config.yaml").write_text(
        yaml.safe_dump({"arch": p["arch"], "backbone_kwargs": backbone_kwargs(p["arch"], **INFERENCE_OVERRIDES)})
    )
    ds = TileDataset(Path(p["store"]), image_format="numpy")
    smallest = min(zip(ds.tile_counts, ds.slide_ids, strict=True))[1]
    rows = []
    for precision, compiled in p["variants"]:

        def extract(
            tag: str, slide_ids: list[str] | None, precision: str = precision, compiled: bool = compiled
        ) -> Any:
            name = f"{precision}{'-compile' if compiled else ''}-{tag}"
            values = {
                "store": p["store"],
                "model": str(weights),
                "output": str(root / f"{name}.zarr"),
                "device": device,
                "precision": precision,
                "batch_size": p["batch_size"],
                "loader_threads": p["loader_threads"],
                "prefetch_batches": p["prefetch_batches"],
                "slide_ids": slide_ids,
                "pca_map": False,
                "progress": False,
                "tracking.enabled": False,
                **({"compile": True} if compiled else {}),
            }
            return run_extract(load_config(ExtractConfig, None, values))

        # A first run over the smallest slide pays CUDA start-up, kernel selection and (compile) Inductor's
        # warm-up, whose cache the timed run over the whole store then reuses.
        warm = extract("warm-up", [smallest])
        best = extract("timed", None)
        rows.append(
            {
                "arch": p["arch"],
                "precision": precision,
                "compile": compiled,
                "what": "run_extract (read + JPEG decode + model + write)",
                "tiles": best.tiles,
                "seconds": best.seconds,
                "tiles_per_s": best.tiles_per_s,
                "warm_up_s": warm.seconds,
            }
        )
        alone = model_only(model, device, precision, compiled, p["batch_size"], p["tile_size"], p["model_iters"])
        rows.append(
            {
                "arch": p["arch"],
                "precision": precision,
                "compile": compiled,
                "what": "model only (random batch on the device)",
                **alone,
            }
        )
    return {"rows": rows}


def model_only(
    model: Any, device: str, precision: str, compiled: bool, batch: int, size: int, iters: int
) -> dict[str, Any]:
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    model = model.to(device)
    run = torch.compile(model, dynamic=False) if compiled else model
    x = torch.randn(batch, 3, size, size, device=device)
    with torch.inference_mode(), torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
        for _ in range(3):
            run(x)
        sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            run(x)
        sync(device)
    seconds = time.perf_counter() - start
    return {"tiles": batch * iters, "seconds": seconds, "tiles_per_s": batch * iters / seconds}


def section_profile(p: dict[str, Any]) -> dict[str, Any]:
    """Where a training step's GPU time goes (eager, bf16): the kernels, grouped into matmul / attention / other."""
    import torch
    from step_timing import ssl_step  # benchmarks/step_timing.py, beside this script
    from torch.profiler import ProfilerActivity, profile

    from dinov3_core.config import load_config
    from dinov3_core.data.augment import MultiCrops
    from dinov3_core.data.masking import IBOTMaskSampler
    from dinov3_core.train import config as C
    from dinov3_core.train.distributed import DistEnv
    from dinov3_core.train.ssl_model import build_ssl_model

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cfg = load_config(
        C.PretrainConfig,
        p["recipe"],
        {"data.stores": ["unused"], "output_dir": "unused", **p["overrides"]},
        stage="pretrain",
    )
    torch.manual_seed(0)
    model = build_ssl_model(cfg).model.to(device).train()
    b, c = p["micro_batch"], cfg.crops
    crops = MultiCrops(
        torch.randn(c.n_global_crops, b, 3, c.global_size, c.global_size, device=device),
        torch.randn(c.n_local_crops, b, 3, c.local_size, c.local_size, device=device),
    )
    masks = IBOTMaskSampler(c.global_size // model.student["backbone"].patch_size)(b, c.n_global_crops)
    masks = type(masks).from_masks(masks.masks.to(device), c.n_global_crops)
    env = DistEnv(device=device)

    def step() -> None:
        ssl_step(model, env, crops, masks, bf16=cuda)
        model.student.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    sync(device.type)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        sync(device.type)
    events = [
        e
        for e in prof.key_averages()
        if e.device_type == (torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU)
    ]
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events) or 1.0

    def kind(name: str) -> str:
        n = name.lower()
        if any(k in n for k in ("flash", "fmha", "attention", "sdpa")):
            return "attention"
        if any(k in n for k in ("gemm", "xmma", "nvjet", "cutlass", "matmul", "mm", "linear", "conv")):
            return "matmul"
        return "element-wise / reductions / copies"

    groups: dict[str, float] = {}
    for e in events:
        groups[kind(e.key)] = groups.get(kind(e.key), 0.0) + getattr(e, attr)
    top = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:15]
    return {
        "arch": cfg.student.arch,
        "micro_batch": b,
        "step_ms": total / 2 / 1e3,
        "groups": {k: v / total for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top": [{"kernel": e.key[:110], "share": getattr(e, attr) / total, "calls": e.count} for e in top],
    }


SECTIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "deps": section_deps,
    "env": section_env,
    "tests": section_tests,
    "store": section_store,
    "train": section_train,
    "extract": section_extract,
    "profile": section_profile,
}


# ------------------------------------------------------------------------------------------------------- the plan


COMPILE_LABEL = {True: "on", False: "off", "step": "whole step"}  # train.compile as the report prints it


def train_cases(dry_run: bool) -> list[dict[str, Any]]:
    """Most telling first: ViT-L compiled without and with activation checkpointing (the recipes ship it on for
    one GPU), then ViT-B and ViT-S compiled, then eager, then the whole step compiled."""
    if dry_run:
        tiny = {
            "recipe": "tiny",
            "global_batch": 8,
            "iterations": 4,
            "warmup_iterations": 2,
            "tile_size": 64,
            "overrides": {"train.device": "cpu", "train.num_threads": 2},
        }
        return [{**tiny, "name": "tiny-compile", "compile": True}, {**tiny, "name": "tiny-eager", "compile": False}]
    official = {
        "heads.dino.n_prototypes": 4096,
        "heads.ibot.n_prototypes": 4096,
        "student.pretrained_weights": None,
        "data.num_workers": 10,
    }
    cases = {}
    for arch, batch in (("vitl16", 256), ("vitb16", 256), ("vits16", 512)):
        for compile_, mode in ((True, "compile"), (False, "eager"), ("step", "step")):
            for ac in (True, False):
                name = f"{arch}-{mode}{'' if ac else '-noac'}"
                cases[name] = {
                    "name": name,
                    "recipe": f"{arch}-continued",
                    "global_batch": batch,
                    "iterations": 10,
                    "warmup_iterations": 4,
                    "tile_size": 224,
                    "compile": compile_,
                    "overrides": {**official, "train.activation_checkpointing": ac},
                }
    order = [
        "vitl16-compile-noac",
        "vitl16-compile",
        "vitb16-compile-noac",
        "vits16-compile-noac",
        "vitl16-eager",
        "vitb16-eager-noac",
        "vits16-eager-noac",
        "vitb16-step-noac",
        "vits16-step-noac",
    ]
    return [cases[n] for n in order]


def plan(dry_run: bool) -> list[tuple[str, str, dict[str, Any], float]]:
    """(label, section, params, most seconds it may take). The store is built in the background from the start."""
    extract = (
        {
            "arch": "vit_test",
            "batch_size": 64,
            "loader_threads": 2,
            "prefetch_batches": 2,
            "model_iters": 2,
            "tile_size": 64,
            "variants": [["bf16", False], ["bf16", True]],
        }
        if dry_run
        else {
            "arch": "vit_base",
            "batch_size": 512,
            "loader_threads": 12,
            "prefetch_batches": 4,
            "model_iters": 10,
            "tile_size": 224,
            "variants": [["bf16", False], ["bf16", True], ["fp16", True]],
        }
    )
    profile = (
        {"recipe": "tiny", "micro_batch": 4, "overrides": {}}
        if dry_run
        else {
            "recipe": "vitl16-continued",
            "micro_batch": 32,
            "overrides": {
                "heads.dino.n_prototypes": 4096,
                "heads.ibot.n_prototypes": 4096,
                "student.pretrained_weights": None,
            },
        }
    )
    cases = train_cases(dry_run)
    first = 150 if dry_run else 170  # compile warm-up included
    return [
        ("deps", "deps", {}, 120),
        ("env", "env", {}, 120),
        ("tests", "tests", {}, 240),
        (f"train {cases[0]['name']}", "train", cases[0], first),
        ("extract", "extract", extract, 150),
        ("profile", "profile", profile, 90),
        # The whole step compiles every block inlined: longer than per-block compile's one block, reused.
        *((f"train {c['name']}", "train", c, 240 if c["compile"] == "step" else 150) for c in cases[1:]),
    ]


def store_params(dry_run: bool) -> dict[str, Any]:
    return (
        {"preset": "test", "tile_size": 64, "stride": 64}
        if dry_run
        else {"preset": "demo", "tile_size": 224, "stride": 56}
    )


# ------------------------------------------------------------------------------------------------------ the parent


class Child:
    """One section in its own process (a crash or a hung CUDA call ends that section only)."""

    def __init__(self, section: str, params: dict[str, Any]) -> None:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            self.result_path = Path(f.name)
        cmd = [
            sys.executable,
            __file__,
            "--child",
            section,
            "--params",
            json.dumps(params),
            "--result",
            str(self.result_path),
        ]
        self.start = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait(self, timeout: float) -> dict[str, Any]:
        try:
            _, stderr = self.proc.communicate(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, stderr = self.proc.communicate()
            return {
                "status": "timeout",
                "seconds": time.perf_counter() - self.start,
                "error": f"stopped after {timeout:.0f} s: {stderr[-1500:]}",
            }
        seconds = time.perf_counter() - self.start
        if self.proc.returncode != 0 or not self.result_path.stat().st_size:
            return {"status": "failed", "seconds": seconds, "error": stderr[-4000:] or f"exit {self.proc.returncode}"}
        result = json.loads(self.result_path.read_text())
        self.result_path.unlink()
        return {"status": "ok", "seconds": seconds, "result": result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=os.environ.get("OUT") or "bench-output/gpu-check")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: proves the code, not the GPU")
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole check's time (default 8 minutes)")
    parser.add_argument("--only", help="comma-separated labels or sections to run (default: all)")
    parser.add_argument("--work", help="scratch directory (default: a temporary one)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--params", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = SECTIONS[args.child](json.loads(args.params))
        Path(args.result).write_text(json.dumps(result))
        return 0

    deadline = time.monotonic() + args.budget_s
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-check-"))
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "dry_run": args.dry_run,
        "budget_s": args.budget_s,
        "sections": [],
    }
    only = set(args.only.split(",")) if args.only else None
    common = {"work": str(work), "dry_run": args.dry_run}
    store_child: Child | None = None
    store: str | None = None
    blocked: str | None = None

    def log(msg: str) -> None:
        print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)

    def finish(entry: dict[str, Any]) -> None:
        if entry.get("status") not in (None, "ok", "skipped"):
            log(f"{entry['label']}: {entry['status']}\n{entry.get('error', '')[-1500:]}")
        report["sections"].append(entry)
        write_report(report, out)

    for label, section, params, cap in plan(args.dry_run):
        if only and label not in only and section not in only and section != "deps":
            continue
        entry: dict[str, Any] = {"label": label, "section": section}
        if section in ("train", "extract") and store is None and store_child is not None and not blocked:
            # The tile store, built on the CPU cores while the GPU tests ran.
            store_entry = {"label": "store", "section": "store", **store_child.wait(deadline - time.monotonic() - 20)}
            store_child = None
            if store_entry["status"] == "ok":
                store = store_entry["result"]["path"]
            log(f"store: {store_entry['status']} after {store_entry['seconds']:.0f} s")
            finish(store_entry)
        left = deadline - time.monotonic()
        if blocked and section != "env":
            entry.update(status="skipped", error=blocked)
        elif section in ("train", "extract") and store is None:
            entry.update(status="skipped", error="no tile store (the store section did not finish)")
        elif left < 20:
            entry.update(status="skipped", error=f"out of time ({args.budget_s:.0f} s budget)")
        else:
            timeout = min(cap, left)
            log(f"{label} (≤ {timeout:.0f} s) …")
            child = Child(section, {**params, **common, "timeout_s": timeout - 10, "store": store})
            entry.update(child.wait(timeout))
            log(f"{label}: {entry['status']} in {entry['seconds']:.0f} s")
        if section == "deps" and entry.get("status") == "ok":
            if entry["result"]["missing"]:
                blocked = (
                    "missing packages: "
                    + ", ".join(entry["result"]["missing"])
                    + " — bring them as wheels (docs/gpu-check.md, 'A machine without internet')"
                )
            else:
                store_child = Child("store", {**store_params(args.dry_run), **common})
        finish(entry)
    if store_child is not None:  # nothing needed it
        store_child.proc.kill()
    print(markdown(report))
    failed = [e["label"] for e in report["sections"] if e.get("status") in ("failed", "timeout")]
    tests = next((e for e in report["sections"] if e["section"] == "tests" and e.get("status") == "ok"), None)
    if tests and tests["result"]["returncode"] not in (0, 5):  # failed, or stopped by its limit
        failed.append("tests")
    if failed:
        print(f"gpu-check: not clean: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or blocked else 0


# ------------------------------------------------------------------------------------------------------ the report


def write_report(report: dict[str, Any], out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_check.md").write_text(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    by = {e["label"]: e for e in report["sections"]}
    env = by.get("env", {}).get("result", {})
    lines = [f"# GPU check, {report['date']}{' (dry run: CPU, tiny shapes)' if report['dry_run'] else ''}", ""]
    if env:
        lines += [
            f"Device: **{env.get('device')}** ({env.get('nvidia_smi', '')}); torch {env.get('torch')}, CUDA "
            f"{env.get('cuda')}, NCCL {env.get('nccl')}, Python {env.get('python')}, {env.get('cpu_cores')} "
            f"CPU cores. bf16 matmul (8192³): **{env.get('bf16_matmul_tflops', 0):.0f} TFLOP/s** measured, "
            f"{env.get('spec_bf16_tflops') or '–'} on the data sheet.",
            "",
        ]
    lines += ["| section | status | seconds | note |", "|---|---|---|---|"]
    for e in report["sections"]:
        note = (e.get("error") or "").strip().splitlines()[-1:] or [""]
        lines.append(f"| {e['label']} | {e.get('status')} | {e.get('seconds', 0):.0f} | {note[0][:160]} |")
    deps = by.get("deps", {}).get("result")
    if deps:
        lines += [
            "",
            f"Packages missing: {', '.join(deps['missing']) or 'none'}; Prefect/MLflow imported by the "
            f"core path: {', '.join(deps['orchestration_imported']) or 'no'}.",
        ]
    tests = by.get("tests", {}).get("result")
    if tests:
        lines += ["", f"## GPU tests: {tests['summary']}", "", "| test | outcome | s | message |", "|---|---|---|---|"]
        lines += [
            f"| {t['name']} | {t['outcome']} | {t['seconds']:.1f} | {t['message'][:200]} |" for t in tests["tests"]
        ]
    peak = env.get("bf16_matmul_tflops") or 0
    spec = env.get("spec_bf16_tflops")
    train = [e["result"] for e in report["sections"] if e["section"] == "train" and e.get("status") == "ok"]
    if train:
        lines += [
            "",
            "## Training (one GPU, `train.batch_size_per_gpu=auto`)",
            "",
            "| arch | compile | act. ckpt | crops | global batch | micro × accum | img/s | step s | data s | "
            "GFLOP/img | TFLOP/s | MFU (spec) | MFU (matmul) | peak GiB | estimated GiB | est. error |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in train:
            mfu_spec = f"{100 * r['achieved_tflops'] / spec:.0f} %" if spec else "–"
            mfu_mm = f"{100 * r['achieved_tflops'] / peak:.0f} %" if peak else "–"
            lines.append(
                f"| {r['arch']} | {COMPILE_LABEL[r['compile']]} "
                f"| {'on' if r['activation_checkpointing'] else 'off'} "
                f"| {r['crops']} | {r['global_batch']} | {r['micro_batch']} × {r['accumulation_steps']} "
                f"| {r['images_per_s']:.1f} | {r['step_s']:.3f} | {r['data_s']:.3f} | {r['gflop_per_image']:.1f} "
                f"| {r['achieved_tflops']:.1f} | {mfu_spec} | {mfu_mm} | {r['peak_allocated_gib']:.2f} "
                f"| {r['estimated_gib']:.2f} | {100 * r['estimate_error']:+.0f} % |"
            )
    ext = by.get("extract", {}).get("result")
    if ext:
        lines += [
            "",
            "## Extraction",
            "",
            "| arch | precision | compile | what | tiles | tiles/s |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['arch']} | {r['precision']} | {'on' if r.get('compile') else 'off'} | {r['what']} "
            f"| {r['tiles']} | {r['tiles_per_s']:.0f} |"
            for r in ext["rows"]
        ]
    prof = by.get("profile", {}).get("result")
    if prof:
        shares = ", ".join(f"{k} {100 * v:.0f} %" for k, v in prof["groups"].items())
        lines += [
            "",
            f"## Profile: one {prof['arch']} training step, eager bf16, micro-batch {prof['micro_batch']}",
            "",
            f"Device time {prof['step_ms']:.0f} ms per step: {shares}.",
            "",
            "| kernel | share | calls |",
            "|---|---|---|",
        ]
        lines += [f"| `{t['kernel']}` | {100 * t['share']:.1f} % | {t['calls']} |" for t in prof["top"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
