"""Does `make demo` show the promise? The demo's pipeline over several training seeds: promoted to `@champion`?

The demo's own two commands, as `make demo` runs them (the "demo" sample slides, `wsidino pipeline ... --nproc-per-node
2`), once per seed, each into its own work directory (its own MLflow registry, so each trained model is the
registry's first and the gate compares it with the architecture at initialisation). The seed is the training's
(`pretrain.train.seed`, `gram.train.seed`): the slides, the tiles, the folds and the probes' draws stay the same,
so what varies is what the model learned. Seed 0 is exactly `make demo`.

Per seed: wall time, the gate's evidence line (linear-probe balanced accuracy vs init, its bootstrap interval, the
permutation test's p-value) and whether `@champion` moved. Then the seed-0 command again with nothing changed: every
stage must be skipped and the registry's aliases must be as they were (a rerun promotes nothing new).

Usage: python benchmarks/demo_promotion.py [--seeds 0 1 2 3 4 | --quick] [--output bench-output]
       (writes OUTPUT/demo_promotion.json; ~5 min a seed on a quiet 2-core box)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dinov3_core.evaluate.evaluation_json import EvaluationReport

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cmd: list[str], logfile: Path) -> float:
    start = time.perf_counter()
    with logfile.open("a") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}; see {logfile}")
    return time.perf_counter() - start


def aliases(workdir: Path) -> dict[str, Any]:
    """Every registered model's aliases and version count in the work directory's MLflow store."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    out = {}
    for model in client.search_registered_models():
        versions = client.search_model_versions(f"name='{model.name}'")
        out[model.name] = {"aliases": dict(model.aliases), "versions": len(versions)}
    return out


def pipeline_command(slides: Path, workdir: Path, seed: int) -> list[str]:
    """`make demo`'s pipeline command, training with `seed` (0: the recipe's own, as make demo runs it)."""
    overrides = [f"pretrain.train.seed={seed}", f"gram.train.seed={seed}"] if seed else []
    return [
        str(BIN / "wsidino"),
        "pipeline",
        "--slides",
        str(slides),
        "--workdir",
        str(workdir),
        "--annotations",
        str(slides / "annotations"),
        "--nproc-per-node",
        "2",
        *overrides,
    ]


def stage_statuses(output: str) -> set[str]:
    """The statuses in the pipeline's `=== stages` table (the last one printed in `output`)."""
    block = output.rsplit("=== stages", 1)[-1].split("\n\n", 1)[0]
    return {line.split()[1] for line in block.splitlines()[1:] if len(line.split()) >= 2}


def seed_row(seed: int, workdir: Path, seconds: float) -> dict[str, Any]:
    ev = EvaluationReport.from_json((workdir / "evaluation" / "evaluation.json").read_text())
    decision, evidence = ev.decision or {}, ev.evidence
    diff = ev.comparisons["candidate_vs_baseline"]["linear.balanced_accuracy"]
    linear = {role: m["probes"]["linear"]["balanced_accuracy"]["value"] for role, m in ev.models.items()}
    return {
        "seed": seed,
        "seconds": round(seconds, 1),
        "candidate": linear["candidate"],
        "baseline": linear.get("baseline"),
        "difference": diff["value"],
        "ci": [diff["ci_low"], diff["ci_high"]],
        "p_value": diff.get("p_value"),
        "test_slides": evidence.get("test_groups"),
        "promoted": bool(decision["applied"]),
        "reason": decision["reason"],
        "registry": aliases(workdir),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--workdir", default=None, help="where the runs go (default: OUTPUT/demo_promotion)")
    parser.add_argument("--quick", action="store_true", help="seed 0 only (make demo itself) and its rerun")
    args = parser.parse_args()
    if args.quick:
        args.seeds = [0]
    out = Path(args.output).resolve()
    base = Path(args.workdir).resolve() if args.workdir else out / "demo_promotion"
    base.mkdir(parents=True, exist_ok=True)
    logfile = base / "runs.log"
    slides = base / "slides"
    env_note = f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    log(f"demo_promotion: {env_note}; logs in {logfile}")
    samples = run([str(BIN / "wsidino-dev"), "samples", str(slides), "--preset", "demo", "--no-negatives"], logfile)
    rows = []
    for seed in args.seeds:
        workdir = base / f"seed{seed}"
        seconds = run(pipeline_command(slides, workdir, seed), logfile)
        rows.append(seed_row(seed, workdir, seconds))
        r = rows[-1]
        log(
            f"seed {seed}: {seconds:.0f} s, linear {r['candidate']:.3f} vs init {r['baseline']:.3f}, "
            f"p = {r['p_value']}, promoted: {r['promoted']}"
        )
    rerun: dict[str, Any] = {}
    if args.seeds:
        seed = args.seeds[0]
        workdir = base / f"seed{seed}"
        before = aliases(workdir)
        start = logfile.stat().st_size
        seconds = run(pipeline_command(slides, workdir, seed), logfile)
        text = logfile.read_text()[start:]
        after = aliases(workdir)
        rerun = {
            "seed": seed,
            "seconds": round(seconds, 1),
            "registry_unchanged": before == after,
            "every_stage_skipped": stage_statuses(text) == {"skipped"},
        }
    promoted = sum(r["promoted"] for r in rows)
    result = {
        "machine": env_note,
        "samples_seconds": round(samples, 1),
        "seeds": rows,
        "rerun": rerun,
        "promoted": f"{promoted}/{len(rows)}",
    }
    (out / "demo_promotion.json").write_text(json.dumps(result, indent=2))
    print(f"\nDemo promotion over {len(rows)} training seeds ({env_note}; samples {samples:.0f} s)\n")
    print(
        "| seed | pipeline s | linear bal. acc (candidate / init) | difference [95 % bootstrap] | p (permutation) "
        "| test slides | @champion |"
    )
    print("|---:|---:|---|---|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['seed']} | {r['seconds']:.0f} | {r['candidate']:.3f} / {r['baseline']:.3f} | "
            f"{r['difference']:+.3f} [{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}] | {r['p_value']:.4f} | "
            f"{r['test_slides']} | {'promoted' if r['promoted'] else 'not promoted'} |"
        )
    print(f"\npromoted: {promoted} of {len(rows)}")
    if rerun:
        print(
            f"rerun of seed {rerun['seed']} with nothing changed: {rerun['seconds']:.0f} s, every stage skipped: "
            f"{rerun['every_stage_skipped']}, registry unchanged: {rerun['registry_unchanged']}"
        )


if __name__ == "__main__":
    main()
