"""The zarr tile store: layout, per-slide atomic commit, manifest and the single-run lock.

Layout and attributes are specified in docs/tile-store.md. Invariants this module keeps:
- a slide group under `slides/` is complete: it is built under `.incoming/` and renamed into place last;
- each shard of `tiles` has exactly one writer (writers get shard-aligned index ranges);
- store metadata (root group, manifest, array creation) is written by one process only.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zarr
import zarr.codecs

from dinov3_core import locks
from dinov3_core.errors import WsidinoError
from dinov3_core.tiling.codecs import JpegCodec
from dinov3_core.tiling.shard_writer import tile_encoder, write_shard

STORE_FORMAT = {"format": "tile-store", "version": 1}
SLIDES = "slides"
INCOMING = ".incoming"
MANIFEST = "manifest.json"
LOCK = ".lock"
ATTRS_KEY = "wsidino"

Compressor = Literal["zstd", "jpeg", "none"]


class TileStoreError(WsidinoError, RuntimeError):
    """The tile store is missing, not a tile store, or in use."""


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    os.replace(tmp, path)


def init_store(path: str | os.PathLike[str]) -> Path:
    """Create (or validate) a tile store root. Raises a clear error when the directory is unusable."""
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise TileStoreError(f"tile store path {root} exists and is not a directory; choose another --output")
    if root.is_dir() and any(root.iterdir()) and not (root / "zarr.json").exists():
        raise TileStoreError(
            f"{root} is a non-empty directory that is not a tile store; choose an empty or new --output path"
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise TileStoreError(
            f"cannot write the tile store at {root}: {err.strerror or err}; "
            "check permissions or choose another --output"
        ) from None
    if (root / "zarr.json").exists():
        check_store(root)
    else:
        group = zarr.open_group(str(root), mode="w", zarr_format=3)
        group.attrs[ATTRS_KEY] = {**STORE_FORMAT, "created": utc_now()}
    (root / SLIDES).mkdir(exist_ok=True)
    if not (root / SLIDES / "zarr.json").exists():
        zarr.open_group(str(root / SLIDES), mode="w", zarr_format=3)
    (root / INCOMING).mkdir(exist_ok=True)
    return root


def check_store(path: str | os.PathLike[str]) -> Path:
    """Validate that `path` is a tile store readable by this version."""
    root = Path(path)
    if not (root / "zarr.json").is_file():
        raise TileStoreError(f"no tile store at {root} (missing zarr.json); run `wsidino tile` to create one")
    try:
        attrs = json.loads((root / "zarr.json").read_text()).get("attributes", {}).get(ATTRS_KEY, {})
    except (OSError, json.JSONDecodeError) as err:
        raise TileStoreError(f"unreadable tile store metadata {root / 'zarr.json'}: {err}") from None
    if attrs.get("format") != STORE_FORMAT["format"]:
        raise TileStoreError(f"{root} is a zarr group but not a wsidino tile store (no '{ATTRS_KEY}.format')")
    if attrs.get("version") != STORE_FORMAT["version"]:
        raise TileStoreError(
            f"tile store {root} has format version {attrs.get('version')}; this wsidino reads version "
            f"{STORE_FORMAT['version']}. Re-tile the slides into a new store."
        )
    return root


@contextlib.contextmanager
def store_lock(root: Path) -> Iterator[None]:
    """One tiling run per store at a time. flock is released by the kernel even on SIGKILL."""

    def busy(holder: str) -> TileStoreError:
        return TileStoreError(f"tile store {root} is being written by {holder}; wait for that run to finish")

    with locks.exclusive(root / LOCK, busy):
        yield


def clear_incoming(root: Path) -> list[str]:
    """Remove debris of interrupted runs (call only while holding the store lock)."""
    removed = []
    incoming = root / INCOMING
    if incoming.is_dir():
        for entry in incoming.iterdir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def slide_dir(root: str | os.PathLike[str], slide_id: str) -> Path:
    """The committed group of a slide: `<root>/slides/<slide_id>` (checked by `_slide_path`)."""
    return _slide_path(Path(root), SLIDES, slide_id)


def incoming_dir(root: str | os.PathLike[str], slide_id: str, tag: str) -> Path:
    """A slide's folder under `.incoming/`: `<root>/.incoming/<slide_id>-<tag>` (checked by `_slide_path`)."""
    return _slide_path(Path(root), INCOMING, slide_id, f"-{tag}")


