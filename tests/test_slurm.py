"""Training on a real SLURM cluster from Prefect: munged + slurmctld + slurmd on this host (`make slurm` installs
Debian's slurm-wlm and munge; `wsidino_dev.slurm_local` starts them), the tiny pretrain as a 2-process torchrun job
submitted with sbatch by the Prefect task, a real Prefect server and worker, MLflow on SQLite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tasks.launch_slurm import SlurmSettings, sbatch_script
from tests.helpers import REPO, pretrain_values
from tests.prefect_deploy import deploy, flow_logs, job_processes, trigger, wait_final, worker
from wsidino_dev import faults
from wsidino_dev.slurm_local import LocalSlurm, missing

__all__ = ["worker"]  # the module's process-worker fixture (started after the cluster: it inherits SLURM_CONF)

needs_slurm = pytest.mark.skipif(missing() is not None, reason=str(missing()))

STAGE = {"train.stop_at": 4, "checkpointing.period": 2, "checkpointing.max_to_keep": 5, "train.batch_size_per_gpu": 4}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    with pytest.MonkeyPatch.context() as mp:
        cluster.start()
        mp.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
        try:
            yield cluster
        finally:
            cluster.stop()


def queued() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %T %j"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def logs_with(flow_run_id: Any, *texts: str, timeout: float = 60.0) -> str:
    """The flow run's Prefect log once it holds every one of `texts` (the run's last lines reach the API in batches,
    after the run has finished)."""
    deadline = time.monotonic() + timeout
    while True:
        logs = flow_logs(flow_run_id)
        if all(t in logs for t in texts) or time.monotonic() > deadline:
            return logs
        time.sleep(1.0)


def pretrain_params(
    store: Path, out: Path, tracking: Any, retries: int = 0, stage: dict[str, Any] | None = None
) -> dict[str, Any]:
    values = {
        k: v
        for k, v in pretrain_values(store, out, **(STAGE if stage is None else stage)).items()
        if k not in ("data.stores", "output_dir", "tracking.enabled")
    }
    return {
        "stores": [str(store)],
        "output_dir": str(out),
        "stage": {"config": "tiny", "overrides": [f"{k}={v}" for k, v in values.items()]},
        "launch": {"nproc_per_node": 2, "retries": retries, "backend": "slurm", "timeout_hours": 1},
        "tracking": {"tracking_uri": tracking.uri, "experiment": tracking.experiment},
    }


def test_the_batch_script_is_one_torchrun_per_node_with_rendezvous_on_the_first(tmp_path) -> None:
    from dinov3_core.launch import TorchrunJob

    job = TorchrunJob(
        module="dinov3_core.train",
        args=["--config", "/runs/a b/launch_config.yaml"],
        nproc_per_node=8,
        nnodes=4,
        env={"MLFLOW_RUN_ID": "r1"},
        log_dir=tmp_path / "logs",
        timeout_s=3 * 3600,
    )
    settings = SlurmSettings(
        partition="gpu",
        account="lab",
        gpus_per_node=8,
        extra_directives=["--qos=high"],
        setup=["module load cuda/12.4"],
    )
    script = sbatch_script(job, settings, name="wsidino-pretrain", workdir=tmp_path)
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=lab",
        "#SBATCH --time=180",
        "#SBATCH --qos=high",
        "module load cuda/12.4",
        "export MLFLOW_RUN_ID=r1",
    ):
        assert line in script.splitlines(), (line, script)
    assert "--rdzv-endpoint=$head:$port" in script and "--nproc-per-node=8" in script
    assert "'/runs/a b/launch_config.yaml'" in script  # quoted for the shell
    check = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True, check=False)
    assert check.returncode == 0, check.stderr


def test_the_script_of_a_stage_prints_for_submitting_by_hand(stage_tile_store, tmp_path) -> None:
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "tasks.launch_slurm",
        "pretrain",
        "--config",
        "tiny",
        f"data.stores=[{stage_tile_store}]",
        f"output_dir={out}",
        "--nodes",
        "2",
        "--nproc-per-node",
        "8",
        "--gpus-per-node",
        "8",
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --nodes=2" in done.stdout and "#SBATCH --gpus-per-node=8" in done.stdout
    assert f"--config {out / 'launch_config.yaml'}" in done.stdout and (out / "launch_config.yaml").is_file()


@needs_slurm
def test_a_job_slurm_refuses_is_bad_input_naming_the_settings(slurm, tmp_path) -> None:
    from dinov3_core.errors import WsidinoError
    from dinov3_core.launch import TorchrunJob
    from tasks.launch_slurm import SlurmRunner

    runner = SlurmRunner(SlurmSettings(partition="no-such-partition"))
    with pytest.raises(WsidinoError, match=r"(?s)sbatch refused .*invalid partition.*launch\.slurm \(partition"):
        runner(TorchrunJob(module="dinov3_core.train", log_dir=tmp_path / "logs"), log=lambda line: None)
    assert not queued()


@needs_slurm
@pytest.mark.timeout(600)
def test_pretrain_on_slurm_through_the_prefect_task(
    slurm, stage_tile_store, prefect_api, mlflow_tracking, tmp_path
) -> None:
    """One SLURM job of 2 torchrun ranks; rank 0's lines in the Prefect log; one manifest, one MLflow run."""
    from mlflow import MlflowClient

    from flows.pretrain import pretrain_flow
    from tasks.params import PretrainParams

    out = tmp_path / "pretrain"
    params = PretrainParams.model_validate(pretrain_params(stage_tile_store, out, mlflow_tracking))
    state = pretrain_flow(params, return_state=True)
    assert state.is_completed(), state
    logs = logs_with(state.state_details.flow_run_id, "slurm: submitted job", "pretrain: iterations 0…3")
    assert "slurm: submitted job" in logs and "slurm: job" in logs, logs[-3000:]
    assert "pretrain: iterations 0…3" in logs, logs[-3000:]  # rank 0's own summary line, from the node
    manifest = json.loads((out / "stage_manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["summary"]["iteration"] == 3
    client = MlflowClient(mlflow_tracking.uri)
    run = client.get_run(manifest["mlflow_run_id"])
    assert run.data.metrics["total_loss"] > 0  # rank 0 logged into the stage's one run
    runs = client.search_runs([mlflow_tracking.experiment_id], f"tags.`wsidino.output` = '{out.resolve()}'")
    assert len(runs) == 1
    assert not queued()


@needs_slurm
@pytest.mark.timeout(900)
def test_a_crashing_rank_fails_the_job_and_the_retry_resumes_from_its_checkpoint(
    slurm, stage_tile_store, prefect_api, mlflow_tracking, tmp_path, monkeypatch
) -> None:
    """Rank 0 crashes after its checkpoint of iteration 1: the SLURM job fails with that rank's error (in the
    Prefect log), the task's retry submits a new job, which resumes from iteration 2."""
    from flows.pretrain import pretrain_flow
    from tasks.params import PretrainParams

    for key, value in faults.environment("pretrain@1").items():
        monkeypatch.setenv(key, value)  # sbatch passes the submitting environment to the job
    out = tmp_path / "pretrain"
    params = PretrainParams.model_validate(pretrain_params(stage_tile_store, out, mlflow_tracking, retries=1))
    state = pretrain_flow(params, return_state=True)
    assert state.is_completed(), state
    logs = logs_with(state.state_details.flow_run_id, "injected fault in stage pretrain after iteration 1")
    assert "injected fault in stage pretrain after iteration 1" in logs, logs[-4000:]
    assert logs.count("slurm: submitted job") == 2
    metrics = [json.loads(line) for line in (out / "training_metrics.json").read_text().splitlines() if line.strip()]
    iterations = [m["iteration"] for m in metrics if "iteration" in m and "event" not in m]
    assert iterations[-1] == 3 and 2 in iterations
    assert not queued()


@needs_slurm
@pytest.mark.timeout(600)
def test_cancelling_the_flow_run_cancels_the_slurm_job(
    slurm, worker, stage_tile_store, mlflow_tracking, tmp_path
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    deploy("flows/pretrain.py:pretrain_flow", "pretrain-slurm-test")
    out = tmp_path / "long"
    params = pretrain_params(
        stage_tile_store, out, mlflow_tracking, stage={"optim.epochs": 100000, "train.batch_size_per_gpu": 4}
    )
    run_id = trigger("pretrain/pretrain-slurm-test", params, env={"SLURM_CONF": os.environ["SLURM_CONF"]})
    deadline = time.monotonic() + 240
    metrics = out / "training_metrics.json"
    while not (metrics.is_file() and metrics.read_text().strip()):
        assert time.monotonic() < deadline, f"the SLURM job never started training: {queued()}"
        time.sleep(0.5)
    assert any("RUNNING" in line for line in queued())
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, Cancelling(), force=True)
    final = wait_final(run_id, timeout=180)
    assert final.state.is_cancelled(), final.state
    deadline = time.monotonic() + 90
    while queued():
        assert time.monotonic() < deadline, f"still queued after the flow run was cancelled: {queued()}"
        time.sleep(0.5)
    assert not job_processes(str(out))
