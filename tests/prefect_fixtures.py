"""Real orchestration back ends for tests: one Prefect API server per session, MLflow on temporary SQLite.

A pytest plugin (`pytest_plugins` in tests/conftest.py): every test module can ask for `prefect_api` and
`mlflow_tracking`; nothing starts unless a test does.

`prefect_api` enters `prefect_test_harness` (a real Prefect API server subprocess on 127.0.0.1 with a
temporary SQLite database) once per session, with an isolated `PREFECT_HOME`, analytics off and a 120 s
startup timeout (startup takes ~10-25 s on a 2-core box). Settings are applied both as Prefect settings (this
process) and as environment variables (subprocesses: the server itself and process-pool task workers).
`mlflow_tracking` is a SQLite tracking DB plus an artifact directory, both temporary; it is created while the
Prefect server boots.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import sqlite_uri

# Variables that would point runs at another server, MLflow run or profile than the test's own.
_CLEARED_ENV = (
    "PREFECT_API_URL",
    "PREFECT_API_KEY",
    "PREFECT_PROFILE",
    "PREFECT_PROFILES_PATH",
    "MLFLOW_RUN_ID",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_EXPERIMENT_ID",
    "MLFLOW_TRACKING_URI",
    "WSIDINO_MLFLOW_PARENT_RUN_ID",
)


@pytest.fixture(scope="session")
def orchestration_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Environment for the session: no outside server/run/profile, isolated `PREFECT_HOME`, analytics off."""
    env = {
        "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-home")),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }
    patch = pytest.MonkeyPatch()
    try:
        for name in _CLEARED_ENV:
            patch.delenv(name, raising=False)
        for name, value in env.items():
            patch.setenv(name, value)
        yield env
    finally:
        patch.undo()


@dataclass(frozen=True)
class MlflowTracking:
    """A temporary MLflow back end: SQLite runs, artifacts under `artifact_root`, one experiment."""

    uri: str
    experiment: str
    experiment_id: str
    artifact_root: Path


def _create_mlflow_backend(root: Path) -> MlflowTracking:
    """SQLite tracking DB with the experiment pre-created, so artifacts land under `root` (MLflow's default
    artifact root for a SQLite back end is `./mlruns` in the working directory)."""
    from mlflow.tracking import MlflowClient

    uri = sqlite_uri(root)
    artifacts = root / "artifacts"
    name = "wsidino-flow-tests"
    experiment_id = MlflowClient(uri).create_experiment(name, artifact_location=artifacts.as_uri())
    return MlflowTracking(uri=uri, experiment=name, experiment_id=experiment_id, artifact_root=artifacts)


@dataclass(frozen=True)
class Backends:
    prefect_api_url: str
    mlflow: MlflowTracking


@pytest.fixture(scope="session")
def orchestration_backends(
    orchestration_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Backends]:
    """Both back ends, started together: the MLflow DB (schema migrations, ~5-10 s) is created in a thread
    while the Prefect server subprocess boots (~10-25 s), which saves their sum on a 2-core box."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_SERVER_ANALYTICS_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        temporary_settings,
    )
    from prefect.testing.utilities import prefect_test_harness

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-backend") as pool:
        mlflow_backend = pool.submit(_create_mlflow_backend, tmp_path_factory.mktemp("mlflow"))
        with (
            temporary_settings(
                updates={
                    PREFECT_HOME: Path(orchestration_env["PREFECT_HOME"]),
                    PREFECT_SERVER_ANALYTICS_ENABLED: False,
                    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 120,
                },
                restore_defaults={PREFECT_API_URL},
            ),
            prefect_test_harness(server_startup_timeout=120),
        ):
            url = PREFECT_API_URL.value()
            assert url and url.startswith("http://127.0.0.1:"), url
            yield Backends(prefect_api_url=url, mlflow=mlflow_backend.result())


@pytest.fixture(scope="session")
def prefect_api(orchestration_backends: Backends) -> str:
    """A real Prefect API server on 127.0.0.1 for the whole session (runs go to it); its API URL."""
    return orchestration_backends.prefect_api_url


@pytest.fixture(scope="session")
def mlflow_tracking(orchestration_backends: Backends) -> MlflowTracking:
    """MLflow tracking on a temporary SQLite file with artifacts in a temporary directory."""
    return orchestration_backends.mlflow
