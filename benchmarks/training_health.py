"""Iterations (and CPU minutes) to the first reliable sign of learning, upstream-shaped vs fitted teacher schedules.

A real tile store (the tile stage on the "demo" sample slides, 96 px tiles at 0.5 µm/px; `--quick`: the "test"
slides) and, side by side in one run, each model with two teacher schedules:

* **upstream shapes**: what a user got by cutting upstream's recipe to a short run: teacher momentum cosine
  0.992 → 1.0 over the run, temperature 0.04 → 0.07 over 30 % of it (upstream's 30 of 100 epochs);
* **fitted (auto)**: the default: momentum and temperature fitted to the run's length
  (`dinov3_core.train.schedules`).

Models: `tiny` at the tests' 8 images a step, the `cpu` recipe (the same backbone at 32 a step: what `make demo`
trains) and ViT-S/16 at 96/48 px crops (8 a step, ~1 s an iteration on 2 cores, so a shorter run). Everything else
(data, seed, upstream's warm-up proportions) is the same within each pair.

The first reliable sign of learning is the first iteration at which the DINO gap (ln K − DINO loss), averaged over
the last 50 iterations, reaches `health.min_gap` (the alarm's own threshold); the CPU minutes to it are wall time ×
threads. The cost of the health probe (256 tiles at every eval checkpoint) is reported per 1,000 iterations at the
default eval period (the `health/probe_seconds` of one measurement × checkpoints per 1,000 iterations).

Usage: python benchmarks/training_health.py [--quick] [--output DIR]   (writes DIR/training_health.json)
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from extract import make_store  # the sibling script (its directory is sys.path[0]): the same tile store

from dinov3_core.config import load_config
from dinov3_core.train.config import PretrainConfig
from dinov3_core.train.metrics import read_metrics
from dinov3_core.train.pretrain import run_pretrain

WINDOW = 50
SCHEDULES: dict[str, dict[str, Any]] = {
    "upstream shapes": {
        "teacher.momentum_teacher": 0.992,
        "teacher.final_momentum_teacher": 1.0,
        "teacher.warmup_teacher_temp": 0.04,
        "teacher.warmup_teacher_temp_epochs": 0.3 * 4,
    },  # 30 % of the run's 4 epochs
    "fitted (auto)": {
        "teacher.momentum_teacher": "auto",
        "teacher.final_momentum_teacher": "auto",
        "teacher.warmup_teacher_temp": 0.04,
        "teacher.warmup_teacher_temp_epochs": "auto",
    },
    # The recipe as shipped (only for models that are a recipe): cpu = auto schedules, temperature from 0.02.
    "recipe as shipped": {},
}


def models(quick: bool) -> dict[str, dict[str, Any]]:
    """Each model with its run length and batch: `tiny` at the tests' batch of 8, the `cpu` recipe (the same
    backbone at 32 a step: what `make demo` trains) and ViT-S/16 at 96/48 px (~1 s an iteration on 2 cores)."""
    vits = {
        "student.arch": "vit_small",
        "crops.global_size": 96,
        "crops.local_size": 48,
        "heads.dino.n_prototypes": 4096,
        "heads.ibot.n_prototypes": 4096,
    }
    return {
        "tiny, batch 8": {"config": "tiny", "iterations": 200 if quick else 1000, "overrides": {}},
        "cpu recipe, batch 32": {"config": "cpu", "iterations": 100 if quick else 1000, "overrides": {}},
        "ViT-S/16 96 px, batch 8": {"config": "tiny", "iterations": 20 if quick else 150, "overrides": vits},
    }


def first_sign(rows: list[dict[str, Any]], min_gap: float) -> int | None:
    gaps: list[float] = []
    for row in rows:
        gaps.append(row["dino_gap"])
        recent = gaps[-WINDOW:]
        if len(recent) == WINDOW and sum(recent) / WINDOW >= min_gap:
            return int(row["iteration"])
    return None


def bench(store: Path, root: Path, name: str, spec: dict[str, Any], teacher: dict[str, Any]) -> dict[str, Any]:
    # Every model at upstream's proportions: lr warm-up 10 % of the run, last layer frozen 1 %.
    iterations = spec["iterations"]
    batch = 32 if spec["config"] == "cpu" else 8
    slug = "".join(c if c.isalnum() else "_" for c in name)
    values = {
        "data.stores": [str(store)],
        "output_dir": str(root / slug),
        "tracking.enabled": False,
        "train.global_batch_size": batch,
        "train.batch_size_per_gpu": batch,
        "train.epoch_length": iterations // 4,
        "train.log_period": 1,
        "checkpointing.period": 10**6,
        "evaluation.eval_period_iterations": 0,
        "optim.warmup_epochs": 0.4,
        "optim.freeze_last_layer_epochs": 0.04,
        **spec["overrides"],
        **teacher,
    }
    cfg = load_config(PretrainConfig, spec["config"], values, stage="pretrain")
    threads = torch.get_num_threads()
    start = time.perf_counter()
    result = run_pretrain(cfg)
    seconds = time.perf_counter() - start
    rows = read_metrics(Path(cfg.output_dir) / "training_metrics.json")
    sign = first_sign(rows, cfg.health.min_gap)
    per_it = seconds / iterations
    probe = next((r["probe_seconds"] for r in reversed(rows) if "probe_seconds" in r), float("nan"))
    last = rows[-WINDOW:]
    return {
        "iterations": iterations,
        "seconds": round(seconds, 1),
        "first_sign_iteration": sign,
        "first_sign_cpu_minutes": None if sign is None else round((sign + 1) * per_it * threads / 60, 2),
        "final_gap": round(sum(r["dino_gap"] for r in last) / len(last), 4),
        "final_teacher_entropy": round(sum(r["teacher_entropy"] for r in last) / len(last), 4),
        "verdict": result.health,
        "probe_seconds": round(probe, 3),
        # At an eval checkpoint every 250 iterations (the cpu recipe's): 4 probes per 1,000 iterations.
        "probe_share_at_eval_every_250": round(4 * probe / (1000 * per_it), 4),
        "curve": curve(rows),  # for docs/make_figures.py: the healthy vs inert picture
    }


def curve(rows: list[dict[str, Any]], every: int = 10) -> list[list[float]]:
    """[iteration, gap averaged over the last 10 iterations, teacher entropy] every `every` iterations."""
    out = []
    for i in range(every - 1, len(rows), every):
        window = rows[i + 1 - every : i + 1]
        gap = sum(r["dino_gap"] for r in window) / every
        out.append([rows[i]["iteration"], round(gap, 4), round(rows[i]["teacher_entropy"], 4)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = make_store(Path(tmp), tile_size=96, stride=96, preset="test" if args.quick else "demo")
        for model, spec in models(args.quick).items():
            for schedule, teacher in SCHEDULES.items():
                if not teacher and spec["config"] != "cpu":
                    continue
                key = f"{model} / {schedule}"
                results[key] = bench(store, Path(tmp), key, spec, teacher)
    (out / "training_health.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"CPU, {torch.get_num_threads()} threads; first sign = {WINDOW}-iteration mean DINO gap ≥ health.min_gap\n")
    print(
        "| model / schedules | iterations | first sign of learning (it) | CPU min to it | final gap (nats) "
        "| teacher entropy | verdict | probe s (share of 1,000 it at eval every 250) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        sign = "none" if r["first_sign_iteration"] is None else str(r["first_sign_iteration"])
        minutes = "–" if r["first_sign_cpu_minutes"] is None else f"{r['first_sign_cpu_minutes']:.2f}"
        print(
            f"| {key} | {r['iterations']} | {sign} | {minutes} | {r['final_gap']:.3f} | "
            f"{r['final_teacher_entropy']:.3f} | {r['verdict'].split(':')[0]} | "
            f"{r['probe_seconds']:.2f} ({r['probe_share_at_eval_every_250']:.1%}) |"
        )


if __name__ == "__main__":
    main()
