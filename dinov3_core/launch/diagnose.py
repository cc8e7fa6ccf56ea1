"""Why a torchrun job failed: the failing rank's own error (error.json or its stderr), not torchrun's guess.

torchrun always exits 1 and names as root cause the earliest-stamped failure, which is often a peer's
"connection reset" rather than the rank that died first; `_diagnose` skips such consequences.
"""

from __future__ import annotations

import json
import re
import signal
from collections import deque
from dataclasses import dataclass
from pathlib import Path

_CALLSTACK_LINES = 30
_CONSOLE_LINES = 40
_RANK_LOG_LINES = 40

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


def new_run_dir(log_dir: Path, runs_before: set[str]) -> Path | None:
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


def diagnose_failure(run_dir: Path | None, console: list[str], exit_code: int) -> tuple[str, int | None, int | None]:
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
