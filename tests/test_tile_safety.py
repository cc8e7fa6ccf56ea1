"""The tile stage against hostile and repeated inputs, on real sample slides (OpenSlide) and real zarr stores.

A slide id can never name a path outside its own group; the store refuses any id that would; symlink loops,
broken links and unreadable files are failed rows naming the path; byte-identical files and the files of one
DICOM slide are tiled once; every failed row names its file once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dinov3_core.cli import main as cli_main
from dinov3_core.tiling import store as ts
from dinov3_core.tiling.discovery import (
    MAX_ID_BYTES,
    assign_slide_ids,
    discover_slides,
    find_repeats,
    safe_slide_id,
)
from dinov3_core.tiling.engine import run_tile
from tests.helpers import by_name, slide_list, tile_config

SMALL = {"tile_size": 64, "mpp": 2.0}  # tens of tiles a slide: these tests are about paths, not pixels
EXISTING = "tissue_20x"
RUN_FILES = {"manifest.json", "config.yaml", ".lock"}  # what every run rewrites at the store root


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root`: relative path → content hash (files), link target (links) or "dir"."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = f"link:{os.readlink(p)}"
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def entries(store: Path) -> dict[str, dict]:
    return {e["slide_id"]: e for e in ts.read_manifest(store)["slides"]}


def is_safe_id(slide_id: str) -> bool:
    return (
        slide_id not in {"", ".", ".."}
        and not slide_id.startswith(".")
        and slide_id.isprintable()
        and not any(c in slide_id for c in "/\\")
        and len(slide_id.encode()) <= MAX_ID_BYTES
    )


@pytest.fixture(scope="module")
def base_store(sample_slides, tmp_path_factory) -> Path:
    """A store that already holds one normal slide (the 20× sample). Read-only: tests copy it."""
    store = tmp_path_factory.mktemp("base") / "tiles.zarr"
    result = run_tile(tile_config(by_name(sample_slides, "tissue_20x.svs"), store, **SMALL))
    assert [o.status for o in result.outcomes] == ["ok"]
    return store


@pytest.fixture
def store(base_store, tmp_path) -> Path:
    copy = tmp_path / "tiles.zarr"
    shutil.copytree(base_store, copy, symlinks=True)
    return copy


# ------------------------------------------------------------------------------------------------------ slide ids


@pytest.mark.parametrize(
    "name",
    ["..svs", "...svs", ".svs", "new\nline.svs", "ctrl\x01char.svs", "sl/ash\\back.svs", "y" * 250 + ".svs"],
    ids=["dot", "dotdot", "hidden", "newline", "ctrl", "backslash", "long"],
)
def test_a_hostile_name_gets_a_safe_id_and_touches_no_other_slide(name, sample_slides, store, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    *dirs, leaf = name.split("/")  # "/" cannot be in a file name: put the part before it in a folder
    hostile = folder.joinpath(*dirs, leaf)
    hostile.parent.mkdir(parents=True, exist_ok=True)
    hostile.symlink_to(by_name(sample_slides, "tissue_40x.svs"))
    before = tree(store)
    existing_entry = entries(store)[EXISTING]

    result = run_tile(tile_config(hostile, store, **SMALL))

    (outcome,) = result.outcomes
    assert outcome.status == "ok", outcome
    new_id = outcome.slide_id
    assert is_safe_id(new_id), new_id
    assert new_id != EXISTING and (store / "slides" / new_id).is_dir()
    after = tree(store)
    for rel, digest in before.items():  # the existing slide's group (and everything else) bit for bit
        if rel not in RUN_FILES:
            assert after.get(rel) == digest, rel
    added = {rel for rel in after.keys() - before.keys()}
    assert added and all(rel == f"slides/{new_id}" or rel.startswith(f"slides/{new_id}/") for rel in added), added
    assert not list((store / ts.INCOMING).iterdir())
    assert ts.complete_slide_ids(store) == sorted([EXISTING, new_id])
    manifest = entries(store)
    assert manifest[EXISTING] == existing_entry
    assert manifest[new_id]["status"] == "ok" and manifest[new_id]["source_path"] == str(hostile)
    assert ts.read_slide_attrs(store, new_id)["input_path"] == str(hostile)  # the id is traceable to its file

    again = run_tile(tile_config(hostile, store, **SMALL))  # the id is stable: the slide is up to date
    assert [(o.slide_id, o.status) for o in again.outcomes] == [(new_id, "skipped")]


def test_an_overlong_missing_name_fails_alone_with_a_capped_id(sample_slides, store, tmp_path):
    missing = tmp_path / ("z" * 300 + ".svs")  # longer than a file name may be: it cannot exist
    listing = slide_list(tmp_path / "slides.txt", [by_name(sample_slides, "tissue_20x.svs"), missing])
    result = run_tile(tile_config(listing, store, **SMALL))
    by_path = {o.source_path: o for o in result.outcomes}
    failed = by_path[str(missing)]
    assert failed.status == "failed" and is_safe_id(failed.slide_id)
    assert failed.error.count(str(missing)) == 1 and "File name too long" in failed.error
    assert by_path[str(by_name(sample_slides, "tissue_20x.svs"))].status == "skipped"
    assert entries(store)[failed.slide_id]["status"] == "failed"


def test_plain_names_keep_their_ids_and_unsafe_ones_are_cleaned_deterministically():
    for plain in ("tissue_20x", "TCGA-A1-0001 (HE) v2", "Ünïcode-名前", "a.b.c", "x" * MAX_ID_BYTES):
        assert safe_slide_id(plain) == plain  # stores tiled before keep their ids
    cleaned = {name: safe_slide_id(name) for name in (".", "..", "", ".hidden", "a\nb", "a\x00b", "a/b", "\u202egpj")}
    assert all(is_safe_id(i) for i in cleaned.values()), cleaned
    assert len(set(cleaned.values())) == len(cleaned)  # different names never share an id
    assert cleaned["a\nb"].startswith("a_b-") and cleaned[".."].startswith("slide-")
    assert cleaned == {name: safe_slide_id(name) for name in cleaned}  # reruns find the same ids
    assert len(safe_slide_id("é" * 200).encode()) <= MAX_ID_BYTES  # the cap counts bytes, on a character boundary


def test_one_file_under_two_names_gets_two_ids(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    target = tmp_path / "a" / "s.svs"
    target.write_bytes(b"x")
    (tmp_path / "b" / "s.svs").symlink_to(target)  # same stem, same resolved file
    ids = [t.slide_id for t in assign_slide_ids([target, tmp_path / "b" / "s.svs"])]
    assert len(set(ids)) == 2 and all(i.startswith("s-") for i in ids)


# --------------------------------------------------------------------------------------------------- store guard


@pytest.mark.parametrize("bad", [".", "..", "a/b", "", "a\\b", "../slides/x", "x\x00"])
def test_the_store_refuses_ids_that_escape_and_touches_nothing(bad, store):
    before = tree(store)
    calls = {
        "slide_dir": lambda: ts.slide_dir(store, bad),
        "read_slide_attrs": lambda: ts.read_slide_attrs(store, bad),
        "remove_slide": lambda: ts.remove_slide(store, bad),
        "begin_slide": lambda: ts.begin_slide(store, bad, n_tiles=1, tile_size=16, tiles_per_shard=1),
        "incoming": lambda: ts.IncomingSlide(store, bad, "tag", 1, 1),
    }
    for what, call in calls.items():
        with pytest.raises(ts.TileStoreError, match="refusing") as err:
            call()
        assert repr(bad) in str(err.value), what
    assert tree(store) == before


def test_the_store_refuses_a_slide_folder_that_links_elsewhere(store, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    (store / "slides" / "evil").symlink_to(outside, target_is_directory=True)
    incoming = ts.begin_slide(store, "evil", n_tiles=2, tile_size=16, tiles_per_shard=2)  # its own folder: fine
    incoming.write_tiles(0, np.zeros((2, 16, 16, 3), np.uint8))
    with pytest.raises(ts.TileStoreError, match="'evil'"):
        ts.commit_slide(incoming, {"tile_size": 16})
    with pytest.raises(ts.TileStoreError, match="'evil'"):
        ts.remove_slide(store, "evil")
    assert tree(outside) == {"precious.txt": hashlib.sha256(b"keep me").hexdigest()}
    assert (store / "slides" / "evil").is_symlink()


# ------------------------------------------------------------------------------------ loops and unreadable paths


def tile_argv(folder: Path, store: Path) -> list[str]:
    """`wsidino tile` of `folder` into `store` at the `SMALL` settings, quiet and without MLflow."""
    small = [f"{k}={v}" for k, v in SMALL.items()]
    return ["tile", "--input", str(folder), "--output", str(store), "progress=false", "tracking.enabled=false", *small]


def test_symlink_loops_and_broken_links_are_failed_rows_naming_them(sample_slides, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "good.svs").symlink_to(by_name(sample_slides, "tissue_20x.svs"))
    loop = folder / "loop.svs"
    loop.symlink_to(loop)
    ping, pong = folder / "ping.svs", folder / "pong.svs"
    ping.symlink_to(pong)
    pong.symlink_to(ping)
    broken = folder / "broken.svs"
    broken.symlink_to(tmp_path / "gone.svs")
    store = tmp_path / "tiles.zarr"

    code = cli_main(tile_argv(folder, store))

    assert code == 1  # some inputs failed; the batch went on
    rows = {e["source_path"]: e for e in ts.read_manifest(store)["slides"]}
    assert set(rows) == {str(folder / n) for n in ("good.svs", "loop.svs", "ping.svs", "pong.svs", "broken.svs")}
    assert rows[str(folder / "good.svs")]["status"] == "ok"
    for path, needle in ((loop, "symbolic link loop"), (ping, "symbolic link loop"), (broken, "broken symbolic link")):
        row = rows[str(path)]
        assert row["status"] == "failed" and needle in row["error"], row
        assert row["error"].startswith(f"{path}: ") and row["error"].count(str(path)) == 1
    assert ts.complete_slide_ids(store) == ["good"]


def _unprivileged() -> list[str]:
    """A command prefix under which file permissions apply: as root, drop the capabilities that bypass them."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    probe = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "true"] if setpriv else None
    if probe is None or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("running as root without setpriv: an unreadable file cannot be made")
    return probe[:2]


