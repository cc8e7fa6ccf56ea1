"""Each CPU hot path against this machine's own limit: the measured matmul peak, then GFLOP/s and % of that peak for
the training step, torch extraction (eager and compiled) and ONNX Runtime extraction, with where each one's time goes.

    python benchmarks/machine_limits.py --output bench-output           # several minutes on 2 cores
    python benchmarks/machine_limits.py --quick --output bench-output   # smoke run, about a minute
    python benchmarks/machine_limits.py --only train --upstream-src ~/src/dinov3   # + upstream's step

* **peak**: fp32 `torch.mm` of square matrices (2048, `--quick` 1024) on all of torch's threads, the best of the
  repeats: what the BLAS reaches here. bf16 too where the CPU has bf16 matrix instructions (AVX512-BF16 / AMX).
* **extract**: the ViT-S/16 backbone (`vit_small`, `--quick`: `vit_test`) on 224 px tiles, batch 16, the way the
  extract stage runs it: torch eager (`inference_mode`), torch compiled (Inductor; warm-up reported separately) and
  ONNX Runtime on the model the export stage writes (`run_export`, fp32, default graph optimisations).
* **train**: one `step.forward_backward` plus AdamW of the `cpu` recipe (vit_test) and of ViT-S/16 at the shapes of
  the issue's upstream comparison (2 × 112² + 8 × 48² crops, 4,096 prototypes, batch 8), eager and with
  `train.compile` (each block compiled), each in fp32 and with `train.precision=bf16` (CPU autocast). With
  `--upstream-src DIR` (a facebookresearch/dinov3 checkout) also Meta's official step beside ours at equal
  configuration, same weights and batch (`benchmarks/upstream_step.py`, which documents what was changed to run it
  on a CPU); skipped without it. Those rows time each trainer's whole
  iteration (gradient clipping and the EMA update included), so their "ours eager" is not this section's "eager".

FLOPs are counted from the model (`FlopCounterMode`: matrix products and attention; a multiply-add is 2), never
assumed. Variants of one path run interleaved, round after round, in one process, and the table shows the median
and the spread (min–max) over rounds: on a shared box the ratios hold better than the absolute figures. Each path's
profile (`torch.profiler`, CPU self time) gives its top operators.

Output: a markdown table on stdout and `<output>/machine_limits.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# benchmarks/step_timing.py and benchmarks/upstream_step.py, beside this script
import upstream_step  # noqa: E402
from step_timing import (  # noqa: E402
    VITS_UPSTREAM_SHAPES,
    Step,
    build_ours,
    counted_flops,
    environment,
    fresh_dynamo,
    interleaved,
    load_average,
    matmul_peak,
    row,
    top_ops,
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ extract


def section_extract(arch: str, batch: int, rounds: int, peak: float, workdir: Path) -> list[dict[str, Any]]:
    import numpy as np
    import onnxruntime as ort

    from dinov3_core.config import load_config
    from dinov3_core.export.config import ExportConfig
    from dinov3_core.export.onnx_export import run_export
    from dinov3_core.inference.backbone import BackboneFeatures
    from dinov3_core.models import build_backbone, save_backbone

    torch.manual_seed(0)
    backbone = build_backbone(arch).eval()
    weights = save_backbone(backbone, workdir / f"{arch}.pth")
    onnx = workdir / f"{arch}.onnx"
    run_export(
        load_config(ExportConfig, None, {"weights": str(weights), "output": str(onnx), "tracking.enabled": False})
    )
    model = BackboneFeatures(backbone, pooled=False).eval()
    x = torch.randn(batch, 3, 224, 224)
    compiled = torch.compile(model, dynamic=False)
    session = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: x.numpy()}

    def eager() -> None:
        with torch.inference_mode():
            model(x)

    def inductor() -> None:
        with torch.inference_mode():
            compiled(x)

    def onnxruntime() -> None:
        session.run(None, feed)

    def eager_bf16() -> None:  # extract's precision=bf16: CPU autocast (AMX / AVX512-BF16 matrix units where present)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)

    def inductor_bf16() -> None:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            compiled_bf16(x)

    compiled_bf16 = torch.compile(model, dynamic=False)
    start = time.perf_counter()
    inductor_bf16()
    warmup_bf16 = time.perf_counter() - start

    start = time.perf_counter()
    inductor()
    warmup = time.perf_counter() - start
    with torch.inference_mode():  # the same features: the compiled and ORT models are the eager one
        want = model(x)[0]
        got = {"compiled": compiled(x)[0], "onnxruntime": torch.from_numpy(np.asarray(session.run(None, feed)[0]))}
    agree = {k: float((v - want).abs().max() / want.abs().max()) for k, v in got.items()}
    flops = counted_flops(eager)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        got["bf16"] = model(x)[0].float()
    agree["bf16"] = float((got["bf16"] - want).abs().max() / want.abs().max())
    steps = {
        "torch eager": eager,
        "torch compiled (Inductor)": inductor,
        "ONNX Runtime": onnxruntime,
        "torch eager, bf16 autocast": eager_bf16,
        "torch compiled, bf16 autocast": inductor_bf16,
    }
    times = interleaved(steps, rounds, 2)
    rows = [row("extract", name, t, flops, peak, batch, "tiles/s") for name, t in times.items()]
    rows[1]["compile_warmup_s"], rows[4]["compile_warmup_s"] = warmup, warmup_bf16
    rows[3]["max_rel_diff_vs_eager"] = agree["bf16"]
    for r, name in zip(rows[1:3], ("compiled", "onnxruntime"), strict=True):
        r["max_rel_diff_vs_eager"] = agree[name]
    for r, step in zip(rows, steps.values(), strict=True):
        r["top_ops"] = top_ops(step)
    for r in rows:
        r["arch"] = arch
    return rows


# -------------------------------------------------------------------------------------------------- train


def section_train(recipe: str, overrides: dict[str, Any], batch: int, rounds: int, peak: float) -> list[dict[str, Any]]:
    from dinov3_core.config import load_config
    from dinov3_core.data.augment import MultiCrops
    from dinov3_core.data.masking import IBOTMaskSampler
    from dinov3_core.train import config as C
    from dinov3_core.train.distributed import DistEnv
    from dinov3_core.train.flops import one_step
    from dinov3_core.train.ssl_model import LOSS_NAMES

    cfg = load_config(
        C.PretrainConfig, recipe, {"data.stores": ["unused"], "output_dir": "unused", **overrides}, stage="pretrain"
    )
    c = cfg.crops
    env = DistEnv(device=torch.device("cpu"))
    torch.manual_seed(0)
    crops = MultiCrops(
        torch.randn(c.n_global_crops, batch, 3, c.global_size, c.global_size),
        torch.randn(c.n_local_crops, batch, 3, c.local_size, c.local_size),
    )

    def build(compiled: bool, bf16: bool, first: list[torch.Tensor]) -> Step:
        model, optimizer = build_ours(cfg, compiled)
        masks = IBOTMaskSampler(c.global_size // model.student["backbone"].patch_size)(batch, c.n_global_crops)

        def step() -> None:
            values = one_step(model, env, crops, masks, bf16=bf16)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if not first:  # the first step's losses, from the same weights and inputs for every variant
                first.append(values[: len(LOSS_NAMES)].detach().clone())

        return step

    fresh_dynamo()
    variants = {
        "eager": (False, False),
        "compiled blocks (train.compile)": (True, False),
        "eager, bf16 autocast (train.precision=bf16)": (False, True),
        "compiled blocks, bf16 autocast": (True, True),
    }
    firsts: dict[str, list[torch.Tensor]] = {name: [] for name in variants}
    steps = {name: build(*flags, firsts[name]) for name, flags in variants.items()}
    flops = counted_flops(steps["eager"])
    warmups = {}
    for name, (compiled, _) in variants.items():
        start = time.perf_counter()
        steps[name]()
        if compiled:
            warmups[name] = time.perf_counter() - start
    times = interleaved(steps, rounds, 1)
    rows = [
        row("train step", name, t, flops, peak, batch, "img/s", arch=cfg.student.arch, recipe=recipe)
        for name, t in times.items()
    ]
    want = firsts["eager"][0]
    for r, name in zip(rows, variants, strict=True):
        if name in warmups:
            r["compile_warmup_s"] = warmups[name]
        r["first_step_loss_max_rel_diff_vs_eager"] = float(((firsts[name][0] - want).abs() / want.abs()).max())
        r["top_ops"] = top_ops(steps[name])
    return rows


# --------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--only", default="peak,extract,train", help="comma-separated: peak, extract, train")
    parser.add_argument(
        "--upstream-src",
        type=Path,
        default=None,
        help="a facebookresearch/dinov3 checkout: the train section also runs upstream's step at "
        "equal configuration (benchmarks/upstream_step.py); skipped without it",
    )
    args = parser.parse_args()

    only = set(args.only.split(","))
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    rounds = args.rounds or (3 if args.quick else 7)
    env = environment(quick=args.quick, rounds=rounds, load_average_start=load_average())
    n = 1024 if args.quick else 2048
    peaks = {"fp32": matmul_peak(n, torch.float32, 5 if args.quick else 10)}
    from dinov3_core.train.distributed import cpu_has_bf16_matmul

    if cpu_has_bf16_matmul():
        peaks["bf16"] = matmul_peak(n, torch.bfloat16, 5 if args.quick else 10)
    log(f"matmul peak: {peaks}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        if "extract" in only:
            rows += section_extract("vit_test" if args.quick else "vit_small", 16, rounds, peaks["fp32"], Path(tmp))
            log("extract: done")
    if "train" in only:
        rows += section_train("cpu", {}, 8 if args.quick else 32, rounds, peaks["fp32"])
        log("train cpu: done")
        if not args.quick:
            rows += section_train("cpu", VITS_UPSTREAM_SHAPES, 8, rounds, peaks["fp32"])
            log("train vit_small: done")
        if args.upstream_src is None:
            log(f"train vs upstream: {upstream_step.SKIP_MESSAGE}")
        else:
            shapes = ("vit_test",) if args.quick else upstream_step.SHAPES
            rows += upstream_step.upstream_rows(
                args.upstream_src, rounds, shapes=shapes, peak=peaks["fp32"], bf16="bf16" in peaks
            )
            log("train vs upstream: done")
    env["load_average_end"] = load_average()
    for r in rows:  # a bf16 path's own ceiling is the bf16 matrix unit
        if "bf16" in r["variant"] and "bf16" in peaks:
            r["percent_of_bf16_peak"] = 100 * r["gflops"] / peaks["bf16"]
    doc = {"environment": env, "matmul_peak_gflops": peaks, "rows": rows}
    (out / "machine_limits.json").write_text(json.dumps(doc, indent=2) + "\n")
    print_table(doc)


def print_table(doc: dict[str, Any]) -> None:
    env, peaks = doc["environment"], doc["matmul_peak_gflops"]
    print(
        f"\n## machine limits (torch {env['torch']}, {env['threads']} threads, {env['cpu_capability']}; load "
        f"{env['load_average_start']:.1f} → {env['load_average_end']:.1f})\n"
    )
    print("matmul peak: " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peaks.items()) + "\n")
    head = "| path | model | variant | throughput (median, min–max) | GFLOP/s | % of fp32 peak | warm-up s | top ops |"
    print(head)
    print("|---|---|---|---|---:|---:|---:|---|")
    for r in doc["rows"]:
        lo, hi = r["spread"]
        ops = ", ".join(f"{o['op']} {100 * o['share']:.0f} %" for o in r["top_ops"][:4])
        warm = f"{r['compile_warmup_s']:.0f}" if "compile_warmup_s" in r else ""
        bf16 = f" ({r['percent_of_bf16_peak']:.0f} of bf16)" if "percent_of_bf16_peak" in r else ""
        share = f"{r['percent_of_peak']:.0f}{bf16}"
        print(
            f"| {r['path']} | {r.get('arch', '')} | {r['variant']} | {r['items_per_s']:.1f} {r['unit']} "
            f"({lo:.1f}–{hi:.1f}) | {r['gflops']:.0f} | {share} | {warm} | {ops} |"
        )


if __name__ == "__main__":
    main()
