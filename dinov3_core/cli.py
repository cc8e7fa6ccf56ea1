"""`wsidino <stage>`: every stage runs alone from the command line.

Options name the essentials; everything else is `key=value` overrides on the stage's typed config, on top of an
optional `--config` (a YAML path or a name under configs/<stage>/).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from dinov3_core.config import ConfigError, flat_params, load_config, parse_overrides
from dinov3_core.errors import WsidinoError
from dinov3_core.stages import IN_PROCESS, run_once

EXIT_OK, EXIT_FAILED_ITEMS, EXIT_USAGE = 0, 1, 2


def _load(schema: type, stage: str, args: argparse.Namespace, explicit: dict[str, Any]) -> Any:
    values = parse_overrides(args.overrides)
    values.update({k: v for k, v in explicit.items() if v is not None})
    return load_config(schema, args.config, values, stage=stage)


def cmd_tile(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dinov3_core import tracking
    from dinov3_core.tiling import report
    from dinov3_core.tiling.config import TileConfig
    from dinov3_core.tiling.stage import run_tile

    cfg = _load(TileConfig, "tile", args, {"input": args.input, "output": args.output, "workers": args.workers})
    bar = tqdm(total=0, unit="tile", disable=not cfg.progress or not sys.stderr.isatty(), dynamic_ncols=True)

    def progress(done: int, planned: int) -> None:
        bar.total = planned
        bar.n = done
        bar.refresh()

    from dinov3_core.tiling.stage import prepare_store

    prepare_store(cfg)  # a bad output path fails here, before the stage manifest is written into it
    results: list[Any] = []

    def tile() -> dict[str, Any]:
        with tracking.stage_run(cfg.tracking, "tile", params=flat_params(cfg), tags={"wsidino.stage": "tile"}):
            result = run_tile(cfg, progress=progress)
            bar.close()
            report.log_to_mlflow(result)
        results.append(result)
        return {**result.counts, "tiles_total": result.total_tiles}

    ran, manifest = run_once("tile", cfg, tile, force=args.force)
    if ran:
        print(report.format_summary(results[0]))
    return EXIT_FAILED_ITEMS if manifest.summary.get("failed") else EXIT_OK


def cmd_pretrain(args: argparse.Namespace) -> int:
    """One process runs here; more processes (or nodes) run under torchrun with the same config and overrides."""
    overrides = list(args.overrides)
    if args.store:
        overrides.append(f"data.stores=[{','.join(args.store)}]")
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    from dinov3_core.train.config import PretrainConfig

    cfg = load_config(PretrainConfig, args.config or "tiny", overrides, stage="pretrain")
    if args.nproc_per_node == 1 and args.nnodes == 1:
        from dinov3_core.train.__main__ import main as train_main

        launch = lambda: train_main(["--config", args.config or "tiny", *overrides])  # noqa: E731
    else:
        from dinov3_core.train.stage import torchrun_command

        cmd = torchrun_command(
            args.config or "tiny", args.nproc_per_node, overrides, nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint
        )
        launch = lambda: _call(cmd)  # noqa: E731
    return _run_training("pretrain", cfg, launch, args.force)


def _call(cmd: list[str]) -> int:
    import subprocess

    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


class _LaunchFailed(Exception):
    """The training command exited non-zero (its own message is already on stderr)."""

    def __init__(self, stage: str, code: int) -> None:
        super().__init__(f"{stage} exited with code {code}; rerun the same command to resume")
        self.code = code


def _run_training(stage: str, cfg: Any, launch: Any, force: bool) -> int:
    """Training under the stage manifest: a complete, unchanged run is skipped; a failed one resumes."""

    def run() -> dict[str, Any]:
        code = launch()
        if code != 0:
            raise _LaunchFailed(stage, code)  # inside the guard: the manifest records the failure
        return {}

    try:
        run_once(stage, cfg, run, force=force)
    except _LaunchFailed as failed:
        return failed.code
    return EXIT_OK


def cmd_gram(args: argparse.Namespace) -> int:
    """Gram anchoring after pretraining: one process here, more under torchrun."""
    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    from dinov3_core.gram.config import GramConfig

    head = [f"pretrain_dir={args.pretrain_dir}"] if args.pretrain_dir else []
    cfg = load_config(GramConfig, args.config, [*head, *overrides], stage="gram")
    if args.nproc_per_node == 1:
        from dinov3_core.gram.__main__ import main as gram_main

        argv = [*(["--pretrain-dir", args.pretrain_dir] if args.pretrain_dir else []),
                *(["--config", args.config] if args.config else []), *overrides]  # fmt: skip
        launch = lambda: gram_main(argv)  # noqa: E731
    else:
        from dinov3_core.gram.stage import torchrun_command

        cmd = torchrun_command(args.pretrain_dir, args.nproc_per_node, overrides, config=args.config)
        launch = lambda: _call(cmd)  # noqa: E731
    return _run_training("gram", cfg, launch, args.force)


def cmd_convert(args: argparse.Namespace) -> int:
    from dinov3_core.export.config import ConvertConfig

    cfg = _load(ConvertConfig, "convert", args, {"input": args.input, "output_dir": args.output_dir})

    def run() -> dict[str, Any]:
        result, summary = IN_PROCESS["convert"](cfg)
        print(f"convert: {result.checkpoint} → {result.backbone}")
        return summary

    run_once("convert", cfg, run, force=args.force)
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from dinov3_core.export.config import ExportConfig

    cfg = _load(ExportConfig, "export", args, {"weights": args.weights, "output": args.output})

    def run() -> dict[str, Any]:
        result, summary = IN_PROCESS["export"](cfg)
        print(f"export: {result.path} (ONNX Runtime vs PyTorch max abs error {result.max_abs_error:.2e})")
        return summary

    run_once("export", cfg, run, force=args.force)
    return EXIT_OK


def cmd_extract(args: argparse.Namespace) -> int:
    from dinov3_core.export.config import ExtractConfig

    cfg = _load(ExtractConfig, "extract", args, {"store": args.store, "model": args.model, "output": args.output})

    def run() -> dict[str, Any]:
        result, summary = IN_PROCESS["extract"](cfg)
        print(f"extract: {len(result.extracted)} slides extracted, {len(result.skipped)} up to date → {result.output}")
        return summary

    run_once("extract", cfg, run, force=args.force)
    return EXIT_OK


def cmd_make_sample_slides(args: argparse.Namespace) -> int:
    from dinov3_core.sample_slides import make_sample_slides

    samples = make_sample_slides(args.out_dir, preset=args.preset, seed=args.seed, negatives=args.negatives)
    for path in samples.slides:
        print(path)
    for name, path in samples.negatives.items():
        print(f"{path}  (negative case: {name})")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wsidino", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def stage_parser(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", help=f"YAML file, or a name under configs/{name}/")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. tile_size=256")
        p.add_argument(
            "--force", action="store_true", help="run even when the stage manifest says the outputs are up to date"
        )
        return p

    tile = stage_parser("tile", "Whole-slide images → zarr tile store (µm/px-exact tiles, tissue mask, QC).")
    tile.add_argument("--input", help="directory, glob, slide file, or .txt/.csv list of slide paths")
    tile.add_argument("--output", help="tile store directory, e.g. out/tiles.zarr")
    tile.add_argument("--workers", type=int, help="worker processes (default from config: 1)")
    tile.set_defaults(func=cmd_tile)

    pretrain = stage_parser("pretrain", "DINOv3 self-supervised (continued) pretraining on tile stores.")
    pretrain.add_argument("--store", action="append", help="tile store (repeat for several); = data.stores")
    pretrain.add_argument("--output-dir", help="run directory (checkpoints, eval/, metrics); = output_dir")
    pretrain.add_argument("--nproc-per-node", type=int, default=1, help="training processes per node (torchrun)")
    pretrain.add_argument("--nnodes", type=int, default=1, help="nodes (multi-node needs --rdzv-endpoint)")
    pretrain.add_argument("--rdzv-endpoint", help="host:port of the c10d rendezvous for multi-node runs")
    pretrain.set_defaults(func=cmd_pretrain)

    gram = stage_parser("gram", "Gram anchoring: continue a pretraining run with a frozen, auto-selected gram teacher.")
    gram.add_argument("--pretrain-dir", help="the pretraining run directory to continue (its eval/ holds the teachers)")
    gram.add_argument("--output-dir", help="the gram stage's own run directory; = output_dir")
    gram.add_argument("--nproc-per-node", type=int, default=1, help="training processes (torchrun)")
    gram.set_defaults(func=cmd_gram)

    convert = stage_parser("convert", "DCP checkpoint → backbone.pth with the released DINOv3 key layout.")
    convert.add_argument("--input", help="a ckpt/<iteration>/ directory, or a run directory (latest checkpoint)")
    convert.add_argument("--output-dir", help="where backbone.pth and config.yaml go")
    convert.set_defaults(func=cmd_convert)

    export = stage_parser("export", "backbone.pth → ONNX (dynamic batch and size), checked with ONNX Runtime.")
    export.add_argument("--weights", help="backbone.pth or .safetensors (e.g. from wsidino convert)")
    export.add_argument("--output", help="model.onnx path")
    export.set_defaults(func=cmd_export)

    extract = stage_parser("extract", "Features for every tile of a tile store, slide embeddings, PCA maps.")
    extract.add_argument("--store", help="tile store (tiles.zarr)")
    extract.add_argument("--model", help="model.onnx (ONNX Runtime) or backbone.pth (PyTorch)")
    extract.add_argument("--output", help="feature store (features.zarr)")
    extract.set_defaults(func=cmd_extract)

    samples = sub.add_parser("make-sample-slides", help="Write sample pyramidal SVS/TIFF slides (real tissue).")
    samples.add_argument("out_dir")
    samples.add_argument("--preset", choices=["demo", "test"], default="demo")
    samples.add_argument("--seed", type=int, default=0)
    samples.add_argument("--no-negatives", dest="negatives", action="store_false", help="skip the bad-input files")
    samples.set_defaults(func=cmd_make_sample_slides)
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
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"wsidino {args.command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
