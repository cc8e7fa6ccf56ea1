"""The pipeline as users run it: deployments on a real Prefect server, a real process worker, MLflow on SQLite.

One deployed pipeline run carries two injected faults (`WSIDINO_FAULT`): rank 0 of pretraining crashes after its
first checkpoint (the task retries and training resumes from that checkpoint), and export fails as it starts
(no retry for light stages: the run fails). Retrying the failed flow run, as the UI's Retry button does, must
resume at export without recomputing anything before it. Then: a rerun skips every stage; a single-stage export
rerun does not retrain; cancelling a running training flow leaves no process behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import psutil
import pytest

from dinov3_core.stages import STAGE_NAMES
from tests.browser import needs_chromium
from tests.helpers import REPO, by_name, read_json, slide_list
from tests.prefect_deploy import deploy, flow_logs, job_processes, retry, trigger, ui_page_text, wait_final, worker
from tests.prefect_fixtures import MlflowTracking
from wsidino_dev import faults
from wsidino_dev.short_run import SHORT_EXPORT, SHORT_RUN

__all__ = ["worker"]  # the module's process-worker fixture
STAGES = list(STAGE_NAMES)  # every built-in stage runs in the pipeline


def pipeline_parameters(slides: Path, workdir: Path, tracking: MlflowTracking) -> dict[str, Any]:
    """A small but complete pipeline: one 20× test slide at 64 px / 2 µm/px, 2 training processes."""
    return {
        "slides": str(slides),
        "workdir": str(workdir),
        "config": "cpu",
        "overrides": [*SHORT_RUN, "extract.progress=false"],
        "launch": {"nproc_per_node": 2, "retries": 1},
        "tracking": {"tracking_uri": tracking.uri, "experiment": tracking.experiment},
    }


MANIFESTS = {
    "tile": "tiles.zarr/stage_manifest.json",
    "pretrain": "pretrain/stage_manifest.json",
    "gram": "gram/stage_manifest.json",
    "convert": "model/stage_manifest.json",
    "export": "model/model.onnx.stage_manifest.json",
    "evaluate": "evaluation/stage_manifest.json",
    "extract": "features.zarr/stage_manifest.json",
}


def manifests(workdir: Path) -> dict[str, dict[str, Any]]:
    """Each stage's manifest under the pipeline work directory ({} where the stage never ran)."""
    return {stage: read_json(workdir / rel) for stage, rel in MANIFESTS.items()}


