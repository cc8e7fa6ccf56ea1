"""The prepared GPU check (benchmarks/gpu_check.py, docs/gpu-check.md) runs clean on CPU with tiny shapes, and names
what a machine lacks. Its `tests` section is left out: the GPU tests run in this same suite (tests/test_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def gpu_check(
    tmp_path: Path, only: str, pythonpath: tuple[Path, ...] = (), timeout: float = 300
) -> tuple[int, dict, str]:
    """The check as a user runs it (`--dry-run`), in its own process; (exit code, gpu_check.json, gpu_check.md)."""
    out, work = tmp_path / "out", tmp_path / "work"
    path = os.pathsep.join([*map(str, pythonpath), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--only", only, "--output", str(out), "--work", str(work)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if not (out / "gpu_check.json").exists():
        pytest.fail(f"no report (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.returncode, json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


@pytest.mark.slow  # ~50 s on 2 cores: sample slides → tile store, two tiny training runs, one extraction
@pytest.mark.timeout(420)
def test_the_dry_run_measures_training_and_extraction(tmp_path: Path) -> None:
    code, report, md = gpu_check(tmp_path, "deps,env,store,train,extract")
    by_section: dict[str, list[dict[str, Any]]] = {}
    for entry in report["sections"]:
        by_section.setdefault(entry["section"], []).append(entry)
    assert code == 0, [(e["label"], e.get("error", "")[-1500:]) for e in report["sections"] if e["status"] != "ok"]
    assert report["dry_run"] is True
    assert sorted(by_section) == ["deps", "env", "extract", "store", "train"]
    assert all(e["status"] == "ok" for e in report["sections"]), report["sections"]

    deps = by_section["deps"][0]["result"]
    assert deps["missing"] == [] and deps["orchestration_imported"] == []
    assert by_section["store"][0]["result"]["tiles"] > 0

    train = [e["result"] for e in by_section["train"]]
    assert sorted(r["compile"] for r in train) == [False, True]
    for row in train:
        assert row["images_per_s"] > 0 and row["estimated_gib"] > 0 and row["gflop_per_image"] > 0, row
        assert row["peak_allocated_gib"] > 0 and row["timed_iterations"] > 0, row

    extract = by_section["extract"][0]["result"]["rows"]
    assert {r["what"].split(" ")[0] for r in extract} == {"run_extract", "model"}
    assert all(r["tiles_per_s"] > 0 and r["tiles"] > 0 for r in extract), extract

    assert "## Training (one GPU" in md and "| arch | compile | act. ckpt |" in md
    assert "## Extraction" in md and "| arch | precision | compile | what | tiles | tiles/s |" in md
    assert md.count("| vit_test | bf16 |") == 4  # extraction: whole stage and model alone, eager and compiled


@pytest.mark.timeout(120)
def test_the_deps_section_names_what_is_missing_or_broken(tmp_path: Path) -> None:
    """A machine without simplejpeg, and one with openslide-python but not openslide-bin (the library it loads):
    Python itself refuses both imports (a `None` entry in sys.modules, set by a sitecustomize on PYTHONPATH for the
    check's every process), so the check sees them as it would on a machine that lacks them."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n\nsys.modules['simplejpeg'] = sys.modules['openslide_bin'] = None\n"
    )
    code, report, md = gpu_check(tmp_path, "deps,extract", pythonpath=(site,), timeout=100)

    assert code == 1  # not clean: what follows cannot run
    deps, extract = report["sections"]
    assert deps["status"] == "ok", deps
    missing = deps["result"]["missing"]
    assert missing[0] == "simplejpeg (simplejpeg)", missing  # absent: named, no error text
    if system_openslide():  # openslide-python falls back on a system libopenslide: then it is not broken
        assert len(missing) == 1, missing
    else:  # there but not importable: named with the error
        assert len(missing) == 2, missing
        assert missing[1].startswith("openslide (openslide-python (+ openslide-bin)): ModuleNotFoundError: "), missing
    assert "torch" in deps["result"]["versions"] and "simplejpeg" not in deps["result"]["versions"]
    # What needs them (the tile store, training, extraction) is skipped, saying why and where the wheels are.
    assert extract["section"] == "extract" and extract["status"] == "skipped"
    assert "missing packages: simplejpeg (simplejpeg), openslide (" in extract["error"]
    assert "docs/gpu-check.md" in extract["error"]
    assert "Packages missing: simplejpeg (simplejpeg), openslide (" in md


def system_openslide() -> bool:
    """Whether a fresh process finds a system libopenslide (what openslide-python tries without openslide-bin). In a
    fresh process: in this one an earlier test may have loaded openslide-bin's copy, which the name then finds."""
    probe = (
        "import ctypes, sys\n"
        "for n in ('libopenslide.so.1', 'libopenslide.so.0'):\n"
        "    try:\n        ctypes.CDLL(n)\n        sys.exit(0)\n    except OSError:\n        pass\n"
        "sys.exit(1)"
    )
    return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0
