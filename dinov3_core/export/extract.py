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
output (per-slide commits do not collide); within a process tiles are read and run batch by batch (no reader threads).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
import zarr

from dinov3_core import tracking
from dinov3_core.config import to_dict
from dinov3_core.data.augment import IMAGENET_MEAN, IMAGENET_STD
from dinov3_core.errors import WsidinoError
from dinov3_core.export.config import ExtractConfig
from dinov3_core.manifest import MANIFEST_NAME
from dinov3_core.progress import Progress
from dinov3_core.tiling import store as ts

__all__ = ["ExtractConfig", "ExtractError", "ExtractResult", "FeatureModel", "open_model", "run_extract"]

logger = logging.getLogger(__name__)

ATTRS_KEY = "wsidino_features"
INCOMING = ".incoming"
FORMAT = {"format": "wsidino-features", "version": 1}
Features = tuple[np.ndarray, np.ndarray]  # cls (N, D), patch tokens (N, P, D), float32


class ExtractError(WsidinoError):
    """Bad extract input: tile store, model file or output."""


def file_hash(path: str | os.PathLike[str]) -> str:
    """sha256 (16 hex) of a model file and, for ONNX, its external data file."""
    h = hashlib.sha256()
    for p in (Path(path), Path(f"{path}.data")):
        if p.is_file():
            with p.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def normalise(tiles: np.ndarray) -> np.ndarray:
    """(N, T, T, 3) uint8 → (N, 3, T, T) float32, ImageNet mean / std (as in training)."""
    x = tiles.astype(np.float32).transpose(0, 3, 1, 2) / 255.0
    mean = np.asarray(IMAGENET_MEAN, np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(IMAGENET_STD, np.float32).reshape(1, 3, 1, 1)
    return np.ascontiguousarray((x - mean) / std)


@dataclass
class FeatureModel:
    """A callable (N, 3, H, W) float32 → (cls, patch tokens) with its identity."""

    backend: str
    path: Path
    hash: str
    run: Callable[[np.ndarray], Features]
    providers: list[str] = field(default_factory=list)
    patch_size: int | None = None  # known for the PyTorch backbone


def open_model(path: str | os.PathLike[str], backend: str = "auto", providers: list[str] | None = None,
               threads: int = 0) -> FeatureModel:  # fmt: skip
    p = Path(path)
    if not p.is_file():
        raise ExtractError(f"model file {p} not found; give a model.onnx (export) or backbone.pth (convert)")
    if backend == "auto":
        backend = "onnx" if p.suffix == ".onnx" else "torch"
    if backend == "onnx":
        from dinov3_core.export.onnx_export import INPUT_NAME, ort_session

        try:
            session = ort_session(p, providers, threads)
        except Exception as err:  # ORT raises its own exception types
            raise ExtractError(f"model {p} cannot be loaded by ONNX Runtime ({err})") from None
        outputs = [o.name for o in session.get_outputs()]
        if outputs != ["cls", "patch_tokens"]:
            raise ExtractError(f"model {p} outputs {outputs}; extract needs cls + patch_tokens (export pooled=false)")

        def run_onnx(x: np.ndarray) -> Features:
            cls, patch = session.run(None, {INPUT_NAME: x})
            return cls.astype(np.float32), patch.astype(np.float32)

        return FeatureModel("onnx", p, file_hash(p), run_onnx, session.get_providers())
    if backend == "torch":
        from dinov3_core.export.onnx_export import BackboneFeatures, load_backbone

        model = BackboneFeatures(load_backbone(p)).eval()

        def run_torch(x: np.ndarray) -> Features:
            with torch.inference_mode():
                cls, patch = model(torch.from_numpy(x))
            return cls.float().numpy(), patch.float().numpy()

        return FeatureModel("torch", p, file_hash(p), run_torch, ["torch-cpu"], model.backbone.patch_size)
    raise ExtractError(f"backend={backend!r}: use auto, onnx or torch")


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


def _done(out: Path, slide_id: str, model_hash: str, source_fingerprint: str | None) -> bool:
    """Extracted completely, with this model, from this version of the slide (a re-scanned slide that was
    re-tiled under the same id has another source fingerprint: its features are stale)."""
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


def _extract_slide(cfg: ExtractConfig, ds: Any, s: int, start: int, model: FeatureModel, out: Path, bar: Any) -> None:
    slide_id = ds.slide_ids[s]
    n = int(ds.tile_counts[s])
    incoming = out / INCOMING / slide_id
    shutil.rmtree(incoming, ignore_errors=True)
    incoming.parent.mkdir(parents=True, exist_ok=True)
    group = zarr.open_group(str(incoming), mode="w")
    arrays: dict[str, Any] = {}
    for b0 in range(0, n, cfg.batch_size):
        idx = np.arange(start + b0, start + min(n, b0 + cfg.batch_size))
        try:
            cls, patch = model.run(normalise(ds.read_batch(idx)))
        except (RuntimeError, ValueError, AssertionError) as err:
            if b0:
                raise
            raise ExtractError(
                f"model {model.path} failed on the {ds.tile_size} px tiles of slide {slide_id} ({type(err).__name__}: "
                f"{str(err)[:300]}); the tile size must be a multiple of the model's patch size"
            ) from None
        if not arrays:
            d, p = cls.shape[1], patch.shape[1]
            chunk = max(1, min(n, 4096))
            arrays["cls"] = group.create_array("cls", shape=(n, d), chunks=(chunk, d), dtype="float32")
            arrays["mean_patch"] = group.create_array("mean_patch", shape=(n, d), chunks=(chunk, d), dtype="float32")
            if cfg.patch_tokens:
                pc = max(1, min(n, cfg.batch_size))
                arrays["patch"] = group.create_array("patch", shape=(n, p, d), chunks=(pc, p, d), dtype="float32")
        sl = slice(b0, b0 + len(idx))
        arrays["cls"][sl] = cls
        arrays["mean_patch"][sl] = patch.mean(axis=1)
        if cfg.patch_tokens:
            arrays["patch"][sl] = patch
        bar.update(len(idx))
    coords = ds.slide_coords(s)
    group.create_array("coords", data=coords.astype(np.int64))
    cls_all = np.asarray(arrays["cls"][:])
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
    threads = torch.get_num_threads()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    try:
        model = open_model(cfg.model, cfg.backend, cfg.providers, cfg.num_threads)
        if model.patch_size and ds.tile_size % model.patch_size:
            raise ExtractError(
                f"tile store {cfg.store} has {ds.tile_size} px tiles, not a multiple of the model's patch size "
                f"{model.patch_size}: re-tile with a tile_size that is"
            )
        out = Path(cfg.output)
        _init_output(out, cfg)
        offsets = np.concatenate([[0], np.cumsum(ds.tile_counts)])
        mine = list(range(cfg.shard_index, len(ds.slide_ids), cfg.num_shards))
        todo = [
            s for s in mine if not _done(out, ds.slide_ids[s], model.hash, ds.slide_attrs(s).get("source_fingerprint"))
        ]
        skipped = [ds.slide_ids[s] for s in mine if s not in todo]
        for sid in skipped:
            logger.info("slide %s already extracted with model %s: skipped", sid, model.hash)
        total = int(sum(ds.tile_counts[s] for s in todo))
        bar = Progress("extract", unit="tile", total=total, enabled=cfg.progress, callback=progress,
                       every_s=cfg.progress_every_s)  # fmt: skip
        with tracking.stage_run(cfg.tracking, "extract", params={"model_hash": model.hash, "backend": model.backend,
                                                                   "store": cfg.store}):  # fmt: skip
            try:
                for s in todo:
                    _extract_slide(cfg, ds, s, int(offsets[s]), model, out, bar)
            finally:
                bar.close()
            seconds = time.perf_counter() - start_time
            if cfg.tracking.enabled:
                tracking.log_metrics({"tiles": total, "tiles_per_s": total / max(seconds, 1e-9)})
        pictures_dir(out).mkdir(parents=True, exist_ok=True)
        (pictures_dir(out) / "extract_config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    finally:
        torch.set_num_threads(threads)
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
