"""Reading one slide's ``tiles`` array: straight from the tile writer's shard files, or through zarr.

Through zarr-python 3.1 a single tile costs far more CPU than its decoding (docs/benchmarks.md, tile dataset), mostly
hand-offs between its event loop and thread pool (shard index read, chunk read and decode are each one), and
an integer-array (orthogonal) selection on a sharded array is slower still: inside a shard it becomes a
per-element coordinate selection. So `ShardFileTiles` reads tiles straight from the shard files when the
``tiles`` array has exactly the layout the tile writer produces (zarr v3 ``sharding_indexed``, one tile per
inner chunk, index at the end with crc32c, inner codec zstd / none / ``wsidino.jpeg``): one ``pread`` of the
shard index (crc-checked), one of the chunk, one decode per tile. Any other layout goes through
`ZarrTiles`, where batches are fetched as slices of consecutive rows. Both return identical pixels (tested tile
by tile), including zarr's fill value for chunks that were not stored. Readers hold no open file between reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import google_crc32c
import imagecodecs
import numcodecs
import numpy as np
import zarr

from dinov3_core.tiling import store as ts

__all__ = ["ShardFileTiles", "TileReader", "ZarrTiles"]

EMPTY_CHUNK = 2**64 - 1  # zarr sharding: (offset, nbytes) of a chunk that was not stored (all fill value)
_ZSTD = numcodecs.Zstd()  # stateless: a decompression context is made per call


class TileReader(Protocol):
    def read(self, row: int) -> np.ndarray: ...

    def read_rows(self, rows: np.ndarray, out: np.ndarray, dest: np.ndarray) -> None:
        """Write tile `rows[k]` to `out[dest[k]]`; `rows` ascending and distinct."""
        ...


class ZarrTiles:
    """Tiles through zarr: any layout zarr can read."""

    def __init__(self, array: zarr.Array) -> None:
        self.array = array

    def read(self, row: int) -> np.ndarray:
        return np.asarray(self.array[row])

    def read_rows(self, rows: np.ndarray, out: np.ndarray, dest: np.ndarray) -> None:
        # Runs of consecutive rows are read as one slice each: zarr 3.1 turns an integer-array selection on a
        # sharded array into a per-element coordinate selection inside the shard, far slower per tile.
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        for run, where in zip(np.split(rows, breaks), np.split(dest, breaks), strict=True):
            out[where] = self.array[int(run[0]) : int(run[-1]) + 1]


@dataclass(frozen=True)
class ShardFileTiles:
    """Tiles read straight from shard files laid out exactly as the tile writer lays them out.

    zarr v3 sharding (spec: zarr-specs codecs/sharding-indexed): shard k of `tiles` holds rows k·S … k·S+S-1,
    one (1, T, T, 3) chunk each; the file ends with the index, S little-endian uint64 (offset, nbytes) pairs
    followed by their crc32c. A chunk that holds only the fill value is not stored ((2⁶⁴-1, 2⁶⁴-1)), and a
    shard with no stored chunk has no file: both read as the fill value, as with zarr.
    """

    path: Path
    tiles_per_shard: int
    tile_size: int
    separator: str
    codec: Literal["zstd", "none", "jpeg"]
    fill_value: int

    @classmethod
    def open(cls, path: Path) -> ShardFileTiles | None:
        """The reader for the array at `path`, or None when its layout is not the one this reader knows."""
        try:
            meta = json.loads((path / "zarr.json").read_text())
            shape = [int(n) for n in meta["shape"]]
            shard = [int(n) for n in meta["chunk_grid"]["configuration"]["chunk_shape"]]
            key_encoding = meta["chunk_key_encoding"]
            (sharding,) = meta["codecs"]
            config = sharding["configuration"]
            inner = [c["name"] for c in config["codecs"]]
            index_codecs = config["index_codecs"]
            fill_value = int(meta["fill_value"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        t = shape[1] if len(shape) == 4 else -1
        codec = {("bytes", "zstd"): "zstd", ("bytes",): "none", ("wsidino.jpeg",): "jpeg"}.get(tuple(inner))
        known = (
            meta.get("data_type") == "uint8"
            and shape[1:] == [t, t, 3]
            and shard[1:] == [t, t, 3]
            and sharding.get("name") == "sharding_indexed"
            and [int(n) for n in config["chunk_shape"]] == [1, t, t, 3]
            and config.get("index_location", "end") == "end"
            and [c["name"] for c in index_codecs] == ["bytes", "crc32c"]
            and index_codecs[0].get("configuration", {}).get("endian", "little") == "little"
            and key_encoding.get("name") == "default"
            and not meta.get("storage_transformers")
            and codec is not None
        )
        if not known:
            return None
        separator = key_encoding.get("configuration", {}).get("separator", "/")
        return cls(path, shard[0], t, separator, codec, fill_value)  # type: ignore[arg-type]

    def _shard_file(self, shard: int) -> Path:
        return self.path / self.separator.join(("c", str(shard), "0", "0", "0"))

    def read(self, row: int) -> np.ndarray:
        out = np.empty((1, self.tile_size, self.tile_size, 3), dtype=np.uint8)
        self.read_rows(np.array([row]), out, np.zeros(1, dtype=np.int64))
        return out[0]

    def read_rows(self, rows: np.ndarray, out: np.ndarray, dest: np.ndarray) -> None:
        # Rows come sorted, so each shard file is opened once and its index read once.
        shards = rows // self.tiles_per_shard
        breaks = np.flatnonzero(np.diff(shards)) + 1
        for run, where in zip(np.split(rows, breaks), np.split(dest, breaks), strict=True):
            shard = int(run[0]) // self.tiles_per_shard
            path = self._shard_file(shard)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                out[where] = self.fill_value
                continue
            try:
                index = self._read_index(fd, path)
                for row, d in zip(run.tolist(), where.tolist(), strict=True):
                    offset, nbytes = index[row - shard * self.tiles_per_shard].tolist()
                    if offset == EMPTY_CHUNK and nbytes == EMPTY_CHUNK:
                        out[d] = self.fill_value
                    else:
                        out[d] = self._decode(os.pread(fd, nbytes, offset), path, row)
            finally:
                os.close(fd)

    def _read_index(self, fd: int, path: Path) -> np.ndarray:
        size = self.tiles_per_shard * 16
        end = os.fstat(fd).st_size
        raw = os.pread(fd, size + 4, end - size - 4) if end >= size + 4 else b""
        if len(raw) != size + 4 or google_crc32c.value(raw[:size]).to_bytes(4, "little") != raw[size:]:
            raise ts.TileStoreError(
                f"corrupt shard {path}: its chunk index is truncated or fails its checksum; re-tile the slide"
            )
        return np.frombuffer(raw[:size], dtype="<u8").reshape(-1, 2)

    def _decode(self, data: bytes, path: Path, row: int) -> np.ndarray:
        t = self.tile_size
        if self.codec == "jpeg":
            tile = imagecodecs.jpeg_decode(data)
        elif self.codec == "zstd":
            tile = np.frombuffer(_ZSTD.decode(data), dtype=np.uint8)
        else:
            tile = np.frombuffer(data, dtype=np.uint8)
        if tile.size != t * t * 3:
            raise ts.TileStoreError(f"corrupt tile {row} in {path}: it decodes to {tile.size} bytes, not {t}×{t}×3")
        return tile.reshape(t, t, 3)
