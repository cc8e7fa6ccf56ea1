"""A flow run whose form names input paths that do not exist fails at once, in one line naming the parameter.

Checked against every deployment of deploy/prefect.yaml (its placeholder /data/... paths exist nowhere here), and on
a real Prefect server and process worker: a deployment registered with those placeholders, run with its defaults,
ends Failed with that one line as its message and no traceback in its logs.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.chain_params import PipelineParams
from tasks.inputs import MissingInput, check_inputs
from tasks.params import ConvertParams, PretrainParams, TileParams
from tests.helpers import REPO
from tests.prefect_deploy import deploy, flow_logs, trigger, wait_final, worker
from tests.test_deploy import model_for

__all__ = ["worker"]  # the module's process-worker fixture
DEPLOYMENTS = {d["name"]: d for d in yaml.safe_load((REPO / "deploy" / "prefect.yaml").read_text())["deployments"]}

# The first input each deployment's placeholders name: the one its runs report.
FIRST_MISSING = {
    "tile": "input",
    "convert": "input",
    "export": "weights",
    "evaluate": "store",
    "extract": "store",
    "extract-gpu": "store",
    "pretrain": "stores[0]",
    "gram": "pretrain_dir",
    "pipeline": "slides",
    "pipeline-gpu": "slides",
    "pipeline-slurm": "slides",
    "retrain": "slides",
    "retrain-cpu": "slides",
}


def final_logs(flow_run_id: Any, timeout: float = 60.0) -> str:
    """The run's logs up to its last line: the flow-run process ships them in batches, after its final state."""
    deadline = time.monotonic() + timeout
    while "Finished in state" not in (logs := flow_logs(flow_run_id)) and time.monotonic() < deadline:
        time.sleep(1.0)
    return logs


def placeholder_params(name: str) -> Any:
    deployment = DEPLOYMENTS[name]
    return model_for(deployment).model_validate(deployment["parameters"]["params"])


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_each_deployments_placeholders_name_the_parameter_to_set(name: str) -> None:
    params = placeholder_params(name)
    with pytest.raises(MissingInput) as err:
        check_inputs(params)
    message = str(err.value)
    key = FIRST_MISSING[name]
    assert message.startswith(f"{key} (") and "does not exist" in message, message
    assert f"set the deployment's `{key.split('[')[0]}` parameter to " in message and "\n" not in message


def test_existing_inputs_pass_and_each_kind_of_spec_is_read(tmp_path: Path) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    (slides / "a.svs").write_bytes(b"")
    for spec in (str(slides), str(slides / "*.svs"), str(slides / "a.svs")):
        check_inputs(TileParams(input=spec, output=str(tmp_path / "tiles.zarr")))
    with pytest.raises(MissingInput, match=r"^input \(Slides\): .*\*\.ndpi does not exist"):
        check_inputs(TileParams(input=str(slides / "*.ndpi"), output="out"))  # a glob that matches nothing
    with pytest.raises(MissingInput, match=r"^stores\[1\] \(Tile stores\): .*nope\.zarr does not exist"):
        check_inputs(PretrainParams(stores=[str(slides), str(tmp_path / "nope.zarr")], output_dir="run"))
    with pytest.raises(MissingInput, match=r"relative paths start at "):
        check_inputs(ConvertParams(input="no/such/run", output_dir="model"))


def test_the_pipeline_checks_only_the_inputs_its_stages_read(tmp_path: Path) -> None:
    common = {"slides": str(tmp_path / "none"), "workdir": str(tmp_path / "run")}
    check_inputs(PipelineParams(**common, start_at="convert", weights="/no/such.pth"))  # no tile, no pretrain
    check_inputs(PipelineParams(**{**common, "slides": str(tmp_path)}, weights="vitb16"))  # a preset: later
    with pytest.raises(MissingInput, match=r"^weights \(Released DINOv3 weights\): /no/such\.pth does not"):
        check_inputs(PipelineParams(**{**common, "slides": str(tmp_path)}, weights="/no/such.pth"))
    with pytest.raises(MissingInput, match=r"^annotations \(Annotations\)"):
        check_inputs(PipelineParams(**common, start_at="evaluate", annotations=str(tmp_path / "none")))


def test_a_python_caller_of_the_flow_gets_the_error_raised(prefect_api: str, tmp_path: Path) -> None:
    from flows.convert import convert_flow

    with pytest.raises(MissingInput, match=r"^input \(Checkpoint or run\): "):
        convert_flow(ConvertParams(input=str(tmp_path / "none"), output_dir=str(tmp_path / "model")))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("name", "entrypoint"), [("tile", "flows/tile.py:tile_flow"), ("pretrain", "flows/pretrain.py:pretrain_flow")]
)
def test_a_deployment_run_with_its_placeholders_fails_in_one_line(
    worker: subprocess.Popen[str], name: str, entrypoint: str
) -> None:
    """As a user's first click on Run does: deploy/prefect.yaml's defaults, the run's message names the parameter."""
    with pytest.raises(MissingInput) as expected:
        check_inputs(placeholder_params(name))
    deploy(entrypoint, f"{name}-placeholders", DEPLOYMENTS[name]["parameters"]["params"])
    flow_name = entrypoint.rsplit(":", 1)[1].removesuffix("_flow")
    run = wait_final(trigger(f"{flow_name}/{name}-placeholders", None), timeout=300)
    message = run.state.message or ""
    logs = final_logs(run.id)
    assert run.state.is_failed(), (run.state.name, message, logs[-3000:])
    assert message == str(expected.value) and message.startswith(f"{FIRST_MISSING[name]} ("), logs[-3000:]
    assert "Traceback" not in logs, logs
    assert logs.splitlines().count(message) == 1, logs  # logged once, as its own line
