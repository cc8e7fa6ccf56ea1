"""Follow a flow run in the terminal: its state changes and every log line (its task runs' and training ranks'
included) as they arrive, so a run is never silent while a worker picks it up and starts it.

    python -m tasks.follow 'pipeline/pipeline' --params my-params.json   # start a deployment run, follow it
    python -m tasks.follow 'pipeline/pipeline'                           # … with the deployment's own params
    python -m tasks.follow --flow-run 0d7c…                              # follow a run started in the UI

Exit code 0 when the run ends Completed, 1 when it fails, crashes or is cancelled. `prefect deployment run
--watch` only polls the state; this prints the log as well.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

PAGE = 200  # the most log lines the API returns per request
LOG_WINDOW = timedelta(seconds=30)  # logs reach the server in batches: re-read this far back, print each once


def start(deployment: str, params: dict[str, Any] | None) -> UUID:
    """A run of the deployment (`flow/deployment`), with `params` as its whole `params` object when given."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        found = client.read_deployment_by_name(deployment)
        parameters = {"params": params} if params is not None else None
        return client.create_flow_run_from_deployment(found.id, parameters=parameters).id


def follow(flow_run_id: UUID, out: Callable[[str], None] = print, poll_s: float = 1.0) -> Any:
    """Print state changes and new log lines until the run is final and its last lines are in; its final state."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp
    from prefect.client.schemas.sorting import LogSort

    seen: set[UUID] = set()
    newest = None
    last_state = None
    quiet_polls_after_end = 0
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        out(f"following flow run {run.name} ({flow_run_id})")
        while True:
            run = client.read_flow_run(flow_run_id)
            state = run.state
            label = f"{state.name}: {state.message}" if state and state.message else (state.name if state else "?")
            if label != last_state:
                out(f"{_now()} state  {label}")
                last_state = label
            window = LogFilterTimestamp(after_=newest - LOG_WINDOW) if newest else None
            wanted = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]), timestamp=window)
            logs: list[Any] = []
            while True:  # the API pages at most 200 lines
                page = client.read_logs(wanted, limit=PAGE, offset=len(logs), sort=LogSort.TIMESTAMP_ASC)
                logs += page
                if len(page) < PAGE:
                    break
            fresh = [log for log in logs if log.id not in seen]
            for log in fresh:
                seen.add(log.id)
                newest = max(newest, log.timestamp) if newest else log.timestamp
                out(f"{log.timestamp:%H:%M:%S} {_level(log.level):<7} {log.message}")
            if state is not None and state.is_final():
                quiet_polls_after_end = 0 if fresh else quiet_polls_after_end + 1
                if quiet_polls_after_end >= 3:  # the worker flushes its last log batch shortly after the end
                    return state
            time.sleep(poll_s)


def _level(number: int) -> str:
    import logging

    return logging.getLevelName(number)


def _now() -> str:
    return time.strftime("%H:%M:%S")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.follow", description=__doc__.splitlines()[0])
    parser.add_argument("deployment", nargs="?", help="flow/deployment to start, e.g. pipeline/pipeline")
    parser.add_argument("--params", type=Path, help="JSON file: the run's whole `params` object")
    parser.add_argument("--flow-run", type=UUID, help="follow this flow run instead of starting one")
    args = parser.parse_args(argv)
    if (args.deployment is None) == (args.flow_run is None):
        parser.error("give a deployment to start, or --flow-run ID")
    params = json.loads(args.params.read_text()) if args.params else None
    run_id = args.flow_run or start(args.deployment, params)
    final = follow(run_id, out=lambda line: print(line, flush=True))
    return 0 if final.is_completed() else 1


if __name__ == "__main__":
    sys.exit(main())
