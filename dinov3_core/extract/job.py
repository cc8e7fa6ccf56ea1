"""`python -m dinov3_core.extract.job --config FILE [key=value ...]`: one rank of an extract job.

    torchrun --standalone --nproc-per-node=8 -m dinov3_core.extract.job --config features/launch_config.yaml

`wsidino extract --nproc-per-node N` (and the Prefect extract flow with `launch.nproc_per_node` > 1) starts this
through the one torchrun launcher (`dinov3_core.launch`), which writes the resolved config beside the feature store.
Every rank runs `run_extract` with its `Team` (gloo; each rank on its own GPU when there are GPUs); rank 0 logs
into the stage's MLflow run (`$MLFLOW_RUN_ID`) and writes the run record the launcher summarises. Exit codes: 0
done, 2 bad input (message on stderr, no traceback); any other failure raises and `@record` hands it to torchrun
as the failing rank's root cause.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import record

from dinov3_core.config import load_config
from dinov3_core.extract.config import ExtractConfig
from dinov3_core.extract.extract import run_extract
from dinov3_core.inference.team import Team, rank_main


@record
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dinov3_core.extract.job", description=__doc__)
    parser.add_argument("--config", required=True, help="the extract config (YAML)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)

    def work(team: Team) -> str:
        cfg = load_config(ExtractConfig, args.config, args.overrides, stage="extract")
        if not team.is_main:  # one MLflow writer; the other ranks' figures reach it through the gather
            cfg = dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, enabled=False))
        r = run_extract(cfg, team=team, mlflow_run_id=os.environ.get("MLFLOW_RUN_ID"))  # the runner's run
        rate = f"{r.tiles} tiles in {r.seconds:.1f} s ({r.tiles_per_s:.1f} tiles/s) on {team.world_size} rank(s)"
        return f"extract: {len(r.extracted)} slides extracted, {len(r.skipped)} up to date, {rate} → {r.output}"

    return rank_main(work)


if __name__ == "__main__":
    sys.exit(main())
