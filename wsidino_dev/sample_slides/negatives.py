"""Bad inputs a slide reader must reject cleanly: a truncated slide and a text file with a slide extension.

The other two negative cases of a preset (`presets.py`) are ordinary writes: a generic TIFF without resolution tags
(no µm/px) and an SVS of blank glass (no tissue).
"""

from __future__ import annotations

from pathlib import Path

NOT_A_SLIDE_TEXT = (
    "This is not a slide. It is a plain-text file with a slide file extension, used to check that\n"
    "readers reject it with a clear error instead of crashing.\n"
)


def write_not_a_slide(path: Path) -> None:
    """Plain text under a slide file name: OpenSlide raises ``OpenSlideUnsupportedFormatError``."""
    path.write_text(NOT_A_SLIDE_TEXT)


def truncate(path: Path, fraction: float = 0.6) -> None:
    """Cut a file to `fraction` of its bytes, like an interrupted copy or download.

    tifffile writes each IFD just before its image data and level 0 holds most of the bytes, so a 60 % cut
    lands inside level 0's tiles: IFD 0 survives but points to a next IFD past the end of the file. OpenSlide
    4.0.1 walks the whole IFD chain when it opens a TIFF, so ``OpenSlide(path)`` raises
    ``OpenSlideUnsupportedFormatError`` (an ``OpenSlideError``); it never gets as far as reading tiles.
    Beware ``openslide.open_slide(path)``: it then falls back to PIL's ``ImageSlide``, which opens IFD 0
    lazily and only fails (or returns garbage) when it reaches the missing tiles. Readers should call
    ``OpenSlide`` directly and treat the error as a per-slide failure.
    """
    size = path.stat().st_size
    with path.open("r+b") as fh:
        fh.truncate(int(size * fraction))
