"""`make_sample_slides`: write a preset's files idempotently (marker file, atomic renames) and describe them.

Every good slide comes with its class annotations, ``annotations/<slide stem>.geojson`` (QuPath GeoJSON, level-0
pixel coordinates; see `annotations`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dinov3_core.files import atomic_path
from wsidino_dev.sample_slides.annotations import write_annotations
from wsidino_dev.sample_slides.canvas import TissueCanvas
from wsidino_dev.sample_slides.negatives import truncate, write_not_a_slide
from wsidino_dev.sample_slides.presets import PRESETS, SlideSpec
from wsidino_dev.sample_slides.pyramid import write_generic_tiff
from wsidino_dev.sample_slides.svs import write_svs

# Bumped whenever generated pixels or file layout change: markers written by older code are not trusted.
GENERATOR_VERSION = 3  # 2: tissue classes and GeoJSON annotations; 3: H&E, classes by morphology, per-slide stain
MARKER_NAME = "sample_slides.json"
ANNOTATIONS_DIR = "annotations"


@dataclass(frozen=True)
class SampleSet:
    """Files written by `make_sample_slides`.

    `slides`: the good slides; `negatives`: ``no_mpp``, ``truncated``, ``not_a_slide``, ``no_tissue`` (empty
    when not requested); `info`: per file, keyed by path relative to `root`: ``format``, ``size`` (level-0
    width, height), ``mpp``, ``levels`` (width, height per level), ``bytes``, ``expect`` and more.
    `annotations`: per good slide, keyed by its stem (the slide id), its QuPath GeoJSON file under
    ``annotations/``: one feature per tissue section and class (`texture.CLASS_NAMES`).
    """

    slides: list[Path]
    negatives: dict[str, Path]
    info: dict[str, dict[str, Any]]
    annotations: dict[str, Path] = field(default_factory=dict)
    root: Path = field(default=Path())
    preset: str = "demo"
    seed: int = 0


def _spec_rng(seed: int, index: int) -> np.random.Generator:
    # One independent stream per file: changing one spec does not change the others' pixels.
    return np.random.default_rng([seed, index])


def _canvas(spec: SlideSpec, rng: np.random.Generator) -> TissueCanvas:
    return TissueCanvas.plan(
        spec.height,
        spec.width,
        rng=rng,
        mpp=spec.mpp or 0.25,
        tissue=spec.content == "tissue",
        pen_mark=spec.content == "tissue",
        pen_color=spec.pen_color,
        stain=spec.stain,
    )


def sample_canvas(preset: Literal["demo", "test", "heldout"], name: str, *, seed: int = 0) -> TissueCanvas:
    """The canvas behind a preset's image file, for comparing what a reader returns with the source pixels."""
    for index, spec in enumerate(PRESETS[preset]):
        if spec.name == name and spec.kind != "text":
            return _canvas(spec, _spec_rng(seed, index))
    raise KeyError(f"preset {preset!r} has no image named {name!r}")


def _annotated(spec: SlideSpec) -> bool:
    """Whether the file gets annotations: the good slides (negatives are inputs that should fail or be empty)."""
    return spec.negative is None and spec.kind in ("svs", "tiff") and spec.content == "tissue"


def _annotation_name(spec: SlideSpec) -> str:
    return f"{ANNOTATIONS_DIR}/{Path(spec.name).stem}.geojson"


def _write_annotations(root: Path, spec: SlideSpec, canvas: TissueCanvas) -> dict[str, Any]:
    final = root / _annotation_name(spec)
    with atomic_path(final) as tmp:
        summary = write_annotations(tmp, canvas, Path(spec.name).stem)
    return {"file": _annotation_name(spec), "slide": spec.name, "bytes": final.stat().st_size, **summary}


def _write_spec(spec: SlideSpec, target: Path, rng: np.random.Generator, canvas: TissueCanvas | None) -> dict[str, Any]:
    info: dict[str, Any] = {"size": [spec.width, spec.height], "mpp": spec.mpp}
    if spec.kind == "text":
        write_not_a_slide(target)
        return {"format": "text", "size": None, "mpp": None, "levels": []}
    assert canvas is not None
    if spec.kind in ("svs", "truncated"):
        # `name` explicitly: `target` is a temporary path, and the output must not depend on it.
        name = Path(spec.name).stem
        dims = write_svs(
            target, canvas, mpp=spec.mpp, app_mag=spec.app_mag, levels=spec.levels, name=name, label_rng=rng
        )
        info |= {"format": "aperio-svs", "app_mag": spec.app_mag, "compression": "jpeg"}
        if spec.kind == "truncated":
            truncate(target)
            info["format"] = "aperio-svs (truncated)"
    else:
        dims = write_generic_tiff(target, canvas, mpp=spec.mpp, levels=spec.levels, compression=spec.compression)
        info |= {"format": "generic-tiff", "compression": spec.compression}
    return info | {"levels": [list(d) for d in dims], "content": spec.content, "pen_color": spec.pen_color}


