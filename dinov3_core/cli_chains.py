"""`wsidino pipeline` and `wsidino retrain`: the commands that chain stages. Each is the plain function its Prefect
flow runs (`dinov3_core.pipeline.run.run_pipeline`, `dinov3_core.retrain.cycle.run_cycle`) with the stage
runner of this process (`dinov3_core.runner.run_stage`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from dinov3_core.cli_options import job_failed, launch_from, launch_options, tile_progress
from dinov3_core.config import parse_overrides
from dinov3_core.errors import EXIT_FAILED, EXIT_OK
from dinov3_core.stages import STAGES, Stage


def local_runner(launch: Any, bars: bool = True) -> Any:
    """The `StageRunner` of this process: `run_stage` with the launch, a tile bar on the terminal."""
    from dinov3_core.runner import RunHooks, StageOutcome, run_stage

    def run(stage: Stage[Any], stage_cfg: Any, parent: str | None, force: bool = False) -> StageOutcome[Any]:
        hooks = RunHooks(parent_run_id=parent)
        close_bar: Callable[[], None] = lambda: None  # noqa: E731
        if bars and stage.shows_progress(launch):
            hooks.progress, close_bar = tile_progress(stage.name, stage_cfg)
        try:
            return run_stage(stage, stage_cfg, force=force, launch=launch, hooks=hooks)
        finally:
            close_bar()

    return run


def cmd_pipeline(args: argparse.Namespace) -> int:
    """Every stage on the user's slides: the pipeline flow's code path (`dinov3_core.pipeline.run.run_pipeline`)
    with the stage runner of this process."""
    import time

    from dinov3_core.launch import TorchrunFailed
    from dinov3_core.pipeline.config import load_pipeline_config
    from dinov3_core.pipeline.report import final_report
    from dinov3_core.pipeline.run import run_pipeline

    values = parse_overrides(args.overrides)
    for key, dest in PIPELINE_OPTIONS.items():
        if getattr(args, dest) is not None:
            values[key] = getattr(args, dest)
    if args.print_config:
        print(resolved_pipeline_config(args.config or "cpu", values), end="")
        return EXIT_OK
    cfg = load_pipeline_config(args.config or "cpu", values)
    launch = launch_from(args)
    start = time.perf_counter()
    try:
        result = run_pipeline(cfg, local_runner(launch), world_size=launch.world_size)
    except TorchrunFailed as err:
        return job_failed("pipeline", err, "resume from the last checkpoint")
    print(final_report(result, cfg.tracking.experiment, time.perf_counter() - start))
    failed = [(name, o.summary) for name, o in result.outcomes.items() if o.summary.failures]
    for name, summary in failed:  # the last lines say what failed
        print(f"wsidino pipeline: {name}: {summary.note()}; a rerun retries them", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


PLACEHOLDERS = {"slides": "<slides>", "workdir": "/<workdir>"}  # --print-config without the paths


def resolved_pipeline_config(config: str, values: dict[str, Any]) -> str:
    """The pipeline config as YAML (`--config` of it reproduces the run), then, as comments, every stage's config
    with every value the run will use. Paths not given print as `???` (required), the stages' under `/<workdir>`."""
    import yaml

    from dinov3_core.config import ConfigError, named_config_keys
    from dinov3_core.config_tree import to_dict, to_yaml
    from dinov3_core.pipeline.config import load_pipeline_config
    from dinov3_core.pipeline.run import stage_config

    given = set(values) | named_config_keys("pipeline", config)  # a --config file may set the paths
    missing = {k: v for k, v in PLACEHOLDERS.items() if k not in given}
    cfg = load_pipeline_config(config, {**missing, **values})
    text = to_yaml(cfg)
    for key, placeholder in missing.items():
        text = text.replace(f"{key}: {placeholder}\n", f"{key}: ???\n")
    if "workdir" in missing:  # the MLflow store follows the work directory the run will be given
        text = text.replace(f"uri: sqlite:///{PLACEHOLDERS['workdir']}/mlflow.db\n", "uri: null\n")
    lines = ["", "# What each stage will run with, resolved (read only: --config reads the keys above):"]
    for name in cfg.selected():
        try:
            resolved: Any = to_dict(stage_config(cfg, name))
        except ConfigError as err:
            resolved = f"not resolvable yet: {err}"
        lines += [f"# {line}" for line in yaml.safe_dump({name: resolved}, sort_keys=False).splitlines()]
    return text + "\n".join(lines) + "\n"


# `wsidino pipeline` options → pipeline config keys (the same fields as the `pipeline` deployment's form).
PIPELINE_OPTIONS = {
    "slides": "slides",
    "workdir": "workdir",
    "weights": "weights",
    "annotations": "annotations",
    "start_at": "start_from",
    "stop_after": "stop_after",
    "force": "force",
    "yes": "yes",
}

