"""Links between the UIs: a stage's Prefect artifact links its MLflow run when tracking goes to a server;
`wsidino pipeline` prints the experiment's page, not the MLflow UI's landing tab."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dinov3_core import tracking
from dinov3_core.pipeline.report import experiment_page
from dinov3_core.tracking import TrackingConfig
from tests.helpers import sqlite_uri


def test_a_local_store_has_no_ui_link_and_a_server_run_has_one(tmp_path: Path) -> None:
    assert tracking.run_ui_url(TrackingConfig(uri=sqlite_uri(tmp_path)), "abc") is None
    # An unreachable server: the link is a convenience, so there is none and nothing fails.
    assert tracking.run_ui_url(TrackingConfig(uri="http://127.0.0.1:9"), None) is None


@pytest.mark.timeout(240)
def test_a_run_on_an_mlflow_server_links_to_its_page(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from wsidino_dev.serve.servers import start_mlflow_server, wait_mlflow_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_mlflow_server(tmp_path / "mlflow", port)
    try:
        wait_mlflow_server(server)
        uri = f"http://127.0.0.1:{port}"
        client = MlflowClient(tracking_uri=uri)
        experiment = client.create_experiment("links")
        run = client.create_run(experiment).info.run_id
        url = tracking.run_ui_url(TrackingConfig(uri=uri), run)
        # The workflow type makes MLflow 3.17 show it as a training run, not under "Evaluations" (mlflow_app.py).
        assert url == f"{uri}/#/experiments/{experiment}/runs/{run}?workflowType=machine_learning"
    finally:
        server.stop()


def test_the_pipeline_prints_its_experiment_page(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    uri = sqlite_uri(tmp_path)
    assert experiment_page(uri, "wsidino") == ""
    experiment = MlflowClient(tracking_uri=uri).create_experiment("wsidino")
    assert experiment_page(uri, "wsidino") == f"#/experiments/{experiment}/runs?workflowType=machine_learning"