def _slide_path(root: Path, area: str, slide_id: str, suffix: str = "") -> Path:
    """The one place a slide id becomes a path: every write, rename and delete of a slide's files goes through here.

    The path must be a direct child of `<root>/<area>` named exactly `<slide_id><suffix>`, also after resolving
    symlinks; an id such as `.`, `..`, `a/b` or `` (or a slide folder that is a link to somewhere else) would
    otherwise let one slide's commit replace, move or delete what is not its own.
    """
    name = f"{slide_id}{suffix}"
    parent = root / area
    path = parent / name
    escapes = not isinstance(slide_id, str) or slide_id in {"", ".", ".."} or any(c in slide_id for c in "/\\\0")
    if not escapes:
        real = path.resolve()
        escapes = real.name != name or real.parent != parent.resolve()
    if escapes:
        raise TileStoreError(
            f"slide id {slide_id!r} does not name one folder of its own under {parent}; refusing to write, move or "
            "delete anything for it. `wsidino tile` never makes such an id: if a tool of yours wrote this store, "
            "give the slide a plain id (a file name without path separators)"
        )
    return path


def complete_slide_ids(root: str | os.PathLike[str]) -> list[str]:
    """Ids of the slides committed to the store, sorted."""
    slides = Path(root) / SLIDES
    if not slides.is_dir():
        return []
    return sorted(p.name for p in slides.iterdir() if p.is_dir() and (p / "zarr.json").is_file())


def read_slide_attrs(root: str | os.PathLike[str], slide_id: str) -> dict[str, Any]:
    meta = json.loads((slide_dir(root, slide_id) / "zarr.json").read_text())
    return dict(meta.get("attributes", {}).get(ATTRS_KEY, {}))


def slide_levels(attrs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A slide's µm/px levels, the first first: each with `path` (its group inside the slide's, "" for the first),
    `mpp_requested`, `mpp_effective`, `tile_count` … A single-level slide has no `levels` attribute: its one level
    is read from the slide's own attributes."""
    if attrs.get("levels"):
        return [dict(level) for level in attrs["levels"]]
    keys = (
        "mpp_requested",
        "mpp_effective",
        "level_used",
        "level_mpp",
        "read_size",
        "tile_size",
        "stride",
        "tile_size_level0",
        "stride_level0",
        "reader",
        "tile_count",
    )
    return [{"index": 0, "path": "", **{k: attrs.get(k) for k in keys}}]


def find_level(attrs: Mapping[str, Any], mpp: float) -> dict[str, Any] | None:
    """The slide's level tiled for `mpp` µm/px (as `tile.mpp` asked for it), or None."""
    for level in slide_levels(attrs):
        asked = level.get("mpp_requested")
        if asked is not None and abs(float(asked) - float(mpp)) <= 1e-6 * max(abs(float(mpp)), 1e-12):
            return level
    return None


def format_mpps(values: Iterable[float]) -> str:
    return ", ".join(f"{v:g}" for v in sorted(set(values))) or "none"


def missing_level(root: Path, slide_id: str, attrs: Mapping[str, Any], mpp: float, key: str) -> TileStoreError:
    """The error for a slide that holds no tiles at `mpp` µm/px: names the level, the levels it has and the fix."""
    have = [float(lv["mpp_requested"]) for lv in slide_levels(attrs) if lv.get("mpp_requested") is not None]
    return TileStoreError(
        f"{key}={mpp:g}: slide {slide_id!r} in tile store {root} has no level at {mpp:g} µm/px (its levels: "
        f"{format_mpps(have)} µm/px); set {key} to one of those, or tile the store again with that level in "
        "tile.mpp (e.g. mpp=[" + ", ".join(f"{v:g}" for v in [*have, mpp]) + "])"
    )