PIPELINE_EPILOG = """\
stages:
  tile → pretrain → gram → convert → export → evaluate → extract, each in its own folder under --workdir
  (README: "On your own slides"). A stage whose manifest shows the same inputs and config is skipped, so the
  same command resumes after a failure and a rerun does nothing; training resumes from its last checkpoint.

configs (configs/pipeline/; hardware and run times: docs/hardware.md):
  cpu            the demo and smoke path (tiny ViT, minutes on a laptop; not a model to deploy)
  vits16-1gpu    continued pretraining of released ViT-S/16 weights on one GPU (24 GB or more)
  vitb16-1gpu    ViT-B/16 on one GPU (24 GB or more)      vitl16-1gpu   ViT-L/16 on one GPU (24 GB or more)
  vitb16, vitl16 one node of 8 GPUs (--nproc-per-node 8)

examples:
  wsidino pipeline --slides /data/slides --workdir runs/lab1
  wsidino pipeline --slides /data/slides --workdir runs/lab1 --config vitb16-1gpu \\
      --weights /weights/dinov3_vitb16_pretrain_lvd1689m-73cec8be.pth --annotations /data/annotations
  wsidino pipeline --slides /data/slides --workdir runs/lab1 --from convert --force export
  wsidino pipeline ... pretrain.train.stop_at=2000 evaluate.gate.margin=0.01 tile.mpp=0.5
"""

RETRAIN_EPILOG = """\
a cycle:
  tile new slides into <root>/tiles.zarr → record the data snapshot → train only when the cohort grew
  (trigger.min_new_slides, trigger.min_new_tiles, trigger.force) → pretrain warm-started from
  @champion → gram → convert → export → evaluate (the gate moves @champion or not) → extract the
  cohort's features with the champion → retention. Each cycle lives in <root>/cycles/<id>/; a rerun
  after a crash resumes it. Any stage's config key goes after its name: pretrain.train.stop_at=100.

examples:
  wsidino retrain --slides slides/ --root retrain/ --config tiny --annotations slides/annotations
  wsidino retrain --slides /data/slides --root /data/retrain --config vitb16 --nproc-per-node 8 \\
      pretrained_weights=/models/dinov3_vitb16.pth trigger.min_new_slides=20
"""


def cmd_retrain(args: argparse.Namespace) -> int:
    """One retraining cycle; exits 0 whether it trained or was skipped (the last line says which and why)."""
    from dinov3_core.launch import TorchrunFailed
    from dinov3_core.retrain.config import load_retrain_config
    from dinov3_core.retrain.cycle import run_cycle

    values = parse_overrides(args.overrides)
    for key in ("slides", "root", "annotations"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    cfg = load_retrain_config(args.config, values)
    try:
        launch = launch_from(args)
        result = run_cycle(cfg, local_runner(launch, bars=False), world_size=launch.world_size)
    except TorchrunFailed as err:
        return job_failed("retrain", err, "resume the cycle")
    print(result.message)
    return EXIT_OK


def add_chain_commands(sub: Any) -> None:
    pipeline = sub.add_parser(
        "pipeline",
        help="Every stage on your slides in one work directory: tile → pretrain → gram → convert → export → "
        "evaluate → extract.",
        description="Every stage on your slides, each output under --workdir (the MLflow store too, unless a "
        "tracking server is configured). The `pipeline` deployment runs the same code.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=PIPELINE_EPILOG,
    )
    pipeline.add_argument(
        "--slides",
        help="directory (searched recursively), glob, slide file or .txt/.csv list "
        "(required, unless the --config file sets it)",
    )
    pipeline.add_argument("--workdir", help="where every output goes (required, unless the --config file sets it)")
    pipeline.add_argument("--config", help="a name under configs/pipeline/ (default cpu) or a YAML path")
    pipeline.add_argument(
        "--weights",
        help="released DINOv3 backbone to warm-start from: a .pth file, or a preset "
        "(vitb16, …) found in weights_dir=DIR / $WSIDINO_WEIGHTS_DIR",
    )
    pipeline.add_argument(
        "--annotations",
        help="QuPath <slide_id>.geojson folder or CSV slide_id,x,y,label for the "
        "evaluation (without: label-free health, no promotion)",
    )
    stage_name: dict[str, Any] = {"choices": STAGES.names, "metavar": "STAGE"}  # --from, --to and --force take one
    pipeline.add_argument(
        "--from", dest="start_from", **stage_name, help="start at this stage (earlier outputs are used as they are)"
    )
    pipeline.add_argument("--to", dest="stop_after", **stage_name, help="stop after this stage")
    pipeline.add_argument(
        "--force", action="append", **stage_name, help="rerun this stage even when up to date (repeat for several)"
    )
    pipeline.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration as YAML and exit (use it as --config)",
    )
    pipeline.add_argument(
        "--yes",
        action="store_const",
        const=True,
        help="run even when the training would take more than a day on this machine's CPU (= yes=true)",
    )
    pipeline.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="pipeline keys, or a stage's key after its name: pretrain.train.stop_at=9",
    )
    launch_options(pipeline)
    pipeline.set_defaults(func=cmd_pipeline)

    retrain = sub.add_parser(
        "retrain",
        help="One scheduled-retraining cycle: tile new slides, train from the champion when the cohort grew, "
        "evaluate, promote only if better, extract with the champion.",
        description="One retraining cycle in a new versioned directory under --root (see "
        "docs/retraining.md). Exits 0 whether it trained or skipped, printing which and why.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=RETRAIN_EPILOG,
    )
    retrain.add_argument("--config", help="YAML file, or a name under configs/retrain/ (tiny: CPU-sized; vitb16)")
    retrain.add_argument("--slides", help="the cohort's slides: directory, glob, or .txt/.csv list")
    retrain.add_argument("--root", help="where the tile store, cycles/ and features/ live")
    retrain.add_argument("--annotations", help="QuPath GeoJSON folder or CSV for the evaluation")
    retrain.add_argument("overrides", nargs="*", metavar="key=value", help="retrain or <stage>.<key> overrides")
    launch_options(retrain)
    retrain.set_defaults(func=cmd_retrain)
