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
from dinov3_core.errors import WsidinoError, exit_code
from dinov3_core.procutil import die_with_parent
from dinov3_core.train.config import PretrainConfig
from dinov3_core.train.pretrain import run_pretrain


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dinov3_core.train", description="DINOv3 pretraining stage")
    parser.add_argument("--config", required=True, help="YAML file, or a name under dinov3_core/configs/pretrain/")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.stop_at=10")
    return parser


@record
def main(argv: Sequence[str] | None = None) -> int:
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # a torchrun rank: do not outlive a SIGKILLed torchrun
        die_with_parent()
    args = build_parser().parse_args(argv)

    try:
        cfg = load_config(PretrainConfig, args.config, args.overrides, stage="pretrain")
        result = run_pretrain(cfg, os.environ.get("MLFLOW_RUN_ID"))  # the stage runner's run (rank 0 joins it)
    except WsidinoError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return exit_code(err)  # 2: bad input (the stage removes what it created), 1: stopped, output kept
    if os.environ.get("RANK", "0") != "0":
        return 0
    print(
        f"pretrain: iterations {result.start_iteration}…{result.end_iteration - 1} of {result.total_iterations} "
        f"done, {result.images_per_second:.1f} images/s after a first step of {result.first_step_seconds:.1f} s; "
        f"last checkpoint {result.last_checkpoint}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
