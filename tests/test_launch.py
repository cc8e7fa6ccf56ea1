"""`dinov3_core.launch`: real torchrun, 2 gloo/CPU ranks of tests/dist_scripts/launch_worker.py, no mocks.

What must hold in production: only local rank 0 reaches the Prefect log while every rank's output stays on disk; a
failure names the failing rank and its own error (not torchrun's traceback, not a peer's "connection closed");
and no process of the job survives a timeout, an exception in the caller, Prefect's SIGTERM → SIGKILL
cancellation of the flow-run process group, or the launcher being SIGKILLed alone.

Every job carries a unique marker in its environment, so "nothing of the job is left" is checked over all
processes of the machine, not only over the pids the ranks wrote down.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from dinov3_core.launch import TorchrunFailed, TorchrunJob, run_torchrun, torchrun_argv
from dinov3_core.procutil import PARENT_PID_ENV

REPO = Path(__file__).resolve().parents[1]
WORKER = "tests.dist_scripts.launch_worker"
DRIVER = "tests.dist_scripts.launch_driver"
MARK = "WSIDINO_TEST_LAUNCH_MARK"


def _job(mode: str, marker: str, *extra: str, **kw: object) -> TorchrunJob:
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", MARK: marker}
    return TorchrunJob(module=WORKER, args=[mode, *extra], env=env, **{"nproc_per_node": 2, **kw})  # type: ignore[arg-type]


def _alive(pid: int) -> bool:
    """Running, not a zombie (killed orphans wait for PID 1 to reap them; they hold nothing)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _marked(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries `marker`: torchrun, every rank and the ranks' children."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK) == marker and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def _assert_all_gone(marker: str, pids: dict[str, int], within_s: float = 0.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        left = {name: pid for name, pid in pids.items() if _alive(pid)}
        strays = _marked(marker)
        if (not left and not strays) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    for p in strays:  # never leave them behind for the next test, even when failing
        p.kill()
    assert not left, f"still alive: {left}"
    assert not strays, f"processes of the job still alive: {[(p.pid, p.cmdline()) for p in strays]}"


def _wait_pid_files(pid_dir: Path, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while len(list(pid_dir.glob("rank*.json"))) < 2:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"driver exited early ({proc.returncode}): {proc.stdout.read() if proc.stdout else ''}")
        if time.monotonic() > deadline:
            pytest.fail(f"ranks did not start within {timeout_s} s")
        time.sleep(0.1)
    return _pids(pid_dir)


def _pids(pid_dir: Path) -> dict[str, int]:
    pids = {}
    for f in pid_dir.glob("rank*.json"):
        for name, pid in json.loads(f.read_text()).items():
            pids[f"{f.stem}.{name}"] = pid
    return pids


# --------------------------------------------------------------------------------------------------- argv


def test_argv_standalone_and_multinode(tmp_path: Path) -> None:
    single = torchrun_argv(TorchrunJob("dinov3_core.train", ["--config", "c.yaml"], nproc_per_node=4, log_dir=tmp_path))
    assert single[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in single and "--nproc-per-node=4" in single
    assert {f"--log-dir={tmp_path}", "--tee=3", "--local-ranks-filter=0"} <= set(single)
    assert not any(a.startswith("--rdzv") for a in single)
    assert single[-4:] == ["-m", "dinov3_core.train", "--config", "c.yaml"]

    multi = torchrun_argv(TorchrunJob("dinov3_core.gram", nproc_per_node=8, nnodes=2, rdzv_endpoint="head:29400"))
    assert "--standalone" not in multi
    assert {"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=head:29400", "--rdzv-id=wsidino"} <= set(multi)
    assert not any(a.startswith("--log-dir") for a in multi)  # run_torchrun always fills it in
    # An explicit endpoint on one node uses it too (a fixed port instead of --standalone's random one).
    one = torchrun_argv(TorchrunJob("m", rdzv_endpoint="[::1]:29500", rdzv_id="job-7", max_restarts=2))
    assert {"--nnodes=1", "--rdzv-endpoint=[::1]:29500", "--rdzv-id=job-7", "--max-restarts=2"} <= set(one)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nproc_per_node": 0}, "nproc_per_node must be an integer ≥ 1"),
        ({"nproc_per_node": True}, "nproc_per_node must be an integer ≥ 1"),
        ({"nnodes": 0}, "nnodes must be an integer ≥ 1"),
        ({"nnodes": 2}, "rdzv_endpoint .* is required when nnodes > 1"),
        ({"nnodes": 2, "rdzv_endpoint": "head"}, "must be host:port"),
        ({"module": "scripts/train.py"}, "dotted Python module name"),
        ({"args": "--config x"}, "args must be a list of strings"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
        ({"env": {"OMP_NUM_THREADS": 1}}, "env keys and values must be strings"),
    ],
)
def test_argv_validation(kwargs: dict, message: str) -> None:
    job = TorchrunJob(**{"module": "dinov3_core.train", **kwargs})
    with pytest.raises(ValueError, match=message):
        torchrun_argv(job)


# -------------------------------------------------------------------------------------------- real jobs


@pytest.mark.timeout(120)
def test_success_streams_only_rank0(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    lines: list[str] = []
    run_torchrun(_job("ok", marker, log_dir=tmp_path / "logs"), log=lines.append)

    assert "rank-0 says hello (sum=2)" in lines and "rank-0 on stderr" in lines
    assert not [line for line in lines if "rank-1" in line], "only local rank 0 may reach the log"
    assert not [line for line in lines if line.startswith("[default")], "torchrun's rank prefix must be stripped"
    (rank1,) = (tmp_path / "logs").glob("*/attempt_0/1")
    assert "rank-1 says hello (sum=2)" in (rank1 / "stdout.log").read_text()
    assert "rank-1 on stderr" in (rank1 / "stderr.log").read_text()
    _assert_all_gone(marker, {})


@pytest.mark.timeout(120)
def test_two_nodes_on_one_host_rendezvous_with_c10d(tmp_path: Path) -> None:
    """The multi-node flags for real: two launches (one rank each) meet at one c10d endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    marker = uuid.uuid4().hex
    lines: dict[int, list[str]] = {0: [], 1: []}
    errors: dict[int, BaseException] = {}

    def node(i: int) -> None:
        rdzv = {"rdzv_endpoint": f"127.0.0.1:{port}", "rdzv_id": f"t-{marker[:8]}"}
        job = _job("ok", marker, nproc_per_node=1, nnodes=2, timeout_s=90, log_dir=tmp_path / f"node{i}", **rdzv)
        try:
            run_torchrun(job, log=lines[i].append)
        except BaseException as exc:
            errors[i] = exc

    threads = [threading.Thread(target=node, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # Each node's console shows its own local rank 0: global ranks 0 and 1, in either order.
    hellos = sorted(line for i in (0, 1) for line in lines[i] if "says hello" in line)
    assert hellos == ["rank-0 says hello (sum=2)", "rank-1 says hello (sum=2)"]
    _assert_all_gone(marker, {})


@pytest.mark.timeout(120)
def test_exception_on_rank1_is_the_root_cause() -> None:
    marker = uuid.uuid4().hex
    with pytest.raises(TorchrunFailed) as info:
        run_torchrun(_job("raise", marker), log=lambda line: None)  # no log_dir: a temporary one
    err = info.value
    assert not err.timed_out and err.exit_code == 1
    # Rank 0 fails too ("Connection closed by peer" in its barrier): that is a consequence, never the root cause.
    assert err.rank == 1 and "boom-rank1" in err.root_cause and "Connection closed" not in err.root_cause
    assert 'raise ValueError("boom-rank1")' in err.root_cause  # the traceback tail from error.json
    text = str(err)
    assert f"`{WORKER}` failed" in text and "torchrun exit code 1" in text and "rank 1" in text
    assert err.run_log_dir is not None and str(err.run_log_dir) in text and err.log_dir.is_dir()
    assert (err.run_log_dir / "attempt_0" / "1" / "error.json").is_file()
    # Prefect pickles a failed task's exception; keyword-only __init__ must survive that.
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == text and again.rank == 1 and again.log_dir == err.log_dir
    _assert_all_gone(marker, {})
    shutil.rmtree(err.log_dir)  # the temporary log directory is the caller's to remove


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("job", "exit_code", "shown", "cause"),
    [
        # Rank 1's stderr never reaches the console (--local-ranks-filter=0): it comes from its log file.
        ("exit2", 2, "error: bad input X", "exited with code 2"),
        # torchrun itself often names rank 0's "Connection reset by peer" first (stamped before the kill is seen).
        ("sigkill", -signal.SIGKILL, "SIGKILL", "rank 1 (local rank 1) was killed by signal SIGKILL (out of memory?"),
    ],
)
def test_a_failed_rank_is_named_with_its_cause(
    job: str, exit_code: int, shown: str, cause: str, tmp_path: Path
) -> None:
    """The rank that failed, its exit code (a signal's negative), what the error shows and its root cause."""
    with pytest.raises(TorchrunFailed) as info:
        run_torchrun(_job(job, uuid.uuid4().hex, log_dir=tmp_path), log=lambda line: None)
    err = info.value
    assert err.rank == 1 and err.rank_exit_code == exit_code
    assert shown in str(err) and cause in err.root_cause, str(err)


@pytest.mark.timeout(120)
def test_timeout_stops_every_process(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    # 6 s, not less: torchrun alone needs ~3 s to start on 2 busy cores, and the ranks must be running when the
    # limit strikes for this test to show that they (and their children) are killed.
    start = time.monotonic()
    with pytest.raises(TorchrunFailed) as info:
        run_torchrun(_job("hang", marker, str(pid_dir), log_dir=tmp_path / "logs", timeout_s=6), log=lambda _: None)
    elapsed = time.monotonic() - start
    err = info.value
    assert err.timed_out and "timeout_s=6 s" in str(err) and "resumes from its last checkpoint" in str(err)
    assert elapsed < 6 + 10, f"took {elapsed:.1f} s"
    pids = _pids(pid_dir)
    assert len(pids) == 6, f"ranks had not started: {pids}"  # 2 × worker, child, torchrun
    _assert_all_gone(marker, pids)  # at once: run_torchrun returns only when they are gone


@pytest.mark.timeout(120)
def test_exception_in_log_callback_stops_the_job(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    def log(line: str) -> None:
        if line == "rank-0 ready":
            _wait_pid_files(pid_dir, timeout_s=30)  # rank 1 too, so that its pids are checked as well
            raise RuntimeError("logging backend is down")

    with pytest.raises(RuntimeError, match="logging backend is down"):
        run_torchrun(_job("hang", marker, str(pid_dir), log_dir=tmp_path / "logs"), log=log)
    _assert_all_gone(marker, _pids(pid_dir))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "how",
    [
        "sigterm-group",  # Prefect's cancellation: SIGTERM to the flow run's process group
        "sigkill-group",  # its escalation: no cleanup code runs anywhere; ranks die by PR_SET_PDEATHSIG
        "sigkill-launcher",  # only the launching process dies (OOM killer): torchrun dies with it, then the ranks
    ],
)
def test_cancellation_leaves_no_orphans(tmp_path: Path, how: str) -> None:
    marker = uuid.uuid4().hex
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), MARK: marker}
    cmd = [sys.executable, "-m", DRIVER, str(pid_dir), str(tmp_path / "logs")]
    # Like Prefect's runner starting a flow run: its own session/process group, which is what gets signalled.
    driver = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        pids = _wait_pid_files(pid_dir, proc=driver)
        torchrun = pids["rank0.torchrun"]
        assert torchrun == pids["rank1.torchrun"] and psutil.Process(torchrun).ppid() == driver.pid
        # torchrun has a session of its own (a signal to the flow run's group reaches the launcher alone, which stops
        # the job); the ranks are in their own too.
        assert os.getpgid(torchrun) == torchrun and os.getpgid(pids["rank0.worker"]) == pids["rank0.worker"]
        if how == "sigterm-group":
            os.killpg(driver.pid, signal.SIGTERM)
        elif how == "sigkill-group":
            os.killpg(driver.pid, signal.SIGKILL)
        else:
            os.kill(driver.pid, signal.SIGKILL)
        out, _ = driver.communicate(timeout=30)
        _assert_all_gone(marker, pids, within_s=30)
        if how == "sigterm-group":
            assert "Terminated" in out, out  # the driver's exception propagated after run_torchrun cleaned up
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        for p in _marked(marker):
            p.kill()


# Verbatim (traceback shortened) from torchrun 2.13 after rank 1 was SIGKILLed while rank 0 sat in a barrier:
# rank 0's error file is stamped 1 s before torchrun noticed the kill, so torchrun names the victim's peer.
TORCHRUN_NAMES_THE_PEER = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
fail2.py FAILED
------------------------------------------------------------
Failures:
[0]:
  time      : 2026-11-21_22:19:18
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 17394)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 17394
------------------------------------------------------------
Root Cause (first observed failure):
[1]:
  time      : 2026-11-21_22:19:17
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 17393)  (SIGTERM)
  error_file: {run}/attempt_0/0/error.json
  traceback : Traceback (most recent call last):
  RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:11143: Connection reset by peer.
