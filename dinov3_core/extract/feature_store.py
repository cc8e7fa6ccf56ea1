"""The feature store extract writes: its layout, which slides are done, and how a slide is staged and committed.

Layout (zarr v3): `features.zarr/slides/<id>/{cls (N, D), mean_patch (N, D), coords (N, 2) int64 level-0 x, y,
slide_embedding (D,) [, patch (N, n_patches, D)]}`, attrs `wsidino_features` (model path and hash, source store,
created, …); rows are the tile store's rows (same order as its coords). The store holds only zarr: pictures, the
resolved config and a distributed job's result go beside it (`pictures_dir`: features.zarr → `features/`).

A slide is written under `.incoming/<id>/` and renamed into `slides/` by `commit_slide` once every row is there, so
a slide under `slides/` with `complete: true` is whole; anything under `.incoming/` is debris of a stopped run. Its
`.h5` and QuPath GeoJSON are written under `.incoming/.<id>.exports/` and renamed into place only after that commit,
so a failed or killed run never leaves an export that looks complete for a slide that is not; a rerun writes the
exports a committed slide lacks from the store (`finish_exports`).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from PIL import Image, ImageDraw

from dinov3_core.checksums import sha256
from dinov3_core.data.augment_config import IMAGENET_MEAN, IMAGENET_STD
from dinov3_core.extract.exports import cluster_tiles, h5_dir, write_h5
from dinov3_core.inference.feature_model import ExtractError
from dinov3_core.manifest import MANIFEST_NAME
from dinov3_core.qupath import write_qupath_tiles
from dinov3_core.tiling import store as ts

ATTRS_KEY = "wsidino_features"
INCOMING = ".incoming"
EXPORT_DIGESTS = "export_sha256"  # in a slide's attrs: each export's SHA-256 as extract wrote it
log = logging.getLogger(__name__)
FORMAT = {"format": "wsidino-features", "version": 1}


def pictures_dir(output: str | os.PathLike[str]) -> Path:
    """Where extract's pictures and resolved config go: beside the feature store, not inside it (a zarr store that
    holds other files makes zarr warn, and copies of the store drag them along). features.zarr → features/."""
    out = Path(output)
    return out.with_suffix("") if out.suffix == ".zarr" else out.parent / f"{out.name}.pictures"


def export_h5(out: Path, slide_id: str, tile_attrs: dict[str, Any], tile_size: int) -> Path:
    """The .h5 of a committed slide, from the feature store (a slide extracted before `format=both` was asked)."""
    group = zarr.open_group(str(out / "slides" / slide_id), mode="r")
    attrs = group.attrs.asdict().get(ATTRS_KEY, {})
    path = h5_dir(out) / f"{slide_id}.h5"
    write_h5(
        path,
        slide_id,
        np.asarray(group["cls"][:]),
        np.asarray(group["coords"][:]),
        tile_attrs,
        tile_size,
        {k: attrs[k] for k in ("model_path", "model_hash", "precision") if k in attrs},
    )
    return path


def export_targets(cfg: Any, out: Path, slide_id: str) -> dict[str, Path]:
    """A slide's exports the config asks for: name under its staging folder → final path."""
    targets = {}
    if getattr(cfg, "format", "zarr") == "both":
        targets[f"{slide_id}.h5"] = h5_dir(out) / f"{slide_id}.h5"
    if getattr(cfg, "qupath", False):
        targets["tiles.geojson"] = pictures_dir(out) / slide_id / "tiles.geojson"
    return targets


def write_geojson(path: Path, cls_all: np.ndarray, coords: np.ndarray, tile_level0: float, clusters: int) -> None:
    """The slide's tiles for QuPath: each a detection classified by its k-means cluster, PC1-3 as measurements."""
    rgb, _ = pca_rgb(cls_all)
    labels = cluster_tiles(cls_all, clusters)
    classes = [f"cluster {i + 1}" for i in range(int(labels.max()) + 1)]
    measures = {f"PC{k + 1} (0-1 in slide)": rgb[:, k] for k in range(3)}
    write_qupath_tiles(path, coords, tile_level0, classes, labels, {**measures, "cluster": labels + 1})


