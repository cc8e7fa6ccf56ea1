"""Fast paths of the tile stage against the real thing: the direct TIFF reader (full and DCT-scaled JPEG decoding)
against tifffile, and direct shard writes against zarr.

Real SVS files store their JPEG tiles as abbreviated streams with the Huffman and quantisation tables once in the
JPEGTables tag; the file here is written that way, so the table splicing of the scaled decoder is exercised.
"""

from __future__ import annotations

import struct
from pathlib import Path

import imagecodecs
import numpy as np
import pytest
import tifffile
import zarr
from PIL import Image

from dinov3_core.tiling.tiff_reader import TiffLevelReader, UnsupportedTiff

W, H, T = 768, 512, 256


def _image() -> np.ndarray:
    yy, xx = np.mgrid[0:H, 0:W]
    img = np.zeros((H, W, 3), np.uint8)
    img[..., 0] = xx * 255 // W
    img[..., 1] = yy * 255 // H
    img[..., 2] = ((xx // 3 + yy // 5) % 32) * 8
    return img


def _split_tables(jpeg: bytes) -> tuple[bytes, bytes]:
    """A full JPEG → (tables-only stream, abbreviated stream without DQT/DHT), as Aperio writes them."""
    i, tables, rest = 2, b"", b""
    while True:
        marker = jpeg[i : i + 2]
        (length,) = struct.unpack(">H", jpeg[i + 2 : i + 4])
        segment = jpeg[i : i + 2 + length]
        if marker in (b"\xff\xdb", b"\xff\xc4"):
            tables += segment
        else:
            rest += segment
        i += 2 + length
        if marker == b"\xff\xda":  # start of scan: entropy-coded data follows
            return b"\xff\xd8" + tables + b"\xff\xd9", b"\xff\xd8" + rest + jpeg[i:]


@pytest.fixture(scope="module")
def abbreviated_tiff(tmp_path_factory) -> Path:
    img = _image()
    tiles, tables = [], b""
    for ty in range(0, H, T):
        for tx in range(0, W, T):
            full = imagecodecs.jpeg_encode(
                img[ty : ty + T, tx : tx + T], level=90, colorspace="RGB", outcolorspace="YCBCR", subsampling=(2, 2)
            )
            tables, abbreviated = _split_tables(full)
            tiles.append(abbreviated)
    path = tmp_path_factory.mktemp("tiff") / "abbreviated.tif"
    tifffile.imwrite(
        path,
        data=iter(tiles),
        shape=(H, W, 3),
        dtype="uint8",
        tile=(T, T),
        compression="jpeg",
        photometric="ycbcr",
        subsampling=(2, 2),
        extratags=[(347, 7, len(tables), tables, True)],
    )
    with tifffile.TiffFile(path) as tif:
        assert tif.pages[0].jpegtables is not None  # the file really is abbreviated
    return path


def test_full_decode_matches_tifffile(abbreviated_tiff):
    reader = TiffLevelReader(abbreviated_tiff, (W, H))
    expected = tifffile.imread(abbreviated_tiff)
    np.testing.assert_array_equal(reader.read(0, 0, W, H), expected)
    np.testing.assert_array_equal(reader.read(100, 37, 300, 200), expected[37:237, 100:400])
    reader.close()


@pytest.mark.parametrize("reduce", [2, 4])
def test_scaled_decode_is_close_to_full_decode_and_box_average(abbreviated_tiff, reduce):
    full = TiffLevelReader(abbreviated_tiff, (W, H)).read(0, 0, W, H)
    scaled = TiffLevelReader(abbreviated_tiff, (W, H), reduce)
    box = np.asarray(Image.fromarray(full).reduce(reduce))
    region = scaled.read(0, 0, W // reduce, H // reduce)
    assert region.shape == box.shape
    diff = np.abs(region.astype(int) - box)
    assert diff.mean() < 2.5, diff.mean()
    # A region across tile borders is the same pixels as the whole image's.
    np.testing.assert_array_equal(scaled.read(50, 20, 100, 60), region[20:80, 50:150])
    # Outside the image is white, as in full decoding.
    assert (scaled.read(W // reduce - 4, 0, 8, 8)[:, 4:] == 255).all()


def test_scaled_decode_refuses_what_it_cannot_do(abbreviated_tiff, tmp_path):
    with pytest.raises(UnsupportedTiff, match="reduces by"):
        TiffLevelReader(abbreviated_tiff, (W, H), 3)
    lossless = tmp_path / "zlib.tif"
    tifffile.imwrite(lossless, _image(), tile=(T, T), compression="zlib")
    with pytest.raises(UnsupportedTiff, match="YCbCr JPEG"):
        TiffLevelReader(lossless, (W, H), 2)
    TiffLevelReader(lossless, (W, H)).close()  # full decoding still reads it


# ------------------------------------------------------------------------------------- direct shard writes


@pytest.mark.parametrize("compressor", ["jpeg", "zstd", "none"])
def test_direct_shard_writes_are_byte_identical_to_zarr(tmp_path, compressor):
    """`IncomingSlide.write_tiles` writes shard files itself; zarr writing the same tiles gives the same bytes,
    and plain zarr reads them back (a full shard and a short last one)."""
    from dinov3_core.tiling import store as ts

    rng = np.random.default_rng(3)
    tiles = (_image()[None, :64, :64] // 2 + rng.integers(1, 64, (10, 64, 64, 3), dtype=np.uint8)).astype(np.uint8)
    root = ts.init_store(tmp_path / "t.zarr")
    made = {}
    for how in ("direct", "zarr"):
        incoming = ts.begin_slide(
            root,
            how,
            n_tiles=10,
            tile_size=64,
            tiles_per_shard=4,
            compressor=compressor,
            compression_level=1,
            jpeg_quality=90,
        )
        array = None if how == "direct" else incoming.tiles_array()
        for a, b in incoming.shard_ranges():
            incoming.write_tiles(a, tiles[a:b], array)
        made[how] = incoming
    for shard in range(3):
        direct, by_zarr = (made[h].path / "tiles" / "c" / str(shard) / "0" / "0" / "0" for h in ("direct", "zarr"))
        assert direct.read_bytes() == by_zarr.read_bytes(), shard
    back = zarr.open_array(str(made["direct"].path / "tiles"), mode="r")[:]
    if compressor == "jpeg":  # lossy (and noisy tiles are JPEG's worst case): the same pixels as zarr's own
        np.testing.assert_array_equal(back, zarr.open_array(str(made["zarr"].path / "tiles"), mode="r")[:])
    else:
        np.testing.assert_array_equal(back, tiles)
    with pytest.raises(ValueError, match="whole shards"):
        made["direct"].write_tiles(0, tiles[:3])
