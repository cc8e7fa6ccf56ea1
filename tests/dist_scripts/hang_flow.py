"""A Prefect flow whose one task runs a torchrun job that never ends (run by tests/test_launch_signals.py).

Like `run_job_stage`, the task is called directly, so `run_torchrun` runs in the flow-run process's main thread,
where Prefect's cancellation (SIGTERM to the flow run's process group) arrives.
"""

from __future__ import annotations

import os

from prefect import flow, get_run_logger, task

from dinov3_core.launch import TorchrunJob, run_torchrun


@task(name="hang-job")
def hang_job(pid_dir: str, log_dir: str) -> None:
    job = TorchrunJob(
        module="tests.dist_scripts.launch_worker",
        args=["hang", pid_dir],
        nproc_per_node=2,
        log_dir=log_dir,
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()},
    )
    run_torchrun(job, log=get_run_logger().info, grace_s=10)


@flow(name="hang")
def hang_flow(pid_dir: str, log_dir: str) -> None:
    hang_job(pid_dir, log_dir)