def finish_exports(cfg: Any, out: Path, slide_id: str, tile_attrs: dict[str, Any], tile_size: int) -> list[Path]:
    """The exports a committed slide lacks (asked for after it was extracted, or a run stopped between its commit
    and their renames), or whose content is no longer what extract wrote (their SHA-256 is in the slide's attrs),
    written from the feature store; what a stopped run staged is not trusted and removed."""
    shutil.rmtree(staged_exports(out, slide_id), ignore_errors=True)
    group = zarr.open_group(str(out / "slides" / slide_id), mode="r+")
    attrs = group.attrs.asdict().get(ATTRS_KEY, {})
    recorded = attrs.get(EXPORT_DIGESTS, {})
    written = []
    for name, final in export_targets(cfg, out, slide_id).items():
        if final.is_file():
            if recorded.get(name) in (None, sha256(final)):  # intact (or from before digests were recorded)
                continue
            log.warning("%s: its content differs from what extract wrote; rewriting it from the stored features", final)
        if name.endswith(".h5"):
            export_h5(out, slide_id, tile_attrs, tile_size)
        else:
            tile_level0 = float(tile_attrs.get("tile_size_level0") or tile_size)
            write_geojson(
                final, np.asarray(group["cls"][:]), np.asarray(group["coords"][:]), tile_level0, cfg.qupath_clusters
            )
        written.append(final)
        recorded = {**recorded, name: sha256(final)}
    if written:
        group.attrs[ATTRS_KEY] = {**attrs, EXPORT_DIGESTS: recorded}
    return written


def is_extracted(
    out: Path, slide_id: str, model_hash: str, source_fingerprint: str | None, precision: str, mpp: float | None = None
) -> bool:
    """Extracted completely, with this model and precision, from this version of the slide (a re-scanned slide that
    was re-tiled under the same id has another source fingerprint: its features are stale), at the `mpp` µm/px
    level of its tile store (the level as tiled, `mpp_requested`; features from before levels were recorded
    count as the first level's: pass None for it)."""
    meta = out / "slides" / slide_id / "zarr.json"
    if not meta.is_file():
        return False
    try:
        attrs = zarr.open_group(str(out / "slides" / slide_id), mode="r").attrs.asdict().get(ATTRS_KEY, {})
    except Exception:  # unreadable: redo
        return False
    return (
        bool(attrs.get("complete"))
        and attrs.get("model_hash") == model_hash
        and attrs.get("source_fingerprint") == source_fingerprint
        and attrs.get("precision", "fp32") == precision
        and (attrs.get("mpp_requested") == mpp or (mpp is None and attrs.get("tile_level_index", 0) == 0))
    )


def check_output(out: Path) -> None:
    """`out` is a feature store, or does not exist yet, or is empty: extract writes nowhere else."""
    if out.exists() and (out / "zarr.json").is_file():
        attrs = zarr.open_group(str(out), mode="r").attrs.asdict().get(ATTRS_KEY, {})
        if attrs.get("format") != FORMAT["format"]:
            raise ExtractError(f"output {out} is a zarr store but not a wsidino feature store; choose another output")
    elif out.exists() and any(p.name != MANIFEST_NAME and not p.name.startswith(".") for p in out.iterdir()):
        raise ExtractError(f"output {out} exists and is not a feature store; choose a new path")


def init_output(out: Path, store: str) -> None:
    """Create the feature store (or check that `out` is one); refuses to write into anything else."""
    check_output(out)
    root = zarr.open_group(str(out), mode="a")
    root.attrs[ATTRS_KEY] = {**FORMAT, "source_store": str(Path(store).resolve())}
    if "slides" not in root:
        root.create_group("slides")


def staging(out: Path, slide_id: str) -> Path:
    return out / INCOMING / slide_id


