"""extract: per-tile features of a tile store with the exported ONNX model (ONNX Runtime) or the PyTorch backbone.

    cfg = load_config(ExtractConfig, None, {"store": "out/tiles.zarr", "model": "out/model/model.onnx",
                                             "output": "out/features.zarr"}, stage="extract")
    result = run_extract(cfg)

Layout (zarr v3): `features.zarr/slides/<id>/{cls (N, D), mean_patch (N, D), coords (N, 2) int64 level-0 x, y,
slide_embedding (D,) [, patch (N, n_patches, D)]}`, attrs `wsidino_features` (model path and hash, source store,
created, …); rows are the tile store's rows (same order as its coords). The store holds only zarr: pictures and the
resolved config go beside it (`pictures_dir`: features.zarr → `features/<id>/pca.png`, `features/extract_config.yaml`).
Tiles are normalised as in training (ImageNet mean / std). Each slide is written under `.incoming/<id>/` and
renamed into `slides/` when complete; a rerun skips slides already extracted with the same model (hash) and
redoes the others. `num_shards` / `shard_index` split the slides over independent processes writing the same
output (per-slide commits do not collide). Within a process `loader_threads` threads read, decode and normalise the
next `prefetch_batches` batches while the model runs and one thread writes behind it (`dinov3_core.export.loader`);
the features are bit-identical to the serial loop (`loader_threads=0`). The model: `dinov3_core.export.feature_model`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
import zarr

from dinov3_core import tracking
from dinov3_core.config import to_dict
from dinov3_core.data.augment import IMAGENET_MEAN, IMAGENET_STD
from dinov3_core.export.config import ExtractConfig
from dinov3_core.export.feature_model import ExtractError, FeatureModel, file_hash, normalise, open_model
from dinov3_core.export.loader import BackgroundWriter, TileReader, read_ahead
from dinov3_core.manifest import MANIFEST_NAME
from dinov3_core.progress import Progress
from dinov3_core.tiling import store as ts

__all__ = [
    "ExtractConfig",
    "ExtractError",
    "ExtractResult",
    "FeatureModel",
    "file_hash",
    "normalise",
    "open_model",
    "run_extract",
]

logger = logging.getLogger(__name__)

ATTRS_KEY = "wsidino_features"
INCOMING = ".incoming"
FORMAT = {"format": "wsidino-features", "version": 1}
CHUNK_ROWS = 4096  # rows per chunk of cls / mean_patch
Batch = tuple[int, int, np.ndarray]  # slide index, first row in the slide, global tile indices


@dataclass
class ExtractResult:
    output: Path
    extracted: list[str]
    skipped: list[str]
    tiles: int
    seconds: float
    tiles_per_s: float
    model_hash: str
    backend: str


def _open_dataset(cfg: ExtractConfig) -> Any:
    from dinov3_core.data.tile_dataset import TileDataset

    root = ts.check_store(cfg.store)  # TileStoreError (a WsidinoError) names the store and what to do
    try:
        return TileDataset(root, slide_ids=cfg.slide_ids, image_format="numpy")
    except (ValueError, KeyError, OSError) as err:
        raise ExtractError(f"tile store {root} cannot be read for extraction: {err}") from None


def _done(out: Path, slide_id: str, model_hash: str, source_fingerprint: str | None, precision: str) -> bool:
    """Extracted completely, with this model and precision, from this version of the slide (a re-scanned slide that
    was re-tiled under the same id has another source fingerprint: its features are stale)."""
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
    )


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


def write_pca_png(
    path: Path, coords: np.ndarray, features: np.ndarray, tile_level0: float, max_side: int, title: str = ""
) -> list[float]:
    """Tiles at their level-0 coords, scaled so the map's long side is `max_side` px, coloured by the first 3 PCs;
    `title` (slide, model) on top, what the colours mean and the explained variance below."""
    from PIL import Image, ImageDraw

    rgb, ratio = pca_rgb(features)
    extent = float((coords.max(0) - coords.min(0)).max()) + tile_level0
    scale = max_side / extent
    side = max(1, round(tile_level0 * scale))
    xy = np.round((coords - coords.min(0)) * scale).astype(int)
    legend = "colour = CLS features' principal components 1/2/3 as R/G/B; variance explained " + "/".join(
        f"{100 * r:.0f}%" for r in ratio
    )
    width = max(int(xy[:, 0].max()) + side, 7 * len(legend), 7 * len(title))
    height = int(xy[:, 1].max()) + side + 28
    canvas = np.full((height, width, 3), 255, np.uint8)
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


class _SlideArrays:
    """A slide's output arrays, written in whole chunks: rows are buffered until their chunk is complete, so zarr
    encodes each chunk once instead of reading and re-encoding it for every batch that lands in it."""

    def __init__(self, group: Any, n: int, d: int, p: int, patch_tokens: bool, batch_size: int) -> None:
        self.n, self.chunk = n, max(1, min(n, CHUNK_ROWS))
        self.arrays = {name: group.create_array(name, shape=(n, d), chunks=(self.chunk, d), dtype="float32")
                       for name in ("cls", "mean_patch")}  # fmt: skip
        self.buffers = {name: np.empty((self.chunk, d), np.float32) for name in self.arrays}
        pc = max(1, min(n, batch_size))  # one chunk per batch: written whole as it comes
        self.patch = None
        if patch_tokens:
            self.patch = group.create_array("patch", shape=(n, p, d), chunks=(pc, p, d), dtype="float32")

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


def _batches(ds: Any, slides: list[int], offsets: np.ndarray, batch_size: int) -> Iterator[Batch]:
    for s in slides:
        n, start = int(ds.tile_counts[s]), int(offsets[s])
        for b0 in range(0, n, batch_size):
            yield s, b0, np.arange(start + b0, start + min(n, b0 + batch_size))


def _batch_reader(ds: Any, model: FeatureModel) -> Callable[[Batch], Any]:
    """Reads and prepares a batch on any thread; a failure names the slide and its rows (it surfaces in the main
    thread when the model reaches that batch)."""
    reader = TileReader(ds, model.prepare)

    def read(batch: Batch) -> Any:
        s, b0, idx = batch
        try:
            return reader(idx)
        except Exception as err:
            raise ExtractError(
                f"tiles {b0}-{b0 + len(idx) - 1} of slide {ds.slide_ids[s]} in tile store {ds.slide_store(s)} cannot "
                f"be read ({type(err).__name__}: {str(err)[:300]}); re-tile the slide"
            ) from err

    return read


def _extract_slide(cfg: ExtractConfig, ds: Any, s: int, model: FeatureModel, out: Path, bar: Any,
                   batches: Iterator[tuple[Batch, Any]], writer: BackgroundWriter) -> None:  # fmt: skip
    slide_id = ds.slide_ids[s]
    incoming = out / INCOMING / slide_id
    shutil.rmtree(incoming, ignore_errors=True)
    incoming.parent.mkdir(parents=True, exist_ok=True)
    try:
        _write_slide(cfg, ds, s, model, out, bar, batches, writer, incoming)
    except BaseException:
        writer.discard()  # nothing may still be writing into the staging directory we remove
        shutil.rmtree(incoming, ignore_errors=True)
        raise


def _write_slide(cfg: ExtractConfig, ds: Any, s: int, model: FeatureModel, out: Path, bar: Any,
                 batches: Iterator[tuple[Batch, Any]], writer: BackgroundWriter, incoming: Path) -> None:  # fmt: skip
    slide_id = ds.slide_ids[s]
    n = int(ds.tile_counts[s])
    group = zarr.open_group(str(incoming), mode="w")
    arrays: _SlideArrays | None = None
    for _ in range(0, n, cfg.batch_size):
        (bs, b0, idx), prepared = next(batches)
        assert bs == s, "batches out of step with slides"
        try:
            cls, mean, patch = model.infer(prepared, cfg.patch_tokens)
        except (RuntimeError, ValueError, AssertionError) as err:
            if b0:
                raise
            raise ExtractError(
                f"model {model.path} failed on the {ds.tile_size} px tiles of slide {slide_id} ({type(err).__name__}: "
                f"{str(err)[:300]}); the tile size must be a multiple of the model's patch size"
            ) from None
        if arrays is None:
            p = patch.shape[1] if patch is not None else 0
            arrays = _SlideArrays(group, n, cls.shape[1], p, cfg.patch_tokens, cfg.batch_size)
        writer.submit(arrays.write, b0, cls, mean, patch)
        bar.update(len(idx))
    writer.drain()
    coords = ds.slide_coords(s)
    group.create_array("coords", data=coords.astype(np.int64))
    assert arrays is not None  # a slide in the index has at least one tile
    cls_all = np.asarray(arrays.arrays["cls"][:])
    group.create_array("slide_embedding", data=cls_all.mean(0).astype(np.float32))
    tile_attrs = ds.slide_attrs(s)
    ratio = None
    picture = pictures_dir(out) / slide_id / "pca.png"
    if cfg.pca_map:  # written beside the store, renamed into place once the slide is committed
        tile_level0 = float(tile_attrs.get("tile_size_level0") or ds.tile_size)
        title = f"{slide_id}: {n} tiles, model {model.path.name} ({model.hash[:8]})"
        picture.parent.mkdir(parents=True, exist_ok=True)
        staged = picture.with_name(".pca.png.incoming")
        ratio = write_pca_png(staged, coords, cls_all, tile_level0, cfg.pca_max_side, title)
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
        "normalisation": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        "pca_explained_variance": ratio,
        "created": ts.utc_now(),
        "complete": True,
    }
    final = out / "slides" / slide_id
    if final.exists():
        shutil.rmtree(final)  # extracted with another model: replaced
    os.replace(incoming, final)
    if cfg.pca_map:
        os.replace(staged, picture)


def pictures_dir(output: str | os.PathLike[str]) -> Path:
    """Where extract's pictures and resolved config go: beside the feature store, not inside it (a zarr store that
    holds other files makes zarr warn, and copies of the store drag them along). features.zarr → features/."""
    out = Path(output)
    return out.with_suffix("") if out.suffix == ".zarr" else out.parent / f"{out.name}.pictures"


def _init_output(out: Path, cfg: ExtractConfig) -> None:
    if out.exists() and (out / "zarr.json").is_file():
        attrs = zarr.open_group(str(out), mode="r").attrs.asdict().get(ATTRS_KEY, {})
        if attrs.get("format") != FORMAT["format"]:
            raise ExtractError(f"output {out} is a zarr store but not a wsidino feature store; choose another output")
    elif out.exists() and any(p.name != MANIFEST_NAME and not p.name.startswith(".") for p in out.iterdir()):
        raise ExtractError(f"output {out} exists and is not a feature store; choose a new path")
    root = zarr.open_group(str(out), mode="a")
    root.attrs[ATTRS_KEY] = {**FORMAT, "source_store": str(Path(cfg.store).resolve())}
    if "slides" not in root:
        root.create_group("slides")


def run_extract(cfg: ExtractConfig, progress: Callable[[int, int], None] | None = None) -> ExtractResult:
    """Extract per `cfg`; returns which slides were extracted / skipped and the throughput.

    `progress(tiles done, tiles to do)`: called as batches finish (the Prefect progress artifact); with
    `cfg.progress` a bar on a terminal, else a log line with rate and ETA every 30 s."""
    start_time = time.perf_counter()
    ds = _open_dataset(cfg)
    torch_threads = torch.get_num_threads()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    try:
        model = open_model(cfg.model, cfg.backend, cfg.providers, cfg.num_threads, cfg.device, cfg.precision)
        if model.patch_size and ds.tile_size % model.patch_size:
            raise ExtractError(
                f"tile store {cfg.store} has {ds.tile_size} px tiles, not a multiple of the model's patch size "
                f"{model.patch_size}: re-tile with a tile_size that is"
            )
        out = Path(cfg.output)
        _init_output(out, cfg)
        offsets = np.concatenate([[0], np.cumsum(ds.tile_counts)])
        mine = list(range(cfg.shard_index, len(ds.slide_ids), cfg.num_shards))
        fingerprints = {s: ds.slide_attrs(s).get("source_fingerprint") for s in mine}
        todo = [s for s in mine if not _done(out, ds.slide_ids[s], model.hash, fingerprints[s], cfg.precision)]
        skipped = [ds.slide_ids[s] for s in mine if s not in todo]
        for sid in skipped:
            logger.info("slide %s already extracted with model %s: skipped", sid, model.hash)
        total = int(sum(ds.tile_counts[s] for s in todo))
        bar = Progress("extract", unit="tile", total=total, enabled=cfg.progress, callback=progress,
                       every_s=cfg.progress_every_s)  # fmt: skip
        with tracking.stage_run(cfg.tracking, "extract", params={"model_hash": model.hash, "backend": model.backend,
                                                                   "store": cfg.store}):  # fmt: skip
            readers, depth = cfg.loader_threads, cfg.prefetch_batches
            writer = BackgroundWriter(readers, depth)
            jobs = _batches(ds, todo, offsets, cfg.batch_size)
            try:
                with contextlib.closing(read_ahead(jobs, _batch_reader(ds, model), readers, depth)) as batches:
                    for s in todo:
                        _extract_slide(cfg, ds, s, model, out, bar, batches, writer)
            finally:
                writer.close()
                bar.close()
            seconds = time.perf_counter() - start_time
            if cfg.tracking.enabled:
                tracking.log_metrics({"tiles": total, "tiles_per_s": total / max(seconds, 1e-9)})
        pictures_dir(out).mkdir(parents=True, exist_ok=True)
        (pictures_dir(out) / "extract_config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    finally:
        torch.set_num_threads(torch_threads)
    result = ExtractResult(
        output=out,
        extracted=[ds.slide_ids[s] for s in todo],
        skipped=skipped,
        tiles=total,
        seconds=seconds,
        tiles_per_s=total / max(seconds, 1e-9),
        model_hash=model.hash,
        backend=model.backend,
    )
    logger.info("extracted %d tiles of %d slides (%d skipped) in %.1f s: %.1f tiles/s", total, len(todo),
                len(skipped), seconds, result.tiles_per_s)  # fmt: skip
    return result
