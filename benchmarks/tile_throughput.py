"""Tile-stage throughput, side by side in one run, on one large sample SVS.

The slide is made by the sample-slide generator (real IHC tissue, Aperio SVS, JPEG YCbCr 4:2:0 tiles of 256 px):
32768² px at 0.25 µm/px (40×), about 3,000 tissue tiles of 224 px at 0.5 µm/px; `--quick` uses the 16k demo slide.
Measures, each in its own subprocess (so peak RSS is per measurement):
- naive: the same tissue detection, then `OpenSlide.read_region` + resize + one zarr write per tile (one chunk
  per tile, unsharded);
- stage: `run_tile` with 1 and 2 workers, end to end (worker start-up, planning, tissue mask, QC pictures,
  commit), plus its steady-state write rate (tiles / seconds spent reading, resizing, encoding and writing);
- ceiling: decoding the slide's level-0 JPEG tiles alone (tifffile + libjpeg-turbo, one thread), expressed in
  level-0 pixels/s and converted to "tiles/s" with the level-0 pixels each stored tile needs;
- bytes per tile for each compressor, and peak RSS of the stage with 1 slide vs 4 slides (must stay flat).

Usage: python benchmarks/tile_throughput.py [--quick] [--output DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()


class PeakRss:
    """Peak of the summed RSS of this process and all its descendants, sampled every 20 ms.

    (`ru_maxrss` is useless here: Linux carries it across exec, so a child inherits its parent's peak.)
    """

    def __init__(self) -> None:
        import psutil

        self.peak = 0
        self._me = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            for proc in [self._me, *self._me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += proc.memory_info().rss
            self.peak = max(self.peak, total)
            self._stop.wait(0.02)

    def mib(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 2**20


_RSS: PeakRss | None = None


def _peak_rss_mib() -> float:
    return _RSS.mib() if _RSS is not None else float("nan")


def _config(slides: list[str], out: Path, **kw: object):
    from dinov3_core.config import load_config
    from dinov3_core.tiling.config import TileConfig

    list_file = out.with_suffix(".txt")
    list_file.write_text("\n".join(slides))
    values = {"input": str(list_file), "output": str(out), "progress": False, "tracking.enabled": False, **kw}
    return load_config(TileConfig, None, values)


def measure_stage(slides: list[str], out: Path, workers: int, compressor: str) -> dict:
    from dinov3_core.tiling.engine import run_tile

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
        "plan_seconds": result.plan_seconds,
        "write_seconds": result.write_seconds,
        "write_tiles_per_s_per_worker": result.tiles_written / max(result.write_seconds, 1e-9),
        "bytes_per_tile": sum(o.bytes_per_tile or 0 for o in ok) / max(1, len(ok)),
        "failed": result.counts["failed"],
        "peak_rss_mib": _peak_rss_mib(),
    }


def measure_naive(slide: str, out: Path) -> dict:
    """What most scripts do: one read_region, one resize and one zarr write per tile."""
    import numpy as np
    import openslide
    import zarr
    from PIL import Image

    from dinov3_core.tiling.plan import SlideTask, plan_slide

    cfg = _config([slide], out, reader="openslide")
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    plan = plan_slide(SlideTask("naive", Path(slide)), cfg, {})  # the same tissue detection as the stage
    read, tile = plan.read, cfg.tile_size
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


def _benchmark_slide(path: Path) -> Path:
    """A 32768² Aperio SVS at 0.25 µm/px with ~45 % tissue, generated once and reused."""
    if path.exists():
        return path
    import numpy as np

    from wsidino_dev.sample_slides import TissueCanvas, write_svs

    rng = np.random.default_rng(7)
    canvas = TissueCanvas.plan(32768, 32768, rng=rng, mpp=0.25, tissue=True, pen_mark=True, tissue_fraction=(0.4, 0.5))
    tmp = path.with_name(f".{path.name}.tmp")
    write_svs(tmp, canvas, mpp=0.25, app_mag=40, levels=4)
    os.replace(tmp, path)
    return path


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
        global _RSS
        _RSS = PeakRss()
        a = json.loads(args.child_args)
        if args.child == "stage":
            res = measure_stage(a["slides"], Path(a["out"]), a["workers"], a["compressor"])
        elif args.child == "naive":
            res = measure_naive(a["slide"], Path(a["out"]))
        else:
            res = measure_decode_ceiling(a["slide"])
        print(json.dumps(res))
        return

    from wsidino_dev.sample_slides import make_sample_slides

    out = Path(args.output).resolve()
    work = out / "tile_throughput"
    work.mkdir(parents=True, exist_ok=True)
    if args.quick:
        samples = make_sample_slides(out / "slides-demo", preset="demo", negatives=False)
        big = str(max((p for p in samples.slides if p.suffix == ".svs"), key=lambda p: p.stat().st_size))
    else:
        big = str(_benchmark_slide(out / "bench_slide_32k.svs"))
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
    for workers in (1, 2):
        results[f"stage_w{workers}_4slides"] = _child(
            "stage",
            {"slides": copies, "out": str(work / f"four_w{workers}.zarr"), "workers": workers, "compressor": "zstd"},
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
        "scaling_w2_vs_w1_4slides": results["stage_w2_4slides"]["tiles_per_s"]
        / results["stage_w1_4slides"]["tiles_per_s"],
        "w1_fraction_of_ceiling": w1["tiles_per_s"] / ceiling_tps,
        "w1_steady_fraction_of_ceiling": w1["write_tiles_per_s_per_worker"] / ceiling_tps,
    }
    rows = [
        ("JPEG decode only (ceiling, 1 thread)", ceiling_tps, "-", "-"),
        ("naive read_region + per-tile zarr write", naive_tps, "-", results["naive"]["peak_rss_mib"]),
        ("wsidino tile, 1 worker (zstd)", w1["tiles_per_s"], w1["bytes_per_tile"], w1["peak_rss_mib"]),
        ("  steady-state write rate, per worker", w1["write_tiles_per_s_per_worker"], "-", "-"),
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
        (
            "wsidino tile, 2 workers, 4 slides",
            results["stage_w2_4slides"]["tiles_per_s"],
            results["stage_w2_4slides"]["bytes_per_tile"],
            results["stage_w2_4slides"]["peak_rss_mib"],
        ),
    ]
    lines = [
        f"Slide: {Path(big).name} ({Path(big).stat().st_size / 2**20:.0f} MiB), "
        f"{w1['tiles']} tiles of 224 px at 0.5 µm/px "
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
        f"- 2 workers vs 1 worker: **{summary['scaling_w2_vs_w1']:.2f}×** on this slide, "
        f"**{summary['scaling_w2_vs_w1_4slides']:.2f}×** on 4 slides (2 cores; one slide has ~2 s of serial "
        "start-up, planning and commit)",
        f"- 1 worker vs JPEG-decode ceiling: **{summary['w1_fraction_of_ceiling']:.0%}** end to end, "
        f"**{summary['w1_steady_fraction_of_ceiling']:.0%}** steady state (goal ≥ 70 %)",
        f"- 1 worker: {w1['plan_seconds']:.1f} s planning, {w1['write_seconds']:.1f} s writing, "
        f"{w1['seconds']:.1f} s end to end",
    ]
    table = "\n".join(lines)
    print(table)
    (out / "tile_throughput.json").write_text(json.dumps({"summary": summary, "results": results}, indent=2))
    (out / "tile_throughput.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
