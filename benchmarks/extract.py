"""Feature extraction throughput (tiles/s, end to end from the tile store): PyTorch eager vs ONNX Runtime, CPU.

A real tile store (the tile stage on the "test" sample slides, 224 px tiles at 0.5 µm/px, stride 112), randomly
initialised backbones saved in the released layout (tiny `vit_test` and `vit_small`), each exported to ONNX with
`run_export` (fp32, parity-checked), then `run_extract` over every tile with each backend. tiles/s counts
everything `run_extract` does: reading + decoding tiles, normalising, the model, zarr writes, PCA maps; the best
of `--repeats` runs into fresh outputs (the first run also warms caches).

Usage: python benchmarks/extract.py [--quick] [--output DIR]   (writes DIR/extract.json; --quick: tiny only)
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

from dinov3_core.config import load_config
from dinov3_core.export.config import ExportConfig, ExtractConfig
from dinov3_core.export.extract import run_extract
from dinov3_core.export.onnx_export import INFERENCE_OVERRIDES, run_export
from dinov3_core.models import backbone_kwargs, build_backbone, save_backbone
from dinov3_core.tiling.config import TileConfig
from dinov3_core.tiling.engine import run_tile
from wsidino_dev.sample_slides import make_sample_slides


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_store(root: Path, tile_size: int, stride: int, preset: Literal["demo", "test"] = "test") -> Path:
    slides = make_sample_slides(root / "slides", preset, negatives=False)
    store = root / "tiles.zarr"
    for slide in slides.slides:
        values = {"input": str(slide), "output": str(store), "tile_size": tile_size, "stride": stride, "mpp": 0.5}
        run_tile(load_config(TileConfig, None, {**values, "progress": False, "tracking.enabled": False}))
    return store


def make_model(root: Path, arch: str) -> tuple[Path, Path, float]:
    torch.manual_seed(0)
    kwargs = backbone_kwargs(arch, **INFERENCE_OVERRIDES)
    weights = save_backbone(build_backbone(arch, **INFERENCE_OVERRIDES).eval(), root / arch / "backbone.pth")
    (root / arch / "config.yaml").write_text(yaml.safe_dump({"arch": arch, "backbone_kwargs": kwargs}))
    start = time.perf_counter()
    values = {"weights": str(weights), "output": str(root / arch / "model.onnx"), "parity_batches": [2]}
    result = run_export(load_config(ExportConfig, None, values))
    return weights, result.path, time.perf_counter() - start


def bench(store: Path, model: Path, root: Path, repeats: int, batch_size: int) -> dict[str, Any]:
    best: dict[str, Any] = {}
    for r in range(repeats):
        values = {"store": str(store), "model": str(model), "output": str(root / f"f{r}.zarr"), "progress": False,
                  "batch_size": batch_size}  # fmt: skip
        result = run_extract(load_config(ExtractConfig, None, values))
        if not best or result.tiles_per_s > best["tiles_per_s"]:
            best = {"tiles": result.tiles, "seconds": result.seconds, "tiles_per_s": result.tiles_per_s}
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only, one repeat")
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--tile-size", type=int, default=224)
    parser.add_argument("--stride", type=int, default=112, help="tile stride (px): overlap gives more tiles")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    archs = ["vit_test"] if args.quick else ["vit_test", "vit_small"]
    repeats = 1 if args.quick else args.repeats
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        store = make_store(root, args.tile_size, args.stride)
        log(f"tile store ready in {time.perf_counter() - t0:.1f} s")
        for arch in archs:
            weights, onnx_path, export_s = make_model(root / "models", arch)
            log(f"{arch}: exported in {export_s:.1f} s")
            for backend, model in (("torch eager", weights), ("onnxruntime", onnx_path)):
                row = {"arch": arch, "backend": backend, "export_seconds": round(export_s, 1)}
                row.update(bench(store, model, root / arch / backend.replace(" ", "_"), repeats, args.batch_size))
                rows.append(row)
                log(f"{arch:10s} {backend:12s} {row['tiles']} tiles  {row['tiles_per_s']:.1f} tiles/s")
    env = {"torch": torch.__version__, "python": platform.python_version(), "cpu": platform.processor(),
           "threads": torch.get_num_threads(), "tile_size": args.tile_size, "batch_size": args.batch_size}  # fmt: skip
    (out / "extract.json").write_text(json.dumps({"environment": env, "results": rows}, indent=2))
    print(f"\n## extract (tiles/s, {args.tile_size} px tiles, batch {args.batch_size}, CPU {env['threads']} threads)\n")
    print("| model | backend | tiles | tiles/s | export s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['arch']} | {r['backend']} | {r['tiles']} | {r['tiles_per_s']:.1f} | {r['export_seconds']} |")


if __name__ == "__main__":
    main()
