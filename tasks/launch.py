"""Run a torchrun job from a Prefect task (or plain Python) without losing its output, its errors or its processes.

Why not just ``subprocess.run(torchrun …)``:

* **Cancellation.** Prefect's process worker cancels a flow run with ``os.killpg`` (SIGTERM, then SIGKILL) on the
  flow run's process group. torchrun is started in that group (no ``start_new_session``) so it gets the SIGTERM and
  forwards it to its ranks. The ranks themselves run in sessions of their own (torchrun's ``SubprocessHandler``
  uses ``start_new_session=True``), so they only die with torchrun because they call
  `dinov3_core.procutil.die_with_parent` (``PR_SET_PDEATHSIG``). torchrun gets the same protection from a tiny
  ``exec`` wrapper, so it stops its ranks when the launching process is SIGKILLed on its own (OOM killer,
  ``kill -9``).
* **Timeouts.** A sync Prefect task in a worker thread cannot be interrupted, and a blocking ``proc.wait()`` cannot
  be either: the job is polled, and on expiry it is stopped here (`TorchrunJob.timeout_s`).
* **No orphans.** Whatever ends the wait — success, failure, timeout, an exception in the calling thread such as
  Prefect's ``TerminationSignal`` or a failing log handler — every process of the job is stopped before
  `run_torchrun` returns or raises: torchrun gets SIGTERM (it forwards it), and after a grace period every
  remaining process is SIGKILLed. Processes are found as torchrun's descendants and, for those already orphaned,
  by a per-launch token in their environment.
* **Readable failures.** torchrun always exits 1 and prints its own traceback; the useful part is the failing
  rank's ``error.json`` (written by ``@record``) or, when there is none (exit code 2 for bad input, SIGKILL by the
  OOM killer), that rank's own stderr in the log directory. `TorchrunFailed` carries that root cause.

Only local rank 0's output is streamed (``--tee=3 --local-ranks-filter=0``); every rank's stdout/stderr stays in
``<log_dir>/<rdzv run id>_<random>/attempt_<n>/<local rank>/{stdout,stderr}.log`` (+ ``error.json``).

This module imports neither Prefect nor torch: pass ``get_run_logger().info`` as `log` inside a task. `log` is
always called from the calling thread (Prefect's run logger needs the run context, which is per thread).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import psutil

from dinov3_core.procutil import PARENT_PID_ENV

__all__ = ["DEFAULT_RDZV_ID", "TorchrunFailed", "TorchrunJob", "run_torchrun", "torchrun_argv"]

DEFAULT_RDZV_ID = "wsidino"
#: Environment variable holding a per-launch token: every process of the job inherits it, so processes orphaned
#: by a dead torchrun (reparented to init, no longer its descendants) can still be found and stopped.
LAUNCH_TOKEN_ENV = "WSIDINO_LAUNCH_TOKEN"
#: torchrun's pid, published to the ranks for `die_with_parent`'s check of the parent-died-before-prctl race.
TORCHRUN_PID_ENV = PARENT_PID_ENV

_CALLSTACK_LINES = 30
_CONSOLE_LINES = 40
_RANK_LOG_LINES = 40
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

# Errors a rank gets because a peer died or hung: never the root cause when another rank failed on its own.
_PEER_FAILURE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|DistNetworkError|remote process exited|"
    r"NCCL communicator was aborted|Watchdog caught collective operation timeout|Socket Timeout|recvValue failed",
    re.IGNORECASE,
)

_SIGNAL_HINTS = {
    "SIGKILL": "out of memory? see `dmesg` or the container's OOM events",
    "SIGSEGV": "a crash in native code",
    "SIGBUS": "a crash in native code, or /dev/shm too small",
    "SIGABRT": "an abort in native code, e.g. a NCCL watchdog timeout or a failed C++ assertion",
    "SIGTERM": "stopped by torchrun after another rank failed, or by an external kill",
}


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


def run_torchrun(
    job: TorchrunJob,
    log: Callable[[str], None] = print,
    *,
    grace_s: float = 15.0,
    poll_s: float = 0.5,
    tie_to_launcher: bool = True,
) -> None:
    """Run `job` to completion, streaming local rank 0's output line by line to `log`.

    Args:
        job: What to run.
        log: Called from this thread with each console line (torchrun's ``[default0]:`` prefix removed).
        grace_s: When the job must be stopped: seconds between SIGTERM to torchrun (which forwards it to the
            ranks, letting them shut down) and SIGKILL to every process of the job that is still alive.
        poll_s: Longest time this thread blocks at once (≤ 1 s keeps it responsive to Prefect's cancellation).
        tie_to_launcher: Start torchrun through an exec wrapper that arms ``PR_SET_PDEATHSIG`` (Linux), so that
            torchrun gets SIGTERM if this thread's process dies without a chance to clean up.

    Raises:
        TorchrunFailed: Non-zero exit (with the root cause), or the time limit expired (``timed_out=True``).
        ValueError: `job` is invalid.
        BaseException: Anything raised by `log` or delivered to this thread (KeyboardInterrupt, Prefect's
            TerminationSignal) propagates — after every process of the job has been stopped.
    """
    # Absolute, so that the paths torchrun prints (error files) do not depend on anybody's working directory.
    log_dir = Path(job.log_dir).resolve() if job.log_dir is not None else Path(tempfile.mkdtemp(prefix="torchrun-"))
    job = replace(job, log_dir=log_dir)
    argv = torchrun_argv(job)
    log_dir.mkdir(parents=True, exist_ok=True)
    runs_before = {p.name for p in log_dir.iterdir()}
    token = uuid.uuid4().hex
    env = _job_env(job, token)
    cmd = argv
    if tie_to_launcher and sys.platform.startswith("linux"):
        cmd = [job.python, "-c", _EXEC_TIED_TO_LAUNCHER, str(os.getpid()), *argv]

    log(f"torchrun: {shlex.join(argv)}")
    log(f"torchrun: every rank's output goes to {log_dir}")
    # No start_new_session: torchrun must stay in our process group, which Prefect signals on cancellation.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        encoding="utf-8",
        errors="replace",
        bufsize=1,
        env=env,
    )
    tracker = _JobProcesses(proc.pid, token)
    reader: threading.Thread | None = None
    timed_out = False
    try:  # from here on, whatever happens, the job's processes are stopped before this function is left
        console: deque[str] = deque(maxlen=_CONSOLE_KEEP)
        lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        reader = threading.Thread(target=_pump, args=(proc.stdout, lines), name=f"torchrun-{proc.pid}", daemon=True)
        reader.start()
        deadline = None if job.timeout_s is None else time.monotonic() + job.timeout_s
        eof = False
        exited_at: float | None = None
        last_scan = 0.0
        while True:
            now = time.monotonic()
            wait = poll_s if deadline is None else max(0.0, min(poll_s, deadline - now))
            if eof:
                time.sleep(wait)
            else:
                try:
                    line = lines.get(timeout=wait)
                except queue.Empty:
                    pass
                else:
                    if line is None:
                        eof = True
                    else:
                        console.append(line)
                        log(line)
            now = time.monotonic()
            if proc.poll() is not None:
                exited_at = exited_at or now
                if eof or now - exited_at > _EOF_WAIT_S:
                    break
            else:
                if now - last_scan > _SCAN_INTERVAL_S:
                    tracker.scan()
                    last_scan = now
                if deadline is not None and now >= deadline:
                    timed_out = True
                    break
    finally:
        # Runs on success too: a rank that outlived torchrun (or anything else carrying the token) is an orphan.
        try:
            stopped = tracker.stop_all(proc, grace_s)
        except BaseException:  # interrupted again (a second Ctrl-C / TerminationSignal): no grace any more
            tracker.kill_now(proc)
            raise
        if stopped:
            _safe_log(log, f"torchrun: stopped {len(stopped)} process(es) of the job: pids {sorted(stopped)}")
        if reader is not None:
            reader.join(timeout=1.0)
        if (reader is None or not reader.is_alive()) and proc.stdout is not None:
            proc.stdout.close()

    run_dir = _new_run_dir(log_dir, runs_before)
    if timed_out:
        raise TorchrunFailed(
            job.module,
            exit_code=proc.returncode,
            root_cause=(
                f"the job exceeded its wall-clock limit timeout_s={job.timeout_s:g} s and was stopped (torchrun and "
                f"every rank killed). Raise timeout_s, or run the job again: training resumes from its last "
                f"checkpoint."
            ),
            log_dir=log_dir,
            timed_out=True,
            run_log_dir=run_dir,
        )
    if proc.returncode != 0:
        root_cause, rank, rank_code = _diagnose(run_dir, list(console), proc.returncode)
        raise TorchrunFailed(
            job.module,
            exit_code=proc.returncode,
            root_cause=root_cause,
            log_dir=log_dir,
            rank=rank,
            rank_exit_code=rank_code,
            run_log_dir=run_dir,
        )


def _job_env(job: TorchrunJob, token: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(TORCHRUN_PID_ENV, None)  # only the exec wrapper may set it, to torchrun's own pid
    env.update(job.env)
    if job.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = job.cuda_visible_devices.replace(" ", "")
    env["PYTHONUNBUFFERED"] = "1"  # torchrun's teed lines (and the ranks') must reach the pipe as they happen
    env[LAUNCH_TOKEN_ENV] = token
    return env


def _pump(stream: IO[str] | None, lines: queue.SimpleQueue[str | None]) -> None:
    """Reader thread: move console lines to the queue (the calling thread logs them), then None at EOF."""
    try:
        if stream is not None:
            for raw in stream:
                lines.put(_RANK_PREFIX.sub("", raw.rstrip("\r\n"), count=1))
    except (OSError, ValueError):  # the pipe was closed under us while the job was being stopped
        pass
    finally:
        lines.put(None)


def _safe_log(log: Callable[[str], None], message: str) -> None:
    try:
        log(message)
    except Exception:  # the log callback may be what failed; the cleanup must go on regardless
        print(message, file=sys.stderr, flush=True)


class _JobProcesses:
    """Every process of one launch: torchrun's descendants as seen while it ran, plus token holders at the end."""

    def __init__(self, root_pid: int, token: str) -> None:
        self.root_pid = root_pid
        self.token = token
        self.known: dict[int, psutil.Process] = {}

    def scan(self) -> None:
        """Record torchrun's current descendants (ranks and their children) while the tree is still connected."""
        try:
            children = psutil.Process(self.root_pid).children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            self.known.setdefault(child.pid, child)

    def _token_holders(self) -> list[psutil.Process]:
        """Processes carrying this launch's token in their environment: finds ranks already orphaned by torchrun."""
        me = os.getpid()
        found = []
        for p in psutil.process_iter():
            if p.pid in (me, self.root_pid) or p.pid in self.known:
                continue
            try:
                if p.environ().get(LAUNCH_TOKEN_ENV) == self.token:
                    found.append(p)
            except psutil.Error:
                continue
        return found

    def kill_now(self, proc: subprocess.Popen[str]) -> None:
        """SIGKILL every known process of the job and torchrun, without a grace period."""
        for p in [*self._alive(), *self._token_holders()]:
            _signal(p, signal.SIGKILL)
        if proc.poll() is None:
            _signal_popen(proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def _alive(self) -> list[psutil.Process]:
        return [p for p in self.known.values() if _is_alive(p)]

    def stop_all(self, proc: subprocess.Popen[str], grace_s: float) -> set[int]:
        """SIGTERM torchrun (it forwards to the ranks), wait `grace_s`, SIGKILL whatever is left; reap torchrun.

        Returns the pids (other than an already-exited torchrun) that had to be signalled.
        """
        self.scan()
        for p in self._token_holders():
            self.known.setdefault(p.pid, p)
        signalled: set[int] = set()
        torchrun_running = proc.poll() is None
        if torchrun_running:
            signalled.add(proc.pid)
            _signal_popen(proc, signal.SIGTERM)
        else:
            # torchrun is gone: nobody forwards anything, so the orphans get SIGTERM directly.
            for p in self._alive():
                signalled.add(p.pid)
                _signal(p, signal.SIGTERM)
        if not signalled:
            return signalled
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if proc.poll() is None:
                self.scan()  # catch a rank started while the stop began
            if proc.poll() is not None and not self._alive():
                break
            time.sleep(0.1)
        if proc.poll() is None:
            self.scan()
        leftovers = self._alive() + self._token_holders()
        for p in leftovers:
            signalled.add(p.pid)
            _signal(p, signal.SIGKILL)
        if proc.poll() is None:
            _signal_popen(proc, signal.SIGKILL)
        # A process in D state (hung driver call) survives SIGKILL: nothing more can be done from here.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        _wait_gone(leftovers, timeout=5.0)
        return signalled


def _is_alive(p: psutil.Process) -> bool:
    """Running and not a zombie (an exited orphan waits for init to reap it; it holds no resources)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(p: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.Error):
        p.send_signal(sig)  # psutil refuses if the pid was reused by another process


def _signal_popen(proc: subprocess.Popen[str], sig: int) -> None:
    with contextlib.suppress(OSError):
        proc.send_signal(sig)


def _wait_gone(procs: Iterable[psutil.Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if _is_alive(p)]
        if pending:
            time.sleep(0.05)


def _new_run_dir(log_dir: Path, runs_before: set[str]) -> Path | None:
    """This launch's ``<run id>_<random>`` directory (a reused `log_dir` keeps earlier runs' directories)."""
    try:
        new = [p for p in log_dir.iterdir() if p.is_dir() and p.name not in runs_before]
    except OSError:
        return None
    return max(new, key=lambda p: p.stat().st_mtime) if new else None


@dataclass
class _RankFailure:
    rank: int
    local_rank: int
    exit_code: int
    error_file: Path | None


_FAILURE_FIELDS = re.compile(
    r"rank\s*:\s*(?P<rank>-?\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+).*\n"
    r"\s*error_file\s*:\s*(?P<file>.*)"
)


def _parse_summary(console: list[str]) -> tuple[_RankFailure | None, list[_RankFailure]]:
    """torchrun's ChildFailedError summary: (root cause, other failures). Both empty if torchrun printed none."""
    marker = "Root Cause (first observed failure):"
    idx = max((i for i, line in enumerate(console) if line.strip() == marker), default=None)
    if idx is None:
        return None, []
    start = max((i for i, line in enumerate(console[:idx]) if line.strip() == "Failures:"), default=idx)
    end = next((i for i in range(idx + 1, len(console)) if re.fullmatch(r"=+", console[i].strip())), len(console))

    def parse(text: str) -> list[_RankFailure]:
        out = []
        for m in _FAILURE_FIELDS.finditer(text):
            path = m["file"].strip()
            err = Path(path) if path and path != "<N/A>" else None
            out.append(_RankFailure(int(m["rank"]), int(m["local"]), int(m["code"]), err))
        return out

    roots = parse("\n".join(console[idx:end]))
    return (roots[0] if roots else None), parse("\n".join(console[start:idx]))


def _read_error_file(path: Path) -> tuple[str, str, float] | None:
    """(message, py_callstack, timestamp) from a torchelastic error file; both of its message layouts."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    message = data.get("message", "")
    if isinstance(message, dict):
        extra = message.get("extraInfo", {}) or {}
        text, stack, ts = message.get("message", ""), extra.get("py_callstack", ""), extra.get("timestamp", 0)
    else:
        text, stack, ts = str(message), "", data.get("timestamp", 0)
    try:
        stamp = float(ts)
    except (TypeError, ValueError):
        stamp = 0.0
    return str(text), str(stack), stamp


def _error_files(run_dir: Path | None) -> list[Path]:
    """Error files of the last attempt, earliest failure first (file timestamp is whole seconds: mtime breaks ties)."""
    if run_dir is None:
        return []
    attempts = sorted(run_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[-1] or 0))
    if not attempts:
        return []
    files = list(attempts[-1].glob("*/error.json"))

    def key(p: Path) -> tuple[float, float]:
        parsed = _read_error_file(p)
        try:
            mtime = p.stat().st_mtime
        except OSError:
            mtime = float("inf")
        return (parsed[2] if parsed else float("inf"), mtime)

    return sorted(files, key=key)


def _tail(path: Path, n: int) -> list[str]:
    try:
        with path.open(errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=n)]
    except OSError:
        return []


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _rank_dir(run_dir: Path | None, local_rank: int) -> Path | None:
    if run_dir is None:
        return None
    attempts = sorted(run_dir.glob("attempt_*"), key=lambda p: int(p.name.split("_")[-1] or 0))
    return attempts[-1] / str(local_rank) if attempts else None


def _describe_error_file(path: Path, who: str) -> str | None:
    parsed = _read_error_file(path)
    if parsed is None:
        return None
    text, stack, _ = parsed
    lines = [f"{who} raised {text}"]
    stack_lines = stack.rstrip("\n").splitlines()
    if stack_lines:
        lines.append(f"traceback (last {min(len(stack_lines), _CALLSTACK_LINES)} lines, from {path}):")
        lines += stack_lines[-_CALLSTACK_LINES:]
    return "\n".join(lines)


def _exit_headline(failure: _RankFailure) -> str:
    who = f"rank {failure.rank} (local rank {failure.local_rank})"
    if failure.exit_code < 0:
        name = _signal_name(failure.exit_code)
        return f"{who} was killed by signal {name}" + (f" ({_SIGNAL_HINTS[name]})" if name in _SIGNAL_HINTS else "")
    return f"{who} exited with code {failure.exit_code} without raising (no error file)"


def _describe_exit(failure: _RankFailure, run_dir: Path | None) -> str:
    """A failure without an error file: exit code or signal, plus the last lines the rank wrote."""
    parts = [_exit_headline(failure)]
    rank_dir = _rank_dir(run_dir, failure.local_rank)
    if rank_dir is None:
        return parts[0]
    for path in (rank_dir / "stderr.log", rank_dir / "stdout.log"):
        stream = path.stem
        tail = _tail(path, _RANK_LOG_LINES)
        if any(line.strip() for line in tail):
            parts.append(f"last lines of its {stream} ({path}):")
            parts += tail
            break
    return "\n".join(parts)


def _is_consequence(failure: _RankFailure, message: str | None) -> bool:
    """A failure caused by another rank's: stopped by torchrun, or a communication error about a dead peer."""
    if message is not None:
        return bool(_PEER_FAILURE.search(message))
    return failure.exit_code < 0 and _signal_name(failure.exit_code) in ("SIGTERM", "SIGINT")


def _diagnose(run_dir: Path | None, console: list[str], exit_code: int) -> tuple[str, int | None, int | None]:
    """(root cause text, failing global rank, its exit code) for a failed launch.

    torchrun's "Root Cause (first observed failure)" is the failure with the smallest timestamp, but error files
    have whole-second timestamps and a failure without one (exit code, signal) is stamped when torchrun notices
    it: a peer's "Connection reset by peer" often wins against the rank the OOM killer SIGKILLed. So failures
    that are consequences of another rank's (SIGTERM from torchrun, peer-communication errors) are skipped.
    """
    root, others = _parse_summary(console)
    if root is None:
        files = _error_files(run_dir)
        described = _describe_error_file(files[0], f"local rank {files[0].parent.name}") if files else None
        if described:
            return described, None, None
        code = f"signal {_signal_name(exit_code)}" if exit_code < 0 else f"exit code {exit_code}"
        tail = "\n".join(console[-_CONSOLE_LINES:])
        return (
            f"torchrun itself failed ({code}) before reporting a rank failure; last console lines:\n{tail}",
            None,
            None,
        )

    failures = [root, *others]
    for f in failures:  # torchrun prints the error file path when it has one; else look where it would be
        rank_dir = _rank_dir(run_dir, f.local_rank)
        if f.error_file is None and rank_dir is not None and (rank_dir / "error.json").is_file():
            f.error_file = rank_dir / "error.json"
    messages: dict[int, str | None] = {}
    for f in failures:
        parsed = _read_error_file(f.error_file) if f.error_file is not None else None
        messages[id(f)] = parsed[0] if parsed else None
    chosen = next((f for f in failures if not _is_consequence(f, messages[id(f)])), root)

    who = f"rank {chosen.rank} (local rank {chosen.local_rank})"
    described = _describe_error_file(chosen.error_file, who) if chosen.error_file else None
    parts = [described or _describe_exit(chosen, run_dir)]
    if chosen is not root:
        first = messages[id(root)] or _exit_headline(root)
        parts.append(f"(torchrun reported rank {root.rank} first, but its failure looks like a consequence: {first})")
    # Always mention ranks killed by a signal torchrun does not send (OOM killer's SIGKILL, segfaults).
    for f in failures:
        if f is not chosen and f.exit_code < 0 and not _is_consequence(f, None) and f.error_file is None:
            parts.append(_exit_headline(f))
    return "\n".join(parts), chosen.rank, chosen.exit_code
