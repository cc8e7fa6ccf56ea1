"""The files of each preset ("demo", "test", "heldout"): good slides first, then the negative cases, in a fixed order;
the demo's further stains come last.

A file's index in its preset seeds its random stream (`generate.make_sample_slides`): append, never reorder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from wsidino_dev.sample_slides.texture import EOSIN_AMOUNT, HEMATOXYLIN_AMOUNT, SlideStain

# The "heldout" slide's stain: paler hematoxylin and stronger eosin than any drawn stain (amounts e^-0.6 and e^0.7,
# outside texture.HEMATOXYLIN_AMOUNT and EOSIN_AMOUNT), as from an over-eosinated lab no training slide comes from.
HELDOUT_STAIN = SlideStain(hematoxylin_amount=float(np.exp(-0.6)), eosin_amount=float(np.exp(0.7)))
assert HELDOUT_STAIN.hematoxylin_amount < np.exp(HEMATOXYLIN_AMOUNT[0]) and HELDOUT_STAIN.eosin_amount > np.exp(
    EOSIN_AMOUNT[1]
)

# Stains of the demo's further slides (`DEMO_STAINS`), each a look of its own: distinct labs for the slide-level
# promotion test (nine annotated slides give the demo its evidence). None is over-eosinated like HELDOUT_STAIN:
# benchmarks/adaptation.py trains on the demo and tests on that stain as a lab it has not seen. DAB's unit OD vector
# (R, G, B) is scikit-image's (`skimage.color.rgb_from_hed`, after Ruifrok & Johnston), normalised.
_DAB = np.array([0.27, 0.57, 0.78])
DAB_OD: tuple[float, float, float] = tuple(float(x) for x in _DAB / np.linalg.norm(_DAB))  # type: ignore[assignment]
PALE_STAIN = SlideStain(hematoxylin_amount=float(np.exp(-0.5)), eosin_amount=float(np.exp(-0.5)))  # faded, thin
HEMATOXYLIN_HEAVY_STAIN = SlideStain(hematoxylin_amount=float(np.exp(0.55)), eosin_amount=float(np.exp(-0.1)))
# Hematoxylin and DAB: the eosin concentrations rendered brown. Not a real IHC pattern (DAB marks whatever eosin would),
# but an immunostain's colours: blue nuclei on brown.
H_DAB_STAIN = SlideStain(eosin=DAB_OD, hematoxylin_amount=1.0, eosin_amount=1.0)
# Three more labs within the drawn ranges' corners: eosin-rich (still below HELDOUT_STAIN's), strong in both, and a
# faint eosin under firm hematoxylin. Nine annotated slides let the demo's gate see a consistent gain.
EOSIN_RICH_STAIN = SlideStain(hematoxylin_amount=float(np.exp(-0.1)), eosin_amount=float(np.exp(0.4)))
STRONG_STAIN = SlideStain(hematoxylin_amount=float(np.exp(0.2)), eosin_amount=float(np.exp(0.3)))
FAINT_EOSIN_STAIN = SlideStain(hematoxylin_amount=float(np.exp(0.1)), eosin_amount=float(np.exp(-0.3)))


@dataclass(frozen=True)
class SlideSpec:
    """One file of a preset. `kind`: svs | tiff | truncated | text; `content`: tissue | blank."""

    name: str  # path relative to the output directory
    kind: Literal["svs", "tiff", "truncated", "text"]
    width: int = 0
    height: int = 0
    mpp: float | None = None
    app_mag: int | None = None
    levels: int = 3
    compression: Literal["jpeg", "zlib"] = "jpeg"
    content: Literal["tissue", "blank"] = "tissue"
    pen_color: Literal["blue", "green", "black"] | None = None
    negative: str | None = None  # key in SampleSet.negatives
    expect: str = ""  # how readers should behave, recorded in the marker for humans
    stain: SlideStain | None = None  # None: drawn per slide (`SlideStain.draw`)


def _preset(big: bool) -> list[SlideSpec]:
    # The test preset is the demo at a quarter of the size per side (the same layout, ~3k×4k px, still
    # ≥ 3 levels), so tests exercise exactly the code paths a demo run uses.
    if big:
        svs40, svs20, generic, negative = (16384, 16384, 4), (8192, 6144, 3), (6144, 8192, 5), (4096, 3072)
    else:
        svs40, svs20, generic, negative = (4096, 3072, 3), (2048, 1536, 3), (2048, 3072, 4), (2048, 1536)
    nw, nh = negative
    return [
        SlideSpec("tissue_40x.svs", "svs", svs40[0], svs40[1], 0.25, 40, levels=svs40[2], pen_color="blue"),
        SlideSpec("tissue_20x.svs", "svs", svs20[0], svs20[1], 0.5, 20, levels=svs20[2], pen_color="green"),
        SlideSpec(
            "tissue_generic.tiff",
            "tiff",
            generic[0],
            generic[1],
            0.25,
            levels=generic[2],
            compression="zlib",
            pen_color="black",
        ),
        SlideSpec(
            "negatives/no_mpp.tiff",
            "tiff",
            nw,
            nh,
            None,
            levels=3,
            pen_color="blue",
            negative="no_mpp",
            expect="opens as generic-tiff; no openslide.mpp-x/y",
        ),
        SlideSpec(
            "negatives/truncated.svs",
            "truncated",
            nw,
            nh,
            0.25,
            40,
            levels=3,
            negative="truncated",
            expect="valid SVS cut to 60 % of its bytes; see negatives.truncate",
        ),
        SlideSpec(
            "negatives/not_a_slide.svs",
            "text",
            negative="not_a_slide",
            expect="text with a slide extension; OpenSlideUnsupportedFormatError",
        ),
        SlideSpec(
            "negatives/no_tissue.svs",
            "svs",
            nw,
            nh,
            0.25,
            40,
            levels=3,
            content="blank",
            negative="no_tissue",
            expect="opens with MPP; blank glass only",
        ),
    ]


# The demo's further annotated slides, after its negatives (indices 7 to 12): small (4096×3072 at 0.5 µm/px, 20×, as
# the "heldout" slide) so that `make demo` stays short, each in its own stain. The test preset does not have them.
DEMO_STAINS = [
    SlideSpec("tissue_pale.svs", "svs", 4096, 3072, 0.5, 20, levels=3, pen_color="blue", stain=PALE_STAIN),
    SlideSpec(
        "tissue_dark_h.svs", "svs", 4096, 3072, 0.5, 20, levels=3, pen_color="black", stain=HEMATOXYLIN_HEAVY_STAIN
    ),
    SlideSpec("tissue_h_dab.svs", "svs", 4096, 3072, 0.5, 20, levels=3, pen_color="green", stain=H_DAB_STAIN),
    SlideSpec("tissue_eosin_rich.svs", "svs", 4096, 3072, 0.5, 20, levels=3, pen_color="blue", stain=EOSIN_RICH_STAIN),
    SlideSpec("tissue_strong.svs", "svs", 4096, 3072, 0.5, 20, levels=3, pen_color="green", stain=STRONG_STAIN),
    SlideSpec(
        "tissue_faint_eosin.svs", "svs", 4096, 3072, 0.5, 20, levels=3, pen_color="black", stain=FAINT_EOSIN_STAIN
    ),
]


# One annotated slide whose stain no "demo" or "test" slide has: a held-out-lab test slide (benchmarks/adaptation.py).
# Its index 0 shares the demo's first slide's random stream: make it with another seed for different tissue.
HELDOUT = [
    SlideSpec("tissue_heldout_stain.svs", "svs", 4096, 3072, 0.5, 20, levels=3, pen_color="green", stain=HELDOUT_STAIN)
]

PRESETS: dict[str, list[SlideSpec]] = {
    "demo": _preset(big=True) + DEMO_STAINS,
    "test": _preset(big=False),
    "heldout": HELDOUT,
}
