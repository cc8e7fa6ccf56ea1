"""benchmarks/upstream_step.py without upstream's code: the upstream rows are skipped with a message and our rows
still run; the commit of a checkout is read from git, else a COMMIT file. Upstream itself is never needed here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import REPO

SCRIPT = REPO / "benchmarks" / "upstream_step.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("upstream_step_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_without_a_checkout_the_upstream_rows_are_skipped_and_ours_run(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--shapes",
        "vit_test",
        "--rounds",
        "1",
        "--no-compile",
        "--output",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert load_script().SKIP_MESSAGE in proc.stderr
    doc = json.loads((tmp_path / "upstream_step.json").read_text())
    assert doc["environment"]["upstream"] == "skipped"
    assert [r["variant"] for r in doc["rows"]] == ["ours eager"]
    row = doc["rows"][0]
    assert row["items_per_s"] > 0 and row["arch"] == "vit_test" and "ratio_vs_upstream" not in row
    assert set(row["first_step_losses"]) >= {"dino_global_loss", "dino_local_loss", "ibot_loss", "koleo_loss"}
    assert "| vit_test | ours eager |" in proc.stdout


def test_the_commit_comes_from_git_else_a_commit_file_else_unknown(tmp_path: Path) -> None:
    script = load_script()
    plain = tmp_path / "plain"
    plain.mkdir()
    assert script.upstream_commit(plain) == "unknown"
    (plain / "COMMIT").write_text("6876159a11b4df116f30f667f8c9888617df0751\n")
    assert script.upstream_commit(plain) == "6876159a11b4df116f30f667f8c9888617df0751"

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    assert script.upstream_commit(repo) == head


def test_a_directory_without_the_dinov3_package_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no dinov3/__init__\.py"):
        load_script().import_upstream(tmp_path)
