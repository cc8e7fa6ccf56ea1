"""A slide's id, once in a tile store, is stable: a byte-identical copy added later, whatever its name, is a
`duplicate` row pointing at the id the store already holds; nothing is re-tiled or removed. Real sample slides
(OpenSlide), real zarr stores, the real CLI."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from dinov3_core.cli import main as cli_main
from dinov3_core.tiling import report
from dinov3_core.tiling import store as ts
from dinov3_core.tiling.engine import run_tile
from tests.helpers import by_name, tile_config

SMALL = {"tile_size": 64, "mpp": 2.0}  # tens of tiles a slide: these tests are about ids, not pixels


def slide_files(store: Path, slide_id: str) -> dict[str, tuple[str, int]]:
    """Every file of a slide's committed group: relative path → (content hash, inode). The inode proves the files
    are the very ones written before, not a re-tiling that happens to write the same bytes."""
    group = ts.slide_dir(store, slide_id)
    out = {}
    for dirpath, _, filenames in os.walk(group):
        for name in filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(group))] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_ino)
    return out


def entries(store: Path) -> dict[str, dict]:
    return {e["slide_id"]: e for e in ts.read_manifest(store)["slides"]}


def tile_argv(folder: Path, store: Path) -> list[str]:
    small = [f"{k}={v}" for k, v in SMALL.items()]
    return ["tile", "--input", str(folder), "--output", str(store), "progress=false", "tracking.enabled=false", *small]


def test_a_copy_that_sorts_first_is_a_duplicate_of_the_slide_already_in_the_store(sample_slides, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    original = by_name(sample_slides, "tissue_20x.svs")
    shutil.copy(original, folder / "b.svs")
    store = tmp_path / "tiles.zarr"
    assert run_tile(tile_config(folder, store, **SMALL)).counts["ok"] == 1  # only b so far
    before = slide_files(store, "b")
    shutil.copy(original, folder / "a.svs")  # a byte-identical copy whose name sorts first

    assert cli_main(tile_argv(folder, store)) == 0  # a duplicate is not a failure
    manifest = entries(store)
    assert manifest["b"]["status"] == "skipped"  # already in the store, from this very content
    dup = manifest["a"]
    assert dup["status"] == "duplicate" and dup["duplicate_of"] == "b" and dup["tile_count"] == 0
    assert str(folder / "a.svs") in dup["note"] and str(folder / "b.svs") in dup["note"]
    assert ts.complete_slide_ids(store) == ["b"]  # the tissue is in once, under the id it had
    assert slide_files(store, "b") == before  # not re-tiled, not rewritten
    result = run_tile(tile_config(folder, store, **SMALL))
    assert result.counts == {"ok": 0, "failed": 0, "skipped": 1} and result.duplicates == 1
    assert f"byte-identical to {folder / 'b.svs'}" in report.format_summary(result)


def test_a_new_copy_of_a_new_slide_is_a_duplicate_of_the_first_in_path_order(sample_slides, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    original = by_name(sample_slides, "tissue_20x.svs")
    for name in ("b.svs", "a.svs"):
        shutil.copy(original, folder / name)
    store = tmp_path / "tiles.zarr"
    result = run_tile(tile_config(folder, store, **SMALL))
    rows = {o.slide_id: o for o in result.outcomes}
    assert rows["a"].status == "ok" and rows["b"].status == "duplicate" and rows["b"].duplicate_of == "a"
    assert ts.complete_slide_ids(store) == ["a"]


def test_two_ids_of_one_content_already_in_the_store_stay_put(sample_slides, tmp_path):
    """Tiled one at a time (each run saw one file), the store holds the same tissue under two ids: neither is
    renamed, re-tiled or removed when both are listed together; both rows say the other is byte-identical."""
    folder = tmp_path / "in"
    folder.mkdir()
    original = by_name(sample_slides, "tissue_20x.svs")
    store = tmp_path / "tiles.zarr"
    for name in ("b.svs", "a.svs"):
        shutil.copy(original, folder / name)
        assert run_tile(tile_config(folder / name, store, **SMALL)).counts["ok"] == 1
    before = {slide_id: slide_files(store, slide_id) for slide_id in ("a", "b")}

    result = run_tile(tile_config(folder, store, **SMALL))
    rows = {o.slide_id: o for o in result.outcomes}
    assert {k: o.status for k, o in rows.items()} == {"a": "skipped", "b": "skipped"}
    assert str(folder / "b.svs") in rows["a"].note and str(folder / "a.svs") in rows["b"].note
    assert ts.complete_slide_ids(store) == ["a", "b"]
    assert {slide_id: slide_files(store, slide_id) for slide_id in ("a", "b")} == before
