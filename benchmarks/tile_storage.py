"""What the tile store's codec and the DCT-scaled decode cost and change, side by side in one run.

Reference tiles: the tile stage on the 32k benchmark slide (`tile_throughput.py` makes it; `--quick`: the demo
slide) with lossless zstd and full decoding. Each codec then stores the same tiles through the stage's writer
(`IncomingSlide.write_tiles`) and they are read back through the training reader (`TileDataset.read_batch`):
- bytes per tile, and what 10⁸ tiles take;
- write and read tiles/s on one core;
- pixel error against the lossless tiles (mean |Δ|, max |Δ|, PSNR);
- what it does to features: the CLS token of a fixed backbone (`--backbone backbone.pth`, else a ViT-S/16 with a
  fixed random initialisation) on an evenly spaced sample of tiles: relative L2 change ‖Δ‖/‖cls‖ and cosine
  similarity against the lossless tiles. Yardsticks on the same tiles: the tile shifted by 1 px (a change no one
  would call a different tile), and the DCT-scaled decode (`scaled_decode`, the default) against full decoding.

Usage: python benchmarks/tile_storage.py [--quick] [--output DIR] [--backbone PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CODECS = {  # name → tile config overrides
    "zstd-1 (lossless)": {"compressor": "zstd", "compression_level": 1},
    "jpeg q95": {"compressor": "jpeg", "jpeg_quality": 95},
    "jpeg q90 (default)": {"compressor": "jpeg", "jpeg_quality": 90},
    "jpeg q80": {"compressor": "jpeg", "jpeg_quality": 80},
    "none": {"compressor": "none"},
}


def tile_reference(slide: str, out: Path, scaled_decode: bool) -> np.ndarray:
    """Every tile of the slide, lossless (zstd), full or DCT-scaled decoding."""
    import zarr

    from dinov3_core.config import load_config
    from dinov3_core.tiling.config import TileConfig
    from dinov3_core.tiling.engine import run_tile

    shutil.rmtree(out, ignore_errors=True)
    values = {
        "input": slide,
        "output": str(out),
        "progress": False,
        "tracking.enabled": False,
        "compressor": "zstd",
        "scaled_decode": scaled_decode,
    }
    result = run_tile(load_config(TileConfig, None, values))
    (outcome,) = result.outcomes
    return zarr.open_group(str(out / "slides" / outcome.slide_id), mode="r")["tiles"][:]


def store_with(tiles: np.ndarray, root: Path, overrides: dict) -> dict:
    """Write `tiles` as one slide with the stage's writer, read them back with the training reader."""
    from dinov3_core.data.tile_dataset import TileDataset
    from dinov3_core.tiling import store as ts

    shutil.rmtree(root, ignore_errors=True)
    store = ts.init_store(root)
    incoming = ts.begin_slide(
        store,
        "s",
        n_tiles=len(tiles),
        tile_size=tiles.shape[1],
        tiles_per_shard=256,
        compression_level=overrides.get("compression_level", 1),
        compressor=overrides["compressor"],
        jpeg_quality=overrides.get("jpeg_quality", 90),
        columns={"coords": np.zeros((len(tiles), 2), dtype=np.int64)},  # the index needs a coords column
    )
    start = time.perf_counter()
    for a, b in incoming.shard_ranges():
        incoming.write_tiles(a, tiles[a:b])
    write_s = time.perf_counter() - start
    stored = ts.stored_bytes(incoming.path / "tiles")
    ts.commit_slide(incoming, {"tile_size": int(tiles.shape[1]), "compressor": overrides["compressor"]})
    ds = TileDataset(store)
    rows = np.arange(len(ds))
    back = ds.read_batch(rows)  # warm the page cache: the reads below measure decoding, not the disk
    start = time.perf_counter()
    back = ds.read_batch(rows)
    read_s = time.perf_counter() - start
    return {
        "tiles": back,
        "bytes_per_tile": stored / len(tiles),
        "write_tps": len(tiles) / write_s,
        "read_tps": len(tiles) / read_s,
    }


def pixel_error(a: np.ndarray, ref: np.ndarray) -> dict:
    d = np.abs(a.astype(np.int16) - ref.astype(np.int16))
    mse = float((d.astype(np.float64) ** 2).mean())
    return {
        "mean_abs": float(d.mean()),
        "max_abs": int(d.max()),
        "psnr_db": float("inf") if mse == 0 else 10 * np.log10(255**2 / mse),
    }


