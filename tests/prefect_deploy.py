"""Deployments on the session's real Prefect server and a real process worker: shared by the flow tests.

deploy("flows/pipeline.py:pipeline_flow", "pipeline-test")     # registered from this checkout
run_id = trigger("pipeline/pipeline-test", params)             # what the UI's Run does
run = wait_final(run_id, timeout=600)
retry(run_id)                                                  # what the UI's Retry does
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import psutil
import pytest

from tests.helpers import REPO

POOL = "wsidino-test-cpu"


def deploy(entrypoint: str, name: str, params: dict[str, Any] | None = None) -> UUID:
    """Register a deployment of this checkout's flow on the test pool (what `prefect deploy` does), with `params`
    as its default parameters when given."""
    from prefect import flow

    remote = flow.from_source(source=str(REPO), entrypoint=entrypoint)
    parameters = {"params": params} if params is not None else None
    return remote.deploy(
        name=name, work_pool_name=POOL, parameters=parameters, print_next_steps=False, ignore_warnings=True
    )


def wait_final(flow_run_id: UUID, timeout: float) -> Any:
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.is_final():
                return run
            if time.monotonic() > deadline:
                pytest.fail(f"flow run {flow_run_id} still {run.state.name if run.state else None} after {timeout} s")
            time.sleep(1.0)


def trigger(deployment: str, parameters: dict[str, Any] | None, env: dict[str, str] | None = None) -> UUID:
    """What the UI's Run does; `parameters` None: with the deployment's own defaults (Quick run)."""
    from prefect.deployments import run_deployment

    given = {"params": parameters} if parameters is not None else None
    run = run_deployment(deployment, parameters=given, job_variables={"env": env or {}}, timeout=0, as_subflow=False)
    return run.id


def retry(flow_run_id: UUID) -> None:
    """The UI's Retry: the same flow run is scheduled again (a worker picks it up)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Scheduled(), force=True)


def flow_logs(flow_run_id: UUID) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    messages: list[str] = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_logs(
                LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200, offset=len(messages)
            )
            messages += [log.message for log in page]
            if len(page) < 200:
                return "\n".join(messages)


def ui_page_text(path: str, serve_dir: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A page of the Prefect UI as a real browser renders it. The test server has no UI, so `make serve`'s Prefect
    server (with its UI) is started on the same database for the page."""
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL

    from tests.browser import page_text
    from wsidino_dev.serve.servers import start_prefect_server

    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", str(PREFECT_API_DATABASE_CONNECTION_URL.value()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_prefect_server(serve_dir, port)
    try:
        return page_text(f"{server.url}{path}")
    finally:
        server.stop()


def job_processes(marker: str) -> list[psutil.Process]:
    """Live processes whose command line mentions `marker` (a run directory): torchrun and its ranks."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in proc.info["cmdline"] or []) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(scope="module")
def worker(prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str]]:
    """A real process worker on the test pool, polling the session's Prefect server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=POOL, type="process"), overwrite=True)
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    # It looks for scheduled runs every second instead of every 10 s: each triggered run waited 5 s on average.
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONUNBUFFERED": "1", "PREFECT_WORKER_QUERY_SECONDS": "1"}
    # No `--limit`: Prefect 3.8.8's worker crashes ("this borrower is already holding one of this CapacityLimiter's
    # tokens") when a flow run it still holds a slot for is scheduled again, as the retry test does.
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    try:
        yield proc
    finally:
        # Prefect's worker, once it has run flows, takes up to 30 s to stop gracefully (it waits on its runner);
        # nothing here needs a graceful stop, and its session is its process group: flow-run processes go with it.
        proc.terminate()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
