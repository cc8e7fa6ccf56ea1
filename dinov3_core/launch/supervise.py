"""Start a torchrun job, stream local rank 0's output, enforce its time limit and leave no process behind.

`run_torchrun` is the only place that starts torchrun (CLI and Prefect tasks alike); see the package docstring
for why cancellation, timeouts and orphans need this much care.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import IO

import psutil

from dinov3_core.launch.diagnose import diagnose_failure, new_run_dir
from dinov3_core.launch.job import (
    _CONSOLE_KEEP,
    _EOF_WAIT_S,
    _EXEC_TIED_TO_LAUNCHER,
    _RANK_PREFIX,
    _SCAN_INTERVAL_S,
    LAUNCH_TOKEN_ENV,
    TORCHRUN_PID_ENV,
    TorchrunFailed,
    TorchrunJob,
    torchrun_argv,
)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def _signals_stop_the_job() -> Iterator[list[int]]:
    """While the job is started and supervised, SIGTERM and SIGINT left at their default action (a `wsidino`
    command's SIGTERM: the process would die at once, leaving the job to die later, if at all) only note themselves
    (the list yielded), and the supervising loop stops the whole job; then the default comes back and the signal is
    delivered again: the process dies by it, as it would have. A handler of the caller's stays in place (Prefect
    acknowledges a cancellation only while its own SIGTERM handler is installed; Python's SIGINT handler raises
    KeyboardInterrupt): its exception reaches `run_torchrun`'s `try`, which encloses torchrun's start. Main thread
    only (Python runs handlers there)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    defaults = [sig for sig in _STOP_SIGNALS if signal.getsignal(sig) is signal.SIG_DFL]
    for sig in defaults:
        signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        for sig in defaults:
            signal.signal(sig, signal.SIG_DFL)
    if received:
        signal.raise_signal(received[0])


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
    timed_out = False
    with _signals_stop_the_job() as received:  # before torchrun exists: no signal can come between start and stop
        tracker = _JobProcesses(None, token)
        proc: subprocess.Popen[str] | None = None
        reader: threading.Thread | None = None
        try:  # from here on, whatever happens, the job's processes are stopped before this function is left
            # Its own session (process group = torchrun's pid): a signal to the caller's group (Prefect's
            # cancellation, Ctrl-C) reaches this process, which stops the job as a whole; torchrun is never caught
            # by it while it is starting its ranks (it would die leaving the ones already started).
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
                start_new_session=True,
            )
            tracker.root_pid = proc.pid
            console: deque[str] = deque(maxlen=_CONSOLE_KEEP)
            lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
            reader = threading.Thread(target=_pump, args=(proc.stdout, lines), name=f"torchrun-{proc.pid}", daemon=True)
            reader.start()
            deadline = None if job.timeout_s is None else time.monotonic() + job.timeout_s
            eof = False
            exited_at: float | None = None
            last_scan = 0.0
            while not received:
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
            if received:
                _safe_log(log, f"torchrun: {signal.Signals(received[0]).name} received: stopping the job")
        finally:
            # Runs on success too: a rank that outlived torchrun (or anything else carrying the token) is an orphan.
            if proc is None:  # Popen itself was interrupted (its exception goes on): torchrun may exist unseen
                tracker.kill_now(None)
            else:
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

    assert proc is not None  # otherwise Popen's exception has propagated
    run_dir = new_run_dir(log_dir, runs_before)
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
        root_cause, rank, rank_code = diagnose_failure(run_dir, list(console), proc.returncode)
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

    def __init__(self, root_pid: int | None, token: str) -> None:
        self.root_pid = root_pid  # torchrun's, once Popen has returned it
        self.token = token
        self.known: dict[int, psutil.Process] = {}
        self.children_before = {p.pid for p in psutil.Process().children()}

    def scan(self) -> None:
        """Record torchrun's current descendants (ranks and their children) while the tree is still connected."""
        if self.root_pid is None:
            return
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

    def kill_now(self, proc: subprocess.Popen[str] | None) -> None:
        """SIGKILL every known process of the job and torchrun, without a grace period. Without `proc` (Popen was
        interrupted) torchrun is whichever child this process started since, exec'd or not."""
        started = (
            [] if proc is not None else [p for p in psutil.Process().children() if p.pid not in self.children_before]
        )
        for p in [*started, *self._alive(), *self._token_holders()]:
            _signal(p, signal.SIGKILL)
        _wait_gone(started, timeout=5.0)
        if proc is None:
            return
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
            _signal_popen(proc, signal.SIGKILL)  # first: once torchrun is gone it cannot start another rank
        # A process in D state (hung driver call) survives SIGKILL: nothing more can be done from here.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        leftovers = self._alive() + self._token_holders()
        for p in leftovers:
            signalled.add(p.pid)
            _signal(p, signal.SIGKILL)
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
    """`sig` to torchrun's whole process group (its session: `run_torchrun`), torchrun included."""
    with contextlib.suppress(OSError):
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
    with contextlib.suppress(OSError):
        proc.send_signal(sig)  # torchrun alone, should its group be gone


def _wait_gone(procs: Iterable[psutil.Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if _is_alive(p)]
        if pending:
            time.sleep(0.05)