class Features:
    """CLS tokens of a fixed backbone (ImageNet-normalised tiles, as in extraction)."""

    def __init__(self, backbone: str | None) -> None:
        import torch

        from dinov3_core.inference.backbone import INFERENCE_OVERRIDES, BackboneFeatures, load_backbone
        from dinov3_core.inference.feature_model import normalise
        from dinov3_core.models import build_backbone

        torch.manual_seed(0)
        if backbone:
            model, self.name = load_backbone(backbone), Path(backbone).name
        else:
            model, self.name = build_backbone("vit_small", **INFERENCE_OVERRIDES), "ViT-S/16, fixed random init"
            if hasattr(model, "init_weights"):
                model.init_weights()
        self._model, self._normalise, self._torch = BackboneFeatures(model).eval(), normalise, torch

    def cls(self, tiles: np.ndarray) -> np.ndarray:
        out = []
        with self._torch.inference_mode():
            for a in range(0, len(tiles), 16):
                cls, _ = self._model(self._torch.from_numpy(self._normalise(tiles[a : a + 16])))
                out.append(cls.float().numpy())
        return np.concatenate(out)


def feature_change(cls: np.ndarray, ref: np.ndarray) -> dict:
    rel = np.linalg.norm(cls - ref, axis=1) / np.linalg.norm(ref, axis=1)
    cos = (cls * ref).sum(1) / (np.linalg.norm(cls, axis=1) * np.linalg.norm(ref, axis=1))
    return {
        "rel_l2_mean": float(rel.mean()),
        "rel_l2_max": float(rel.max()),
        "cos_min": float(cos.min()),
        "cls_max_abs": float(np.abs(cls - ref).max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backbone", help="backbone.pth (released layout) for the feature comparison")
    parser.add_argument("--feature-tiles", type=int, default=64)
    args = parser.parse_args()
    out = Path(args.output).resolve()
    work = out / "tile_storage"
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(HERE))
    if args.quick:
        from wsidino_dev.sample_slides import make_sample_slides

        samples = make_sample_slides(out / "slides-demo", preset="demo", negatives=False)
        slide = str(max((p for p in samples.slides if p.suffix == ".svs"), key=lambda p: p.stat().st_size))
    else:
        from tile_throughput import benchmark_slide

        slide = str(benchmark_slide(out / "bench_slide_32k.svs"))

    ref = tile_reference(slide, work / "full.zarr", scaled_decode=False)
    dct = tile_reference(slide, work / "dct.zarr", scaled_decode=True)
    stored = {name: store_with(ref, work / f"codec{i}.zarr", o) for i, (name, o) in enumerate(CODECS.items())}
    features = Features(args.backbone)
    sample = np.linspace(0, len(ref) - 1, min(args.feature_tiles, len(ref))).astype(int)
    ref_cls = features.cls(ref[sample])
    rows = []
    for name, s in stored.items():
        rows.append(
            {
                "name": name,
                **{k: v for k, v in s.items() if k != "tiles"},
                **pixel_error(s["tiles"], ref),
                **feature_change(features.cls(s["tiles"][sample]), ref_cls),
            }
        )
    shifted = np.roll(ref[sample], 1, axis=2)
    yardsticks = {
        "DCT-scaled decode vs full decode (lossless storage)": (dct, dct[sample]),
        "tile shifted by 1 px (np.roll)": (None, shifted),
    }
    yard_rows = []
    for name, (whole, tiles) in yardsticks.items():
        err = pixel_error(whole, ref) if whole is not None else pixel_error(tiles, ref[sample])
        yard_rows.append({"name": name, **err, **feature_change(features.cls(tiles), ref_cls)})

    lines = [
        f"{len(ref)} tiles of 224 px from {Path(slide).name}; features: {features.name}, {len(sample)} tiles.",
        "",
        "| storage | bytes/tile | 10⁸ tiles | write tiles/s | read tiles/s | mean abs Δpx | max abs Δpx | PSNR dB "
        "| CLS ‖Δ‖/‖cls‖ mean | max | CLS cos min |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['bytes_per_tile']:,.0f} | {r['bytes_per_tile'] * 1e8 / 1e12:,.1f} TB | "
            f"{r['write_tps']:,.0f} | {r['read_tps']:,.0f} | {r['mean_abs']:.2f} | {r['max_abs']} | "
            f"{r['psnr_db']:.1f} | {r['rel_l2_mean']:.4f} | {r['rel_l2_max']:.4f} | {r['cos_min']:.5f} |"
        )
    lines += [
        "",
        "| yardstick | mean abs Δpx | max abs Δpx | PSNR dB | CLS ‖Δ‖/‖cls‖ mean | max | CLS cos min |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in yard_rows:
        lines.append(
            f"| {r['name']} | {r['mean_abs']:.2f} | {r['max_abs']} | {r['psnr_db']:.1f} | {r['rel_l2_mean']:.4f} | "
            f"{r['rel_l2_max']:.4f} | {r['cos_min']:.5f} |"
        )
    table = "\n".join(lines)
    print(table)
    (out / "tile_storage.json").write_text(json.dumps({"codecs": rows, "yardsticks": yard_rows}, indent=2))


if __name__ == "__main__":
    main()
