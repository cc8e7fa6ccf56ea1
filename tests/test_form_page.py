"""The pipeline deployment's run form as a user sees it: Prefect's UI (V2, its default) in headless Chromium.

The test server has no UI, so `make serve`'s Prefect server (with its UI) is started on the same database, as the
pipeline flow's page test does. The form's launch section is the union on `backend` (tasks/launch_params.py): its
selector, then the chosen backend's fields, and no greyed "Backend is a const" input.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser import needs_chromium
from tests.prefect_deploy import POOL, deploy, ui_page_text


@needs_chromium
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_run_form_offers_the_backends_without_a_const_backend_field(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=POOL, type="process"), overwrite=True)
    params = {"slides": "/slides", "workdir": "/runs/lab1", "launch": {"nproc_per_node": 2, "backend": "local"}}
    deployment_id = deploy("flows/pipeline.py:pipeline_flow", "pipeline-form", params)
    text = ui_page_text(f"/v2/deployments/deployment/{deployment_id}/run", tmp_path / "serve", monkeypatch)
    launch = text[text.index("Training launch") :]
    assert "Local (this host) SLURM Kubernetes" in launch, text[:4000]
    assert "Processes per node" in launch and "Partition" not in launch, launch[:3000]  # the local variant's fields
    assert "const" not in text and "Backend" not in launch, launch[:3000]
