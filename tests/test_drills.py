"""Fault drills the audit did not reach (issue 50), each on real components: real `wsidino` processes, the sample
slides (OpenSlide), real zarr stores, a real read-only or full file system (a tmpfs mounted for the test: we run as
root). The promise each holds is in docs/reliability.md."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import event_hooks
from tests.helpers import REPO, by_name, read_json, tile_store
from wsidino_dev.short_run import SHORT_RUN


def wsidino(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The console command as a user types it (its own MLflow store in the work directory), started, not awaited."""
    base = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    command = [sys.executable, "-m", "dinov3_core.cli", *args]
    return subprocess.Popen(
        command, cwd=REPO, env={**base, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finished(proc: subprocess.Popen[str], timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def messages(stderr: str) -> list[str]:
    """What the command said on stderr, log lines aside."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(("INFO ", "DEBUG "))]


# ------------------------------------------------------------------------- 1. two pipelines into one workdir


def test_two_pipelines_into_one_workdir_one_runs_the_other_refuses_naming_the_holder(
    sample_slides: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    for name in ("tissue_20x.svs", "tissue_40x.svs"):
        (slides / name).symlink_to(by_name(sample_slides, name))
    workdir = tmp_path / "run"
    args = ["pipeline", "--slides", str(slides), "--workdir", str(workdir), "--to", "tile", *SHORT_RUN]
    events = event_hooks.arm(monkeypatch, "hold_at_stage_start", tmp_path / "events")
    both = [wsidino(*args), wsidino(*args)]  # started together, into one (not yet existing) work directory
    try:
        deadline = time.monotonic() + 300
        while not list(events.glob("stage-started-*")) and time.monotonic() < deadline:
            if all(p.poll() is not None for p in both):
                pytest.fail(f"both ended before a stage started: {[finished(p)[2][-1500:] for p in both]}")
            time.sleep(0.05)
        (started,) = events.glob("stage-started-*")
        holder = int(started.name.rsplit("-", 1)[1])
        winner = next(p for p in both if p.pid == holder)
        loser = next(p for p in both if p.pid != holder)
        rc, _, err = finished(loser, timeout=120)  # refused while the winner still holds the tile stage
        assert winner.poll() is None, "the winner ended before the other was refused"
    finally:
        (events / "release").touch()
    assert rc != 0, err[-3000:]
    said = messages(err)
    assert len(said) == 1 and "Traceback" not in err, err[-3000:]
    assert f"pid {holder}" in said[0] and str(workdir / "tiles.zarr") in said[0], said[0]
    rc, out, err = finished(winner)
    assert rc == 0, err[-3000:]
    manifest = read_json(workdir / "tiles.zarr" / "stage_manifest.json")
    assert manifest["status"] == "complete", manifest
    assert manifest["summary"]["failed"] == 0 and manifest["summary"]["tiles_total"] > 0, manifest["summary"]

    monkeypatch.delenv(event_hooks.HOOKS_ENV)
    rc, out, err = finished(wsidino(*args))
    assert rc == 0, err[-3000:]
    assert "tile: up to date" in out + err, (out + err)[-3000:]
    assert read_json(workdir / "tiles.zarr" / "stage_manifest.json") == manifest  # the rerun skipped: untouched


# ---------------------------------------------------------------------------------- 2. a read-only output


@contextlib.contextmanager
def tmpfs(where: Path, size: str = "64m", *, read_only: bool = False) -> Iterator[Path]:
    """A real tmpfs mounted at `where` for the block (root may mount: the drills run as root); `read_only`: remounted
    read-only, which binds root too (a chmod would not)."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


QUIET = ["progress=false", "tracking.enabled=false"]


def test_extract_into_a_read_only_directory_is_one_line_naming_the_path(
    stage_extract_store: Path, converted: Path, tmp_path: Path
) -> None:
    with tmpfs(tmp_path / "readonly", read_only=True) as readonly:
        out = readonly / "features.zarr"
        argv = ["extract", "--store", str(stage_extract_store), "--model", str(converted), "--output", str(out)]
        rc, _, err = finished(wsidino(*argv, *QUIET), timeout=300)
        assert not any(readonly.iterdir())  # nothing written, nothing half-made
    said = messages(err)
    assert rc != 0 and "Traceback" not in err, err[-3000:]
    assert len(said) == 1 and str(readonly) in said[0], err[-3000:]


# ------------------------------------------------------------------- 3. a level's group deleted from the store


def test_a_level_deleted_by_hand_is_named_with_its_slide_and_what_to_do(
    sample_slides: Any, converted: Path, tmp_path: Path
) -> None:
    from dinov3_core.tiling import store as ts

    slide = by_name(sample_slides, "tissue_20x.svs")
    store = tile_store([slide], tmp_path / "tiles.zarr", tile_size=64, mpp=[0.5, 1.0])
    (slide_id,) = ts.complete_slide_ids(store)
    level = ts.find_level(ts.read_slide_attrs(store, slide_id), 1.0)
    assert level is not None and level.get("path"), level
    shutil.rmtree(ts.slide_dir(store, slide_id) / level["path"])  # by hand: the slide's attributes still list it

    out = tmp_path / "features.zarr"
    argv = ["extract", "--store", str(store), "--model", str(converted), "--output", str(out), "mpp=1.0", *QUIET]
    rc, _, err = finished(wsidino(*argv), timeout=300)
    said = messages(err)
    assert rc != 0 and "Traceback" not in err and len(said) == 1, err[-3000:]
    assert repr(slide_id) in said[0] and "1 µm/px" in said[0] and "wsidino tile" in said[0], said[0]


# ---------------------------------------------------------------------- 4. a tampered export of extract


def same_content(path: Path, written: bytes, tmp_path: Path) -> bool:
    """`path` holds what `written` held: the same bytes, or for an .h5 (HDF5 stamps its own times) the same
    datasets."""
    if path.suffix != ".h5":
        return path.read_bytes() == written
    import h5py
    import numpy as np

    first = tmp_path / "written.h5"
    first.write_bytes(written)
    with h5py.File(first, "r") as a, h5py.File(path, "r") as b:
        names: list[str] = []
        a.visit(lambda n: names.append(n) if isinstance(a[n], h5py.Dataset) else None)
        return bool(names) and all(np.array_equal(a[n][()], b[n][()]) for n in names)


@pytest.mark.parametrize("damaged", ["h5", "geojson"])
def test_a_tampered_export_is_noticed_by_the_rerun_and_rewritten_from_the_features(
    stage_extract_store: Path, converted: Path, tmp_path: Path, damaged: str
) -> None:
    from dinov3_core.extract.feature_store import h5_dir, pictures_dir

    out = tmp_path / "features.zarr"
    argv = ["extract", "--store", str(stage_extract_store), "--model", str(converted), "--output", str(out)]
    words = ["format=both", "qupath=true", "qupath_clusters=2", "pca_map=false", *QUIET]
    rc, _, err = finished(wsidino(*argv, *words), timeout=300)
    assert rc == 0, err[-3000:]
    slide_id = sorted(p.name for p in (out / "slides").iterdir())[0]
    target = h5_dir(out) / f"{slide_id}.h5" if damaged == "h5" else pictures_dir(out) / slide_id / "tiles.geojson"
    good = target.read_bytes()
    tampered = bytearray(good)
    tampered[len(good) // 2] ^= 0xFF  # edited in place, same size: only the content (and its mtime) tells
    target.write_bytes(bytes(tampered))

    rc, out_text, err = finished(wsidino(*argv, *words), timeout=300)
    said = out_text + err
    assert rc == 0, err[-3000:]
    assert "content differs" in said and str(target) in said, said[-3000:]  # why it reran, and what it rewrote
    assert same_content(target, good, tmp_path)  # rewritten from the stored features: what extract wrote at first
    rc, out_text, err = finished(wsidino(*argv, *words), timeout=300)
    assert rc == 0 and "up to date" in out_text + err, (out_text + err)[-3000:]  # and now it holds again
