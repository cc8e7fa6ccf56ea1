"""The processes `make serve` starts and waits for: the Prefect and MLflow servers, workers, the sample slides.

Each `start_*` returns a `Child` handle; with ``wait=False`` it returns at once and the matching `wait_*` blocks
until the process answers (or fails with its log tail), so several can start side by side.
"""

from __future__ import annotations

import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from wsidino_dev.serve.children import Child, ServeError, child_env, prefect_cli, spawn
from wsidino_dev.serve.deployments import CPU_POOL

HOST = "127.0.0.1"
DEFAULT_PREFECT_PORT = 4200
DEFAULT_MLFLOW_PORT = 5000


class PortInUseError(ServeError):
    """A port `make serve` wants is already taken."""


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
        "--app-name",  # dinov3_core/mlflow_app.py: our experiments open on the runs table, not MLflow 3's GenAI view
        "wsidino",
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
    # wsidino_dev.sample_slides.MARKER_NAME, not imported: that would pull numpy, scipy and tifffile in here.
    if (slides / "sample_slides.json").exists():
        return None
    cmd = [sys.executable, "-m", "wsidino_dev", "samples", str(slides), "--preset", preset, "--no-negatives"]
    return spawn("sample slides", cmd, child_env(serve_dir), serve_dir / "logs" / "sample-slides.log")
