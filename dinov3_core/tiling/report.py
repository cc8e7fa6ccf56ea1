"""Summaries of a tile run: a console table, MLflow params/metrics/artifacts."""

from __future__ import annotations

from typing import Any

from dinov3_core import tracking
from dinov3_core.tiling.engine import TileResult


def summary_metrics(result: TileResult) -> dict[str, float]:
    counts = result.counts
    ok = [o for o in result.outcomes if o.status in ("ok", "skipped") and o.bytes_per_tile]
    return {
        "slides_ok": counts["ok"],
        "slides_skipped": counts["skipped"],
        "slides_failed": counts["failed"],
        "slides_duplicate": result.duplicates,
        "tiles_total": result.total_tiles,
        "tiles_written": result.tiles_written,
        "seconds": round(result.seconds, 3),
        "tiles_per_second": result.tiles_written / result.seconds if result.seconds > 0 else 0.0,
        "bytes_per_tile": sum(o.bytes_per_tile or 0 for o in ok) / len(ok) if ok else 0.0,
    }


def summary_rows(result: TileResult) -> list[dict[str, Any]]:
    return [
        {
            "slide": o.slide_id,
            "status": o.status,
            "tiles": o.tile_count,
            "um_per_px": round(o.mpp_effective, 4) if o.mpp_effective else None,
            "seconds": o.seconds,
            "error": o.error or o.note or "",  # a duplicate's note: which input it repeats
        }
        for o in result.outcomes
    ]


def format_summary(result: TileResult) -> str:
    rows = summary_rows(result)
    header = f"{'slide':<28} {'status':<9} {'tiles':>7} {'µm/px':>7}  error"
    lines = [header, "-" * len(header)]
    for r in rows:
        mpp = f"{r['um_per_px']:.3f}" if r["um_per_px"] else "-"
        lines.append(f"{r['slide'][:28]:<28} {r['status']:<9} {r['tiles']:>7} {mpp:>7}  {r['error']}")
    m = summary_metrics(result)
    lines.append(
        f"{m['slides_ok']:.0f} tiled, {m['slides_skipped']:.0f} up to date, {m['slides_failed']:.0f} failed, "
        f"{m['slides_duplicate']:.0f} duplicate; "
        f"{m['tiles_total']:.0f} tiles in {result.store} ({m['tiles_written']:.0f} written in {m['seconds']:.1f} s)"
    )
    return "\n".join(lines)


def log_to_mlflow(result: TileResult) -> None:
    """Counts as metrics; config, manifest and QC pictures as artifacts (inside an active MLflow run)."""
    tracking.log_metrics(summary_metrics(result))
    tracking.log_artifact(result.store / "config.yaml")
    tracking.log_artifact(result.store / "manifest.json")
    for outcome in result.outcomes:
        for rel in outcome.qc.values():
            tracking.log_artifact(result.store / rel, artifact_path=f"qc/{outcome.slide_id}")
