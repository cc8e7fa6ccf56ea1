"""What a torchrun job is: `TorchrunJob` (validated) → its command line, and `TorchrunFailed` when it fails.

Pure data and argv building; starting and supervising the processes is `supervise.py`, reading a failed job's
logs for its root cause is `diagnose.py`. Imports neither Prefect nor torch.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dinov3_core.procutil import PARENT_PID_ENV

LAUNCH_CONFIG = "launch_config.yaml"  # the resolved stage config every rank loads, in the job's directory

DEFAULT_RDZV_ID = "wsidino"
#: Environment variable holding a per-launch token: every process of the job inherits it, so processes orphaned
#: by a dead torchrun (reparented to init, no longer its descendants) can still be found and stopped.
LAUNCH_TOKEN_ENV = "WSIDINO_LAUNCH_TOKEN"
#: torchrun's pid, published to the ranks for `die_with_parent`'s check of the parent-died-before-prctl race.
TORCHRUN_PID_ENV = PARENT_PID_ENV

_CONSOLE_KEEP = 2000  # console lines kept for diagnosis; torchrun's failure summary repeats a full traceback
_SCAN_INTERVAL_S = 2.0  # how often torchrun's descendants are recorded while it runs
_EOF_WAIT_S = 5.0  # after torchrun exits, how long to wait for the rest of its output

# torchrun's TailLog prefixes each teed line with "[<role><local rank>]:" ("[default0]:").
_RANK_PREFIX = re.compile(r"^\[[A-Za-z_][\w.-]*?\d+\]:")
_MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

# Runs torchrun through a 5-line exec wrapper: arm PR_SET_PDEATHSIG (survives exec), check the launcher is still
# the parent (the race: it may have died before prctl), publish torchrun's pid for the ranks' own check, exec.
_EXEC_TIED_TO_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('torchrun launcher %s died before torchrun started' % sys.argv[1])\n"
    f"os.environ[{TORCHRUN_PID_ENV!r}] = str(os.getpid())\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


@dataclass(frozen=True)
class TorchrunJob:
    """One torchrun launch: ``python -m torch.distributed.run … -m <module> <args…>`` on this node.

    Attributes:
        module: Python module run on every rank (``python -m``), e.g. ``dinov3_core.train``.
        args: Arguments after the module, e.g. ``["--config", "/run/cfg.yaml", "train.stop_at=10"]``.
        nproc_per_node: Ranks started on this node (one per GPU).
        nnodes: Number of nodes; more than one needs `rdzv_endpoint`, and one launch per node.
        rdzv_endpoint: ``host:port`` of the c10d rendezvous; None on a single node → ``--standalone``.
        rdzv_id: Job id shared by all nodes of one job (default ``wsidino``); also prefixes the log directory.
        cuda_visible_devices: e.g. ``"0,1"``; None inherits the caller's environment.
        env: Extra environment for every rank (``MLFLOW_RUN_ID``, ``MLFLOW_TRACKING_URI``, ``OMP_NUM_THREADS``…).
        log_dir: torchrun ``--log-dir``: per-rank logs and error files; None → a new temporary directory.
        timeout_s: Wall-clock limit for the whole job; None → no limit.
        python: Interpreter that runs torchrun (and, through torchrun, every rank).
        max_restarts: torchrun ``--max-restarts``; only useful when the module resumes from its last checkpoint.
    """

    module: str
    args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    cuda_visible_devices: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    timeout_s: float | None = None
    python: str = sys.executable
    max_restarts: int = 0


class TorchrunFailed(RuntimeError):
    """A torchrun job ended with a non-zero exit code, or was stopped at its time limit.

    Attributes:
        module: The module the job ran.
        exit_code: torchrun's exit code (1 for any rank failure; negative when it was killed by a signal).
        root_cause: The first failing rank's exception and traceback tail, or its last output lines and exit code
            (or the signal that killed it); for a timeout, what to do about it.
        log_dir: The ``--log-dir`` of the launch.
        timed_out: True when `TorchrunJob.timeout_s` expired and the job was stopped here.
        rank: Global rank of the root cause, when torchrun named one.
        rank_exit_code: That rank's exit code (negative: killed by that signal).
        run_log_dir: This launch's subdirectory of `log_dir` (``<run id>_<random>``), when it was created.
    """

    def __init__(
        self,
        module: str,
        *,
        exit_code: int | None,
        root_cause: str,
        log_dir: Path,
        timed_out: bool = False,
        rank: int | None = None,
        rank_exit_code: int | None = None,
        run_log_dir: Path | None = None,
    ) -> None:
        self.module = module
        self.exit_code = exit_code
        self.root_cause = root_cause
        self.log_dir = Path(log_dir)
        self.timed_out = timed_out
        self.rank = rank
        self.rank_exit_code = rank_exit_code
        self.run_log_dir = Path(run_log_dir) if run_log_dir is not None else None
        super().__init__(self._message())

    def _message(self) -> str:
        if self.timed_out:
            head = f"torchrun job `{self.module}` timed out and was stopped"
        else:
            codes = f"torchrun exit code {self.exit_code}"
            if self.rank is not None:
                codes += f"; rank {self.rank} exit code {self.rank_exit_code}"
            head = f"torchrun job `{self.module}` failed ({codes})"
        where = self.run_log_dir or self.log_dir
        body = "\n".join("    " + line for line in self.root_cause.splitlines())
        return (
            f"{head}.\nRoot cause:\n{body}\n"
            f"Every rank's output: {where} (attempt_<n>/<local rank>/stdout.log, stderr.log, error.json)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only __init__: the default Exception pickling (cls(*args)) would fail, and Prefect pickles a
        # failed task's exception into its state.
        return (_rebuild_failure, (self.module, self.__dict__.copy()))


def _rebuild_failure(module: str, state: dict[str, Any]) -> TorchrunFailed:
    fields = ("exit_code", "root_cause", "log_dir", "timed_out", "rank", "rank_exit_code", "run_log_dir")
    return TorchrunFailed(module, **{k: state.get(k) for k in fields})


def torchrun_argv(job: TorchrunJob) -> list[str]:
    """The torchrun command line for `job` (validated; raises ValueError naming the bad field).

    Single node without an endpoint → ``--standalone`` (private rendezvous on a free port); otherwise c10d
    rendezvous at `rdzv_endpoint`. ``--tee=3 --local-ranks-filter=0``: all ranks' output goes to files under
    ``--log-dir`` and only local rank 0's also to the console, i.e. to the launcher's pipe.
    """
    _validate(job)
    argv = [job.python, "-m", "torch.distributed.run"]
    if job.nnodes == 1 and job.rdzv_endpoint is None:
        argv.append("--standalone")
    else:
        argv += [
            f"--nnodes={job.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={job.rdzv_endpoint}",
            f"--rdzv-id={job.rdzv_id or DEFAULT_RDZV_ID}",
        ]
    argv.append(f"--nproc-per-node={job.nproc_per_node}")
    if job.max_restarts:
        argv.append(f"--max-restarts={job.max_restarts}")
    if job.log_dir is not None:
        argv.append(f"--log-dir={job.log_dir}")
    argv += ["--tee=3", "--local-ranks-filter=0", "-m", job.module, *job.args]
    return argv


def _validate(job: TorchrunJob) -> None:
    def positive_int(name: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"TorchrunJob.{name} must be an integer ≥ 1, got {value!r}")

    if not isinstance(job.module, str) or not _MODULE_NAME.match(job.module):
        raise ValueError(f"TorchrunJob.module must be a dotted Python module name (python -m …), got {job.module!r}")
    if isinstance(job.args, str) or not all(isinstance(a, str) for a in job.args):
        raise ValueError(f"TorchrunJob.args must be a list of strings, got {job.args!r}")
    positive_int("nproc_per_node", job.nproc_per_node)
    positive_int("nnodes", job.nnodes)
    if job.nnodes > 1 and not job.rdzv_endpoint:
        raise ValueError(
            f"TorchrunJob.rdzv_endpoint (host:port of the c10d rendezvous) is required when nnodes > 1 "
            f"(nnodes={job.nnodes}); start the same job on every node with the same endpoint and rdzv_id"
        )
    if job.rdzv_endpoint is not None:
        host, _, port = job.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"TorchrunJob.rdzv_endpoint must be host:port, got {job.rdzv_endpoint!r}")
    if job.rdzv_id is not None and not re.fullmatch(r"[\w.-]+", job.rdzv_id):
        raise ValueError(f"TorchrunJob.rdzv_id must be letters, digits, '_', '.', '-', got {job.rdzv_id!r}")
    if job.timeout_s is not None and not job.timeout_s > 0:
        raise ValueError(f"TorchrunJob.timeout_s must be > 0 seconds or None, got {job.timeout_s!r}")
    if isinstance(job.max_restarts, bool) or not isinstance(job.max_restarts, int) or job.max_restarts < 0:
        raise ValueError(f"TorchrunJob.max_restarts must be an integer ≥ 0, got {job.max_restarts!r}")
    bad_env = [k for k, v in job.env.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad_env:
        raise ValueError(f"TorchrunJob.env keys and values must be strings; check {bad_env}")
