"""`python -m dinov3_core.train --config FILE_OR_NAME [key=value ...]`: the torchrun entry point.

    torchrun --standalone --nproc-per-node=8 -m dinov3_core.train --config vitb16-continued \
        data.stores=[/data/tiles.zarr] output_dir=/runs/vitb16-lab student.pretrained_weights=/w/vitb16.pth

Also runs alone (one process). Exit codes: 0 done, 2 bad input (message on stderr, no traceback). Any other
failure raises; `@record` writes it to torchelastic's error file, so torchrun reports the failing rank's
traceback as the root cause.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import record

from dinov3_core.config import load_config
from dinov3_core.procutil import rank_entry
from dinov3_core.train.config import PretrainConfig
from dinov3_core.train.pretrain import PretrainResult, run_pretrain


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dinov3_core.train", description="DINOv3 pretraining stage")
    parser.add_argument("--config", required=True, help="YAML file, or a name under configs/pretrain/")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.stop_at=10")
    return parser


@record
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def pretrain() -> PretrainResult:
        cfg = load_config(PretrainConfig, args.config, args.overrides, stage="pretrain")
        return run_pretrain(cfg, os.environ.get("MLFLOW_RUN_ID"))  # the stage runner's run (rank 0 joins it)

    return rank_entry(pretrain, _report)


def _report(result: PretrainResult) -> str:
    return (
        f"pretrain: iterations {result.start_iteration}…{result.end_iteration - 1} of {result.total_iterations} "
        f"done, {result.images_per_second:.1f} images/s after a first step of {result.first_step_seconds:.1f} s; "
        f"last checkpoint {result.last_checkpoint}"
    )


if __name__ == "__main__":
    sys.exit(main())