def test_unreadable_files_and_folders_are_failed_rows_naming_them(sample_slides, tmp_path):
    prefix = _unprivileged()
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(by_name(sample_slides, "tissue_20x.svs"), folder / "good.svs")
    locked_file = folder / "locked.svs"
    shutil.copy(by_name(sample_slides, "tissue_40x.svs"), locked_file)
    locked_dir = folder / "locked_dir"
    locked_dir.mkdir()
    shutil.copy(by_name(sample_slides, "tissue_40x.svs"), locked_dir / "inside.svs")
    locked_file.chmod(0)
    locked_dir.chmod(0)
    store = tmp_path / "tiles.zarr"
    argv = tile_argv(folder, store)
    try:
        run = subprocess.run(
            [*prefix, sys.executable, "-c", f"from dinov3_core.cli import main; raise SystemExit(main({argv!r}))"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        locked_file.chmod(0o644)
        locked_dir.chmod(0o755)
    assert run.returncode == 1, run.stderr[-2000:]
    rows = {e["source_path"]: e for e in ts.read_manifest(store)["slides"]}
    assert rows[str(folder / "good.svs")]["status"] == "ok"
    for path, needle in ((locked_file, "Permission denied"), (locked_dir, "cannot be listed")):
        row = rows[str(path)]
        assert row["status"] == "failed" and needle in row["error"], row
        assert row["error"].startswith(f"{path}: ")
    assert ts.complete_slide_ids(store) == ["good"]


# ---------------------------------------------------------------------------------------------------- duplicates


def test_the_files_of_one_dicom_folder_are_one_slide(tmp_path):
    scan_a, scan_b = tmp_path / "in" / "scan_a", tmp_path / "in" / "scan_b"
    for folder, names in ((scan_a, ["0003.dcm", "0001.dcm", "0002.DCM"]), (scan_b, ["0001.dcm"])):
        folder.mkdir(parents=True)
        for name in names:
            (folder / name).write_bytes(f"not really DICOM: {folder.name}/{name}".encode())
    paths = discover_slides(str(tmp_path / "in"), [".dcm"])
    tasks, repeats = find_repeats(assign_slide_ids(paths))
    assert [(t.slide_id, t.path) for t in tasks] == [("scan_a", scan_a / "0001.dcm"), ("scan_b", scan_b / "0001.dcm")]
    assert sorted((r.task.path, r.of.slide_id) for r in repeats) == [
        (scan_a / "0002.DCM", "scan_a"),
        (scan_a / "0003.dcm", "scan_a"),
    ]
    ids = [t.slide_id for t in tasks] + [r.task.slide_id for r in repeats]
    assert len(set(ids)) == 4 and all(is_safe_id(i) for i in ids)

    store = tmp_path / "tiles.zarr"
    result = run_tile(tile_config(tmp_path / "in", store, extensions=[".dcm"], **SMALL))
    rows = {o.source_path: o for o in result.outcomes}
    assert len(rows) == 4 and len(ts.read_manifest(store)["slides"]) == 4  # every input has its row
    assert rows[str(scan_a / "0002.DCM")].status == "duplicate"
    assert rows[str(scan_a / "0002.DCM")].duplicate_of == "scan_a"
    assert rows[str(scan_a / "0001.dcm")].status == "failed"  # not a real slide: OpenSlide says so
    assert "not a whole-slide image" in rows[str(scan_a / "0001.dcm")].error


# ------------------------------------------------------------------------------------------ failed rows name files


def test_failed_rows_name_their_file_once(sample_slides, tmp_path):
    corrupt = tmp_path / "corrupt.svs"  # JPEG tile data overwritten: OpenSlide itself raises while reading
    data = bytearray(by_name(sample_slides, "tissue_20x.svs").read_bytes())
    for offset in range(len(data) // 4, len(data) // 2, 997):
        data[offset : offset + 64] = b"\xff\xd9" * 32
    corrupt.write_bytes(bytes(data))
    truncated = sample_slides.negatives["truncated"]
    listing = slide_list(tmp_path / "slides.txt", [truncated, corrupt])
    store = tmp_path / "tiles.zarr"

    result = run_tile(tile_config(listing, store, reader="openslide", **SMALL))

    rows = {o.source_path: o for o in result.outcomes}
    assert rows[str(corrupt)].status == "failed"
    assert rows[str(corrupt)].error.startswith(f"{corrupt}: OpenSlideError: ")  # a library error, now named
    for path in (corrupt, truncated):
        assert rows[str(path)].error.count(str(path)) == 1, rows[str(path)].error
        assert json.loads((store / ts.MANIFEST).read_text())  # and the manifest is whole
        assert entries(store)[rows[str(path)].slide_id]["error"] == rows[str(path)].error
