"""Child processes of `make serve`: each in its own process group, with its log, stopped as a group.

`serve` also becomes a child subreaper (Linux), so processes a server leaves behind are reaped here rather than
left as zombies in a container without an init.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The checkout: children run in it, and `prefect deploy` resolves the entrypoints of deploy/prefect.yaml from it.
REPO_ROOT = Path(__file__).resolve().parents[2]

# Variables that would send the children to another server, profile, account or MLflow run.
_CLEARED_ENV = (
    "PREFECT_API_URL",
    "PREFECT_API_KEY",
    "PREFECT_PROFILE",
    "PREFECT_PROFILES_PATH",
    "PREFECT_UI_API_URL",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_RUN_ID",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_EXPERIMENT_ID",
    "WSIDINO_MLFLOW_PARENT_RUN_ID",
)


class ServeError(RuntimeError):
    """Something `make serve` needs did not start or register; the message says what and where to look."""


@dataclass
class Child:
    """A child process in its own process group (session), stopped as a group."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path | None = None
    url: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def group_members(self) -> list[int]:
        """Live (non-zombie) processes of the group; the leader is reaped first so it does not count once done."""
        self.proc.poll()
        return group_members(self.proc.pid)

    def group_alive(self) -> bool:
        return bool(self.group_members())

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM to the whole group, SIGKILL to what is left after `timeout` s; returns the leader's exit code."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + (timeout if sig == signal.SIGTERM else 5.0)
            while self.group_alive() and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self.group_alive():
                break
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable (D state)
            return None

    def log_tail(self, lines: int = 30) -> str:
        if self.log is None or not self.log.exists():
            return ""
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group `pgid` (Linux /proc; elsewhere `killpg(pgid, 0)`)."""
    proc = Path("/proc")
    if not proc.is_dir():  # pragma: no cover - not Linux
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces and parentheses
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def stop_all(children: Sequence[Child], timeout: float = 20.0) -> None:
    """Stop the workers first (while the API still answers, so they shut down cleanly), then everything else at
    once; each group gets SIGTERM, then SIGKILL after `timeout` s."""
    workers = [c for c in children if c.extra.get("pool")]
    others = [c for c in children if not c.extra.get("pool")]
    for batch in (workers, others):
        if not batch:
            continue
        with ThreadPoolExecutor(max_workers=len(batch)) as pool:
            codes = list(pool.map(lambda child: child.stop(timeout), batch))
        for child, code in zip(batch, codes, strict=True):
            print(f"serve: stopped {child.name} (pid {child.pid}, exit {code})", flush=True)


PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux): processes a server leaves behind when it exits are re-parented to this
    process instead of PID 1, which in a container without an init may never reap them (zombies)."""
    if not sys.platform.startswith("linux"):  # pragma: no cover
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover
        return False


def reap_orphans() -> int:
    """Collect every exited child not waited for yet (call after the `Child` handles have been waited on)."""
    reaped = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped += 1


def child_env(serve_dir: Path, api_url: str | None = None, **extra: str) -> dict[str, str]:
    """This process's environment minus outside Prefect/MLflow targets, plus the serve directory's Prefect home."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED_ENV}
    env.update(
        PREFECT_HOME=str(serve_dir / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONUNBUFFERED="1",
    )
    if api_url:
        env["PREFECT_API_URL"] = api_url
    env.update(extra)
    return env


def spawn(name: str, cmd: Sequence[str], env: dict[str, str], log: Path, url: str | None = None) -> Child:
    """Start `cmd` in the repository root in a new session (its own process group), output appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            list(cmd),
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Child(name=name, proc=proc, log=log, url=url)


def prefect_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", *args]


def wait_exit(child: Child, timeout: float = 300.0) -> None:
    try:
        code = child.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ServeError(f"{child.name} did not finish within {timeout:.0f} s; log {child.log}") from None
    if code != 0:
        raise ServeError(f"{child.name} failed with exit code {code}; log {child.log}:\n{child.log_tail()}")
