"""A zarr v3 JPEG codec for RGB tiles (the lossy option for large cohorts).

Registered under the name `wsidino.jpeg`, both on import and through the `zarr.codecs` entry point, so any
environment with wsidino installed reads JPEG tile stores with plain `zarr.open`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

import imagecodecs
import zarr.registry
from zarr.abc.codec import ArrayBytesCodec
from zarr.core.array_spec import ArraySpec
from zarr.core.buffer import Buffer, NDBuffer
from zarr.core.common import parse_named_configuration

CODEC_NAME = "wsidino.jpeg"


@dataclass(frozen=True)
class JpegCodec(ArrayBytesCodec):
    """Encodes each chunk — one (1, H, W, 3) uint8 tile — as a baseline JPEG."""

    is_fixed_size = False
    quality: int = 90

    def __post_init__(self) -> None:
        if not 1 <= self.quality <= 100:
            raise ValueError(f"JPEG quality must be in 1..100, got {self.quality}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        _, config = parse_named_configuration(data, CODEC_NAME, require_configuration=False)
        return cls(**(config or {}))

    def to_dict(self) -> dict[str, Any]:
        return {"name": CODEC_NAME, "configuration": {"quality": self.quality}}

    def validate(self, *, shape: tuple[int, ...], dtype: Any, chunk_grid: Any) -> None:
        chunk_shape = getattr(chunk_grid, "chunk_shape", None)
        if len(shape) != 4 or shape[-1] != 3 or (chunk_shape is not None and chunk_shape[0] != 1):
            raise ValueError("the JPEG codec needs (N, H, W, 3) arrays chunked one tile per chunk")

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        tile = imagecodecs.jpeg_decode(chunk_bytes.as_numpy_array())
        return chunk_spec.prototype.nd_buffer.from_numpy_array(tile.reshape(chunk_spec.shape))

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        tile = chunk_array.as_numpy_array()
        encoded = imagecodecs.jpeg_encode(tile.reshape(tile.shape[-3:]), level=self.quality)
        return chunk_spec.prototype.buffer.from_bytes(encoded)

    def compute_encoded_size(self, input_byte_length: int, chunk_spec: ArraySpec) -> int:
        raise NotImplementedError("JPEG output size is data-dependent")


zarr.registry.register_codec(CODEC_NAME, JpegCodec)
