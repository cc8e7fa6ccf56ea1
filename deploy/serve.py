"""`make serve`: a local Prefect server, an MLflow server and a process worker, with every deployment registered.

    make serve                                   # or: .venv/bin/python deploy/serve.py [--serve-dir DIR] ...

On 127.0.0.1 it starts, each in its own process group with its log under `<serve dir>/logs/`:

1. a Prefect server (UI + API, default port 4200) with its own `PREFECT_HOME` (`<serve dir>/prefect-home`: SQLite
   database, results), analytics off;
2. an MLflow server (default port 5000): runs in `<serve dir>/mlflow.db`, artifacts served from
   `<serve dir>/mlartifacts`;

then creates the `wsidino-cpu` and `wsidino-gpu` process work pools and the `gpu-slots` global concurrency
limit (one slot per local GPU, at least 1), registers the deployments of `deploy/prefect.yaml` from the
repository root (`prefect --no-prompt deploy --all`), points the CPU `pipeline/pipeline` deployment at sample
slides written to `<serve dir>/slides` (its default `params`, complete, are also written to
`<serve dir>/pipeline-params.json`), and starts a process worker on `wsidino-cpu` whose flow runs log to the
MLflow server. It prints both UI addresses and waits; Ctrl-C (SIGINT) or SIGTERM stops the worker and both
servers (their whole process groups) and exits.

Ports: `--prefect-port`/`WSIDINO_PREFECT_PORT`, `--mlflow-port`/`WSIDINO_MLFLOW_PORT`; a port in use fails at
once with a message naming it. Serve directory: `--serve-dir`/`WSIDINO_SERVE_DIR` (default `.wsidino-serve`
in the repository root). State (runs, pools, deployments, MLflow runs) persists there between sessions.

The functions (`start_prefect_server`, `start_mlflow_server`, `register_deployments`, `start_worker`, ...) each
return a handle and can be used on their own, e.g. from tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = REPO_ROOT / "deploy" / "prefect.yaml"
DEFAULT_SERVE_DIR = REPO_ROOT / ".wsidino-serve"
HOST = "127.0.0.1"
DEFAULT_PREFECT_PORT = 4200
DEFAULT_MLFLOW_PORT = 5000
CPU_POOL = "wsidino-cpu"
GPU_POOL = "wsidino-gpu"
GPU_SLOTS_LIMIT = "gpu-slots"
DEMO_DEPLOYMENT = "pipeline"  # deployment name in prefect.yaml; full name pipeline/pipeline
DEMO_FLOW = "pipeline"

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


class PortInUseError(ServeError):
    """A port `make serve` wants is already taken."""


# --------------------------------------------------------------------------------------------- child processes


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


# ----------------------------------------------------------------------------------------------- readiness


def check_port_free(port: int, host: str = HOST, what: str = "server") -> None:
    """Raise `PortInUseError` naming the port when something already listens on host:port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # Like uvicorn: a port only in TIME_WAIT (a server stopped a moment ago) counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as err:
        raise PortInUseError(
            f"port {port} on {host} (for the {what}) is already in use ({err.strerror}): stop what listens there "
            f"(`ss -ltnp 'sport = :{port}'`) or choose another port: make serve SERVE_ARGS='--prefect-port N "
            "--mlflow-port M' (or WSIDINO_PREFECT_PORT / WSIDINO_MLFLOW_PORT)"
        ) from None
    finally:
        sock.close()


