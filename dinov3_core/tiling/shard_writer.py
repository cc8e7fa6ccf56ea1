"""Writing a shard of tiles straight to its file, in the zarr v3 sharding layout zarr itself writes.

zarr encodes a shard's 256 inner chunks through its async codec pipeline, which costs about as much again as the
encoding itself (docs/benchmarks.md, tile stage); next to the per-tile decoding that overhead decided the tile
stage's speed. This writes the same bytes: each tile encoded
exactly as the array's codecs would (JPEG: `wsidino.jpeg`; zstd: numcodecs' Zstd after the little-endian bytes
codec; none: the raw bytes), concatenated, then the index of (offset, nbytes) little-endian uint64 pairs and its
crc32c (spec: zarr-specs codecs/sharding-indexed, index at the end). Tests check the file is byte-identical to
zarr's own and reads back with plain zarr. The array's metadata is still created by zarr (`store.begin_slide`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import imagecodecs
import numcodecs
import numpy as np

EMPTY = np.uint64(2**64 - 1)  # index entry of a chunk that is not stored


def tile_encoder(array_path: Path) -> tuple[Callable[[np.ndarray], bytes], str] | None:
    """(encoder, chunk-key separator) for the tile array at `array_path`, or None where its layout is not the
    one-tile-per-chunk sharded layout this writer produces (then zarr writes it)."""
    meta = json.loads((array_path / "zarr.json").read_text())
    try:
        (sharding,) = meta["codecs"]
        config = sharding["configuration"]
        inner = config["codecs"]
        key_encoding = meta["chunk_key_encoding"]
        ok = (
            sharding["name"] == "sharding_indexed"
            and config.get("index_location", "end") == "end"
            and [c["name"] for c in config["index_codecs"]] == ["bytes", "crc32c"]
            and int(config["chunk_shape"][0]) == 1
            and key_encoding["name"] == "default"
            and meta["data_type"] == "uint8"
        )
    except (KeyError, TypeError, ValueError):
        return None
    if not ok:
        return None
    names = [c["name"] for c in inner]
    separator = key_encoding.get("configuration", {}).get("separator", "/")
    if names == ["wsidino.jpeg"]:
        quality = int(inner[0].get("configuration", {}).get("quality", 90))
        return (lambda tile: imagecodecs.jpeg_encode(tile, level=quality)), separator
    if names == ["bytes", "zstd"]:
        cfg = inner[1].get("configuration", {})
        zstd = numcodecs.Zstd(level=int(cfg.get("level", 0)), checksum=bool(cfg.get("checksum", False)))
        return (lambda tile: bytes(zstd.encode(np.ascontiguousarray(tile)))), separator
    if names == ["bytes"]:
        return (lambda tile: np.ascontiguousarray(tile).tobytes()), separator
    return None


def write_shard(
    array_path: Path,
    shard: int,
    tiles: np.ndarray,
    tiles_per_shard: int,
    encode: Callable[[np.ndarray], bytes],
    separator: str,
) -> None:
    """Write tiles (n ≤ tiles_per_shard, T, T, 3) as shard `shard` of the array; rows past n stay unstored."""
    index = np.full((tiles_per_shard, 2), EMPTY, dtype="<u8")
    chunks, offset = [], 0
    for i, tile in enumerate(tiles):
        data = encode(tile)
        index[i] = (offset, len(data))
        chunks.append(data)
        offset += len(data)
    raw_index = index.tobytes()
    path = array_path / separator.join(("c", str(shard), "0", "0", "0"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.writelines(chunks)
        f.write(raw_index)
        f.write(google_crc32c.value(raw_index).to_bytes(4, "little"))
