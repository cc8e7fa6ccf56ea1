"""QC pictures: what a pathologist looks at to trust the tiling of a slide."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from scipy import ndimage

from dinov3_core.tiling.plan import SlidePlan

TISSUE_CONTOUR = (0, 200, 0)
TILE_OUTLINE = (30, 90, 255)
DROPPED_OUTLINE = (255, 140, 0)
PEN_TINT = (255, 0, 255)


def _fit(image: np.ndarray, max_side: int) -> tuple[Image.Image, float]:
    img = Image.fromarray(image)
    factor = min(1.0, max_side / max(img.size))
    if factor < 1.0:
        img = img.resize((max(1, round(img.width * factor)), max(1, round(img.height * factor))), Image.Resampling.BOX)
    return img, factor


LEGEND = (
    ("tissue contour", TISSUE_CONTOUR),
    ("pen ink", PEN_TINT),
    ("kept tile", TILE_OUTLINE),
    ("dropped by a QC filter", DROPPED_OUTLINE),
)


def pen_label(pen_filter: bool | None) -> str:
    """The pen entry of the legend: ink is never tissue (the tissue mask cuts it out); the pen filter, when on, also
    drops the tiles more than `filters.pen_max_fraction` inked."""
    if pen_filter is None:
        return "pen ink (not tissue)"
    return f"pen ink (not tissue; pen filter {'on' if pen_filter else 'off'})"


def with_legend(picture: Image.Image, entries: tuple[tuple[str, tuple[int, int, int]], ...]) -> Image.Image:
    """The picture with a white strip below it: a colour swatch and a label per entry."""
    width = max(picture.width, sum(24 + 7 * len(label) for label, _ in entries))
    out = Image.new("RGB", (width, picture.height + 18), (255, 255, 255))
    out.paste(picture, (0, 0))
    draw, x = ImageDraw.Draw(out), 4
    for label, colour in entries:
        draw.rectangle((x, picture.height + 4, x + 10, picture.height + 14), fill=colour)
        draw.text((x + 14, picture.height + 3), label, fill=(0, 0, 0))
        x += 24 + 7 * len(label)
    return out


QC_PICTURES = {"thumbnail": "qc_thumbnail.png", "mask": "qc_mask.png"}  # names in the slide's folder


def save_qc_pictures(out_dir: Path, picture: Image.Image, tissue: np.ndarray) -> dict[str, str]:
    """Save a slide's QC picture (`draw_qc_picture`) and its tissue mask."""
    out_dir.mkdir(parents=True, exist_ok=True)
    thumb_path = out_dir / QC_PICTURES["thumbnail"]
    mask_path = out_dir / QC_PICTURES["mask"]
    picture.save(thumb_path, optimize=False)
    Image.fromarray(tissue.astype(np.uint8) * 255).save(mask_path)
    return {"thumbnail": thumb_path.name, "mask": mask_path.name}


def draw_qc_picture(
    plan: SlidePlan, max_side: int = 1024, title: str = "", pen_filter: bool | None = None
) -> tuple[Image.Image, tuple[tuple[str, tuple[int, int, int]], ...]]:
    """The QC picture of a slide's tiling and its legend entries, over `plan.qc_image`: tissue contour green, pen
    ink tinted magenta, kept tiles blue, tiles dropped by QC filters orange; the legend names only what is drawn on
    this slide."""
    image, image_scale, tissue, pen = plan.qc_image, plan.qc_scale, plan.tissue_mask, plan.pen_mask
    kept_coords, dropped_coords = plan.coords, plan.dropped_coords
    tile_level0 = plan.read.tile_size_level0
    img, factor = _fit(image, max_side)
    overlay = np.asarray(img).copy()
    nearest = Image.Resampling.NEAREST
    small_tissue = np.asarray(Image.fromarray(tissue.astype(np.uint8) * 255).resize(img.size, nearest)) > 127
    small_pen = np.asarray(Image.fromarray(pen.astype(np.uint8) * 255).resize(img.size, nearest)) > 127
    overlay[small_pen] = (0.5 * overlay[small_pen] + 0.5 * np.array(PEN_TINT)).astype(np.uint8)
    contour = small_tissue & ~ndimage.binary_erosion(small_tissue, iterations=2)
    overlay[contour] = TISSUE_CONTOUR
    picture = Image.fromarray(overlay)
    draw = ImageDraw.Draw(picture)
    px = factor / image_scale  # picture px per level-0 px
    side = max(1.0, tile_level0 * px)
    for coords, colour in ((kept_coords, TILE_OUTLINE), (dropped_coords, DROPPED_OUTLINE)):
        for x, y in coords:
            x0, y0 = x * px, y * px
            draw.rectangle((x0, y0, x0 + side - 1, y0 + side - 1), outline=colour)
    if title:
        draw.rectangle((0, 0, min(picture.width, 8 * len(title) + 8), 14), fill=(255, 255, 255))
        draw.text((4, 1), title, fill=(0, 0, 0))
    drawn = {
        TISSUE_CONTOUR: contour.any(),
        PEN_TINT: small_pen.any(),
        TILE_OUTLINE: len(kept_coords) > 0,
        DROPPED_OUTLINE: len(dropped_coords) > 0,
    }
    entries = tuple(
        (pen_label(pen_filter) if colour == PEN_TINT else label, colour) for label, colour in LEGEND if drawn[colour]
    )
    return with_legend(picture, entries), entries