============================================================"""


def test_root_cause_skips_a_failure_caused_by_a_dead_peer(tmp_path: Path) -> None:
    from dinov3_core.launch.diagnose import diagnose_failure as _diagnose

    run = tmp_path / "f00d_abc"
    for rank in ("0", "1"):
        (run / "attempt_0" / rank).mkdir(parents=True)
    message = "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:11143: Connection reset by peer."
    extra = {"py_callstack": f"Traceback (most recent call last):\n{message}\n", "timestamp": "1795299557"}
    error = {"message": {"message": message, "extraInfo": extra}}  # the layout @record writes
    (run / "attempt_0" / "0" / "error.json").write_text(json.dumps(error))
    (run / "attempt_0" / "1" / "stderr.log").write_text("loading batch 17\n")
    console = ["noise"] * 5 + TORCHRUN_NAMES_THE_PEER.format(run=run).splitlines()

    text, rank, code = _diagnose(run, console, 1)
    assert (rank, code) == (1, -9)
    assert text.startswith("rank 1 (local rank 1) was killed by signal SIGKILL (out of memory?")
    assert "loading batch 17" in text  # the victim's own last words, from its log file
    assert "torchrun reported rank 0 first, but its failure looks like a consequence" in text


# ------------------------------------------------------------------------------------------- procutil


@pytest.mark.parametrize(
    ("expected", "env_parent", "dies"),
    [
        ("None", None, False),  # the current parent is alive: armed, process goes on
        ("os.getppid()", None, False),
        ("os.getppid() + 100000", None, True),  # parent died before prctl (adopted by init): exit at once
        ("None", "1", True),  # same via $WSIDINO_TORCHRUN_PID, as set by run_torchrun's wrapper
    ],
)
def test_die_with_parent_detects_a_parent_already_gone(expected: str, env_parent: str | None, dies: bool) -> None:
    code = (
        "import os\n"
        "from dinov3_core.procutil import PARENT_PID_ENV, die_with_parent\n"
        f"print(die_with_parent(expected_parent={expected}), PARENT_PID_ENV in os.environ, flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != PARENT_PID_ENV}
    if env_parent is not None:
        env[PARENT_PID_ENV] = env_parent
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    if dies:
        assert proc.returncode == -signal.SIGTERM, (proc.stdout, proc.stderr)
        assert "is gone" in proc.stderr
    else:
        # The variable is consumed, so the process's own children never compare against the wrong parent.
        assert proc.returncode == 0 and proc.stdout.split() == ["True", "False"], (proc.stdout, proc.stderr)
