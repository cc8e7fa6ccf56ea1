"""FSDP2 (`fully_shard` per block + root, CPU/gloo, 2 processes) = single-process forward and gradients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "dist_scripts" / "fsdp_forward.py"


def test_fsdp2_matches_single_process(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(SCRIPT),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    if proc.returncode != 0:
        tail = f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
        pytest.fail(f"torchrun exited {proc.returncode}\n{tail}")
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in results) == [0, 1], proc.stdout
    for r in results:
        assert r["param_types"] == ["DTensor"]
        assert r["max_out_diff"] < 1e-5, r
        assert r["max_grad_diff"] < 1e-5, r
        assert r["meta_init_ok"] and r["save_ok"], r