def _tile_codecs(compressor: Compressor, level: int, jpeg_quality: int) -> dict[str, Any]:
    if compressor == "zstd":
        return {"compressors": zarr.codecs.ZstdCodec(level=level)}
    if compressor == "jpeg":
        return {"serializer": JpegCodec(quality=jpeg_quality), "compressors": None}
    if compressor == "none":
        return {"compressors": None}
    raise ValueError(f"unknown compressor {compressor!r}; use zstd, jpeg or none")


@dataclass(frozen=True)
class IncomingSlide:
    """A slide group being written under `.incoming/<slide_id>-<tag>`. Picklable: workers reopen arrays by path."""

    root: Path
    slide_id: str
    tag: str  # makes the folder unique per attempt
    n_tiles: int
    tiles_per_shard: int
    sub: str = ""  # a further µm/px level's group inside the slide's (`levels/<k>`); "" for the slide's own arrays
    path: Path = field(init=False)

    def __post_init__(self) -> None:
        path = incoming_dir(self.root, self.slide_id, self.tag)  # checked once, here
        object.__setattr__(self, "path", path / self.sub if self.sub else path)

    def tiles_array(self) -> zarr.Array:
        return zarr.open_array(str(self.path / "tiles"), mode="r+")

    def shard_ranges(self, shards_per_unit: int = 1) -> list[tuple[int, int]]:
        """Shard-aligned [start, stop) index ranges covering all tiles; one writer each."""
        step = self.tiles_per_shard * max(1, shards_per_unit)
        return [(a, min(a + step, self.n_tiles)) for a in range(0, self.n_tiles, step)]

    def write_tiles(self, start: int, tiles: np.ndarray, array: zarr.Array | None = None) -> None:
        if start % self.tiles_per_shard:
            raise ValueError(f"write at {start} is not shard-aligned (shard = {self.tiles_per_shard} tiles)")
        if len(tiles) > self.tiles_per_shard or (
            len(tiles) < self.tiles_per_shard and start + len(tiles) != self.n_tiles
        ):
            raise ValueError(
                f"a write covers whole shards: {len(tiles)} tiles at {start} (shard = {self.tiles_per_shard})"
            )
        direct = tile_encoder(self.path / "tiles") if array is None else None
        if direct is not None:  # the same bytes as zarr's, without its codec pipeline's per-chunk overhead
            encode, separator = direct
            write_shard(
                self.path / "tiles", start // self.tiles_per_shard, tiles, self.tiles_per_shard, encode, separator
            )
            return
        # Encode the whole shard's chunks in one batch: zarr's default batch of 1 doubles the write cost.
        with zarr.config.set({"codec_pipeline.batch_size": max(1, len(tiles))}):
            (array or self.tiles_array())[start : start + len(tiles)] = tiles


