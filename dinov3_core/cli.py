"""`wsidino <stage>`: every stage runs alone from the command line.

Options name the essentials; everything else is `key=value` overrides on the stage's typed config, on top of an
optional `--config` (a YAML path or a name under configs/<stage>/). Every stage goes through the same runner as the
Prefect tasks (`dinov3_core.run.run_stage`): same manifests and skip rule, same MLflow runs, and pretrain/gram run
as a torchrun job through the same launcher (timeout, no orphans, the failing rank's own error).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from dinov3_core.cli_chains import add_chain_commands
from dinov3_core.config import ConfigError, config_dir, load_config, parse_overrides
from dinov3_core.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, WsidinoError, exit_code

# Each stage's options that map onto config keys (option dest → config key).
STAGE_OPTIONS: dict[str, dict[str, str]] = {
    "tile": {"input": "input", "output": "output", "workers": "workers"},
    "pretrain": {"store": "data.stores", "output_dir": "output_dir"},
    "gram": {"pretrain_dir": "pretrain_dir", "output_dir": "output_dir"},
    "convert": {"input": "input", "output_dir": "output_dir"},
    "export": {"weights": "weights", "output": "output"},
    "evaluate": {"store": "store", "candidate": "candidate", "output": "output", "annotations": "annotations"},
    "extract": {"store": "store", "model": "model", "output": "output"},
}
DEFAULT_CONFIG = {"pretrain": "tiny"}
# A few overrides that belong to each stage (`--help`; tests/test_cli.py loads every one against its schema).
OVERRIDE_EXAMPLES: dict[str, str] = {
    "tile": "tile_size=224 mpp=0.5 workers=4 filters.pen_filter=true",
    "pretrain": "optim.epochs=30 train.stop_at=100 train.batch_size_per_gpu=32",
    "gram": "gram.teacher_policy=best_dense train.stop_at=50",
    "convert": "which=student safetensors=true",
    "export": "fp16=true huggingface=true register_alias=candidate",
    "evaluate": "gate.margin=0.01 probe.bootstrap=2000",
    "extract": "batch_size=128 patch_tokens=true",
}

EVALUATE_EPILOG = """\
protocol:
  Tiles take the class of the annotation polygon their centre lies in (min_overlap=F: and F of their area).
  Slides (or patients, patients=CSV) are split into training and test, never one slide on both sides.
  Each model embeds the same labelled tiles (cls+mean_patch, probe.features) and is scored by a kNN
  (k=20, cosine, temperature-weighted), a linear probe (logistic regression, C chosen on a validation
  split of the training slides) and few-shot kNN (1-16 tiles per class); balanced accuracy and
  macro-F1 (AUROC for two classes) with bootstrap 95 % intervals over test slides. Label-free health
  (CLS effective rank, dense consistency) is reported for every model, annotations or not.

gate:
  The candidate becomes <register_name>@champion when the lower 95 % bound of its paired difference to
  the champion on gate.primary_metric (default linear.balanced_accuracy) exceeds gate.margin, it is not
  below the baseline, and its features did not collapse. The first model must beat the baseline.
  Without annotations promotion is off (gate.label_free=true opts into a health-only gate);
  gate.promote=false measures without moving aliases.

examples:
  wsidino evaluate --store tiles.zarr --candidate model/model.onnx --output evaluation \\
      --annotations annotations/ probe.bootstrap=2000 gate.margin=0.01
  wsidino evaluate ... patients=patients.csv sites=scanners.csv baseline=/weights/dinov3_vitb16.pth
