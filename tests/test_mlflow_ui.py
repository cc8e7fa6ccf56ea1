"""MLflow's UI on a wsidino store, clicked through in a fresh browser: our experiment opens on the runs table from
MLflow's home page, and the evaluate stage's run is filed under Runs, not "Evaluations" (dinov3_core/mlflow_app.py
says why that takes `mlflow ui --app-name wsidino`). The same clicks on MLflow's plain server show what it fixes."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dinov3_core import tracking
from tests.browser import Page, needs_chromium

pytestmark = [needs_chromium, pytest.mark.timeout(600)]

GENAI_OVERVIEW = ("/overview", "/traces")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A work directory's store with a tile run and an evaluate run, logged as the stage runner logs them."""
    work = tmp_path_factory.mktemp("ui") / "work"
    work.mkdir()
    cfg = tracking.TrackingConfig(uri=f"sqlite:///{work / 'mlflow.db'}", system_metrics=False)
    runs = {}
    for stage in ("tile", "evaluate"):
        with tracking.stage_run(cfg, stage, tags={tracking.STAGE_TAG: stage}) as run:
            tracking.log_metrics({"candidate.knn.balanced_accuracy" if stage == "evaluate" else "tiles": 0.5})
            report = work / f"{stage}.md"
            report.write_text(f"# {stage}\n")
            tracking.log_artifact(report)
            runs[stage] = run.info.run_id
    return {"work": work, "uri": cfg.uri, "experiment": run.info.experiment_id, "runs": runs}


@pytest.fixture
def server(request: pytest.FixtureRequest, store: dict[str, Any]) -> Iterator[str]:
    """`mlflow server` on the store: with `--app-name wsidino` when the test is parametrized so."""
    from wsidino_dev.serve.children import child_env, spawn
    from wsidino_dev.serve.servers import wait_mlflow_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = ["--app-name", "wsidino"] if request.param else []
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store["uri"], "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--workers", "1", *app]
    child = spawn(
        "MLflow server", cmd, child_env(store["work"]), store["work"] / f"mlflow-{port}.log", f"http://127.0.0.1:{port}"
    )
    try:
        wait_mlflow_server(child)
        yield f"http://127.0.0.1:{port}"
    finally:
        child.stop()


def open_from_home(page: Page, url: str, experiment: str) -> str:
    """Home page → click our experiment → the tab MLflow settles on (its address)."""
    page.goto(f"{url}/")
    page.click_text("wsidino")
    opened = f"/experiments/{experiment}/"
    page.wait_for(
        lambda: any(f"{opened}{tab}" in page.url() for tab in ("runs", "overview", "traces")), what="the experiment"
    )
    return page.url()


def filed_under(page: Page, url: str, store: dict[str, Any]) -> str:
    """The evaluate run's page: the breadcrumb naming the list it belongs to ("Runs" or "Evaluations")."""
    page.goto(f"{url}/#/experiments/{store['experiment']}/runs/{store['runs']['evaluate']}")
    crumb = "(document.querySelector('[data-testid=\"experiment-observatory-link-runs\"]') || {}).innerText"
    page.wait_for(lambda: page.evaluate(crumb), what="the run page's breadcrumb")
    return page.evaluate(crumb)


@pytest.mark.parametrize("server", [True], indirect=True, ids=["app-wsidino"])
def test_our_experiment_opens_on_the_runs_table_from_the_home_page(
    server: str, store: dict[str, Any], tmp_path: Path
) -> None:
    with Page(tmp_path / "profile") as page:  # a fresh browser: nothing saved from an earlier visit
        landed = open_from_home(page, server, store["experiment"])
        assert f"/experiments/{store['experiment']}/runs" in landed, landed
        page.wait_for(lambda: "evaluate" in page.text() and "tile" in page.text(), what="the runs table")
        assert "Detect issues" not in page.text()  # the GenAI overview's popover
        assert filed_under(page, server, store) == "Runs"


@pytest.mark.parametrize("server", [False], indirect=True, ids=["plain-mlflow"])
def test_plain_mlflow_opens_it_on_the_genai_overview(server: str, store: dict[str, Any], tmp_path: Path) -> None:
    """What `--app-name wsidino` is for, despite our experiment-kind tag: when MLflow stops doing this, drop it."""
    experiment = tracking.EXPERIMENT_KIND_TAG
    from mlflow import MlflowClient

    tags = MlflowClient(tracking_uri=store["uri"]).get_experiment(store["experiment"]).tags
    assert tags[experiment] == tracking.EXPERIMENT_KIND
    with Page(tmp_path / "profile") as page:
        landed = open_from_home(page, server, store["experiment"])
        assert any(tab in landed for tab in GENAI_OVERVIEW), landed
        assert filed_under(page, server, store) == "Evaluations"