def begin_slide(
    root: Path,
    slide_id: str,
    *,
    n_tiles: int,
    tile_size: int,
    tiles_per_shard: int,
    compressor: Compressor = "zstd",
    compression_level: int = 3,
    jpeg_quality: int = 90,
    columns: Mapping[str, np.ndarray] | None = None,
    level_of: IncomingSlide | None = None,
    sub: str = "",
) -> IncomingSlide:
    """Create the slide's group under `.incoming/` with pre-sized arrays and the per-tile columns; with `level_of`
    (the slide's own incoming group) and `sub`, a further µm/px level's group inside it instead."""
    tag = uuid.uuid4().hex[:8] if level_of is None else level_of.tag
    shard = max(1, min(tiles_per_shard, max(n_tiles, 1)))
    slide = IncomingSlide(root, slide_id, tag, n_tiles, shard, sub if level_of is not None else "")
    if level_of is not None:
        parent = slide.path.parent
        if not (parent / "zarr.json").is_file():  # zarr v3 wants every group on the way down
            zarr.open_group(str(parent), mode="w", zarr_format=3)
    group = zarr.open_group(str(slide.path), mode="w", zarr_format=3)
    shard = slide.tiles_per_shard
    group.create_array(
        "tiles",
        shape=(n_tiles, tile_size, tile_size, 3),
        chunks=(1, tile_size, tile_size, 3),
        shards=(shard, tile_size, tile_size, 3),
        dtype="uint8",
        dimension_names=["tile", "y", "x", "c"],
        **_tile_codecs(compressor, compression_level, jpeg_quality),
    )
    for name, values in (columns or {}).items():
        values = np.asarray(values)
        if len(values) != n_tiles:
            raise ValueError(f"column {name!r} has {len(values)} rows for {n_tiles} tiles")
        dims = ["tile", "xy"] if values.ndim == 2 else ["tile"]
        arr = group.create_array(
            name,
            shape=values.shape,
            chunks=tuple(max(1, d) for d in values.shape),  # one chunk: readers load a slide's column at once
            dtype=values.dtype,
            dimension_names=dims,
        )
        if n_tiles:
            arr[...] = values
    return slide


def stored_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def commit_slide(incoming: IncomingSlide, attrs: Mapping[str, Any]) -> Path:
    """Mark the slide complete and move it into `slides/` atomically, replacing an older version if any."""
    final = slide_dir(incoming.root, incoming.slide_id)  # before anything is written: a bad id changes nothing
    group = zarr.open_group(str(incoming.path), mode="r+")
    tiles_bytes = stored_bytes(incoming.path / "tiles")
    group.attrs[ATTRS_KEY] = {
        **attrs,
        "slide_id": incoming.slide_id,
        "tile_count": incoming.n_tiles,
        "bytes_stored": tiles_bytes,
        "bytes_per_tile": round(tiles_bytes / incoming.n_tiles, 1) if incoming.n_tiles else 0.0,
        "created": utc_now(),
        "complete": True,
    }
    retired = None
    if final.exists():
        retired = incoming_dir(incoming.root, incoming.slide_id, f"retired-{uuid.uuid4().hex[:8]}")
        os.rename(final, retired)
    os.rename(incoming.path, final)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)
    return final


def set_group_attrs(path: Path, attrs: Mapping[str, Any]) -> None:
    """The `wsidino` attributes of a group inside a slide being written (a further µm/px level's)."""
    zarr.open_group(str(path), mode="r+").attrs[ATTRS_KEY] = dict(attrs)


def abandon_slide(incoming: IncomingSlide) -> None:
    shutil.rmtree(incoming.path, ignore_errors=True)


def remove_slide(root: Path, slide_id: str) -> None:
    """Drop a committed slide (its source changed and could not be re-tiled, so the old tiles are stale)."""
    final = slide_dir(root, slide_id)
    if final.exists():
        retired = incoming_dir(root, slide_id, f"stale-{uuid.uuid4().hex[:8]}")
        os.rename(final, retired)
        shutil.rmtree(retired, ignore_errors=True)


def read_manifest(root: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(root) / MANIFEST
    if not path.is_file():
        return {"slides": []}
    return json.loads(path.read_text())


def write_manifest(root: Path, entries: Sequence[Mapping[str, Any]], extra: Mapping[str, Any] | None = None) -> Path:
    """Write the store manifest atomically. Entries of slides not processed this run are kept."""
    previous = {e["slide_id"]: e for e in read_manifest(root).get("slides", [])}
    for entry in entries:
        previous[entry["slide_id"]] = dict(entry)
    payload = {
        "format": "tile-store-manifest",
        "version": STORE_FORMAT["version"],
        "updated": utc_now(),
        **(extra or {}),
        "slides": [previous[k] for k in sorted(previous)],
    }
    write_json_atomic(root / MANIFEST, payload)
    return root / MANIFEST