def staged_exports(out: Path, slide_id: str) -> Path:
    """Where a slide's .h5 and GeoJSON wait for its commit: `.incoming/.<id>.exports`, a folder of its own (no
    slide id starts with ".", see discovery.safe_slide_id, so it never meets a slide's staging group), so ranks
    committing other slides never share or remove it."""
    return out / INCOMING / f".{slide_id}.exports"


class SlideArrays:
    """A slide's output arrays, written in whole chunks: rows are buffered until their chunk is complete, so zarr
    encodes each chunk once instead of reading and re-encoding it for every batch that lands in it.

    Several processes may write one slide's arrays at once (a slide split into row ranges over ranks) as long as
    each range starts on a chunk boundary of every array: then no chunk has two writers."""

    def __init__(self, arrays: dict[str, Any], patch: Any, n: int, chunk: int) -> None:
        self.arrays, self.patch, self.n, self.chunk = arrays, patch, n, chunk
        d = next(iter(arrays.values())).shape[1]
        self.buffers = {name: np.empty((chunk, d), np.float32) for name in arrays}

    @classmethod
    def create(
        cls, group: Any, n: int, d: int, p: int, patch_tokens: bool, chunk_rows: int, batch_size: int
    ) -> SlideArrays:
        chunk = max(1, min(n, chunk_rows))
        arrays = {
            name: group.create_array(name, shape=(n, d), chunks=(chunk, d), dtype="float32")
            for name in ("cls", "mean_patch")
        }
        patch = None
        if patch_tokens:  # one chunk per batch: written whole as it comes
            pc = max(1, min(n, batch_size))
            patch = group.create_array("patch", shape=(n, p, d), chunks=(pc, p, d), dtype="float32")
        return cls(arrays, patch, n, chunk)

    @classmethod
    def open(cls, group: Any) -> SlideArrays:
        """The arrays another process created (`create`), to write a range of rows into."""
        arrays = {name: group[name] for name in ("cls", "mean_patch")}
        patch = group["patch"] if "patch" in group.array_keys() else None
        return cls(arrays, patch, arrays["cls"].shape[0], arrays["cls"].chunks[0])

    def write(self, b0: int, cls: np.ndarray, mean: np.ndarray, patch: np.ndarray | None) -> None:
        if self.patch is not None:
            self.patch[b0 : b0 + len(cls)] = patch
        i = 0
        while i < len(cls):
            row = b0 + i
            c0 = row - row % self.chunk
            k = min(len(cls) - i, c0 + self.chunk - row)
            for name, rows in (("cls", cls), ("mean_patch", mean)):
                self.buffers[name][row - c0 : row - c0 + k] = rows[i : i + k]
            i += k
            end = min(c0 + self.chunk, self.n)
            if row + k == end:
                for name, array in self.arrays.items():
                    array[c0:end] = self.buffers[name][: end - c0]


