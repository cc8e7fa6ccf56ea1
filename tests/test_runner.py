"""The stage runner's contract: it owns each stage's MLflow run (a stage function called without it opens none),
its outcomes are typed, and a rank that stops on bad input is told as its one-line cause."""

from __future__ import annotations

from pathlib import Path

import pytest

from dinov3_core.config import load_config
from dinov3_core.export.config import ExportConfig
from dinov3_core.export.summary import ExportSummary
from dinov3_core.launch import TorchrunFailed
from dinov3_core.runner import run_stage
from tests.helpers import sqlite_uri


@pytest.fixture(scope="module")
def backbone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dinov3_core.models.released import save_backbone
    from dinov3_core.models.vision_transformer import build_backbone

    return save_backbone(build_backbone("vit_test"), tmp_path_factory.mktemp("w") / "backbone.pth")


def export_config(weights: Path, out: Path, uri: str) -> ExportConfig:
    values = {
        "weights": str(weights),
        "output": str(out / "model.onnx"),
        "register_name": "runner-test",
        "parity_sizes": [32],
        "parity_batches": [2],
        "tracking.uri": uri,
    }
    return load_config(ExportConfig, None, values)


@pytest.mark.timeout(300)
def test_the_runner_owns_the_stages_mlflow_run(backbone: Path, tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from dinov3_core.export.onnx_export import run_export

    uri = sqlite_uri(tmp_path)
    run_export(export_config(backbone, tmp_path / "direct", uri))  # the stage function alone: no run of its own
    client = MlflowClient(tracking_uri=uri)
    experiments = client.search_experiments()
    assert not [r for e in experiments for r in client.search_runs([e.experiment_id])]

    outcome = run_stage("export", export_config(backbone, tmp_path / "runner", uri))
    assert isinstance(outcome.summary, ExportSummary) and outcome.summary.model_version == "1"  # typed
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.run_id for r in runs] == [outcome.mlflow_run_id]  # one run: the runner's
    assert runs[0].data.params["n_nodes"] and runs[0].data.tags["wsidino.stage"] == "export"  # the stage logged in it
    assert outcome.as_dict()["summary"]["model_version"] == "1"  # a dict only at the Prefect boundary
    from dinov3_core.checksums import sha256

    tags = client.get_model_version("runner-test", "1").tags  # the registered version carries its files' digests
    assert tags["wsidino.sha256"] == sha256(tmp_path / "runner" / "model.onnx")
    assert tags["wsidino.weights_sha256"] == sha256(backbone)


def test_a_rank_that_stops_on_bad_input_is_told_as_its_one_line_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dinov3_core.cli_options import job_failed

    stderr = "UserWarning: something torch says\nerror: train.global_batch_size=64 is larger than the store; lower it\n"
    err = TorchrunFailed(
        "dinov3_core.train", exit_code=1, root_cause=stderr, log_dir=tmp_path, rank=1, rank_exit_code=2
    )
    assert job_failed("pretrain", err, "resume") == 2
    said = capsys.readouterr().err
    assert said.splitlines() == [
        f"wsidino pretrain: train.global_batch_size=64 is larger than the store; lower it (rank 1; every rank's "
        f"output: {tmp_path})"
    ]
    crash = TorchrunFailed(
        "dinov3_core.train", exit_code=1, root_cause="Traceback ...", log_dir=tmp_path, rank=0, rank_exit_code=-9
    )
    assert job_failed("pretrain", crash, "resume from the last checkpoint") == 1
    assert "Rerun the same command to resume from the last checkpoint." in capsys.readouterr().err