@pytest.fixture(scope="module")
def one_slide(sample_slides: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return slide_list(tmp_path_factory.mktemp("slides") / "slides.txt", [by_name(sample_slides, "tissue_20x.svs")])


@pytest.fixture(scope="module")
def deployed_pipeline_run(
    worker: subprocess.Popen[str],
    one_slide: Path,
    mlflow_tracking: MlflowTracking,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """The deployed pipeline with two faults, then its retry: the run's id, work dir and first-attempt facts."""
    deploy("flows/pipeline.py:pipeline_flow", "pipeline-test")
    workdir = tmp_path_factory.mktemp("pipeline") / "run"
    params = pipeline_parameters(one_slide, workdir, mlflow_tracking)
    run_id = trigger("pipeline/pipeline-test", params, env=faults.environment("pretrain@1,export"))
    first = wait_final(run_id, timeout=600)
    first_logs = flow_logs(run_id)  # the stage tasks' lines included
    before_retry = manifests(workdir) if first.state.is_failed() else {}
    retry(run_id)
    final = wait_final(run_id, timeout=400)
    return {
        "id": run_id,
        "workdir": workdir,
        "params": params,
        "first": first,
        "first_logs": first_logs,
        "before_retry": before_retry,
        "final": final,
    }


# ----------------------------------------------------------------------------------------------------- tests


@pytest.mark.timeout(1200)
def test_deployed_pipeline_survives_a_crash_and_resumes_after_retry(deployed_pipeline_run: dict[str, Any]):
    run = deployed_pipeline_run
    first, final, workdir = run["first"], run["final"], run["workdir"]
    # Attempt 1: the crashed rank was retried and resumed; the run failed at export, with the root cause.
    assert first.state.is_failed(), first.state
    assert "injected fault in stage export" in (first.state.message or "") + run["first_logs"]
    before = run["before_retry"]
    assert not before["evaluate"] and not before["extract"]
    assert [before[s]["status"] for s in STAGES[:4]] == ["complete"] * 4
    assert before["export"]["status"] == "failed" and "injected fault" in before["export"]["error"]
    assert (workdir / "pretrain" / ".wsidino-fault-pretrain").exists()
    metrics = [json.loads(line) for line in (workdir / "pretrain" / "training_metrics.json").read_text().splitlines()]
    iterations = [m["iteration"] for m in metrics if "iteration" in m]
    assert iterations.count(0) == 1 and max(iterations) == 3, iterations  # resumed after ckpt 1, not restarted
    # The crash reached the Prefect logs with its root cause (rank 0's exception), and the task was retried.
    assert "injected fault in stage pretrain after iteration 1" in run["first_logs"]
    assert "Retry 1/1" in run["first_logs"]

    # The retry (same flow run) completed, recomputing nothing before export.
    assert final.state.is_completed(), final.state
    after = manifests(workdir)
    for stage in STAGES[:4]:
        assert after[stage]["finished_at"] == before[stage]["finished_at"], stage
        assert after[stage]["output_fingerprint"] == before[stage]["output_fingerprint"], stage
    assert after["export"]["status"] == after["evaluate"]["status"] == after["extract"]["status"] == "complete"
    # No annotations in this run: label-free health only, nothing promoted, so extract used the candidate.
    assert "no annotations: promotion is off" in after["evaluate"]["summary"]["decision"]
    assert after["evaluate"]["lineage"].keys() == {"tile", "pretrain", "gram", "convert", "export"}
    assert after["extract"]["lineage"].keys() == {"tile", "pretrain", "gram", "convert", "export"}


@pytest.mark.timeout(120)
def test_mlflow_holds_the_pipeline_run_with_one_child_per_stage(
    deployed_pipeline_run: dict[str, Any], mlflow_tracking: MlflowTracking
):
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_tracking.uri)
    exp = [mlflow_tracking.experiment_id]
    flow_run_id = str(deployed_pipeline_run["id"])
    (parent,) = client.search_runs(
        exp, f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.`wsidino.pipeline` = 'true'"
    )
    assert parent.info.status == "FINISHED"
    assert parent.data.params["stages.pretrain.config"] == "tiny" and parent.data.params["stages.gram.config"] == "tiny"
    assert parent.data.params["workdir"] == str(deployed_pipeline_run["workdir"])
    assert [a.path for a in client.list_artifacts(parent.info.run_id)] == ["pipeline_summary.json"]
    children = client.search_runs(exp, f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    by_stage: dict[str, list[Any]] = {}
    for child in children:
        by_stage.setdefault(child.data.tags["wsidino.stage"], []).append(child)
    # One run per stage, even for pretraining that ran twice (the retry resumed the same MLflow run).
    assert {s: len(v) for s, v in by_stage.items()} == dict.fromkeys(STAGES, 1)
    runs = {s: v[0] for s, v in by_stage.items()}
    assert all(r.info.status == "FINISHED" for r in runs.values()), {s: r.info.status for s, r in runs.items()}
    assert runs["pretrain"].data.metrics["total_loss"] > 0 and "gram_loss" in runs["gram"].data.metrics
    assert runs["tile"].data.metrics["slides_ok"] == 1
    assert runs["extract"].data.metrics["tiles"] > 0
    for stage in ("pretrain", "gram", "convert", "export", "extract"):
        names = [a.path for a in client.list_artifacts(runs[stage].info.run_id, "manifest")]
        assert names == [
            "manifest/" + ("model.onnx.stage_manifest.json" if stage == "export" else "stage_manifest.json")
        ]
    assert any(a.path.startswith("pca") for a in client.list_artifacts(runs["extract"].info.run_id))
    for stage in ("convert", "export", "extract"):  # the resolved config of every stage
        assert [a.path for a in client.list_artifacts(runs[stage].info.run_id, "config")] == [f"config/{stage}.yaml"]
    assert "loss_curve.png" in {a.path for a in client.list_artifacts(runs["pretrain"].info.run_id)}
    # Lineage: features → model → training runs → tile store.
    tags = runs["extract"].data.tags
    for stage in ("tile", "pretrain", "gram", "convert", "export"):
        assert tags[f"wsidino.lineage.{stage}_run_id"] == runs[stage].info.run_id, stage
    assert runs["tile"].data.tags["prefect.flow_run_id"] == flow_run_id  # a task run of the pipeline flow run
    # The ONNX model is registered with its alias and carries the lineage.
    version = client.get_model_version_by_alias("wsidino-backbone", "candidate")
    assert version.run_id == runs["export"].info.run_id
    assert version.tags["wsidino.lineage.pretrain_run_id"] == runs["pretrain"].info.run_id


def pipeline_summary(tracking: MlflowTracking, flow_run_id: UUID) -> dict[str, Any]:
    """The pipeline_summary.json artifact of a pipeline flow run's MLflow parent run."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking.uri)
    query = f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.`wsidino.pipeline` = 'true'"
    (parent,) = client.search_runs([tracking.experiment_id], query)
    return json.loads(Path(client.download_artifacts(parent.info.run_id, "pipeline_summary.json")).read_text())


def statuses(summary: dict[str, Any]) -> dict[str, str]:
    return {stage: outcome["status"] for stage, outcome in summary["stages"].items()}


@pytest.mark.timeout(600)
def test_rerun_skips_every_stage_and_export_alone_does_not_retrain(
    deployed_pipeline_run: dict[str, Any], mlflow_tracking: MlflowTracking
):
    """Everything through the worker, as from the UI (a run of the same deployment; the export deployment)."""
    from mlflow import MlflowClient

    workdir, params = deployed_pipeline_run["workdir"], deployed_pipeline_run["params"]
    ckpts = {p: p.stat().st_mtime_ns for p in (workdir / "pretrain").rglob("*")}
    before = manifests(workdir)

    rerun = wait_final(trigger("pipeline/pipeline-test", params), timeout=300)
    assert rerun.state.is_completed(), rerun.state
    assert statuses(pipeline_summary(mlflow_tracking, rerun.id)) == dict.fromkeys(STAGES, "skipped")
    assert manifests(workdir) == before

    deploy("flows/export.py:export_flow", "export-test")
    export = {
        "weights": str(workdir / "model" / "backbone.pth"),
        "output": str(workdir / "model" / "model.onnx"),
        "stage": {"config": None, "overrides": SHORT_EXPORT},  # the same config: only `force` makes it run
        "tracking": params["tracking"],
        "force": True,
    }
    versions = MlflowClient(mlflow_tracking.uri).search_model_versions("name = 'wsidino-backbone'")
    forced = wait_final(trigger("export/export-test", export), timeout=300)
    assert forced.state.is_completed(), forced.state
    after = manifests(workdir)
    assert after["export"]["finished_at"] >= before["export"]["finished_at"]
    assert after["export"]["mlflow_run_id"] != before["export"]["mlflow_run_id"]  # a new run: it did run
    new_versions = MlflowClient(mlflow_tracking.uri).search_model_versions("name = 'wsidino-backbone'")
    assert len(new_versions) == len(versions)  # same weights, same settings: the registry already has this model
    forced_run = MlflowClient(mlflow_tracking.uri).get_run(after["export"]["mlflow_run_id"])
    assert forced_run.data.tags["wsidino.reused_model_version"] == str(before["export"]["summary"]["model_version"])
    assert {p: p.stat().st_mtime_ns for p in (workdir / "pretrain").rglob("*")} == ckpts  # nothing retrained
    assert {s: after[s] for s in STAGES[:4]} == {s: before[s] for s in STAGES[:4]}

    # Extract is due again only if the re-exported file differs (its fingerprint covers the model's content).
    same_model = after["export"]["output_fingerprint"] == before["export"]["output_fingerprint"]
    tail = wait_final(trigger("pipeline/pipeline-test", {**params, "start_at": "convert"}), timeout=300)
    assert tail.state.is_completed(), tail.state
    rerun = "skipped" if same_model else "ran"
    expected = {"convert": "skipped", "export": "skipped", "evaluate": rerun, "extract": rerun}
    assert statuses(pipeline_summary(mlflow_tracking, tail.id)) == expected


@pytest.mark.timeout(300)
def test_following_a_deployment_run_prints_its_states_and_each_log_line_once(
    deployed_pipeline_run: dict[str, Any], prefect_api: str, tmp_path: Path
) -> None:
    params = tmp_path / "params.json"
    params.write_text(json.dumps({**deployed_pipeline_run["params"], "start_at": "export"}))
    command = [sys.executable, "-m", "tasks.follow", "pipeline/pipeline-test", "--params", str(params)]
    env = {**os.environ, "PREFECT_API_URL": prefect_api}  # the session's server (its settings live in this process)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    states = [line.split("state  ", 1)[1].split(":")[0] for line in lines if " state  " in line]
    assert states[-2:] == ["Running", "Completed"], states
    assert sum("pipeline: stage 1/3: export" in line for line in lines) == 1, done.stdout
    for stage in ("export", "evaluate", "extract"):
        assert sum(f"{stage}: up to date" in line for line in lines) == 1, (stage, done.stdout)


@needs_chromium
@pytest.mark.timeout(300)
def test_the_prefect_ui_shows_the_pipeline_run_and_its_stage_logs(
    deployed_pipeline_run: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flow run's page, rendered by a real browser: its final state and the stages' log lines."""
    text = ui_page_text(f"/runs/flow-run/{deployed_pipeline_run['id']}", tmp_path / "serve", monkeypatch)
    assert "Completed" in text and "pipeline: stage 1/7: tile" in text, text[:3000]


@pytest.mark.timeout(300)
def test_cancelling_a_training_flow_leaves_no_process_behind(
    worker: subprocess.Popen[str],
    deployed_pipeline_run: dict[str, Any],
    mlflow_tracking: MlflowTracking,
    tmp_path: Path,
):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    deploy("flows/pretrain.py:pretrain_flow", "pretrain-test")
    run_dir = tmp_path / "long-pretrain"
    params = {
        "stores": [str(deployed_pipeline_run["workdir"] / "tiles.zarr")],
        "output_dir": str(run_dir),
        "stage": {"config": "tiny", "overrides": ["optim.epochs=100000", "train.batch_size_per_gpu=4"]},
        "launch": {"nproc_per_node": 2, "retries": 0},
        "tracking": {"tracking_uri": mlflow_tracking.uri, "experiment": mlflow_tracking.experiment},
    }
    run_id = trigger("pretrain/pretrain-test", params)
    deadline = time.monotonic() + 180
    metrics = run_dir / "training_metrics.json"
    # Cancel once the job is training: its first metrics line is on disk (both ranks are past start-up).
    while not (metrics.is_file() and metrics.read_text().strip()) or len(job_processes(str(run_dir))) < 3:
        assert time.monotonic() < deadline, "the training job never started training"
        time.sleep(0.2)
    procs = job_processes(str(run_dir))
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, Cancelling(), force=True)
    final = wait_final(run_id, timeout=120)
    assert final.state.is_cancelled(), final.state
    _gone, alive = psutil.wait_procs(procs, timeout=60)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    assert not job_processes(str(run_dir))
    m = read_json(run_dir / "stage_manifest.json")
    assert m["status"] in {"running", "failed"}  # never `complete`: a rerun resumes from the last checkpoint
