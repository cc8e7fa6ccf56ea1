"""A real one-host SLURM cluster for tests and trying the SLURM backend on a workstation: munged, slurmctld and slurmd
from Debian's `slurm-wlm` and `munge` (`make slurm` installs them), with every file under one directory.

    with LocalSlurm(Path("/tmp/slurm")) as cluster:      # cluster.env: SLURM_CONF for sbatch / squeue / scancel
        subprocess.run(["sbatch", "--wrap", "hostname"], env={**os.environ, **cluster.env})

The daemons run as the current user (root in CI containers): no cgroups, processes tracked through /proc
(`proctrack/linuxproc`), no accounting database (the SLURM backend does not need one), the host's CPUs as one node
in one partition `debug`, ports chosen free at start.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from wsidino_dev.ports import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
PARTITION = "debug"


def missing() -> str | None:
    """Why a local cluster cannot start here (None: it can)."""
    absent = [d for d in (*DAEMONS, "sbatch", "squeue", "scancel", "scontrol") if shutil.which(d) is None]
    if absent:
        return f"SLURM / munge not installed ({', '.join(absent)} missing): run `make slurm` (Debian: slurm-wlm, munge)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs (as in CI containers); run the tests as root"
    return None


class LocalSlurm:
    """munged + slurmctld + slurmd under `root`; `env` points the SLURM commands at it."""

    def __init__(self, root: Path, cpus: int | None = None) -> None:
        self.root = root.resolve()
        self.cpus = cpus or os.cpu_count() or 1
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}

    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self, timeout_s: float = 60.0) -> None:
        reason = missing()
        if reason:
            raise RuntimeError(reason)
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(r / "munge", 0o700)
        os.chmod(key, 0o400)
        socket_path = r / "munge" / "munge.socket"
        subprocess.run(
            [
                "munged",
                "--force",
                f"--socket={socket_path}",
                f"--key-file={key}",
                f"--log-file={r / 'log' / 'munged.log'}",
                f"--pid-file={r / 'munge' / 'munged.pid'}",
                f"--seed-file={r / 'munge' / 'munged.seed'}",
            ],
            check=True,
        )
        user = getpass.getuser()
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=wsidino-local",
                    f"SlurmctldHost={self.host}",
                    f"SlurmUser={user}",
                    f"SlurmdUser={user}",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={socket_path}",
                    "CredType=cred/munge",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "SchedulerType=sched/backfill",
                    "ReturnToService=2",
                    "MpiDefault=none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "KillWait=5",
                    "MinJobAge=600",
                    f"NodeName={self.host} CPUs={self.cpus} RealMemory={max(1, memory_mb - 1024)} State=UNKNOWN",
                    f"PartitionName={PARTITION} Nodes={self.host} Default=YES MaxTime=INFINITE State=UP "
                    "OverSubscribe=FORCE:4",
                    "",
                ]
            )
        )
        env = {**os.environ, **self.env}
        subprocess.run(["slurmctld", "-c"], env=env, check=True)
        subprocess.run(["slurmd"], env=env, check=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, check=False)
            if info.returncode == 0 and info.stdout.strip() in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the local SLURM cluster in {r} did not come up; see {r / 'log'}")

    def stop(self) -> None:
        for pid_file in (self.root / "slurmd.pid", self.root / "slurmctld.pid", self.root / "munge" / "munged.pid"):
            try:
                pid = int(pid_file.read_text().strip())
            except (OSError, ValueError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)


__all__ = ["PARTITION", "LocalSlurm", "missing"]