def _reusable(root: Path, preset: str, seed: int) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Marker entries (files, annotations), for this generator version, preset and seed, whose file is there
    with its recorded size."""
    try:
        marker = json.loads((root / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return {}, {}
    wanted = {"version": GENERATOR_VERSION, "preset": preset, "seed": seed}
    if not isinstance(marker, dict) or any(marker.get(key) != value for key, value in wanted.items()):
        return {}, {}

    def present(entries: dict[str, dict[str, Any]], path: Any) -> dict[str, dict[str, Any]]:
        return {
            key: meta
            for key, meta in entries.items()
            if (root / path(key, meta)).is_file() and (root / path(key, meta)).stat().st_size == meta.get("bytes")
        }

    files = present(marker.get("files", {}), lambda name, _: name)
    annotations = present(marker.get("annotations", {}), lambda _, meta: meta.get("file", ""))
    return files, annotations


def _sample_set(
    root: Path, preset: str, seed: int, files: dict[str, dict[str, Any]], annotations: dict[str, dict[str, Any]]
) -> SampleSet:
    slides = [root / name for name, meta in files.items() if meta.get("negative") is None]
    negs = {meta["negative"]: root / name for name, meta in files.items() if meta.get("negative") is not None}
    labels = {stem: root / meta["file"] for stem, meta in annotations.items()}
    return SampleSet(slides=slides, negatives=negs, info=files, annotations=labels, root=root, preset=preset, seed=seed)


def make_sample_slides(
    out_dir: str | Path,
    preset: Literal["demo", "test", "heldout"] = "demo",
    *,
    seed: int = 0,
    negatives: bool = True,
    progress: Callable[[str, dict[str, Any]], None] | None = None,
) -> SampleSet:
    """Write a preset set of sample slides into `out_dir` (negatives under ``negatives/``) and describe them.

    "demo": a 16384×16384 SVS at 0.25 µm/px (AppMag 40, 4 levels), an 8192×6144 SVS at 0.5 µm/px
    (AppMag 20), a 6144×8192 zlib generic TIFF at 0.25 µm/px (5 levels). "test": the same slides at a
    quarter of the size per side (≥ 3 levels each). Negatives: ``no_mpp.tiff``, ``truncated.svs``,
    ``not_a_slide.svs``, ``no_tissue.svs``. "heldout": one 4096×3072 SVS at 0.5 µm/px stained outside the range
    the other slides' stains are drawn from (`presets.HELDOUT_STAIN`): a test slide from a lab no training slide
    comes from. Each good slide's class annotations go to
    ``annotations/<slide stem>.geojson``. Files are byte-for-byte deterministic for a seed.

    Idempotent: ``sample_slides.json`` (written last, after every file was written under a temporary name
    and renamed) records what was generated. Files it lists for the same preset and seed that are still
    there with their recorded size are reused; if that covers the request, nothing at all is written.
    Otherwise only the missing or damaged files are regenerated. `progress(name, info)` is called after each file
    written (not for those reused), with its `info` entry (``size``, ``seconds`` …).
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    root = Path(out_dir)
    wanted = [(i, spec) for i, spec in enumerate(PRESETS[preset]) if negatives or spec.negative is None]
    annotated = {Path(spec.name).stem: spec for _, spec in wanted if _annotated(spec)}
    reusable, reusable_annotations = _reusable(root, preset, seed)
    if all(spec.name in reusable for _, spec in wanted) and set(annotated) <= set(reusable_annotations):
        files = {spec.name: reusable[spec.name] for _, spec in wanted}
        return _sample_set(root, preset, seed, files, {s: reusable_annotations[s] for s in annotated})

    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER_NAME).unlink(missing_ok=True)  # a half-rewritten set must not look complete
    files: dict[str, dict[str, Any]] = {}
    annotations: dict[str, dict[str, Any]] = {}
    for index, spec in wanted:
        stem = Path(spec.name).stem
        labelled = _annotated(spec)
        if spec.name in reusable and (not labelled or stem in reusable_annotations):
            files[spec.name] = reusable[spec.name]
            if labelled:
                annotations[stem] = reusable_annotations[stem]
            continue
        started = time.perf_counter()
        rng = _spec_rng(seed, index)
        canvas = None if spec.kind == "text" else _canvas(spec, rng)
        if labelled and stem in reusable_annotations:
            annotations[stem] = reusable_annotations[stem]
        elif labelled:
            assert canvas is not None
            annotations[stem] = _write_annotations(root, spec, canvas)
        if spec.name in reusable:
            files[spec.name] = reusable[spec.name]
            continue
        final = root / spec.name
        with atomic_path(final) as tmp:
            meta = _write_spec(spec, tmp, rng, canvas)
        meta |= {
            "bytes": final.stat().st_size,
            "negative": spec.negative,
            "expect": spec.expect,
            "seconds": round(time.perf_counter() - started, 2),
        }
        files[spec.name] = meta
        if progress is not None:
            progress(spec.name, meta)

    marker = {
        "generator": "wsidino_dev.sample_slides",
        "version": GENERATOR_VERSION,
        "preset": preset,
        "seed": seed,
        "files": files,
        "annotations": annotations,
    }
    with atomic_path(root / MARKER_NAME) as tmp:
        tmp.write_text(json.dumps(marker, indent=2) + "\n")
    return _sample_set(root, preset, seed, files, annotations)
