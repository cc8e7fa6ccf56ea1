"""`wsidino-dev` (or ``python -m wsidino_dev``): development commands.

* ``samples OUT_DIR [--preset demo|test] [--seed N] [--no-negatives]``: write sample slides and their annotations.
* ``serve [--prefect-port N] [--mlflow-port M] [--serve-dir DIR] ...``: what `make serve` runs (`wsidino_dev.serve`).
* ``screenshots [--out DIR] [--form-only]``: the Prefect UI pictures of the docs (`wsidino_dev.screenshots`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any


def cmd_samples(args: argparse.Namespace) -> int:
    from wsidino_dev.sample_slides import make_sample_slides

    def written(name: str, info: dict[str, Any]) -> None:
        size = "×".join(str(n) for n in info["size"]) + " px" if info.get("size") else info["format"]
        print(f"wrote {name}  {size}  {info['seconds']:.1f} s", flush=True)  # slides take seconds to a minute each

    written_before = time.perf_counter()
    samples = make_sample_slides(
        args.out_dir, preset=args.preset, seed=args.seed, negatives=args.negatives, progress=written
    )
    negatives = f", {len(samples.negatives)} negative cases" if samples.negatives else ""
    print(
        f"{args.out_dir}: {len(samples.slides)} slides{negatives}, annotations under "
        f"{args.out_dir}/annotations ({time.perf_counter() - written_before:.1f} s; files already there are kept)"
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from wsidino_dev.serve.cli import run

    return run(args)


def cmd_screenshots(args: argparse.Namespace) -> int:
    from wsidino_dev.screenshots import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from wsidino_dev.serve.cli import DESCRIPTION
    from wsidino_dev.serve.cli import build_parser as serve_parser

    parser = argparse.ArgumentParser(prog="wsidino-dev", description="wsidino development tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    samples = sub.add_parser(
        "samples",
        help="write sample pyramidal SVS/TIFF slides (real tissue)",
        description="Write a preset set of sample slides (Aperio SVS and generic TIFF built from a real IHC image) "
        "with QuPath GeoJSON class annotations under annotations/ and, unless --no-negatives, bad inputs under "
        "negatives/. Files already there for the same preset and seed are kept.",
    )
    samples.add_argument("out_dir")
    samples.add_argument("--preset", choices=["demo", "test", "heldout"], default="demo")
    samples.add_argument("--seed", type=int, default=0)
    samples.add_argument("--no-negatives", dest="negatives", action="store_false", help="skip the bad-input files")
    samples.set_defaults(func=cmd_samples)

    serve = sub.add_parser(
        "serve",
        parents=[serve_parser(add_help=False)],
        help="local Prefect + MLflow servers, pools, deployments and a worker (make serve); Ctrl-C stops",
        description=DESCRIPTION,
    )
    serve.set_defaults(func=cmd_serve)

    from wsidino_dev.screenshots import build_parser as screenshots_parser

    screenshots = sub.add_parser(
        "screenshots",
        parents=[screenshots_parser(add_help=False)],
        help="the Prefect UI pictures of the docs: the pipeline's run form and a finished run (needs chromium)",
    )
    screenshots.set_defaults(func=cmd_screenshots)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
