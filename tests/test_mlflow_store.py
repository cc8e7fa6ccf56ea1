"""The local MLflow store (dinov3_core/tracking_store.py:ensure_store): created atomically, so a failed first creation
(a full disk) leaves nothing and the next run makes it; a broken store stops a command with one line naming it.

Real SQLite stores made by MLflow; the full disk is a real one (a 256 kB tmpfs when this runs as root and may
mount), else a real failed write (RLIMIT_FSIZE: writes past the limit fail with EFBIG).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# In a fresh interpreter: create the store at argv[1] (optionally with writes capped at argv[2] bytes), log a run.
CREATE_AND_LOG = textwrap.dedent(
    """
    import resource, signal, sys
    from dinov3_core import tracking, tracking_store
    if len(sys.argv) > 2:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        limit = int(sys.argv[2])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    cfg = tracking.TrackingConfig(uri=f"sqlite:///{sys.argv[1]}", experiment="store-test")
    try:
        with tracking.stage_run(cfg, "run", {"p": 1}) as run:
            tracking.log_metrics({"m": 0.5})
    except tracking_store.TrackingStoreError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    print(run.info.run_id)
    """
)


def python(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def logged_runs(db: Path) -> list[tuple[str, str]]:
    with contextlib.closing(sqlite3.connect(db)) as con:  # closed: a tmpfs holding it can be unmounted
        return con.execute("SELECT runs.status, metrics.key FROM runs JOIN metrics USING (run_uuid)").fetchall()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A folder on a 256 kB tmpfs (an MLflow store needs ~1 MB) and how to make room: (folder, "tmpfs"); where
    mounting is not allowed, a plain folder and "rlimit" (the test caps the file size of the creating process)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)]
    mounted = os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0
    try:
        yield folder, "tmpfs" if mounted else "rlimit"
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


def test_a_store_whose_creation_fails_leaves_nothing_and_is_made_next_time(
    small_disk: tuple[Path, str], tmp_path: Path
) -> None:
    folder, how = small_disk
    db = folder / "mlflow.db"
    limit = [] if how == "tmpfs" else ["65536"]
    failed = python("-c", CREATE_AND_LOG, str(db), *limit, cwd=tmp_path)
    assert failed.returncode == 2, failed.stderr[-3000:]
    (line,) = failed.stderr.strip().splitlines()
    assert f"cannot create the MLflow store {db}" in line and "nothing was left behind" in line, line
    assert "tracking.enabled=false" in line
    assert sorted(os.listdir(folder)) == [] or sorted(os.listdir(folder)) == ["lost+found"]  # no db, no temp file
    if how == "tmpfs":  # space returns
        subprocess.run(["mount", "-o", "remount,size=16m", str(folder)], check=True)
    made = python("-c", CREATE_AND_LOG, str(db), cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    assert logged_runs(db) == [("FINISHED", "m")]
    assert sorted(p.name for p in folder.iterdir() if p.name != "lost+found") == ["mlflow.db"]
    print(f"full disk simulated with {how}")


@pytest.fixture(scope="module")
def good_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real store made by MLflow through ensure_store, with one run logged."""
    folder = tmp_path_factory.mktemp("good")
    made = python("-c", CREATE_AND_LOG, str(folder / "mlflow.db"), cwd=folder)
    assert made.returncode == 0, made.stderr[-3000:]
    return folder / "mlflow.db"


def truncated(good: Path, db: Path) -> None:
    db.write_bytes(good.read_bytes()[:1000])


def half_made(good: Path, db: Path) -> None:
    """What a creation that stopped after the tables but before MLflow recorded its schema version leaves."""
    shutil.copy(good, db)
    with contextlib.closing(sqlite3.connect(db)) as con:
        con.execute("DELETE FROM alembic_version")
        con.commit()


def not_a_database(good: Path, db: Path) -> None:
    db.write_text("a text file named like the store\n" * 200)


@pytest.mark.parametrize(
    ("damage", "cause"),
    [
        (truncated, "database disk image is malformed"),
        (half_made, "its schema is half-made"),
        (not_a_database, "file is not a database"),
    ],
)
def test_a_broken_store_stops_the_command_with_one_line(good_store: Path, tmp_path: Path, damage, cause) -> None:  # type: ignore[no-untyped-def]
    db = tmp_path / "runs" / "mlflow.db"
    db.parent.mkdir()
    damage(good_store, db)
    before = db.read_bytes()
    weights = tmp_path / "backbone.pth"
    weights.write_text("never read: the store is checked first")
    out = tmp_path / "model" / "model.onnx"
    start = time.perf_counter()
    done = python(
        "-m",
        "dinov3_core.cli",
        "export",
        "--weights",
        str(weights),
        "--output",
        str(out),
        f"tracking.uri=sqlite:///{db}",
        cwd=tmp_path,
    )
    seconds = time.perf_counter() - start
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        f"wsidino export: the MLflow store {db} cannot be opened ({cause}"
        + line.split(cause, 1)[1].split(")", 1)[0]
        + f"): move it aside (mv {db} {db}.broken) to start a new one, or run with tracking.enabled=false"
    ), line
    assert db.read_bytes() == before  # looked at, never changed
    assert not out.parent.exists()
    assert seconds < 30, seconds
    # the first way on works: moved aside, the next run makes a new store
    db.rename(db.with_name("mlflow.db.broken"))
    made = python("-c", CREATE_AND_LOG, str(db), cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    assert logged_runs(db) == [("FINISHED", "m")]


def test_an_empty_store_file_is_made_in_place(tmp_path: Path) -> None:
    """A 0-byte mlflow.db (SQLite's empty database, e.g. `touch`ed) is replaced by a full store, not refused."""
    db = tmp_path / "mlflow.db"
    db.touch()
    made = python("-c", CREATE_AND_LOG, str(db), cwd=tmp_path)
    assert made.returncode == 0, made.stderr[-3000:]
    assert logged_runs(db) == [("FINISHED", "m")]


def test_experiments_are_of_the_model_training_kind(tmp_path: Path) -> None:
    """MLflow 3 opens an experiment without `mlflow.experimentKind` in its GenAI view: ours say model training, also
    one created earlier without the tag."""
    import mlflow

    from dinov3_core import tracking, tracking_store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    with tracking.stage_run(tracking.TrackingConfig(uri=uri, experiment="fresh"), "run", {"p": 1}):
        pass
    tracking_store.ensure_store(uri)
    old = client.create_experiment("older", artifact_location=(tmp_path / "art").as_uri())
    assert "mlflow.experimentKind" not in client.get_experiment(old).tags
    with tracking.stage_run(tracking.TrackingConfig(uri=uri, experiment="older"), "run", {"p": 1}):
        pass
    for name in ("fresh", "older"):
        tags = client.get_experiment_by_name(name).tags
        assert tags.get("mlflow.experimentKind") == "custom_model_development", (name, tags)
