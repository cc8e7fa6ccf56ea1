"""`TissueCanvas`: a synthetic slide image (glass, tissue sections, a pen mark) planned up front, rendered lazily.

Slides of any size are rendered strip by strip (`TissueCanvas.rows`), so a writer streaming them holds a few
strips at a time, never a full-resolution copy.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import numpy as np
from scipy import ndimage

from wsidino_dev.sample_slides.fields import (
    PenStroke,
    Region,
    bezier,
    distance_like,
    layout_cells,
    random_layer,
    region_field,
    smooth_noise,
    upsample,
)
from wsidino_dev.sample_slides.texture import ATLAS_VARIANTS, TEXTURE_MPP, SlideStain, tissue_atlas

# Coarse grid (longest side, px) on which tissue shapes, stain density and the pen stroke are planned. Fields
# are bilinearly upsampled per strip, so shapes stay smooth at any slide size while planning stays cheap.
PLAN_GRID_PX = 1024
# Budget for the float32 work buffer of one rendered strip (rows × width × 3 × 4 bytes): bounds peak memory
# whatever the slide width. Strips are a whole number of tiles high (hence of every pyramid factor used).
STRIP_BYTES = 48 * 2**20

# Width (full-resolution px) over which marker ink fades out at the stroke's edge.
PEN_EDGE_PX = 6.0
# Tissue opacity ramps from 0 to 1 while a section's shape field rises from 0 to SHAPE_RAMP (faint thin edges); the
# annotated outline is where it is half way (half the piece's opacity).
SHAPE_RAMP = 0.08
TISSUE_EDGE_LEVEL = SHAPE_RAMP / 2
# Width (full-resolution px) of the cross-fades between class textures, centred on the annotated boundaries:
# epithelium meets stroma, and tumour meets squamous epithelium, at a sharp interface.
CLASS_EDGE_PX = 4.0
# Class areas within a section: correlation length of their fields (fraction of the section's short side), the
# share of stroma in the section and of tumour in its epithelium.
CLASS_SCALE = 0.2
STROMA_SHARE = (0.28, 0.4)
TUMOUR_SHARE = (0.4, 0.6)

GLASS_RGB = (242.0, 240.0, 244.0)  # clean glass + mounting medium as bright-field scanners render it
INK_RGB: dict[str, tuple[int, int, int]] = {
    "blue": (30, 60, 185),
    "green": (25, 125, 70),
    "black": (35, 35, 42),
}


class ImageSource(Protocol):
    """Anything that can hand out full-width row strips of an RGB uint8 image (a `TissueCanvas`)."""

    @property
    def shape(self) -> tuple[int, int, int]: ...

    def rows(self, y0: int, y1: int) -> np.ndarray: ...


def strip_rows(width: int, multiple: int) -> int:
    """Rows per rendered strip: within `STRIP_BYTES` of float32 work buffer, a multiple of `multiple`."""
    return max(multiple, STRIP_BYTES // (width * 3 * 4) // multiple * multiple)


class TissueCanvas:
    """A synthetic slide image planned up front and rendered lazily, strip by strip.

    All randomness is drawn in `plan`, so rendering is deterministic and strips can be produced in any order.
    Use `rows(y0, y1)` to stream (it satisfies `ImageSource`), `to_array()` for a materialised image.
    """

    def __init__(
        self,
        height: int,
        width: int,
        *,
        scale: int,
        glass_row: np.ndarray,
        vignette_y: np.ndarray,
        noise: np.ndarray,
        atlas: tuple[np.ndarray, ...],
        regions: list[Region],
        pen: PenStroke | None,
    ) -> None:
        self.height, self.width = height, width
        self._scale = scale  # full-res px per coarse planning cell
        self._glass_row = glass_row  # (width * 3,) glass colour × horizontal vignetting, interleaved RGB
        self._vignette_y = vignette_y  # (height,) vertical vignetting factor
        self._noise = noise  # (P, width * 3) sensor-noise rows, reused with period P
        self._atlas = atlas  # per class (CLASS_NAMES order): (S, S, 3) uint8 periodic texture shared by all pieces
        self._regions = regions
        self._pen = pen

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, 3)

    @property
    def scale(self) -> int:
        """Full-resolution px per cell of the coarse planning grid."""
        return self._scale

    @property
    def regions(self) -> tuple[Region, ...]:
        """The tissue sections (coarse fields; what `annotations` outlines)."""
        return tuple(self._regions)

    @property
    def pen(self) -> PenStroke | None:
        return self._pen

    def labels(self, y0: int, y1: int) -> np.ndarray:
        """Class of every pixel in rows [y0, y1), (rows, width) int8: the index in `CLASS_NAMES`, -1 for glass
        and ink. Decided from the same fields, at the same thresholds, as `rows` renders and the annotations
        outline: inside the tissue outline (half opacity), outside the ink."""
        y0, y1 = max(0, y0), min(self.height, y1)
        out = np.full((y1 - y0, self.width), -1, np.int8)
        for region in self._regions:
            top, bottom = max(y0, region.y0), min(y1, region.y1)
            if top >= bottom:
                continue
            local = ((top - region.y0, bottom - region.y0), (0, region.x1 - region.x0))
            tissue = upsample(region.shape_field, self._scale, *local) > TISSUE_EDGE_LEVEL
            epithelium = upsample(region.epithelium, self._scale, *local) > 0
            tumour = upsample(region.tumour, self._scale, *local) > 0
            label = np.where(epithelium, np.where(tumour, 0, 1), 2).astype(np.int8)
            window = out[top - y0 : bottom - y0, region.x0 : region.x1]
            np.copyto(window, label, where=tissue)
        pen = self._pen
        if pen is not None:
            top, bottom = max(y0, pen.rows[0]), min(y1, pen.rows[1])
            if top < bottom:
                ink = upsample(pen.distance, self._scale, (top, bottom), pen.cols) * self._scale < PEN_EDGE_PX / 2
                out[top - y0 : bottom - y0, pen.cols[0] : pen.cols[1]][ink] = -1
        return out

    @classmethod
    def plan(
        cls,
        height: int,
        width: int,
        *,
        rng: np.random.Generator,
        mpp: float = 0.25,
        tissue: bool = True,
        pen_mark: bool = True,
        pen_color: Literal["blue", "green", "black"] | None = None,
        tissue_fraction: tuple[float, float] = (0.25, 0.4),
        stain: SlideStain | None = None,
    ) -> TissueCanvas:
        """Draw the layout: glass tint and vignetting, tissue sections, stain density, one pen stroke.

        `mpp` sets the texture scale (the source images are taken as `TEXTURE_MPP` µm/px), so slides at different
        µm/px show cells of the same physical size. `tissue_fraction` is the target range of tissue area. `stain`:
        this slide's H&E instead of a drawn one (the draw is still made, so the rest of the slide does not change).
        """
        if height < 64 or width < 64:
            raise ValueError(f"canvas must be at least 64×64 px, got {height}×{width}")
        scale = max(1, math.ceil(max(height, width) / PLAN_GRID_PX))
        hc, wc = math.ceil(height / scale), math.ceil(width / scale)

        # Glass: slightly tinted white, darker towards the corners (uneven illumination), fine sensor noise.
        # Vignetting is separable (vy × vx), so a strip costs one outer product. Noise comes from a (prime)
        # 127-row table reused down the slide: drawing 10^9 normals would dominate generation time, and a
        # repeat period of 127 px at an amplitude of ~1 grey level is invisible.
        glass = np.array(GLASS_RGB, np.float32) + rng.uniform(-3, 3, 3).astype(np.float32)
        strength = rng.uniform(0.015, 0.03)
        vy = 1 - strength * np.linspace(-1, 1, height, dtype=np.float32) ** 2
        vx = 1 - strength * np.linspace(-1, 1, width, dtype=np.float32) ** 2
        glass_row = (vx[:, None] * glass[None, :]).ravel()
        noise = np.round(rng.normal(0, 1.0, (127, width * 3))).astype(np.float32)

        regions: list[Region] = []
        atlas: tuple[np.ndarray, ...] = ()  # blank glass needs no texture
        if tissue:
            # This slide's H&E (stain strength and hue, as between labs and staining runs) and the scanner's
            # colour cast, shared by all its pieces. The stain comes from a child stream (`spawn` leaves `rng`
            # where it was): how a slide is stained never moves its tissue, classes or pen mark.
            drawn = SlideStain.draw(rng.spawn(1)[0])
            stain = drawn if stain is None else stain
            atlas, atlas_mean = tissue_atlas(int(rng.integers(ATLAS_VARIANTS)), TEXTURE_MPP / mpp, stain)
            slide_tint = rng.uniform(0.96, 1.04, 3) * rng.uniform(0.95, 1.03)
            fields = []
            for y0, x0, y1, x1 in layout_cells(hc, wc, rng):
                # Gaps between sections: shrink each cell by a random margin.
                gy = round((y1 - y0) * rng.uniform(0.03, 0.08))
                gx = round((x1 - x0) * rng.uniform(0.03, 0.08))
                box = (y0 + gy, x0 + gx, y1 - gy, x1 - gx)
                fields.append((box, region_field(box[2] - box[0], box[3] - box[1], rng)))
            # Shift the shared threshold so the tissue area lands in the requested fraction of the canvas;
            # bounded, so blobs keep their character when the target cannot be met.
            target = rng.uniform(*tissue_fraction) * hc * wc
            values = np.sort(np.concatenate([f.ravel() for _, f in fields]))[::-1]
            threshold = float(np.clip(values[int(min(target, values.size - 1))], -0.25, 0.5))
            for (cy0, cx0, cy1, cx1), shape_field in fields:
                ch, cw = shape_field.shape
                # Stain density varies at the scale of the whole piece (denser and paler areas).
                density = np.clip(0.85 + 0.15 * smooth_noise((ch, cw), min(ch, cw) / 4, rng), 0.55, 1.0)
                epithelium, tumour = cls._plan_classes(shape_field - threshold, rng)
                # Per-piece colour variation (hue via per-channel tint, brightness, saturation), cheap enough
                # to apply while rendering: tex·gain + bias = tint·(mean + saturation·(tex − mean)).
                tint = slide_tint * rng.uniform(0.96, 1.04, 3) * rng.uniform(0.95, 1.03)
                saturation = rng.uniform(0.85, 1.15)
                regions.append(
                    Region(
                        y0=cy0 * scale,
                        x0=cx0 * scale,
                        y1=min(cy1 * scale, height),
                        x1=min(cx1 * scale, width),
                        shape_field=(shape_field - threshold).astype(np.float32),
                        density=density.astype(np.float32),
                        gain=(tint * saturation).astype(np.float32),
                        bias=(tint * (1 - saturation) * atlas_mean).astype(np.float32),
                        layer=random_layer(rng),
                        epithelium=epithelium,
                        tumour=tumour,
                    )
                )

        pen = None
        if pen_mark:
            pen = cls._plan_pen(hc, wc, scale, height, width, regions, rng, pen_color)
        return cls(
            height,
            width,
            scale=scale,
            glass_row=glass_row,
            vignette_y=vy,
            noise=noise,
            atlas=atlas,
            regions=regions,
            pen=pen,
        )

    @staticmethod
    def _plan_classes(shape: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Where a section is stroma, tumour and squamous epithelium: two smooth fields cut at quantiles of the tissue.

        Both are blobby at a fifth of the section's size, so each class forms a few contiguous areas (epithelium in
        stroma, tumour growing within the epithelium); returned as `distance_like` fields, > 0 for epithelium and,
        within it, for tumour.
        """
        ch, cw = shape.shape
        inside = shape > TISSUE_EDGE_LEVEL
        small = min(ch, cw)

        def field() -> np.ndarray:  # blobs with wavy outlines
            return smooth_noise((ch, cw), CLASS_SCALE * small, rng) + 0.3 * smooth_noise((ch, cw), small / 25, rng)

        epithelium, tumour = field(), field()
        if inside.any():
            epithelium -= np.quantile(epithelium[inside], rng.uniform(*STROMA_SHARE))
            in_epithelium = inside & (epithelium > 0)
            if in_epithelium.any():
                tumour -= np.quantile(tumour[in_epithelium], 1 - rng.uniform(*TUMOUR_SHARE))
        return distance_like(epithelium), distance_like(tumour)

    @staticmethod
    def _plan_pen(
        hc: int,
        wc: int,
        scale: int,
        height: int,
        width: int,
        regions: list[Region],
        rng: np.random.Generator,
        pen_color: str | None,
    ) -> PenStroke:
        """A thick, slightly wavy marker stroke entering from one edge and crossing part of a tissue piece."""
        from skimage.draw import disk

        colour = pen_color or str(rng.choice(list(INK_RGB)))
        if colour not in INK_RGB:
            raise ValueError(f"pen_color must be one of {sorted(INK_RGB)}, got {pen_color!r}")
        if regions:
            target_region = regions[int(rng.integers(len(regions)))]
            ty = (target_region.y0 + target_region.y1) / 2 / scale
            tx = (target_region.x0 + target_region.x1) / 2 / scale
        else:
            ty, tx = hc / 2, wc / 2
        # Start just outside the left or top edge, end 55–75 % of the way across, passing over the target.
        if rng.random() < 0.5:
            start = np.array([rng.uniform(0.15, 0.85) * hc, -0.02 * wc])
            end = np.array([rng.uniform(0.2, 0.8) * hc, rng.uniform(0.55, 0.75) * wc])
        else:
            start = np.array([-0.02 * hc, rng.uniform(0.15, 0.85) * wc])
            end = np.array([rng.uniform(0.55, 0.75) * hc, rng.uniform(0.2, 0.8) * wc])
        through = np.array([ty, tx]) + rng.uniform(-0.1, 0.1, 2) * (hc, wc)
        wobble = rng.uniform(-0.15, 0.15, 2) * (hc, wc)
        path = bezier(np.stack([start, through + wobble, through - wobble, end]), 600)
        # Marker strokes are ~0.5 mm wide on a 20 mm slide; on these small fields, 2.5–4 % of the short side.
        radius = rng.uniform(0.012, 0.02) * min(hc, wc)
        widths = radius * (1 + 0.15 * np.sin(np.linspace(0, rng.uniform(6, 12), len(path))))
        mask = np.zeros((hc, wc), bool)
        for (py, px), r in zip(path, widths, strict=True):
            rr, cc = disk((py, px), max(r, 1.0), shape=(hc, wc))
            mask[rr, cc] = True
        # The outline is kept as a signed distance field (slightly smoothed), not as a mask: upsampled per
        # strip and thresholded at full resolution it gives crisp, smooth edges at any coarse-grid scale.
        distance = ndimage.distance_transform_edt(~mask) - ndimage.distance_transform_edt(mask)
        distance = ndimage.gaussian_filter(distance.astype(np.float32), 1.0)
        # Marker ink is streaky: opacity varies along and across the stroke.
        opacity = np.clip(0.85 + 0.06 * smooth_noise((hc, wc), max(radius / 3, 1), rng), 0.6, 0.95)
        ys, xs = np.nonzero(distance * scale < PEN_EDGE_PX / 2 + scale)  # where ink can be (+1 cell for lerp)
        rows = (max(0, (int(ys.min()) - 1) * scale), min(height, (int(ys.max()) + 2) * scale))
        cols = (max(0, (int(xs.min()) - 1) * scale), min(width, (int(xs.max()) + 2) * scale))
        ink = (INK_RGB[colour][0] / 255, INK_RGB[colour][1] / 255, INK_RGB[colour][2] / 255)
        return PenStroke(distance=distance, opacity=opacity.astype(np.float32), ink=ink, rows=rows, cols=cols)

    def rows(self, y0: int, y1: int) -> np.ndarray:
        """Render full-width rows [y0, y1) as a (rows, width, 3) uint8 RGB array."""
        y0, y1 = max(0, y0), min(self.height, y1)
        flat = np.multiply(self._vignette_y[y0:y1, None], self._glass_row[None, :])
        period = len(self._noise)
        for i, y in enumerate(range(y0, y1)):  # contiguous row adds beat a gathered (rows, width*3) temporary
            flat[i] += self._noise[y % period]
        out = flat.reshape(y1 - y0, self.width, 3)  # float32 work buffer, modified in place below

        for region in self._regions:
            top, bottom = max(y0, region.y0), min(y1, region.y1)
            if top >= bottom:
                continue
            local_rows = (top - region.y0, bottom - region.y0)
            local_cols = (0, region.x1 - region.x0)
            shape = upsample(region.shape_field, self._scale, local_rows, local_cols)
            # Opacity ramps from 0 to 1 over a short band inside the outline: thin section edges look faint.
            alpha = _smoothstep(shape * (1 / SHAPE_RAMP))
            alpha *= upsample(region.density, self._scale, local_rows, local_cols)
            texture = self._class_texture(region, (top, bottom), local_rows, local_cols)
            texture *= region.gain
            texture += region.bias
            window = out[top - y0 : bottom - y0, region.x0 : region.x1]
            texture -= window
            texture *= alpha[..., None]
            window += texture

        pen = self._pen
        if pen is not None:
            top, bottom = max(y0, pen.rows[0]), min(y1, pen.rows[1])
            if top < bottom:
                distance = upsample(pen.distance, self._scale, (top, bottom), pen.cols) * self._scale
                alpha = np.clip(0.5 - distance / PEN_EDGE_PX, 0, 1)
                alpha *= upsample(pen.opacity, self._scale, (top, bottom), pen.cols)
                window = out[top - y0 : bottom - y0, pen.cols[0] : pen.cols[1]]
                # Ink absorbs light (multiplicative), so tissue under the stroke stays visible but tinted.
                # Per channel: a (rows, cols, 3) temporary would double the strip's memory for wide strokes.
                for channel, transmittance in enumerate(pen.ink):
                    window[..., channel] *= 1 - alpha * (1 - transmittance)

        np.clip(out, 0, 255, out=out)
        out += 0.5
        return out.astype(np.uint8)

    def _class_texture(
        self, region: Region, rows: tuple[int, int], local_rows: tuple[int, int], local_cols: tuple[int, int]
    ) -> np.ndarray:
        """A section's texture over full-res `rows`, (rows, cols, 3) float32, read from the class atlases.

        Each pixel shows its class (epithelium field > 0: epithelium, then tumour > 0: tumour, else squamous
        epithelium; otherwise stroma), composed in uint8 from the per-class readings. Only within the cross-fade
        bands around the class boundaries (a few % of the pixels) are the classes blended, in float, so three
        textures cost little more than one.
        """
        scale, cols = self._scale, (region.x0, region.x1)
        epithelium = upsample(region.epithelium, scale, local_rows, local_cols)
        tumour = upsample(region.tumour, scale, local_rows, local_cols)
        # Bands where a smoothstep weight is strictly between 0 and 1 (tumour matters only where epithelium shows).
        half = CLASS_EDGE_PX / 2 / scale
        band = np.abs(epithelium) < half
        band |= (np.abs(tumour) < half) & (epithelium > -half)
        ys, xs = np.nonzero(band)
        squamous = epithelium > 0
        is_tumour = tumour > 0
        is_tumour &= squamous
        squamous &= ~is_tumour
        masks = (is_tumour, squamous, None)  # stroma: what the others leave
        parts = [
            region.layer.sample(atlas, rows, cols) if mask is None or len(ys) or mask.any() else None
            for atlas, mask in zip(self._atlas, masks, strict=True)
        ]
        blend = None
        if len(ys):  # every reading was taken (band pixels need all three)
            w_epithelium = _smoothstep(epithelium[ys, xs] * (scale / CLASS_EDGE_PX) + 0.5)[:, None]
            w_tumour = _smoothstep(tumour[ys, xs] * (scale / CLASS_EDGE_PX) + 0.5)[:, None]
            tum, squ, fibrous = (p[ys, xs].astype(np.float32) for p in parts if p is not None)
            blend = fibrous + w_epithelium * (squ + w_tumour * (tum - squ) - fibrous)
        composed = parts[2]  # a fresh array (a gather): composed in place
        assert composed is not None
        for part, mask in zip(parts[:2], masks[:2], strict=True):
            if part is not None:
                np.copyto(composed, part, where=mask[..., None])
        if blend is not None:
            composed[ys, xs] = np.clip(blend + 0.5, 0, 255).astype(np.uint8)
        return composed.astype(np.float32)

    def to_array(self) -> np.ndarray:
        """The whole image (height × width × 3 uint8), rendered strip by strip into one array."""
        image = np.empty(self.shape, np.uint8)
        step = strip_rows(self.width, 16)
        for y in range(0, self.height, step):
            image[y : y + step] = self.rows(y, y + step)
        return image


