"""Tiling from Prefect: the tile engine called directly vs the Prefect tile flow, with and without Dask.

The same slides (the demo preset's three good slides, each twice under another name: 6 slides; `--quick`: the
test preset) into a fresh store per measurement, tracking off, one Prefect API server (a temporary local one)
for the whole session:
- run_tile, workers=2: the engine's own process pool, called directly;
- run_stage("tile"), workers=2: the same under the stage manifest, as `wsidino tile` runs it;
- flow, no Dask: `tile_flow` with `workers=2` (the same engine, plus a flow run, its task and artifacts);
- flow, Dask LocalCluster (2 workers): `dask.n_workers=2`, the cluster started and stopped by the flow run;
- flow, Dask at an address (2 workers): a 2-worker LocalCluster started beforehand, reached by its address; two
  flow runs on it (the first pays the workers' imports of wsidino and Prefect).
tiles/s is tiles written / wall seconds of the call, start-up included.

Usage: python benchmarks/tile_prefect.py [--quick] [--output DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

COPIES = 2  # each good demo slide under this many names: enough slides that start-up does not dominate


def slide_listing(out: Path, preset: str) -> Path:
    from wsidino_dev.sample_slides import make_sample_slides

    samples = make_sample_slides(out / f"slides-{preset}", preset=preset, negatives=False)
    copies = out / f"slides-{preset}-copies"
    copies.mkdir(parents=True, exist_ok=True)
    slides = []
    for slide in samples.slides:
        for i in range(COPIES):
            target = copies / f"{slide.stem}-{i}{slide.suffix}"
            if not target.exists() or target.stat().st_size != slide.stat().st_size:
                shutil.copyfile(slide, target)
            slides.append(target)
    listing = out / f"tile-prefect-{preset}.txt"
    listing.write_text("".join(f"{p}\n" for p in slides))
    return listing


def measure(name: str, tile: Any) -> dict[str, Any]:
    start = time.perf_counter()
    tiles, slides_ok = tile()
    seconds = time.perf_counter() - start
    row = {"measurement": name, "slides": slides_ok, "tiles": tiles, "seconds": seconds, "tiles_per_s": tiles / seconds}
    print(f"  {name}: {tiles} tiles in {seconds:.1f} s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--quick", action="store_true", help="the test preset's small slides")
    args = parser.parse_args()
    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    listing = slide_listing(out, "test" if args.quick else "demo")
    overrides = {"workers": 2, "progress": False, "tracking.enabled": False}
    # A Prefect home of its own (the temporary server's database; no telemetry), inherited by the Dask workers.
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="tile-prefect-home-")
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"

    from distributed import LocalCluster
    from prefect.testing.utilities import prefect_test_harness

    from dinov3_core.config import load_config
    from dinov3_core.runner import run_stage
    from dinov3_core.tiling.config import TileConfig
    from dinov3_core.tiling.engine import run_tile
    from flows.tile import tile_flow
    from tasks.params import DaskParams, StageOptions, TileParams, TrackingParams

    def store(name: str) -> Path:
        path = out / f"tile-prefect-{name}.zarr"
        shutil.rmtree(path, ignore_errors=True)
        return path

    def engine() -> tuple[int, int]:
        values = {"input": str(listing), "output": str(store("engine")), **overrides}
        result = run_tile(load_config(TileConfig, None, values))
        return result.tiles_written, result.counts["ok"]

    def cli_path() -> tuple[int, int]:
        values = {"input": str(listing), "output": str(store("stage")), **overrides}
        result = run_stage("tile", load_config(TileConfig, None, values)).result
        return result.tiles_written, result.counts["ok"]

    def flow(name: str, dask: DaskParams) -> tuple[int, int]:
        params = TileParams(
            input=str(listing),
            output=str(store(name)),
            stage=StageOptions(config="default", overrides=["workers=2"]),
            tracking=TrackingParams(enabled=False),
            dask=dask,
        )
        summary = tile_flow(params)["summary"]
        return summary["tiles_total"], summary["ok"]

    rows = []
    with prefect_test_harness(server_startup_timeout=120):
        rows.append(measure("run_tile, workers=2 (the engine alone)", engine))
        rows.append(measure("run_stage('tile'), workers=2 (what `wsidino tile` runs)", cli_path))
        rows.append(measure("flow, no Dask (workers=2)", lambda: flow("flow", DaskParams())))
        rows.append(measure("flow, Dask LocalCluster, 2 workers", lambda: flow("local", DaskParams(n_workers=2))))
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
            address = DaskParams(address=cluster.scheduler_address)
            for run in ("1st run", "2nd run"):  # the 2nd finds the workers' imports done
                rows.append(measure(f"flow, Dask at an address, 2 workers, {run}", lambda: flow("address", address)))

    base = rows[0]["tiles_per_s"]
    lines = [
        f"{rows[0]['slides']} slides, {rows[0]['tiles']} tiles; {listing.name}",
        "",
        "| measurement | tiles | seconds | tiles/s | vs run_tile |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['measurement']} | {r['tiles']} | {r['seconds']:.1f} | {r['tiles_per_s']:.1f} | "
            f"{r['tiles_per_s'] / base:.2f}× |"
        )
    print("\n".join(lines))
    (out / "tile_prefect.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
