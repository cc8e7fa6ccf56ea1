"""`python -m wsidino_dev serve` / `make serve`: arguments, start-up order, the status lines, shutdown."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from wsidino_dev.serve.children import (
    REPO_ROOT,
    Child,
    ServeError,
    become_subreaper,
    reap_orphans,
    stop_all,
    wait_exit,
)
from wsidino_dev.serve.deployments import (
    CPU_POOL,
    GPU_DEPLOYMENTS,
    GPU_POOL,
    GPU_SLOTS_LIMIT,
    PREFECT_FILE,
    SLURM_DEPLOYMENTS,
    SLURM_POOL,
    demo_pipeline_params,
    demo_retrain_params,
    ensure_gpu_slots,
    ensure_work_pools,
    register_deployments,
    served_pools,
)
from wsidino_dev.serve.servers import (
    DEFAULT_MLFLOW_PORT,
    DEFAULT_PREFECT_PORT,
    HOST,
    PortInUseError,
    check_port_free,
    start_mlflow_server,
    start_prefect_server,
    start_sample_slides,
    start_worker,
    wait_mlflow_server,
    wait_prefect_server,
    wait_worker,
)

DEFAULT_SERVE_DIR = REPO_ROOT / ".wsidino-serve"


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


DESCRIPTION = "Local Prefect server + MLflow server + process worker with the wsidino deployments."


def build_parser(prog: str = "python -m wsidino_dev.serve", add_help: bool = True) -> argparse.ArgumentParser:
    """The options; `add_help=False` for a parent parser (``wsidino-dev serve`` reuses them)."""
    env = os.environ
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, add_help=add_help)
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
        "--gpu-worker",
        action="store_true",
        help="also start a process worker on wsidino-gpu and register the GPU deployments (on a GPU host)",
    )
    parser.add_argument(
        "--all-deployments",
        action="store_true",
        help="register every deployment, also those whose pool (wsidino-gpu, wsidino-slurm) no worker here polls: "
        "for workers on other hosts (default: only the pools this command starts workers for)",
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
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Start everything, print the addresses, wait for Ctrl-C/SIGTERM, stop everything; the exit code."""
    serve_dir: Path = args.serve_dir.expanduser().resolve()
    if not PREFECT_FILE.is_file():
        print(
            f"serve: {PREFECT_FILE} not found: serve runs from a checkout of the repository (pip install -e .)",
            file=sys.stderr,
        )
        return 2
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
        # Start both servers and the sample slides at once: each takes a while on a small machine.
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
        pools = served_pools(args.gpu_worker, args.all_deployments)
        ensure_work_pools(api, pools)
        size = ensure_gpu_slots(api, args.gpu_slots)
        print(f"serve: work pools {', '.join(pools)}; concurrency limit {GPU_SLOTS_LIMIT}={size}", flush=True)
        if slides is not None:
            wait_exit(slides)
            children.remove(slides)
        print("serve: registering deployments (prefect deploy)...", flush=True)
        registration = register_deployments(
            api,
            serve_dir,
            demo_params=demo_pipeline_params(serve_dir),
            retrain_params=demo_retrain_params(serve_dir),
            pools=pools,
        )
        for name, why in registration.skipped.items():
            print(f"serve: WARNING: deployment {name!r} not registered: {why}", file=sys.stderr, flush=True)
        if registration.removed:
            print(
                f"serve: removed {', '.join(registration.removed)} (an earlier session's; no worker here polls "
                "their pools)",
                flush=True,
            )
        for name in registration.kept:
            print(
                f'serve: {name} stays registered although no worker here polls its pool (shown "Not Ready"): '
                f"it has flow runs, which deleting it would delete; `prefect deployment delete '{name}'` if they "
                "can go",
                flush=True,
            )
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

        # Starts a run of the deployment and prints its states and log lines as they come (tasks/follow.py).
        run_hint = f"PREFECT_API_URL={api} {_display(Path(sys.executable))} -m tasks.follow"
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
                f"Run the demo pipeline (CPU, config cpu, outputs under {serve_dir / 'runs' / 'pipeline'}):",
                f"  {run_hint} 'pipeline/pipeline'",
                f"  (other parameters: edit a copy of {_display(registration.demo_params_file)} and add "
                "--params FILE; it replaces the whole params object)",
            ]
        gpu = [d for d in registration.deployments if d.split("/")[1] in GPU_DEPLOYMENTS]
        if not args.gpu_worker and gpu:
            lines += [
                "",
                f'GPU deployments ({", ".join(gpu)}) wait for a worker on pool {GPU_POOL} (shown "Not Ready"',
                "until one polls): on a GPU host that sees this server, run",
                f"  PREFECT_API_URL={api} prefect worker start --pool {GPU_POOL}",
            ]
        elif not args.gpu_worker:
            lines += [
                "",
                f"GPU and SLURM deployments are not registered: no worker here polls {GPU_POOL} or {SLURM_POOL}.",
                "  On a GPU machine: make serve SERVE_ARGS=--gpu-worker (docs/hardware.md: which recipe fits);",
                "  for workers on other hosts: make serve SERVE_ARGS=--all-deployments (deploy/README.md)",
            ]
        slurm = [d for d in registration.deployments if d.split("/")[1] in SLURM_DEPLOYMENTS]
        if slurm:
            lines += [
                "",
                f"SLURM deployments ({', '.join(slurm)}) wait for a worker on pool {SLURM_POOL}: on a host that can",
                f"sbatch (docs/cluster.md), run  PREFECT_API_URL={api} prefect worker start --pool {SLURM_POOL}",
            ]
        if registration.retrain_params_file is not None:
            lines += [
                "",
                "Run a retraining cycle (CPU, configs/retrain/tiny.yaml; cycles under "
                f"{serve_dir / 'runs' / 'retrain'}"
                "): the first trains; run it again after adding slides to the sample folder and it trains from the "
                "champion; with nothing new it is skipped:",
                f"  {run_hint} 'retrain/retrain-cpu'",
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
