"""A SIGTERM that reaches the launching process while torchrun is still starting leaves no process of the job.

Real torchrun, 2 ranks of tests/dist_scripts/launch_worker.py (`hang`), under tests/dist_scripts/launch_driver.py,
which stands for a Prefect flow-run process (its SIGTERM handler raises, as Prefect's does) or a `wsidino` command
(SIGTERM's default action: it dies). One SIGTERM goes to the driver alone, at a point of the launch, several times
over (the race is in the timing); by the time the driver has exited, every process of the job must be gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.prefect_deploy import deploy, job_processes, wait_final, worker
from tests.test_launch import DRIVER, MARK, REPO, _assert_all_gone, _marked

__all__ = ["worker"]  # the module's process-worker fixture

TRIES = 5


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _point_reached(driver: int, point: str) -> bool:
    """`started`: torchrun's process exists (the driver's child); `ranks`: torchrun has begun starting ranks."""
    procs = _descendants(driver)
    return len(procs) >= (1 if point == "started" else 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("sigterm", ["raises", "default"])
@pytest.mark.parametrize("point", ["started", "ranks"])
def test_a_sigterm_during_the_launch_leaves_no_process_of_the_job(tmp_path: Path, point: str, sigterm: str) -> None:
    for attempt in range(TRIES):
        marker = uuid.uuid4().hex
        pid_dir = tmp_path / f"pids{attempt}"
        pid_dir.mkdir()
        env = {**os.environ, "PYTHONPATH": str(REPO), MARK: marker}
        cmd = [sys.executable, "-m", DRIVER, str(pid_dir), str(tmp_path / f"logs{attempt}")]
        cmd += ["default"] if sigterm == "default" else []
        driver = subprocess.Popen(
            cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            deadline = time.monotonic() + 120
            while not _point_reached(driver.pid, point):
                assert driver.poll() is None and time.monotonic() < deadline, (point, attempt, driver.poll())
                time.sleep(0.005)
            job = [p.pid for p in _descendants(driver.pid)]
            os.kill(driver.pid, signal.SIGTERM)  # the launching process alone
            out, _ = driver.communicate(timeout=90)
            # Gone by the time the launcher has exited: stopped by it, not left to die later by PR_SET_PDEATHSIG.
            _assert_all_gone(marker, {f"pid{pid}": pid for pid in job}, within_s=0.0)
            # The driver's own handling still happened, once the job was stopped: the signal was not lost.
            if sigterm == "default":
                assert driver.returncode == -signal.SIGTERM, (point, attempt, driver.returncode, out[-3000:])
            else:
                assert "Terminated" in out, (point, attempt, out[-3000:])
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
                driver.wait()
            for p in _marked(marker):
                p.kill()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_prefect_cancels_a_flow_run_while_its_torchrun_job_starts(
    worker: subprocess.Popen[str], tmp_path: Path
) -> None:
    """Prefect's own cancellation (the worker's SIGTERM to the flow run's process group) as the ranks start: the
    run ends Cancelled and no process of the job is left."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    deploy("tests/dist_scripts/hang_flow.py:hang_flow", "hang-test")
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    run = run_deployment(
        "hang/hang-test",
        parameters={"pid_dir": str(pid_dir), "log_dir": str(tmp_path / "logs")},
        timeout=0,
        as_subflow=False,
    )
    deadline = time.monotonic() + 180
    while not job_processes(str(pid_dir)):  # torchrun is up (its command line names the pid directory)
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.05)
    procs = job_processes(str(pid_dir))
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run.id, Cancelling(), force=True)
    final = wait_final(run.id, timeout=120)
    with get_client(sync_client=True) as client:
        logs = [log.message for log in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))]
    assert final.state.is_cancelled(), (final.state, logs[-20:])
    _gone, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive and not job_processes(str(pid_dir)), [(p.pid, p.cmdline()) for p in alive]
