"""The stages, in order. Each module holds one stage's whole knowledge (`Stage`, its place in a chain included);
this list is the only place that names them all, and everything else (the pipeline, the retraining cycle, the CLI,
the Prefect forms) is derived from it.

    tile → pretrain → gram → convert → export → evaluate → extract

A new stage is its module and one entry here (plus a flow and a form only if it should be its own deployment);
`STAGES.added` puts one in for a while (a lab's own stage in a plugin, the tests' throw-away stage).

The stage modules import their stage's own code (the tile engine, the trainer, ONNX export …) inside the functions
that use it: `import dinov3_core.stages` is on every command's path (the CLI builds its parser from `STAGES`) and
stays free of torch, zarr, OpenSlide and MLflow (tests/test_layering.py checks it).
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator, Sequence
from typing import Any, Literal, overload

from dinov3_core.config import ConfigError
from dinov3_core.stage import ChainPaths, CliOption, Place, PreflightFacts, Problem, RunHooks, Stage, Summary
from dinov3_core.stages import convert, evaluate, export, extract, gram, pretrain, tile


class StageList(Sequence[Stage[Any]]):
    """The stages in chain order. One object for the whole process, so whoever iterates it sees a stage added with
    `added` (never copy it into a tuple at import time)."""

    def __init__(self, stages: Sequence[Stage[Any]]) -> None:
        self._stages = list(stages)

    @overload
    def __getitem__(self, i: int) -> Stage[Any]: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Stage[Any]]: ...
    def __getitem__(self, i: int | slice) -> Stage[Any] | Sequence[Stage[Any]]:
        return self._stages[i]

    def __len__(self) -> int:
        return len(self._stages)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self._stages)

    def get(self, name: str | Stage[Any], key: str = "stage") -> Stage[Any]:
        """The stage called `name`; an unknown name is a `ConfigError` naming `key` and the closest stage."""
        if isinstance(name, Stage):
            return name
        for s in self._stages:
            if s.name == name:
                return s
        close = difflib.get_close_matches(str(name), self.names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{name!r} is not a stage{hint}; stages: {', '.join(self.names)}", key=key)

    def places(self) -> dict[str, Place]:
        return {s.name: s.place for s in self._stages}

    @contextlib.contextmanager
    def added(self, stage: Stage[Any], after: str) -> Iterator[Stage[Any]]:
        """`stage` in the chain right after the stage `after`, until the block ends."""
        if stage.name in self.names:
            raise ConfigError(f"a stage called {stage.name!r} exists already", key="stage")
        before = list(self._stages)
        self._stages.insert(self.names.index(self.get(after).name) + 1, stage)
        try:
            yield stage
        finally:
            self._stages[:] = before


STAGES = StageList(
    [
        tile.STAGE,
        pretrain.STAGE,
        gram.STAGE,
        convert.STAGE,
        export.STAGE,
        evaluate.STAGE,
        extract.STAGE,
    ]
)
STAGE_NAMES: tuple[str, ...] = STAGES.names  # the built-in stages (the forms' choices); STAGES.names is current
StageName = Literal[STAGE_NAMES]  # type: ignore[valid-type]  # the forms' choices, derived from STAGES


def get_stage(name: str | Stage[Any], key: str = "stage") -> Stage[Any]:
    """The stage called `name`; an unknown name is a `ConfigError` naming `key` and the closest stage."""
    return STAGES.get(name, key)


__all__ = [
    "STAGES",
    "STAGE_NAMES",
    "ChainPaths",
    "CliOption",
    "PreflightFacts",
    "Problem",
    "RunHooks",
    "Stage",
    "StageList",
    "StageName",
    "Summary",
    "get_stage",
]
