"""Realistic sample whole-slide images built from real tissue images, for demos and tests.

Nothing is downloaded: the tissue textures come from an H&E region of OpenSlide's CMU-1 test slide shipped in
this package (``data/CMU-1-Small-Region.svs``, CC0) and scikit-image's ``immunohistochemistry()`` image; see
``SOURCES.md``. Slides are synthesised as "glass + tissue sections + a pen mark" and written as real pyramidal
files that OpenSlide opens with its normal vendor drivers:

* Aperio SVS (``write_svs``): tiled JPEG (YCbCr 4:2:0, as scanners write it) level 0, a stripped thumbnail as
  the second IFD, ×4 reduced levels, optional label and macro images, and an ImageDescription in Aperio's
  ``Aperio Image Library …|AppMag = 40|MPP = 0.2500`` format, so OpenSlide reports vendor ``aperio`` with
  ``openslide.mpp-x/y`` and ``openslide.objective-power``.
* Generic tiled TIFF (``write_generic_tiff``): ×2 reduced levels marked ``subfiletype=1`` and resolution
  tags in centimetres, which OpenSlide opens as ``generic-tiff`` with ``openslide.mpp-x/y``.

Tissue sections hold contiguous areas of three classes that differ in structure: ``Tumor`` (nests of columnar
tumour cells with large crowded nuclei), ``Squamous epithelium`` (sheets of polygonal keratinocytes) and ``Stroma``
(wavy collagen bundles with sparse spindle nuclei), each filled from its own texture atlas quilted from the matching
part of a source image. Every slide is stained its own way (hematoxylin and eosin strength and hue drawn per slide,
as between labs), so colour alone does not tell the classes apart across slides.
Every good slide comes with ``annotations/<slide stem>.geojson``: the class polygons it was rendered from, in
QuPath's GeoJSON layout and level-0 pixel coordinates, for probes on labelled tiles.

Slides of any size are rendered strip by strip (``TissueCanvas.rows``) and written tile by tile, so peak
memory is a few strips plus the first reduced level, never a full-resolution copy. ``make_sample_slides``
writes a preset set of good slides with their annotations plus negative examples (no MPP, truncated, not a
slide, no tissue) and is idempotent.

Modules, each importing only the ones above it:

=========== ====================================================================================================
texture     per-class periodic atlases (stain concentrations), stained per slide; `CLASS_NAMES`, `SlideStain`
fields      coarse planning fields: section shapes, class areas, stain density, atlas readings, the pen stroke
canvas      `TissueCanvas` (plan once, render any strip, `labels`), `synthesize_tissue_canvas`, `…_background`
annotations a canvas's class polygons as QuPath GeoJSON (`canvas_annotations`, `write_annotations`)
pyramid     streamed level 0 and reduced levels shared by both writers; `write_generic_tiff`
svs         `write_svs` (Aperio layout, label and macro images)
negatives   the truncated slide and the text file with a slide extension
presets     `SlideSpec` and the "demo" and "test" presets
generate    `make_sample_slides` (idempotent, marker file) and `SampleSet`
=========== ====================================================================================================
"""

from wsidino_dev.sample_slides.annotations import canvas_annotations, write_annotations
from wsidino_dev.sample_slides.canvas import (
    ImageSource,
    TissueCanvas,
    synthesize_background,
    synthesize_tissue_canvas,
)
from wsidino_dev.sample_slides.generate import (
    GENERATOR_VERSION,
    MARKER_NAME,
    SampleSet,
    make_sample_slides,
    sample_canvas,
)
from wsidino_dev.sample_slides.presets import PRESETS, SlideSpec
from wsidino_dev.sample_slides.pyramid import write_generic_tiff
from wsidino_dev.sample_slides.svs import write_svs
from wsidino_dev.sample_slides.texture import CLASS_COLORS, CLASS_NAMES

__all__ = [
    "CLASS_COLORS",
    "CLASS_NAMES",
    "GENERATOR_VERSION",
    "MARKER_NAME",
    "PRESETS",
    "ImageSource",
    "SampleSet",
    "SlideSpec",
    "TissueCanvas",
    "canvas_annotations",
    "make_sample_slides",
    "sample_canvas",
    "synthesize_background",
    "synthesize_tissue_canvas",
    "write_annotations",
    "write_generic_tiff",
    "write_svs",
]
