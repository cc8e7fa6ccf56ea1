"""`make bench`: run every benchmark script side by side in one session and collect their tables.

Each script prints a markdown table and writes JSON under --output. Figures for docs/benchmarks.md come from here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SCRIPTS = [
    "tile_throughput.py",
    "tile_storage.py",
    "tile_prefect.py",
    "deploy_vs_cli.py",
    "tile_dataset.py",
    "backbone.py",
    "train_step.py",
    "extract.py",
    "extract_ranks.py",
    "evaluate.py",
    "gate_calibration.py",
    "demo_promotion.py",
    "training_health.py",
    "stage_manifest.py",
    "verify_cost.py",
    "onnx_parity.py",
    "small_machine.py",
    "pipeline_parallel.py",
    "stain_aug.py",
    "machine_limits.py",
]
# Arguments beyond --output/--quick: the tile stage is measured alone and beside 2 competing CPU-bound jobs, on one
# slide and on a cohort of 4 (3 rounds each).
ARGS = {"tile_throughput.py": ["--competing", "0", "2", "--cohort", "4", "--repeats", "3"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", help="script names to run")
    args = parser.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    sections = [
        f"# wsidino benchmarks, {dt.date.today().isoformat()}",
        f"{platform.processor() or platform.machine()}; {device}; torch {torch.__version__}",
    ]
    failed = []
    for script in SCRIPTS:
        if args.only and script not in args.only and Path(script).stem not in args.only:
            continue
        path = HERE / script
        if not path.exists():
            continue
        extra = ARGS.get(script, []) + (["--quick"] if args.quick else [])
        cmd = [sys.executable, str(path), "--output", str(out), *extra]
        print(f"== {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        print(proc.stdout[-6000:], flush=True)
        if proc.returncode != 0:
            failed.append(script)
            print(proc.stderr[-4000:], file=sys.stderr)
            sections.append(f"## {script}\nFAILED (exit {proc.returncode})")
        else:
            sections.append(f"## {script}\n{proc.stdout.strip()}")
    (out / "summary.md").write_text("\n\n".join(sections) + "\n")
    print(f"summary: {out / 'summary.md'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
