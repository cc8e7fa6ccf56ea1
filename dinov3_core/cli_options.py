"""What every `wsidino` command shares: the launch options, the tile progress bar, and how a failed torchrun job
is told to the user (its one-line cause, never torchrun's traceback)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from dinov3_core.errors import EXIT_FAILED, EXIT_USAGE


def launch_options(p: argparse.ArgumentParser, what: str = "training") -> None:
    p.add_argument("--nproc-per-node", type=int, default=1, help=f"{what} processes per node (torchrun; one per GPU)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (multi-node needs --rdzv-endpoint)")
    p.add_argument("--rdzv-endpoint", help="host:port of the c10d rendezvous for multi-node runs")


def launch_from(args: argparse.Namespace) -> Any:
    """The `LaunchSettings` the launch options ask for."""
    from dinov3_core.launch.training import LaunchSettings

    return LaunchSettings(nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint)


def tile_progress(stage: str, cfg: Any) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    """Tile and extract progress: a bar on a terminal, else log lines with rate and ETA (dinov3_core.progress)."""
    from dinov3_core.progress import Progress

    bar = Progress(stage, unit="tile", enabled=cfg.progress)
    return bar.set, bar.close


def job_failed(command: str, err: Any, rerun: str) -> int:
    """A failed torchrun job (`TorchrunFailed`): a rank's bad input (exit 2) is its one-line cause and exit 2;
    anything else names the failing rank and how to resume."""
    if err.rank_exit_code == 2:
        print(f"wsidino {command}: {bad_input_cause(err)}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wsidino {command}: {err}\nRerun the same command to {rerun}.", file=sys.stderr)
    return EXIT_FAILED


def bad_input_cause(err: Any) -> str:
    """The one line a rank that stopped on bad input printed (`error: …`, exit 2), and where its log is."""
    lines = [line.strip() for line in (err.root_cause or "").splitlines() if line.strip()]
    said = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    cause = said[-1] if said else (lines[-1] if lines else str(err))
    return f"{cause} (rank {err.rank}; every rank's output: {err.run_log_dir or err.log_dir})"


__all__ = ["bad_input_cause", "job_failed", "launch_from", "launch_options", "tile_progress"]
