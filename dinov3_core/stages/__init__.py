"""The stages, in order. Each module holds one stage's whole knowledge (`Stage`); this list is the only place
that names them all, and everything else (the chains, the CLI, the Prefect forms) is derived from it.

    tile → pretrain → gram → convert → export → evaluate → extract

The stage modules import their stage's own code (the tile engine, the trainer, ONNX export …) inside the functions
that use it: `import dinov3_core.stages` is on every command's path (the CLI builds its parser from `STAGES`) and
stays free of torch, zarr, OpenSlide and MLflow (0.2 s instead of ~2 s; tests/test_layering.py checks it).
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from dinov3_core.config import ConfigError
from dinov3_core.stages import convert, evaluate, export, extract, gram, pretrain, tile
from dinov3_core.stages.base import ChainPaths, CliOption, PreflightFacts, Problem, RunHooks, Stage, Summary

STAGES: tuple[Stage[Any], ...] = (
    tile.STAGE,
    pretrain.STAGE,
    gram.STAGE,
    convert.STAGE,
    export.STAGE,
    evaluate.STAGE,
    extract.STAGE,
)
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
StageName = Literal[STAGE_NAMES]  # type: ignore[valid-type]  # the forms' choices, derived from STAGES
_BY_NAME = {s.name: s for s in STAGES}


def get_stage(name: str | Stage[Any], key: str = "stage") -> Stage[Any]:
    """The stage called `name`; an unknown name is a `ConfigError` naming `key` and the closest stage."""
    if isinstance(name, Stage):
        return name
    found = _BY_NAME.get(name)
    if found is None:
        close = difflib.get_close_matches(str(name), STAGE_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{name!r} is not a stage{hint}; stages: {', '.join(STAGE_NAMES)}", key=key)
    return found


__all__ = [
    "STAGES",
    "STAGE_NAMES",
    "ChainPaths",
    "CliOption",
    "PreflightFacts",
    "Problem",
    "RunHooks",
    "Stage",
    "StageName",
    "Summary",
    "get_stage",
]
