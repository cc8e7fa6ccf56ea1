"""FSDP2 (`fully_shard` per block + root, CPU/gloo, 2 processes) = single-process forward and gradients."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import DIST_SCRIPTS, torchrun


def test_fsdp2_matches_single_process(tmp_path: Path) -> None:
    proc = torchrun(str(DIST_SCRIPTS / "fsdp_forward.py"), str(tmp_path), timeout=300)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in results) == [0, 1], proc.stdout
    for r in results:
        assert r["param_types"] == ["DTensor"]
        assert r["max_out_diff"] < 1e-5, r
        assert r["max_grad_diff"] < 1e-5, r
        assert r["meta_init_ok"] and r["save_ok"], r