def _smoothstep(x: np.ndarray) -> np.ndarray:
    """0 below 0, 1 above 1, a smooth cubic in between (in place on a float32 temporary)."""
    t = np.clip(x, 0, 1, out=x)
    return t * t * (3 - 2 * t)


def synthesize_tissue_canvas(
    height: int,
    width: int,
    *,
    rng: np.random.Generator,
    pen_mark: bool = True,
    pen_color: Literal["blue", "green", "black"] | None = None,
    mpp: float = 0.25,
) -> np.ndarray:
    """A slide-like RGB uint8 image: glass background, several H&E tissue sections, one pen stroke.

    Tissue covers roughly 25–40 % of the area (a little less counts as stained: lumens are bright); sections
    have irregular outlines and some have holes. `pen_color` defaults to a random choice of blue, green or
    black; `mpp` sets the texture scale (cells have the same physical size at any µm/px).
    """
    canvas = TissueCanvas.plan(height, width, rng=rng, mpp=mpp, pen_mark=pen_mark, pen_color=pen_color)
    return canvas.to_array()


def synthesize_background(height: int, width: int, *, rng: np.random.Generator) -> np.ndarray:
    """Blank glass only (no tissue, no pen): what a scanner records for an empty slide area."""
    return TissueCanvas.plan(height, width, rng=rng, tissue=False, pen_mark=False).to_array()
