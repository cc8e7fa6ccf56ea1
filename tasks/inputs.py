"""A flow run whose form names input paths that do not exist fails at once, in one line naming the parameter.

    @flow(name="tile")
    @fails_in_one_line
    def tile_flow(params: TileParams) -> dict[str, Any]: ...

Each form model lists its input paths in `INPUTS` (field → what to set it to); `check_inputs` looks at them before
the flow runs any task, so a deployment registered with placeholder paths (deploy/prefect.yaml's /data/cohort/...)
says which parameter to set instead of failing deep inside a stage. `fails_in_one_line` turns any `WsidinoError`
(bad input, named by the code that found it) into a Failed state whose message is that one line: Prefect would
otherwise log the exception's traceback and prefix the message with its class name.
"""

from __future__ import annotations

import functools
import glob
import inspect
import logging
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from prefect import get_run_logger
from prefect.states import Failed
from pydantic import BaseModel

from dinov3_core.errors import WsidinoError

P = TypeVar("P", bound=BaseModel)
GLOB_CHARS = "*?["  # as dinov3_core.tiling.discovery reads a slides spec: a glob when it has one of these


class MissingInput(WsidinoError):
    """An input path of a flow's form that does not exist (or a glob that matches nothing)."""


def _exists(spec: str) -> bool:
    path = Path(spec).expanduser()
    if path.exists() or path.is_symlink():  # a broken link is the stage's to report, naming what it points to
        return True
    return any(ch in spec for ch in GLOB_CHARS) and bool(glob.glob(str(path), recursive=True))


def check_inputs(params: BaseModel) -> None:
    """Raise `MissingInput` for the first input path of `params` (its model's `INPUTS`, less the ones it says it
    does not need: `unused_inputs()`) that does not exist, naming the parameter as the form and the deployment's
    parameters show it. Relative paths resolve against the flow run's working directory, as the stages read them."""
    inputs: dict[str, str] = getattr(params, "INPUTS", {})
    unused: set[str] = params.unused_inputs() if hasattr(params, "unused_inputs") else set()
    for name, what in inputs.items():
        if name in unused:
            continue
        value = getattr(params, name)
        values = value if isinstance(value, list) else [value]
        for index, spec in enumerate(values):
            if spec and not _exists(spec):
                field = type(params).model_fields[name]
                key = f"{name}[{index}]" if isinstance(value, list) else name
                raise MissingInput(
                    f"{key} ({field.title}): {spec} does not exist; set the deployment's `{name}` parameter to {what}"
                    + ("" if os.path.isabs(spec) else f" (relative paths start at {os.getcwd()})")
                )


class _ReportedErrors(logging.Filter):
    """Drops the records logged with an exception already reported in one line (`fails_in_one_line`): the process
    a worker starts for a flow run reads the final state's result, which raises the state's exception, and logs
    that with its traceback ("Engine execution exited with unexpected exception") at the end of every failed run."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: weakref.WeakSet[BaseException] = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.exc_info[1] in self.errors)


_REPORTED = _ReportedErrors()


def fails_in_one_line(fn: Callable[[P], Any]) -> Callable[[P], Any]:
    """A flow function that checks its form's input paths first and ends a run stopped by bad input (a
    `WsidinoError`, whose message is written for the user) in a Failed state whose message is the error's, logged
    once, without a traceback. A caller of the flow in Python still gets the exception raised (the state carries
    it as its data)."""

    @functools.wraps(fn)
    def run(params: P) -> Any:
        try:
            check_inputs(params)
            return fn(params)
        except WsidinoError as err:
            message = str(err)[:4000] or type(err).__name__  # the API's cap on a state message
            get_run_logger().error(message)
            _REPORTED.errors.add(err)
            engine_log = logging.getLogger("prefect.flow_runs")  # the logger of the engine's flow-run lines
            if _REPORTED not in engine_log.filters:
                engine_log.addFilter(_REPORTED)
            return Failed(message=message, data=err)

    # Prefect validates a run's parameters against `run`'s signature, resolving its string annotations in `run`'s
    # module, where the flow's form model is not defined: hand it the signature with the types resolved.
    run.__signature__ = inspect.signature(fn, eval_str=True)  # type: ignore[attr-defined]
    return run


__all__ = ["MissingInput", "check_inputs", "fails_in_one_line"]
