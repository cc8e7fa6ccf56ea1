"""Tile-stage throughput, side by side in one run, on the large demo SVS.

Measures, each in its own subprocess (so peak RSS is per measurement):
- naive: `OpenSlide.read_region` per tile + resize + one zarr write per tile (unsharded, one chunk per tile);
- stage: `run_tile` with 1 and 2 workers (end to end: planning, tissue mask, QC pictures, commit);
- ceiling: decoding the slide's level-0 JPEG tiles alone (tifffile + libjpeg-turbo, one thread), expressed in
  level-0 pixels/s and converted to "tiles/s" with the level-0 pixels each stored tile needs;
- bytes per tile for each compressor, and peak RSS of the stage with 1 slide vs 4 slides (must stay flat).

Usage: python benchmarks/tile_throughput.py [--quick] [--output DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def _peak_rss_mib() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024


def _config(slides: list[str], out: Path, **kw: object):
    from dinov3_core.config import load_config
    from dinov3_core.tiling.config import TileConfig

    list_file = out.with_suffix(".txt")
    list_file.write_text("\n".join(slides))
    values = {"input": str(list_file), "output": str(out), "progress": False, "tracking.enabled": False, **kw}
    return load_config(TileConfig, None, values)


def measure_stage(slides: list[str], out: Path, workers: int, compressor: str) -> dict:
    from dinov3_core.tiling.stage import run_tile

    shutil.rmtree(out, ignore_errors=True)
    cfg = _config(slides, out, workers=workers, compressor=compressor)
    start = time.perf_counter()
    result = run_tile(cfg)
    seconds = time.perf_counter() - start
    ok = [o for o in result.outcomes if o.status == "ok"]
    return {
        "tiles": result.tiles_written,
        "seconds": seconds,
        "tiles_per_s": result.tiles_written / seconds,
        "bytes_per_tile": sum(o.bytes_per_tile or 0 for o in ok) / max(1, len(ok)),
        "failed": result.counts["failed"],
        "peak_rss_mib": _peak_rss_mib(),
    }


def measure_naive(slide: str, out: Path) -> dict:
    """What most scripts do: one read_region, one resize and one zarr write per tile."""
    import numpy as np
    import zarr
    from PIL import Image

    from dinov3_core.tiling.plan import SlideTask, plan_slide

    cfg = _config([slide], out)
    plan = plan_slide(SlideTask("naive", Path(slide)), cfg, {})
    shutil.rmtree(out, ignore_errors=True)
    import openslide

    read, tile = plan.read, cfg.tile_size
    start = time.perf_counter()
    osr = openslide.OpenSlide(slide)
    arr = zarr.create_array(
        str(out), shape=(plan.n_tiles, tile, tile, 3), chunks=(1, tile, tile, 3), dtype="uint8", zarr_format=3
    )
    for i, (x, y) in enumerate(plan.coords):
        region = osr.read_region((int(x), int(y)), read.level, (read.read_size, read.read_size)).convert("RGB")
        if read.needs_resize:
            region = region.resize((tile, tile), Image.Resampling.BOX)
        arr[i] = np.asarray(region)
    seconds = time.perf_counter() - start
    return {
        "tiles": plan.n_tiles,
        "seconds": seconds,
        "tiles_per_s": plan.n_tiles / seconds,
        "peak_rss_mib": _peak_rss_mib(),
        "level0_px_per_tile": read.tile_size_level0**2,
    }


def measure_decode_ceiling(slide: str) -> dict:
    """Decode every level-0 JPEG tile once, single thread: the most a JPEG-bound tiler could reach."""
    import tifffile

    with tifffile.TiffFile(slide) as tif:
        page = tif.pages[0]
        start = time.perf_counter()
        pixels = 0
        for segment in page.segments(maxworkers=1):
            data = segment[0]
            pixels += data.shape[-3] * data.shape[-2] if data is not None else 0
        seconds = time.perf_counter() - start
    return {"level0_px": pixels, "seconds": seconds, "mpx_per_s": pixels / seconds / 1e6}


def _child(mode: str, args: dict) -> dict:
    cmd = [sys.executable, str(HERE), "--child", mode, "--child-args", json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--quick", action="store_true", help="small test slide instead of the 16k demo slide")
    parser.add_argument("--child")
    parser.add_argument("--child-args")
    args = parser.parse_args()
    if args.child:
        a = json.loads(args.child_args)
        if args.child == "stage":
            res = measure_stage(a["slides"], Path(a["out"]), a["workers"], a["compressor"])
        elif args.child == "naive":
            res = measure_naive(a["slide"], Path(a["out"]))
        else:
            res = measure_decode_ceiling(a["slide"])
        print(json.dumps(res))
        return

    from dinov3_core.sample_slides import make_sample_slides

    out = Path(args.output).resolve()
    work = out / "tile_throughput"
    work.mkdir(parents=True, exist_ok=True)
    preset = "test" if args.quick else "demo"
    samples = make_sample_slides(out / f"slides-{preset}", preset=preset, negatives=False)
    svs = [p for p in samples.slides if p.suffix == ".svs"]
    big = str(max(svs, key=lambda p: p.stat().st_size))
    # Four differently named copies of the same slide: RSS must not grow with the number of slides.
    copies = []
    for k in range(4):
        link = work / f"copy{k}.svs"
        if not link.exists():
            os.symlink(big, link)
        copies.append(str(link))

    results: dict[str, dict] = {}
    results["ceiling"] = _child("ceiling", {"slide": big})
    results["naive"] = _child("naive", {"slide": big, "out": str(work / "naive.zarr")})
    for workers in (1, 2):
        results[f"stage_w{workers}"] = _child(
            "stage",
            {
                "slides": [big],
                "out": str(work / f"w{workers}.zarr"),
                "workers": workers,
                "compressor": "zstd",
            },
        )
    for comp in ("none", "jpeg"):
        results[f"stage_{comp}"] = _child(
            "stage", {"slides": [big], "out": str(work / f"{comp}.zarr"), "workers": 2, "compressor": comp}
        )
    results["stage_w1_4slides"] = _child(
        "stage", {"slides": copies, "out": str(work / "four.zarr"), "workers": 1, "compressor": "zstd"}
    )

    px_per_tile = results["naive"]["level0_px_per_tile"]
    ceiling_tps = results["ceiling"]["mpx_per_s"] * 1e6 / px_per_tile
    naive_tps = results["naive"]["tiles_per_s"]
    w1, w2 = results["stage_w1"], results["stage_w2"]
    summary = {
        "slide": big,
        "tiles": w1["tiles"],
        "level0_px_per_tile": px_per_tile,
        "ceiling_tiles_per_s": ceiling_tps,
        "speedup_w1_vs_naive": w1["tiles_per_s"] / naive_tps,
        "scaling_w2_vs_w1": w2["tiles_per_s"] / w1["tiles_per_s"],
        "w1_fraction_of_ceiling": w1["tiles_per_s"] / ceiling_tps,
    }
    rows = [
        ("JPEG decode only (ceiling, 1 thread)", ceiling_tps, "-", "-"),
        ("naive read_region + per-tile zarr write", naive_tps, "-", results["naive"]["peak_rss_mib"]),
        ("wsidino tile, 1 worker (zstd)", w1["tiles_per_s"], w1["bytes_per_tile"], w1["peak_rss_mib"]),
        ("wsidino tile, 2 workers (zstd)", w2["tiles_per_s"], w2["bytes_per_tile"], w2["peak_rss_mib"]),
        (
            "wsidino tile, 2 workers (none)",
            results["stage_none"]["tiles_per_s"],
            results["stage_none"]["bytes_per_tile"],
            results["stage_none"]["peak_rss_mib"],
        ),
        (
            "wsidino tile, 2 workers (jpeg q90)",
            results["stage_jpeg"]["tiles_per_s"],
            results["stage_jpeg"]["bytes_per_tile"],
            results["stage_jpeg"]["peak_rss_mib"],
        ),
        (
            "wsidino tile, 1 worker, 4 slides",
            results["stage_w1_4slides"]["tiles_per_s"],
            results["stage_w1_4slides"]["bytes_per_tile"],
            results["stage_w1_4slides"]["peak_rss_mib"],
        ),
    ]
    lines = [
        f"Slide: {Path(big).name}, {w1['tiles']} tiles of 224 px at 0.5 µm/px "
        f"({px_per_tile} level-0 px decoded per tile)",
        "",
        "| measurement | tiles/s | bytes/tile | peak RSS (MiB) |",
        "|---|---:|---:|---:|",
    ]
    for name, tps, bpt, rss in rows:
        bpt_s = f"{bpt:,.0f}" if isinstance(bpt, float | int) else bpt
        rss_s = f"{rss:,.0f}" if isinstance(rss, float | int) else rss
        lines.append(f"| {name} | {tps:,.1f} | {bpt_s} | {rss_s} |")
    lines += [
        "",
        f"- 1 worker vs naive: **{summary['speedup_w1_vs_naive']:.2f}×** (goal ≥ 3×)",
        f"- 2 workers vs 1 worker: **{summary['scaling_w2_vs_w1']:.2f}×** (2 cores)",
        f"- 1 worker vs JPEG-decode ceiling: **{summary['w1_fraction_of_ceiling']:.0%}** (goal ≥ 70 %)",
    ]
    table = "\n".join(lines)
    print(table)
    (out / "tile_throughput.json").write_text(json.dumps({"summary": summary, "results": results}, indent=2))
    (out / "tile_throughput.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
