"""Extract's per-slide `.h5` and QuPath GeoJSON are staged under the feature store's `.incoming/` and renamed into
place only after the slide's zarr group is committed: a failed run leaves no export that looks complete for a slide
that is not, and a rerun finishes them. A full disk is one line naming the path and the space it needed. Real sample
slides' tile store, the real exported model, real files; the full disk is a real small filesystem (a tmpfs mounted
for the test) where this process may mount one, else a real per-file size limit (RLIMIT_FSIZE) on the CLI process."""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dinov3_core.config import load_config
from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.extract.config import ExtractConfig
from dinov3_core.extract.extract import run_extract
from dinov3_core.extract.feature_store import h5_dir, pictures_dir
from tests.helpers import REPO

EXPORTS = {"format": "both", "qupath": True, "qupath_clusters": 2, "pca_map": False}


def cfg(store: Path, model: Path, out: Path) -> ExtractConfig:
    values = {"store": str(store), "model": str(model), "output": str(out), "progress": False, **EXPORTS}
    return load_config(ExtractConfig, "default", {**values, "tracking.enabled": False}, stage="extract")


def exports(out: Path, slide_id: str) -> list[Path]:
    return [h5_dir(out) / f"{slide_id}.h5", pictures_dir(out) / slide_id / "tiles.geojson"]


def outside_incoming(top: Path, out: Path) -> list[Path]:
    """Files under `top` that are not under the feature store's `.incoming/`."""
    return [p for p in top.rglob("*") if p.is_file() and (out / ".incoming") not in p.parents]


def assert_exports_match_commits(out: Path, slide_ids: list[str], top: Path) -> None:
    """A slide has its .h5 and GeoJSON in place exactly when its zarr group is committed; no staged name is left
    outside `.incoming/`."""
    for slide_id in slide_ids:
        committed = (out / "slides" / slide_id / "zarr.json").is_file()
        assert [p.is_file() for p in exports(out, slide_id)] == [committed, committed], slide_id
    assert not [p for p in outside_incoming(top, out) if "incoming" in p.name or p.name.endswith(".tmp")]


def test_a_failure_before_a_slides_commit_leaves_no_export_that_looks_complete(
    stage_extract_store, converted, tmp_path
) -> None:
    slide_ids = TileDataset(stage_extract_store, image_format="numpy").slide_ids
    out = tmp_path / "features.zarr"
    blocked = pictures_dir(out) / slide_ids[-1]  # a file where the slide's GeoJSON folder goes: a real OSError
    blocked.parent.mkdir(parents=True)
    blocked.write_text("in the way")
    with pytest.raises(OSError):
        run_extract(cfg(stage_extract_store, converted, out))
    assert not (out / "slides" / slide_ids[-1]).exists()
    assert not (h5_dir(out) / f"{slide_ids[-1]}.h5").exists()  # its .h5 must not look complete
    assert_exports_match_commits(out, slide_ids, tmp_path)

    blocked.unlink()
    again = run_extract(cfg(stage_extract_store, converted, out))
    assert slide_ids[-1] in again.extracted and sorted(again.extracted + again.skipped) == sorted(slide_ids)
    assert all(p.is_file() for s in slide_ids for p in exports(out, s))
    assert_exports_match_commits(out, slide_ids, tmp_path)


def allocated(top: Path) -> tuple[int, int]:
    """(bytes the files under `top` take on disk, the largest file's size)."""
    sizes = [(p.stat().st_blocks * 512, p.stat().st_size) for p in top.rglob("*") if p.is_file()]
    return sum(s[0] for s in sizes), max(s[1] for s in sizes)


@contextlib.contextmanager
def small_disk(where: Path, total: int, per_file: int) -> Iterator[Callable[[], None] | None]:
    """A real full disk for the process the test starts: a tmpfs of `total` bytes mounted at `where` (yields None),
    or, where mounting is not allowed, a per-file size limit of `per_file` bytes (yields the subprocess's preexec
    function: the kernel then fails the write that crosses it with EFBIG)."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = os.geteuid() == 0 and (
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={total}", "tmpfs", str(where)], check=False).returncode
        == 0
    )
    try:
        if mounted:
            yield None
        else:
            yield lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (per_file, per_file))
    finally:
        if mounted:
            subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_is_one_line_naming_the_path_and_nothing_half_written_looks_complete(
    stage_extract_store, converted, tmp_path
) -> None:
    slide_ids = TileDataset(stage_extract_store, image_format="numpy").slide_ids
    reference = tmp_path / "reference"
    run_extract(cfg(stage_extract_store, converted, reference / "features.zarr"))
    total, largest = allocated(reference)
    disk = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    with small_disk(disk, total * 3 // 5, largest // 2) as preexec:
        out = disk / "features.zarr"
        argv = ["extract", "--store", str(stage_extract_store), "--model", str(converted), "--output", str(out)]
        words = [f"{k}={str(v).lower()}" for k, v in EXPORTS.items()] + ["progress=false", "tracking.enabled=false"]
        run = subprocess.run(
            [sys.executable, "-m", "dinov3_core.cli", *argv, *words],
            cwd=REPO,
            capture_output=True,
            text=True,
            preexec_fn=preexec,
            check=False,
        )
        lines = [line for line in run.stderr.splitlines() if not line.startswith(("INFO ", "DEBUG "))]
        assert run.returncode == 1, run.stderr[-3000:]
        assert len(lines) == 1, run.stderr[-3000:]
        assert str(disk) in lines[0] and "bytes" in lines[0] and "rerun" in lines[0], lines[0]
        assert_exports_match_commits(out, slide_ids, disk)