def pca_rgb(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First 3 principal components of (N, D) → (N, 3) in [0, 1], and their explained variance ratios."""
    x = features.astype(np.float64) - features.mean(0, keepdims=True)
    if len(x) < 2:
        return np.full((len(x), 3), 0.5), np.zeros(3)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    k = min(3, vt.shape[0])
    comps = x @ vt[:k].T
    var = s**2
    ratio = var[:k] / max(var.sum(), 1e-12)
    rgb = np.full((len(x), 3), 0.5)
    lo, hi = comps.min(0), comps.max(0)
    rgb[:, :k] = (comps - lo) / np.where(hi > lo, hi - lo, 1.0)
    return rgb, np.pad(ratio, (0, 3 - k))


PCA_BACKGROUND_FADE = 0.35  # share of the slide thumbnail left under the PCA map (the rest is white)
QC_LEGEND_PX = 18  # the white strip under the tile stage's QC picture (dinov3_core/tiling/qc.py: with_legend)


def faded_thumbnail(
    thumbnail: Path, level0_size: tuple[int, int], origin: np.ndarray, scale: float, size: tuple[int, int]
) -> np.ndarray | None:
    """The tile store's QC thumbnail of the slide under a PCA map: the level-0 box from `origin` (x, y) that the map
    covers at `scale` map px per level-0 px, resized to `size` (width, height), faded towards white. None when the
    picture is missing or unreadable (the map is then drawn on white)."""
    try:
        with Image.open(thumbnail) as im:
            drawing = im.convert("RGB")
    except (OSError, ValueError):
        return None
    width, height = drawing.width, drawing.height - QC_LEGEND_PX  # the legend strip is no part of the slide
    q = height / level0_size[1]  # thumbnail px per level-0 px (its width may be padded for a wide legend)
    if height <= 0 or q <= 0 or round(level0_size[0] * q) > width + 1:
        return None
    box = (origin[0] * q, origin[1] * q, (origin[0] + size[0] / scale) * q, (origin[1] + size[1] / scale) * q)
    region = drawing.crop(tuple(float(v) for v in box)).resize(size, Image.Resampling.BILINEAR)
    rgb = np.asarray(region, np.float32)
    return np.round(255.0 - PCA_BACKGROUND_FADE * (255.0 - rgb)).astype(np.uint8)


def write_pca_png(
    path: Path,
    coords: np.ndarray,
    features: np.ndarray,
    tile_level0: float,
    max_side: int,
    title: str = "",
    thumbnail: Path | None = None,
    level0_size: tuple[int, int] | None = None,
) -> list[float]:
    """Tiles at their level-0 coords, scaled so the map's long side is `max_side` px, coloured by the first 3 PCs;
    `title` (slide, model) on top, what the colours mean and the explained variance below. Under the tiles, the tile
    store's QC `thumbnail` of the slide (level-0 size `level0_size`), faded, when there is one; else white."""
    rgb, ratio = pca_rgb(features)
    origin = coords.min(0)
    extent = float((coords.max(0) - origin).max()) + tile_level0
    scale = max_side / extent
    side = max(1, round(tile_level0 * scale))
    xy = np.round((coords - origin) * scale).astype(int)
    legend = "colour = CLS features' principal components 1/2/3 as R/G/B; variance explained " + "/".join(
        f"{100 * r:.0f}%" for r in ratio
    )
    map_w, map_h = int(xy[:, 0].max()) + side, int(xy[:, 1].max()) + side
    background = None
    if thumbnail is not None and level0_size is not None:
        background = faded_thumbnail(thumbnail, level0_size, origin, scale, (map_w, map_h))
        legend += "" if background is None else "; the slide faded beneath"
    width = max(map_w, 7 * len(legend), 7 * len(title))
    height = map_h + 28
    canvas = np.full((height, width, 3), 255, np.uint8)
    if background is not None:
        canvas[14 : 14 + map_h, :map_w] = background
    for (x, y), c in zip(xy, (rgb * 255).astype(np.uint8), strict=True):
        canvas[14 + y : 14 + y + side, x : x + side] = c
    image = Image.fromarray(canvas)
    draw = ImageDraw.Draw(image)
    draw.text((2, 1), title, fill=(0, 0, 0))
    draw.text((2, height - 13), legend, fill=(0, 0, 0))
    tmp = path.with_name(f".{path.name}.tmp")
    image.save(tmp, format="PNG")
    os.replace(tmp, path)
    return [float(r) for r in ratio]


def commit_slide(cfg: Any, ds: Any, s: int, model: Any, out: Path) -> None:
    """Finish slide `s` staged under `.incoming/<id>/` (every row of cls / mean_patch written): its coords, slide
    embedding, PCA map and attrs, then the rename into `slides/` that makes it count as extracted."""
    slide_id = ds.slide_ids[s]
    incoming = staging(out, slide_id)
    group = zarr.open_group(str(incoming), mode="r+")
    n = int(ds.tile_counts[s])
    coords = ds.slide_coords(s)
    group.create_array("coords", data=coords.astype(np.int64))
    cls_all = np.asarray(group["cls"][:])
    group.create_array("slide_embedding", data=cls_all.mean(0).astype(np.float32))
    tile_attrs = ds.slide_attrs(s)
    ratio = None
    picture = pictures_dir(out) / slide_id / "pca.png"
    staged = picture.with_name(".pca.png.incoming")
    if cfg.pca_map:  # written beside the store, renamed into place once the slide is committed
        tile_level0 = float(tile_attrs.get("tile_size_level0") or ds.tile_size)
        title = f"{slide_id}: {n} tiles, model {model.path.name} ({model.hash[:8]})"
        picture.parent.mkdir(parents=True, exist_ok=True)
        thumbnail = ts.slide_dir(ds.slide_store(s), slide_id) / "qc_thumbnail.png"
        size = (tile_attrs.get("level0_width"), tile_attrs.get("level0_height"))
        level0_size = (int(size[0]), int(size[1])) if all(size) else None
        ratio = write_pca_png(staged, coords, cls_all, tile_level0, cfg.pca_max_side, title, thumbnail, level0_size)
    group.attrs[ATTRS_KEY] = {
        **FORMAT,
        "slide_id": slide_id,
        "n_tiles": n,
        "embed_dim": int(cls_all.shape[1]),
        "model_path": str(model.path.resolve()),
        "model_hash": model.hash,
        "backend": model.backend,
        "precision": cfg.precision,
        "source_store": str(ds.slide_store(s).resolve()),
        "source_fingerprint": tile_attrs.get("source_fingerprint"),
        "tile_size": int(ds.tile_size),
        "tile_size_level0": tile_attrs.get("tile_size_level0"),
        # The magnification these features hold: the tile store level read (`mpp`; its first unless asked).
        "mpp_requested": tile_attrs.get("mpp_requested"),
        "mpp_effective": tile_attrs.get("mpp_effective"),
        "tile_level_index": tile_attrs.get("index", 0),
        "normalisation": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        "pca_explained_variance": ratio,
        "created": ts.utc_now(),
        "complete": True,
    }
    # Exports are staged beside the slide's group and renamed into place after its commit; every fallible step
    # (writing, making their folders) comes before the commit, so what follows it is renames only.
    exports = staged_exports(out, slide_id)
    shutil.rmtree(exports, ignore_errors=True)
    exports.mkdir(parents=True)
    targets = export_targets(cfg, out, slide_id)
    for name in targets:
        if name.endswith(".h5"):
            about = {"model_path": str(model.path.resolve()), "model_hash": model.hash, "precision": cfg.precision}
            write_h5(exports / name, slide_id, cls_all, coords, tile_attrs, int(ds.tile_size), about)
        else:
            tile_level0 = float(tile_attrs.get("tile_size_level0") or ds.tile_size)
            write_geojson(exports / name, cls_all, coords, tile_level0, cfg.qupath_clusters)
    # What each export held when written: a later run rewrites one whose content differs (`finish_exports`).
    digests = {name: sha256(exports / name) for name in targets}
    group.attrs[ATTRS_KEY] = {**group.attrs[ATTRS_KEY], EXPORT_DIGESTS: digests}
    for target in targets.values():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)  # an earlier model's export must not pass for this commit's
    final = out / "slides" / slide_id
    if final.exists():
        shutil.rmtree(final)  # extracted with another model: replaced
    os.replace(incoming, final)
    for name, target in targets.items():
        os.replace(exports / name, target)
    shutil.rmtree(exports, ignore_errors=True)
    if cfg.pca_map:
        os.replace(staged, picture)


__all__ = [
    "ATTRS_KEY",
    "FORMAT",
    "INCOMING",
    "SlideArrays",
    "check_output",
    "commit_slide",
    "export_h5",
    "export_targets",
    "finish_exports",
    "init_output",
    "is_extracted",
    "pca_rgb",
    "pictures_dir",
    "staged_exports",
    "staging",
    "write_geojson",
    "write_pca_png",
]
