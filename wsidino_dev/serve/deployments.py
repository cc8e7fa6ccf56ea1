"""What `make serve` sets up on the Prefect server: process work pools, the `gpu-slots` limit, the deployments."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dinov3_core.launch.training import local_gpu_count as count_local_gpus
from wsidino_dev.serve.children import REPO_ROOT, ServeError, child_env, prefect_cli

PREFECT_FILE = REPO_ROOT / "deploy" / "prefect.yaml"
CPU_POOL = "wsidino-cpu"
GPU_POOL = "wsidino-gpu"
SLURM_POOL = "wsidino-slurm"  # a worker on a host that can sbatch (tasks.launch_slurm)
GPU_SLOTS_LIMIT = "gpu-slots"
DEMO_DEPLOYMENT = "pipeline"  # deployment name in prefect.yaml; full name pipeline/pipeline
DEMO_FLOW = "pipeline"
# On pool wsidino-gpu (deploy/prefect.yaml).
GPU_DEPLOYMENTS = ("pretrain", "gram", "extract-gpu", "pipeline-gpu", "retrain")
SLURM_DEPLOYMENTS = ("pipeline-slurm",)  # on pool wsidino-slurm
RETRAIN_DEPLOYMENT = "retrain-cpu"  # full name retrain/retrain-cpu
RETRAIN_FLOW = "retrain"


POOL_ROLES = {GPU_POOL: "GPU hosts", SLURM_POOL: "SLURM submit hosts"}


def ensure_work_pools(api_url: str, names: Sequence[str] = (CPU_POOL, GPU_POOL, SLURM_POOL)) -> list[str]:
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
                        description=f"wsidino {POOL_ROLES.get(name, 'CPU work')} (make serve)",
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


def served_pools(gpu_worker: bool = False, all_deployments: bool = False) -> tuple[str, ...]:
    """The work pools whose deployments `make serve` registers: those it starts a worker for (CPU, and GPU with
    `--gpu-worker`), or every pool with `--all-deployments` (workers on other hosts). A deployment whose pool no
    worker polls is shown "Not Ready" in the UI and its runs wait forever."""
    if all_deployments:
        return (CPU_POOL, GPU_POOL, SLURM_POOL)
    return (CPU_POOL, GPU_POOL) if gpu_worker else (CPU_POOL,)


def deployments_on(pools: Sequence[str], prefect_file: Path = PREFECT_FILE) -> list[str]:
    """Names (in prefect.yaml) of the deployments whose work pool is one of `pools`."""
    return [s["name"] for s in load_deployment_specs(prefect_file) if s["work_pool"]["name"] in pools]


def entrypoint_path(spec: dict[str, Any]) -> Path:
    return REPO_ROOT / spec["entrypoint"].split(":", 1)[0]


def demo_pipeline_params(serve_dir: Path, prefect_file: Path = PREFECT_FILE) -> dict[str, Any]:
    """The CPU pipeline deployment's `params` from prefect.yaml with slides, annotations and workdir under
    `serve_dir`.

    Validated against `PipelineParams`; complete (a run's `--params` replaces the whole object).
    """
    from tasks.chain_params import PipelineParams

    spec = next(s for s in load_deployment_specs(prefect_file) if s["name"] == DEMO_DEPLOYMENT)
    params = dict(spec["parameters"]["params"])
    params["slides"] = str(serve_dir / "slides")
    params["workdir"] = str(serve_dir / "runs" / "pipeline")
    params["annotations"] = str(serve_dir / "slides" / "annotations")  # written with the sample slides
    PipelineParams.model_validate(params)
    return params


def demo_retrain_params(serve_dir: Path, prefect_file: Path = PREFECT_FILE) -> dict[str, Any]:
    """The CPU retrain deployment's `params` with slides, annotations and the retraining root under `serve_dir`
    (the same sample slides as the pipeline; add slides there and run it again to see a second cycle)."""
    from tasks.chain_params import RetrainParams

    spec = next(s for s in load_deployment_specs(prefect_file) if s["name"] == RETRAIN_DEPLOYMENT)
    params = dict(spec["parameters"]["params"])
    params["slides"] = str(serve_dir / "slides")
    params["root"] = str(serve_dir / "runs" / "retrain")
    params["annotations"] = str(serve_dir / "slides" / "annotations")
    RetrainParams.model_validate(params)
    return params


@dataclass
class Registration:
    """What `register_deployments` registered: full names (`flow/deployment`) and what it skipped and why."""

    deployments: list[str]
    skipped: dict[str, str]
    log: Path
    demo_params_file: Path | None = None
    retrain_params_file: Path | None = None
    # Earlier sessions' deployments on pools not served now: deleted when they have no flow runs, else kept (the
    # server deletes a deployment's runs with it).
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


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
    retrain_params: dict[str, Any] | None = None,
    pools: Sequence[str] = (CPU_POOL,),
) -> Registration:
    """`prefect --no-prompt deploy --prefect-file deploy/prefect.yaml --name ...` for the deployments on `pools`
    (`served_pools`), run in the repository root. Deployments of this prefect.yaml already on the server but on
    another pool (an earlier session's, e.g. with `--gpu-worker`) are deleted, so none is left "Not Ready", unless
    they have flow runs: the server would delete those with them, so they are kept and named in the result.

    Deployments whose entrypoint file does not exist are skipped (named in the result); if the batch fails
    (a flow module that does not import), each deployment is retried alone and the failures are skipped.
    `demo_params` / `retrain_params`: set as the `pipeline/pipeline` / `retrain/retrain-cpu` deployments' default
    `params` after registering (and written to `<serve_dir>/<deployment>-params.json`).
    """
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    log = serve_dir / "logs" / "deploy.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    all_specs = load_deployment_specs(prefect_file)
    specs = [s for s in all_specs if s["work_pool"]["name"] in pools]
    skipped = {s["name"]: f"{s['entrypoint']}: no such file yet" for s in specs if not entrypoint_path(s).exists()}
    names = [s["name"] for s in specs if s["name"] not in skipped]
    if not names:
        raise ServeError(f"no deployment of {prefect_file} on pools {', '.join(pools)} has an existing entrypoint")
    if not _deploy(serve_dir, api_url, [arg for name in names for arg in ("--name", name)], prefect_file, log):
        for name in names:
            if not _deploy(serve_dir, api_url, ["--name", name], prefect_file, log):
                skipped[name] = f"`prefect deploy` failed (see {log})"
    unserved = {s["name"] for s in all_specs if s["work_pool"]["name"] not in pools}
    removed, kept = [], []
    with SyncPrefectClient(api_url) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        for deployment in client.read_deployments():
            if deployment.name not in unserved or deployment.work_pool_name in pools:
                continue
            full_name = f"{flows.get(deployment.flow_id, '?')}/{deployment.name}"
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])), limit=1
            )
            if runs:
                kept.append(full_name)
            else:
                client.delete_deployment(deployment.id)
                removed.append(full_name)
        registered = sorted(f"{flows.get(d.flow_id, '?')}/{d.name}" for d in client.read_deployments())
        files: dict[str, Path | None] = {}
        for flow_name, name, params in (
            (DEMO_FLOW, DEMO_DEPLOYMENT, demo_params),
            (RETRAIN_FLOW, RETRAIN_DEPLOYMENT, retrain_params),
        ):
            files[name] = None
            if params is None or f"{flow_name}/{name}" not in registered or name in skipped:
                continue
            deployment = client.read_deployment_by_name(f"{flow_name}/{name}")
            client.update_deployment(deployment.id, DeploymentUpdate(parameters={"params": params}))
            files[name] = serve_dir / f"{name}-params.json"
            files[name].write_text(json.dumps({"params": params}, indent=2) + "\n")  # type: ignore[union-attr]
    if not registered:
        raise ServeError(f"no deployment was registered; see {log}")
    return Registration(
        deployments=registered,
        skipped=skipped,
        log=log,
        demo_params_file=files[DEMO_DEPLOYMENT],
        retrain_params_file=files[RETRAIN_DEPLOYMENT],
        removed=sorted(removed),
        kept=sorted(kept),
    )
