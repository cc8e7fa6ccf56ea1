"""`wsidino <stage>`: every stage runs alone from the command line.

Options name the essentials; everything else is `key=value` overrides on the stage's typed config, on top of an
optional `--config` (a YAML path or a name under configs/<stage>/). Every stage goes through the same
runner as the Prefect tasks (`dinov3_core.runner.run_stage`): same manifests and skip rule, same MLflow runs, and
pretrain/gram run as a torchrun job through the same launcher (timeout, no orphans, the failing rank's own error).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from dinov3_core.cli_chains import add_chain_commands
from dinov3_core.cli_options import job_failed, launch_from, launch_options, tile_progress
from dinov3_core.config import ConfigError, config_dir, load_config, parse_overrides
from dinov3_core.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, OutputBusy, WsidinoError, exit_code
from dinov3_core.stages import STAGES, Stage, get_stage


def _config(stage: Stage[Any], args: argparse.Namespace) -> Any:
    values = parse_overrides(args.overrides)
    for option in stage.options:
        value = getattr(args, _dest(option.flag), None)
        if value is not None:
            values[option.key] = value
    return load_config(stage.schema(), args.config or stage.default_config, values, stage=stage.name)


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def cmd_stage(args: argparse.Namespace) -> int:
    from dinov3_core.chain import check_before_work
    from dinov3_core.launch import TorchrunFailed
    from dinov3_core.runner import RunHooks, run_stage

    stage = get_stage(args.command)
    cfg = _config(stage, args)
    if args.print_config:  # the resolved configuration; `--config` of this output reproduces the run
        from dinov3_core.config_tree import to_yaml

        print(to_yaml(cfg), end="")
        return EXIT_OK
    hooks = RunHooks()
    close_bar: Callable[[], None] = lambda: None  # noqa: E731
    launch = launch_from(args) if stage.launch_help else None
    if stage.preflight is not None:  # what would stop it minutes in (a training job, unreadable annotations)
        check_before_work({stage.name: cfg}, None, launch.world_size if launch else 1, prefix=False)
    if stage.shows_progress(launch):
        hooks.progress, close_bar = tile_progress(stage.name, cfg)  # a job's progress: the sum over its ranks
    try:
        outcome = run_stage(stage, cfg, force=args.force, launch=launch, hooks=hooks)
    except TorchrunFailed as err:
        return job_failed(stage.name, err, stage.rerun_hint)
    finally:
        close_bar()
    if stage.report is not None and outcome.result is not None:  # tile: the per-slide table
        print(stage.report(outcome.result))
    return EXIT_FAILED if outcome.summary.failures else EXIT_OK


class StageParser(argparse.ArgumentParser):
    """A stage's sub-parser: its help marks each option whose config key has no default "(required, …)" — argparse
    cannot require it, since a --config file may set it instead. Marked when help is shown, not when the parser is
    built: finding the keys imports the stage's config schema (pretrain's pulls in torch, a slow import every command
    would pay)."""

    stage: Stage[Any] | None = None

    def format_help(self) -> str:
        if self.stage is not None:
            _mark_required(self, self.stage)
            self.stage = None  # once
        return super().format_help()


def _mark_required(parser: argparse.ArgumentParser, stage: Stage[Any]) -> None:
    from omegaconf import OmegaConf

    keys = {_dest(o.flag): o.key for o in stage.options}
    missing = set(OmegaConf.missing_keys(OmegaConf.structured(stage.schema())))
    for action in parser._actions:
        key = keys.get(action.dest)
        if key in missing or (stage.name, key) == ("pretrain", "data.stores"):
            action.help = f"{action.help} (required, unless the --config file sets it)"


def add_stage_command(sub: Any, stage: Stage[Any]) -> argparse.ArgumentParser:
    """`wsidino <stage>`: its options (from `Stage.options`), --config, overrides, --force, --print-config."""
    p = sub.add_parser(stage.name, help=stage.help, description=stage.help)
    p.stage = stage
    named = sorted(q.stem for q in (config_dir() / stage.name).glob("*.yaml"))
    p.add_argument("--config", help=f"YAML file, or a name under configs/{stage.name}/ ({', '.join(named)})")
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help=f"any config key of the stage, e.g. {stage.override_example}"
    )
    p.add_argument(
        "--force", action="store_true", help="run even when the stage manifest says the outputs are up to date"
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration as YAML and exit (use it as --config)",
    )
    for o in stage.options:
        p.add_argument(o.flag, type=o.type, action="append" if o.repeat else None, help=o.help)
    if stage.launch_help:
        launch_options(p, stage.launch_help)
    if stage.epilog:
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        p.epilog = stage.epilog
    p.set_defaults(func=cmd_stage)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wsidino", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=StageParser)
    for stage in STAGES:
        add_stage_command(sub, stage)
    add_chain_commands(sub)
    return parser


OVERRIDE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*=")  # a `key=value` word


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with `key=value` words accepted anywhere after the command (argparse takes one block of
    positionals only: `--to tile a=1 --force x b=2` would refuse `b=2`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [word for word in extra if not (OVERRIDE.match(word) and hasattr(args, "overrides"))]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*(args.overrides or []), *extra]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
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
    except OutputBusy as err:  # another run is writing that output: nothing was touched, rerun once it is done
        print(f"wsidino {args.command}: {err}", file=sys.stderr)
        return EXIT_FAILED
    except ValueError as err:  # launch settings out of bounds (pydantic names the field)
        print(f"wsidino {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"wsidino {args.command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


def run() -> None:
    """The `wsidino` command: `main`, then a quick exit.

    Python's own finalisation tears down every imported module one by one; with MLflow's import graph (pandas,
    pyarrow, SQLAlchemy, …) loaded that is a noticeable share of a short tile run (docs/benchmarks.md, tile stage). The
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
