"""`python -m dinov3_core.gram --pretrain-dir DIR [--config FILE_OR_NAME] [key=value ...]`: torchrun entry point.

    torchrun --standalone --nproc-per-node=8 -m dinov3_core.gram --pretrain-dir /runs/vitb16-lab \
        --config vitb16 data.stores=[/data/tiles.zarr] output_dir=/runs/vitb16-lab-gram

Exit codes: 0 done, 2 bad input (message on stderr). Other failures raise; `@record` writes torchelastic's
error file so torchrun reports the failing rank's traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import record

from dinov3_core.config import load_config
from dinov3_core.gram.anchoring import GramResult, run_gram
from dinov3_core.gram.config import GramConfig
from dinov3_core.procutil import rank_entry


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dinov3_core.gram", description="DINOv3 gram-anchoring stage")
    parser.add_argument("--pretrain-dir", default=None, help="pretraining output_dir to continue (sets pretrain_dir)")
    parser.add_argument("--config", default=None, help="YAML file, or a name under configs/gram/ (default: schema)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.stop_at=10")
    return parser


@record
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.pretrain_dir is not None:
        overrides.append(f"pretrain_dir={args.pretrain_dir}")

    def gram() -> GramResult:
        cfg = load_config(GramConfig, args.config, overrides, stage="gram")
        return run_gram(cfg, os.environ.get("MLFLOW_RUN_ID"))  # the stage runner's run (rank 0 joins it)

    return rank_entry(gram, _report)


def _report(result: GramResult) -> str:
    chosen = (result.teacher_selection or {}).get("chosen", {})
    return (
        f"gram: iterations {result.start_iteration}…{result.end_iteration - 1} of {result.total_iterations} done; "
        f"gram teacher {chosen.get('path', 'from config')}; {result.gram_updates} refresh(es); "
        f"last checkpoint {result.last_checkpoint}"
    )


if __name__ == "__main__":
    sys.exit(main())
