"""`make serve`: a local Prefect server, an MLflow server and a process worker, with every deployment registered.

    make serve                                   # or: .venv/bin/python -m wsidino_dev serve [--serve-dir DIR] ...

On 127.0.0.1 it starts, each in its own process group with its log under `<serve dir>/logs/`:

1. a Prefect server (UI + API, default port 4200) with its own `PREFECT_HOME` (`<serve dir>/prefect-home`: SQLite
   database, results), analytics off;
2. an MLflow server (default port 5000): runs in `<serve dir>/mlflow.db`, artifacts served from
   `<serve dir>/mlartifacts`;

then creates the process work pools it serves (`wsidino-cpu`; `wsidino-gpu` too with `--gpu-worker`; every pool
with `--all-deployments`) and the `gpu-slots` global concurrency limit (one slot per local GPU, at least 1),
registers the deployments of `deploy/prefect.yaml` on those pools from the repository root (`prefect --no-prompt
deploy --name ...`; an earlier session's deployments on other pools are deleted, so the UI shows none "Not
Ready" for want of a worker), points the CPU `pipeline/pipeline` deployment at sample
slides written to `<serve dir>/slides` (`python -m wsidino_dev samples`; its default `params`, complete, are also
written to `<serve dir>/pipeline-params.json`), and starts a process worker on `wsidino-cpu` whose flow runs log
to the MLflow server. It prints both UI addresses and waits; Ctrl-C (SIGINT) or SIGTERM stops the worker and both
servers (their whole process groups) and exits.

Ports: `--prefect-port`/`WSIDINO_PREFECT_PORT`, `--mlflow-port`/`WSIDINO_MLFLOW_PORT`; a port in use fails at
once with a message naming it. Serve directory: `--serve-dir`/`WSIDINO_SERVE_DIR` (default `.wsidino-serve`
in the repository root). State (runs, pools, deployments, MLflow runs) persists there between sessions. It runs
from a checkout (an editable install): deploy/prefect.yaml and the flow entrypoints are read from there.

The functions (`start_prefect_server`, `start_mlflow_server`, `register_deployments`, `start_worker`, ...) each
return a handle and can be used on their own, e.g. from tests. Modules:

=========== =================================================================================================
children    `Child` (a process group with its log), `spawn`, `child_env`, stopping, reaping orphans
deployments work pools, the `gpu-slots` limit, `register_deployments`, the demo pipeline's parameters
servers     the Prefect and MLflow servers, workers and the sample slides: `start_*` / `wait_*`
cli         `build_parser`, `main` / `run`: start-up order, status lines, shutdown
=========== =================================================================================================
"""

from wsidino_dev.serve.children import (
    REPO_ROOT,
    Child,
    ServeError,
    become_subreaper,
    child_env,
    group_members,
    prefect_cli,
    reap_orphans,
    spawn,
    stop_all,
    wait_exit,
)
from wsidino_dev.serve.cli import DEFAULT_SERVE_DIR, build_parser, main, run
from wsidino_dev.serve.deployments import (
    CPU_POOL,
    DEMO_DEPLOYMENT,
    DEMO_FLOW,
    GPU_DEPLOYMENTS,
    GPU_POOL,
    GPU_SLOTS_LIMIT,
    PREFECT_FILE,
    SLURM_DEPLOYMENTS,
    SLURM_POOL,
    Registration,
    count_local_gpus,
    demo_pipeline_params,
    demo_retrain_params,
    deployments_on,
    ensure_gpu_slots,
    ensure_work_pools,
    entrypoint_path,
    load_deployment_specs,
    register_deployments,
    served_pools,
)
from wsidino_dev.serve.servers import (
    DEFAULT_MLFLOW_PORT,
    DEFAULT_PREFECT_PORT,
    HOST,
    PortInUseError,
    check_port_free,
    prefect_api_url,
    start_mlflow_server,
    start_prefect_server,
    start_sample_slides,
    start_worker,
    wait_http,
    wait_mlflow_server,
    wait_prefect_server,
    wait_worker,
)

__all__ = [
    "CPU_POOL",
    "DEFAULT_MLFLOW_PORT",
    "DEFAULT_PREFECT_PORT",
    "DEFAULT_SERVE_DIR",
    "DEMO_DEPLOYMENT",
    "DEMO_FLOW",
    "GPU_DEPLOYMENTS",
    "GPU_POOL",
    "GPU_SLOTS_LIMIT",
    "HOST",
    "PREFECT_FILE",
    "REPO_ROOT",
    "SLURM_DEPLOYMENTS",
    "SLURM_POOL",
    "Child",
    "PortInUseError",
    "Registration",
    "ServeError",
    "become_subreaper",
    "build_parser",
    "check_port_free",
    "child_env",
    "count_local_gpus",
    "demo_pipeline_params",
    "demo_retrain_params",
    "deployments_on",
    "ensure_gpu_slots",
    "ensure_work_pools",
    "entrypoint_path",
    "group_members",
    "load_deployment_specs",
    "main",
    "prefect_api_url",
    "prefect_cli",
    "reap_orphans",
    "register_deployments",
    "run",
    "served_pools",
    "spawn",
    "start_mlflow_server",
    "start_prefect_server",
    "start_sample_slides",
    "start_worker",
    "stop_all",
    "wait_exit",
    "wait_http",
    "wait_mlflow_server",
    "wait_prefect_server",
    "wait_worker",
]