def wait_http(url: str, child: Child | None, timeout: float, what: str) -> None:
    """Poll `url` until it answers 200; fail early (with the log tail) if `child` exits meanwhile."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if child is not None and not child.running():
            raise ServeError(
                f"{what} exited with code {child.proc.returncode} before {url} answered; "
                f"log {child.log}:\n{child.log_tail()}"
            )
        try:
            with urllib.request.urlopen(url, timeout=3) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
            last = str(getattr(err, "reason", err))
        time.sleep(0.5)
    tail = f"; log {child.log}:\n{child.log_tail()}" if child is not None else ""
    raise ServeError(f"{what} did not answer at {url} within {timeout:.0f} s ({last}){tail}")


# ----------------------------------------------------------------------------------------------- servers


def prefect_api_url(port: int, host: str = HOST) -> str:
    return f"http://{host}:{port}/api"


def start_prefect_server(
    serve_dir: Path, port: int = DEFAULT_PREFECT_PORT, host: str = HOST, timeout: float = 180.0, wait: bool = True
) -> Child:
    """`prefect server start` with `PREFECT_HOME=<serve_dir>/prefect-home`; waits for `/api/health`."""
    check_port_free(port, host, "Prefect server")
    api = prefect_api_url(port, host)
    child = spawn(
        "Prefect server",
        prefect_cli("server", "start", "--host", host, "--port", str(port)),
        child_env(serve_dir, api),
        serve_dir / "logs" / "prefect-server.log",
        url=f"http://{host}:{port}",
    )
    child.extra["api_url"] = api
    if wait:
        wait_prefect_server(child, timeout)
    return child


def wait_prefect_server(child: Child, timeout: float = 180.0) -> None:
    wait_http(f"{child.extra['api_url']}/health", child, timeout, "the Prefect server")


def start_mlflow_server(
    serve_dir: Path, port: int = DEFAULT_MLFLOW_PORT, host: str = HOST, timeout: float = 180.0, wait: bool = True
) -> Child:
    """`mlflow server` on SQLite (`<serve_dir>/mlflow.db`), artifacts proxied to `<serve_dir>/mlartifacts`."""
    check_port_free(port, host, "MLflow server")
    serve_dir.mkdir(parents=True, exist_ok=True)
    (serve_dir / "mlartifacts").mkdir(exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"sqlite:///{serve_dir / 'mlflow.db'}",
        "--artifacts-destination",
        str(serve_dir / "mlartifacts"),
        "--serve-artifacts",
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    child = spawn(
        "MLflow server", cmd, child_env(serve_dir), serve_dir / "logs" / "mlflow.log", url=f"http://{host}:{port}"
    )
    if wait:
        wait_mlflow_server(child, timeout)
    return child


def wait_mlflow_server(child: Child, timeout: float = 180.0) -> None:
    wait_http(f"{child.url}/health", child, timeout, "the MLflow server")


# ----------------------------------------------------------------------------------------------- pools, limits


def count_local_gpus() -> int:
    """NVIDIA GPUs this process may use: `nvidia-smi -L`, narrowed by CUDA_VISIBLE_DEVICES when set."""
    smi = shutil.which("nvidia-smi")
    count = 0
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False).stdout
            count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.TimeoutExpired):
            count = 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


def ensure_work_pools(api_url: str, names: Sequence[str] = (CPU_POOL, GPU_POOL)) -> list[str]:
    """Create the process work pools that do not exist yet (existing ones are left as they are)."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.process import ProcessWorker

    created = []
    with SyncPrefectClient(api_url) as client:
        for name in names:
            try:
                client.read_work_pool(name)
                continue
            except ObjectNotFound:
                pass
            try:
                client.create_work_pool(
                    WorkPoolCreate(
                        name=name,
                        type="process",
                        base_job_template=ProcessWorker.get_default_base_job_template(),
                        description=f"wsidino {'GPU hosts' if name == GPU_POOL else 'CPU work'} (make serve)",
                    )
                )
                created.append(name)
            except ObjectAlreadyExists:
                pass
    return created


