"""MLflow's own UI server, opening our experiments on the runs table: `mlflow ui --app-name wsidino …`.

MLflow 3.17's UI chooses between its GenAI view (a traces "Overview", runs without a logged model filed under
"Evaluations") and the classic runs table from the browser's *workflow type*: `?workflowType=` in the address, else
what the browser saved under the localStorage key `mlflow.workflowType_v1`, else GenAI. The experiment's
`mlflow.experimentKind` tag is not consulted (docs/orchestration.md#mlflow names the places in MLflow's bundle). So
a fresh browser that opens our experiment from MLflow's home page lands on the traces overview, and nothing stored
on the server can change that.

This app is MLflow's server with one difference: its page sets the workflow type to "machine learning" in a
browser that has none saved yet. A user who picks GenAI in the sidebar keeps that choice. Registered as the
`mlflow.app` entry point `wsidino` (pyproject.toml); imported only by the MLflow server.
"""

from __future__ import annotations

import os
from typing import Any

WORKFLOW_KEY = "mlflow.workflowType_v1"  # MLflow's useLocalStorage key: `${key}_v${version}`, the value JSON
DEFAULT_SCRIPT = (
    f"<script>try{{if(!localStorage.getItem('{WORKFLOW_KEY}'))"
    f"localStorage.setItem('{WORKFLOW_KEY}','\"machine_learning\"')}}catch(e){{}}</script>"
)


def page_with_default(index_html: str) -> str:
    """MLflow's index.html with the default set before MLflow's own scripts run."""
    if "<head>" not in index_html:
        raise RuntimeError(
            "MLflow's index.html has no <head>: this MLflow version's UI page is not the one dinov3_core.mlflow_app "
            "knows; start the UI without --app-name wsidino"
        )
    return index_html.replace("<head>", "<head>" + DEFAULT_SCRIPT, 1)


def create_app() -> Any:
    """The MLflow server app (FastAPI under uvicorn, Flask under gunicorn or waitress) with our page."""
    from flask import Response
    from mlflow.server import app as flask_app

    index = os.path.join(flask_app.static_folder, "index.html")

    def serve() -> Any:
        if not os.path.exists(index):  # a source install of MLflow without its UI: MLflow's own message
            return original()
        with open(index, encoding="utf-8") as f:
            return Response(page_with_default(f.read()), mimetype="text/html")

    original = flask_app.view_functions["serve"]
    flask_app.view_functions["serve"] = serve
    if os.environ.get("_MLFLOW_SGI_NAME") == "uvicorn":  # as MLflow's own basic-auth app decides
        from mlflow.server.fastapi_app import create_fastapi_app

        return create_fastapi_app(flask_app)
    return flask_app


__all__ = ["DEFAULT_SCRIPT", "WORKFLOW_KEY", "create_app", "page_with_default"]
