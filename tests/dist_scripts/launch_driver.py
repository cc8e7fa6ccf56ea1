"""Stands in for a Prefect flow-run process that runs a torchrun job (run by tests/test_launch.py).

    python -m tests.dist_scripts.launch_driver PID_DIR LOG_DIR [default]

Calls `dinov3_core.launch.run_torchrun` in the main thread on 2 ranks of ``launch_worker hang PID_DIR``, which never
end. Like Prefect's engine, SIGTERM raises an exception in the main thread (Prefect's ``TerminationSignal``), so
`run_torchrun`'s cleanup runs; the test also sends SIGKILL, where no cleanup runs at all. With ``default`` SIGTERM
keeps Python's default action, as in the `wsidino` commands: the process dies by it.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import FrameType

from dinov3_core.launch import TorchrunJob, run_torchrun


class Terminated(BaseException):
    """Like `prefect.exceptions.TerminationSignal`: a BaseException, so `except Exception` does not swallow it."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated(f"signal {signum}")


def main() -> None:
    if sys.argv[3:] != ["default"]:
        signal.signal(signal.SIGTERM, _on_sigterm)
    pid_dir, log_dir = Path(sys.argv[1]), Path(sys.argv[2])
    job = TorchrunJob(
        module="tests.dist_scripts.launch_worker",
        args=["hang", str(pid_dir)],
        nproc_per_node=2,
        log_dir=log_dir,
        env={"OMP_NUM_THREADS": "1"},
    )
    run_torchrun(job, log=lambda line: print(f"driver| {line}", flush=True), grace_s=10)


if __name__ == "__main__":
    main()