"""  # the CPU-sized recipe unless --config names another


def _config(stage: str, args: argparse.Namespace) -> Any:
    from dinov3_core.stage_specs import STAGE_SPECS

    values = parse_overrides(args.overrides)
    for dest, key in STAGE_OPTIONS[stage].items():
        value = getattr(args, dest, None)
        if value is not None:
            values[key] = value
    return load_config(STAGE_SPECS[stage].schema(), args.config or DEFAULT_CONFIG.get(stage), values, stage=stage)


def tile_progress(stage: str, cfg: Any) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    """Tile and extract progress: a bar on a terminal, else log lines with rate and ETA (dinov3_core.progress)."""
    from dinov3_core.progress import Progress

    bar = Progress(stage, unit="tile", enabled=cfg.progress)
    return bar.set, bar.close


def cmd_stage(args: argparse.Namespace) -> int:
    from dinov3_core.launch import TorchrunFailed
    from dinov3_core.launch.training import LaunchSettings
    from dinov3_core.run import RunHooks, run_stage

    stage = args.command
    cfg = _config(stage, args)
    if args.print_config:  # the resolved configuration; `--config` of this output reproduces the run
        from dinov3_core.config import to_yaml

        print(to_yaml(cfg), end="")
        return EXIT_OK
    hooks = RunHooks()
    close_bar: Callable[[], None] = lambda: None  # noqa: E731
    launch = None
    if hasattr(args, "nproc_per_node"):  # a stage with a torchrun job (extract, evaluate: with more than 1 process)
        launch = LaunchSettings(
            nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint
        )
    if stage == "tile" or (stage == "extract" and launch is not None and launch.world_size > 1):
        hooks.progress, close_bar = tile_progress(stage, cfg)  # extract as a job: the sum over its ranks
    try:
        outcome = run_stage(stage, cfg, force=args.force, launch=launch, hooks=hooks)
    except TorchrunFailed as err:
        bad_input = err.rank_exit_code == 2
        resume = {"extract": "finish the slides not yet extracted",
                  "evaluate": "embed again (models already embedded come from the cache)"}.get(
            stage, "resume from the last checkpoint")  # fmt: skip
        hint = "" if bad_input else f"\nRerun the same command to {resume}."
        print(f"wsidino {stage}: {err}{hint}", file=sys.stderr)
        return EXIT_USAGE if bad_input else EXIT_FAILED
    finally:
        close_bar()
    if stage == "tile" and outcome.result is not None:
        from dinov3_core.tiling import report

        print(report.format_summary(outcome.result))
    return EXIT_FAILED if outcome.manifest.summary.get("failed") else EXIT_OK


class StageParser(argparse.ArgumentParser):
    """A stage's sub-parser: its help marks each option whose config key has no default "(required, …)" — argparse
    cannot require it, since a --config file may set it instead. Marked when help is shown, not when the parser is
    built: finding the keys imports the stage's config schema (pretrain's pulls in torch, ~2 s of every command)."""

    stage: str | None = None

    def format_help(self) -> str:
        if self.stage in STAGE_OPTIONS:
            _mark_required(self, self.stage)
            self.stage = None  # once
        return super().format_help()


def _mark_required(parser: argparse.ArgumentParser, stage: str) -> None:
    from omegaconf import OmegaConf

    from dinov3_core.stage_specs import STAGE_SPECS

    options = STAGE_OPTIONS[stage]
    missing = set(OmegaConf.missing_keys(OmegaConf.structured(STAGE_SPECS[stage].schema())))
    for action in parser._actions:
        key = options.get(action.dest)
        if key in missing or (stage, key) == ("pretrain", "data.stores"):
            action.help = f"{action.help} (required, unless the --config file sets it)"


def launch_options(p: argparse.ArgumentParser, what: str = "training") -> None:
    p.add_argument("--nproc-per-node", type=int, default=1, help=f"{what} processes per node (torchrun; one per GPU)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (multi-node needs --rdzv-endpoint)")
    p.add_argument("--rdzv-endpoint", help="host:port of the c10d rendezvous for multi-node runs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wsidino", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=StageParser)

    def stage_parser(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.stage = name
        named = sorted(q.stem for q in (config_dir() / name).glob("*.yaml"))
        p.add_argument("--config", help=f"YAML file, or a name under configs/{name}/ ({', '.join(named)})")
        p.add_argument("overrides", nargs="*", metavar="key=value",
                       help=f"any config key of the stage, e.g. {OVERRIDE_EXAMPLES[name]}")  # fmt: skip
        p.add_argument(
            "--force", action="store_true", help="run even when the stage manifest says the outputs are up to date"
        )
        p.add_argument(
            "--print-config",
            action="store_true",
            help="print the resolved configuration as YAML and exit (use it as --config)",
        )
        p.set_defaults(func=cmd_stage)
        return p

    tile = stage_parser("tile", "Whole-slide images → zarr tile store (µm/px-exact tiles, tissue mask, QC).")
    tile.add_argument("--input", help="directory, glob, slide file, or .txt/.csv list of slide paths")
    tile.add_argument("--output", help="tile store directory, e.g. out/tiles.zarr")
    tile.add_argument("--workers", type=int, help="worker processes (default from config: 1)")

    pretrain = stage_parser("pretrain", "DINOv3 self-supervised (continued) pretraining on tile stores.")
    pretrain.add_argument("--store", action="append", help="tile store (repeat for several); = data.stores")
    pretrain.add_argument("--output-dir", help="run directory (checkpoints, eval/, metrics); = output_dir")
    launch_options(pretrain)

    gram = stage_parser("gram", "Gram anchoring: continue a pretraining run with a frozen, auto-selected gram teacher.")
    gram.add_argument("--pretrain-dir", help="the pretraining run directory to continue (its eval/ holds the teachers)")
    gram.add_argument("--output-dir", help="the gram stage's own run directory; = output_dir")
    launch_options(gram)

    convert = stage_parser("convert", "DCP checkpoint → backbone.pth with the released DINOv3 key layout.")
    convert.add_argument("--input", help="a ckpt/<iteration>/ directory, or a run directory (latest checkpoint)")
    convert.add_argument("--output-dir", help="where backbone.pth and config.yaml go")

    export = stage_parser(
        "export",
        "backbone.pth → ONNX (dynamic batch and size), checked with ONNX Runtime; with huggingface=true also a "
        "transformers model directory (hf/), checked the same way.",
    )
    export.add_argument("--weights", help="backbone.pth or .safetensors (e.g. from wsidino convert)")
    export.add_argument("--output", help="model.onnx path")

    evaluate = stage_parser(
        "evaluate",
        "Frozen-feature probes of the candidate, the registry's champion and a baseline on your annotations; "
        "promotes the candidate to @champion only when it is better.",
    )
    evaluate.formatter_class = argparse.RawDescriptionHelpFormatter
    evaluate.epilog = EVALUATE_EPILOG
    evaluate.add_argument("--store", help="tile store with the annotated slides (tiles.zarr)")
    evaluate.add_argument("--candidate", help="the model to judge: model.onnx (export) or backbone.pth (convert)")
    evaluate.add_argument("--output", help="evaluation directory (evaluation.json, evaluation.md, pictures, cache)")
    evaluate.add_argument(
        "--annotations", help="folder of QuPath <slide_id>.geojson exports, or a CSV slide_id,x,y,label"
    )
    launch_options(evaluate, "embedding")  # more than 1: each model's labelled tiles embedded by a torchrun job

    extract = stage_parser("extract", "Features for every tile of a tile store, slide embeddings, PCA maps.")
    extract.add_argument("--store", help="tile store (tiles.zarr)")
    extract.add_argument("--model", help="model.onnx (ONNX Runtime) or backbone.pth (PyTorch)")
    extract.add_argument("--output", help="feature store (features.zarr)")
    launch_options(extract, "extraction")
    add_chain_commands(sub)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"wsidino {args.command}: configuration error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except WsidinoError as err:
        print(f"wsidino {args.command}: {err}", file=sys.stderr)
        return exit_code(err)  # a run that stopped itself (RunStopped) kept its output: rerun to resume
    except ValueError as err:  # launch settings out of bounds (pydantic names the field)
        print(f"wsidino {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"wsidino {args.command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


def run() -> None:
    """The `wsidino` command: `main`, then a quick exit.

    Python's own finalisation tears down every imported module one by one; with MLflow's import graph (pandas,
    pyarrow, SQLAlchemy, …) loaded that took 0.5–1.4 s after the work was done, a fifth of a short tile run. The
    exit handlers still run (MLflow, logging, multiprocessing register theirs there) and the streams are flushed;
    only the teardown of module objects, which leaves nothing behind, is skipped.
    """
    code = main()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)  # a thread still working: let Python wait for it as usual
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