def ensure_gpu_slots(api_url: str, limit: int | None = None, name: str = GPU_SLOTS_LIMIT) -> int:
    """Create (or resize) the global concurrency limit GPU jobs occupy `nproc_per_node` slots of; returns its size."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectAlreadyExists

    size = max(1, count_local_gpus() if limit is None else limit)
    with SyncPrefectClient(api_url) as client:
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=size))
        except ObjectAlreadyExists:
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=size))
    return size


# ----------------------------------------------------------------------------------------------- deployments


def load_deployment_specs(prefect_file: Path = PREFECT_FILE) -> list[dict[str, Any]]:
    return list(yaml.safe_load(prefect_file.read_text())["deployments"])


def entrypoint_path(spec: dict[str, Any]) -> Path:
    return REPO_ROOT / spec["entrypoint"].split(":", 1)[0]


def demo_pipeline_params(serve_dir: Path, prefect_file: Path = PREFECT_FILE) -> dict[str, Any]:
    """The CPU pipeline deployment's `params` from prefect.yaml with slides and workdir under `serve_dir`.

    Validated against `PipelineParams`; complete (a run's `--params` replaces the whole object).
    """
    from tasks.params import PipelineParams

    spec = next(s for s in load_deployment_specs(prefect_file) if s["name"] == DEMO_DEPLOYMENT)
    params = dict(spec["parameters"]["params"])
    params["slides"] = str(serve_dir / "slides")
    params["workdir"] = str(serve_dir / "runs" / "pipeline")
    PipelineParams.model_validate(params)
    return params


@dataclass
class Registration:
    """What `register_deployments` registered: full names (`flow/deployment`) and what it skipped and why."""

    deployments: list[str]
    skipped: dict[str, str]
    log: Path
    demo_params_file: Path | None = None


def _deploy(serve_dir: Path, api_url: str, args: Sequence[str], prefect_file: Path, log: Path) -> bool:
    cmd = prefect_cli("--no-prompt", "deploy", "--prefect-file", str(prefect_file.relative_to(REPO_ROOT)), *args)
    with log.open("ab") as out:
        out.write(f"\n--- {' '.join(cmd)}\n".encode())
        out.flush()
        result = subprocess.run(
            cmd, cwd=REPO_ROOT, env=child_env(serve_dir, api_url), stdout=out, stderr=subprocess.STDOUT, check=False
        )
    return result.returncode == 0


def register_deployments(
    api_url: str,
    serve_dir: Path,
    prefect_file: Path = PREFECT_FILE,
    demo_params: dict[str, Any] | None = None,
) -> Registration:
    """`prefect --no-prompt deploy --all --prefect-file deploy/prefect.yaml`, run in the repository root.

    Deployments whose entrypoint file does not exist are skipped (named in the result); if the batch fails
    (a flow module that does not import), each deployment is retried alone and the failures are skipped.
    `demo_params`: set as the `pipeline/pipeline` deployment's default `params` after registering.
    """
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import DeploymentUpdate

    log = serve_dir / "logs" / "deploy.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    specs = load_deployment_specs(prefect_file)
    skipped = {s["name"]: f"{s['entrypoint']}: no such file yet" for s in specs if not entrypoint_path(s).exists()}
    names = [s["name"] for s in specs if s["name"] not in skipped]
    if not names:
        raise ServeError(f"no deployment of {prefect_file} has an existing entrypoint")
    batch = ["--all"] if not skipped else [arg for name in names for arg in ("--name", name)]
    if not _deploy(serve_dir, api_url, batch, prefect_file, log):
        for name in names:
            if not _deploy(serve_dir, api_url, ["--name", name], prefect_file, log):
                skipped[name] = f"`prefect deploy` failed (see {log})"
    with SyncPrefectClient(api_url) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        registered = sorted(f"{flows.get(d.flow_id, '?')}/{d.name}" for d in client.read_deployments())
        params_file = None
        wanted = f"{DEMO_FLOW}/{DEMO_DEPLOYMENT}"
        if demo_params is not None and wanted in registered and DEMO_DEPLOYMENT not in skipped:
            deployment = client.read_deployment_by_name(wanted)
            client.update_deployment(deployment.id, DeploymentUpdate(parameters={"params": demo_params}))
            params_file = serve_dir / "pipeline-params.json"
            params_file.write_text(json.dumps({"params": demo_params}, indent=2) + "\n")
    if not registered:
        raise ServeError(f"no deployment was registered; see {log}")
    return Registration(deployments=registered, skipped=skipped, log=log, demo_params_file=params_file)


# ----------------------------------------------------------------------------------------------- worker


def start_worker(
    api_url: str,
    serve_dir: Path,
    mlflow_url: str | None,
    pool: str = CPU_POOL,
    limit: int | None = None,
    timeout: float = 120.0,
    wait: bool = True,
) -> Child:
    """`prefect worker start --pool <pool>`; its flow runs log to `mlflow_url`. Waits until it has registered."""
    name = f"{pool}-{socket.gethostname()}-serve"
    cmd = prefect_cli("worker", "start", "--pool", pool, "--type", "process", "--name", name)
    if limit is not None:
        cmd += ["--limit", str(limit)]
    extra = {"MLFLOW_TRACKING_URI": mlflow_url} if mlflow_url else {}
    child = spawn(f"worker ({pool})", cmd, child_env(serve_dir, api_url, **extra), serve_dir / "logs" / f"{pool}.log")
    child.extra.update(api_url=api_url, pool=pool, worker_name=name)
    if wait:
        wait_worker(child, timeout)
    return child


def wait_worker(child: Child, timeout: float = 120.0) -> None:
    """Until the worker shows up in its pool (it registers with its first heartbeat)."""
    from prefect.client.orchestration import SyncPrefectClient

    deadline = time.monotonic() + timeout
    with SyncPrefectClient(child.extra["api_url"]) as client:
        while time.monotonic() < deadline:
            if not child.running():
                raise ServeError(
                    f"the {child.name} exited with code {child.proc.returncode}; log {child.log}:\n{child.log_tail()}"
                )
            workers = client.read_workers_for_work_pool(child.extra["pool"])
            if any(w.name == child.extra["worker_name"] for w in workers):
                return
            time.sleep(1.0)
    raise ServeError(f"the {child.name} did not register within {timeout:.0f} s; log {child.log}:\n{child.log_tail()}")


# ----------------------------------------------------------------------------------------------- sample slides


def start_sample_slides(serve_dir: Path, preset: str = "test") -> Child | None:
    """Write sample slides to `<serve_dir>/slides` (in the background) unless they are already there."""
    slides = serve_dir / "slides"
    if (slides / "sample_slides.json").exists():
        return None
    cmd = [sys.executable, "-m", "dinov3_core.cli", "make-sample-slides", str(slides), "--preset", preset]
    cmd.append("--no-negatives")
    return spawn("sample slides", cmd, child_env(serve_dir), serve_dir / "logs" / "sample-slides.log")


def wait_exit(child: Child, timeout: float = 300.0) -> None:
    try:
        code = child.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ServeError(f"{child.name} did not finish within {timeout:.0f} s; log {child.log}") from None
    if code != 0:
        raise ServeError(f"{child.name} failed with exit code {code}; log {child.log}:\n{child.log_tail()}")


# ----------------------------------------------------------------------------------------------- main


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def build_parser() -> argparse.ArgumentParser:
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="deploy/serve.py",
        description="Local Prefect server + MLflow server + process worker with the wsidino deployments.",
    )
    parser.add_argument(
        "--serve-dir",
        type=Path,
        default=Path(env.get("WSIDINO_SERVE_DIR", DEFAULT_SERVE_DIR)),
        help="state: Prefect home and database, MLflow database and artifacts, logs, sample slides, runs "
        "(env WSIDINO_SERVE_DIR; default .wsidino-serve in the repository root)",
    )
    parser.add_argument(
        "--prefect-port",
        type=int,
        default=int(env.get("WSIDINO_PREFECT_PORT", DEFAULT_PREFECT_PORT)),
        help="Prefect UI/API port (env WSIDINO_PREFECT_PORT; default 4200)",
    )
    parser.add_argument(
        "--mlflow-port",
        type=int,
        default=int(env.get("WSIDINO_MLFLOW_PORT", DEFAULT_MLFLOW_PORT)),
        help="MLflow port (env WSIDINO_MLFLOW_PORT; default 5000)",
    )
    parser.add_argument(
        "--gpu-slots", type=int, default=None, help="size of the gpu-slots limit (default: local GPUs, at least 1)"
    )
    parser.add_argument(
        "--worker-limit", type=int, default=None, help="flow runs the CPU worker runs at once (default: no limit)"
    )
    parser.add_argument(
        "--gpu-worker", action="store_true", help="also start a process worker on wsidino-gpu (on a GPU host)"
    )
    parser.add_argument(
        "--sample-preset",
        choices=["test", "demo"],
        default="test",
        help="sample slides for the pipeline deployment: test (3 small slides, seconds) or demo (larger)",
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for each server to answer")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    serve_dir: Path = args.serve_dir.expanduser().resolve()
    if args.prefect_port == args.mlflow_port:
        print(f"serve: the Prefect and MLflow ports must differ (both {args.prefect_port})", file=sys.stderr)
        return 2
    try:
        check_port_free(args.prefect_port, HOST, "Prefect server")
        check_port_free(args.mlflow_port, HOST, "MLflow server")
    except PortInUseError as err:
        print(f"serve: {err}", file=sys.stderr)
        return 2
    serve_dir.mkdir(parents=True, exist_ok=True)

    children: list[Child] = []
    # SIGINT too: a shell starting `make serve &` without job control leaves SIGINT ignored in its children.
    previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    become_subreaper()
    try:
        print(f"serve: state in {serve_dir}, logs in {serve_dir / 'logs'}", flush=True)
        # Start both servers and the sample slides at once; on 2 cores they take ~20-40 s together.
        prefect = start_prefect_server(serve_dir, args.prefect_port, wait=False)
        children.append(prefect)
        mlflow = start_mlflow_server(serve_dir, args.mlflow_port, wait=False)
        children.append(mlflow)
        slides = start_sample_slides(serve_dir, args.sample_preset)
        if slides is not None:
            children.append(slides)
        wait_prefect_server(prefect, args.timeout)
        print(f"serve: Prefect server up at {prefect.url}", flush=True)
        api = prefect.extra["api_url"]
        ensure_work_pools(api)
        size = ensure_gpu_slots(api, args.gpu_slots)
        print(f"serve: work pools {CPU_POOL}, {GPU_POOL}; concurrency limit {GPU_SLOTS_LIMIT}={size}", flush=True)
        if slides is not None:
            wait_exit(slides)
            children.remove(slides)
        print("serve: registering deployments (prefect deploy)...", flush=True)
        registration = register_deployments(api, serve_dir, demo_params=demo_pipeline_params(serve_dir))
        for name, why in registration.skipped.items():
            print(f"serve: WARNING: deployment {name!r} not registered: {why}", file=sys.stderr, flush=True)
        wait_mlflow_server(mlflow, args.timeout)
        print(f"serve: MLflow server up at {mlflow.url}", flush=True)
        # Each child is in `children` before anything waits on it, so Ctrl-C at any point stops it.
        workers = [start_worker(api, serve_dir, mlflow.url, CPU_POOL, args.worker_limit, wait=False)]
        children.append(workers[0])
        if args.gpu_worker:
            workers.append(start_worker(api, serve_dir, mlflow.url, GPU_POOL, wait=False))
            children.append(workers[1])
        for worker in workers:
            wait_worker(worker)

        run_hint = f"PREFECT_API_URL={api} {_display(Path(sys.executable).parent / 'prefect')} deployment run"
        lines = [
            "",
            "wsidino serve is up (Ctrl-C stops everything):",
            f"  Prefect UI    {prefect.url}   (API {api})",
            f"  MLflow UI     {mlflow.url}",
            f"  worker        pool {CPU_POOL}" + (f" and {GPU_POOL}" if args.gpu_worker else "") + " (process)",
            f"  deployments   {', '.join(registration.deployments)}",
            f"  sample slides {serve_dir / 'slides'}",
            f"  logs          {serve_dir / 'logs'}",
        ]
        if registration.demo_params_file is not None:
            lines += [
                "",
                f"Run the demo pipeline (CPU, tiny configs, outputs under {serve_dir / 'runs' / 'pipeline'}):",
                f"  {run_hint} 'pipeline/pipeline' --watch",
                f"  (other parameters: edit a copy of {_display(registration.demo_params_file)} and add "
                '--params "$(cat FILE)"; it replaces the whole params object)',
            ]
        print("\n".join(lines), flush=True)

        while True:
            for child in children:
                if not child.running():
                    raise ServeError(
                        f"{child.name} exited unexpectedly with code {child.proc.returncode}; log {child.log}:\n"
                        f"{child.log_tail()}"
                    )
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("\nserve: stopping...", flush=True)
        return_code = 0
    except ServeError as err:
        print(f"serve: {err}", file=sys.stderr, flush=True)
        return_code = 1
    finally:
        # Ignore further Ctrl-C/SIGTERM while the children shut down (their groups get SIGTERM, then SIGKILL).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_all(children)
        reap_orphans()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return return_code


if __name__ == "__main__":
    sys.exit(main())
