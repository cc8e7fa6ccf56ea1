"""The flows' forms as Prefect builds them: the launch is a union on `backend`, no null noise, old launch payloads.

The schemas come from `prefect.utilities.callables.parameter_schema` (what `prefect deploy` stores as a
deployment's `parameter_openapi_schema` and the UI draws), and payloads are checked with Prefect's own server-side
validator (`prefect.utilities.schema_tools.validation.validate`, what a run's creation goes through) and with the
flow's own pydantic validation (what the run itself does). No server is started.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

import pytest
import yaml
from prefect.exceptions import ParameterTypeError
from prefect.server.schemas.actions import DeploymentCreate
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import validate

from flows.convert import convert_flow
from flows.evaluate import evaluate_flow
from flows.export import export_flow
from flows.extract import extract_flow
from flows.gram import gram_flow
from flows.pipeline import pipeline_flow
from flows.pretrain import pretrain_flow
from flows.retrain import retrain_flow
from flows.tile import tile_flow
from tasks.launch_params import LAUNCH, KubernetesLaunch, LocalLaunch, SlurmLaunch, default_processes
from tests.helpers import REPO

FLOWS = {
    f.name: f
    for f in (
        tile_flow,
        pretrain_flow,
        gram_flow,
        convert_flow,
        export_flow,
        evaluate_flow,
        extract_flow,
        pipeline_flow,
        retrain_flow,
    )
}
LAUNCHED = {"pretrain", "gram", "evaluate", "extract", "pipeline", "retrain"}  # the flows with a launch section


def schema_of(flow_name: str) -> dict[str, Any]:
    return parameter_schema(FLOWS[flow_name]).model_dump_for_openapi()


def nulls(schema: Any, where: str = "") -> list[str]:
    """Where a JSON schema has a `"type": "null"` (an anyOf's null branch: "Property is type None" in the form) or a
    `"default": null` (with which Prefect's server would refuse an explicit null)."""
    found = []
    if isinstance(schema, dict):
        if schema.get("type") == "null" or ("default" in schema and schema["default"] is None):
            found.append(where or "/")
        for key, value in schema.items():
            found += nulls(value, f"{where}/{key}")
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            found += nulls(value, f"{where}/{index}")
    return found


def test_the_checker_sees_null_noise() -> None:
    optional = {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Annotations"}
    assert nulls({"properties": {"annotations": optional}}) == [
        "/properties/annotations",
        "/properties/annotations/anyOf/1",
    ]


@pytest.mark.parametrize("flow_name", sorted(FLOWS))
def test_forms_have_no_null_noise(flow_name: str) -> None:
    schema = schema_of(flow_name)
    assert nulls(schema) == []
    # An empty optional field is still valid on the server and still None for the flow.
    optional = {
        "pipeline": ("weights", "annotations"),
        "retrain": ("annotations",),
        "gram": ("teacher_path", "stores"),
        "pretrain": ("pretrained_weights",),
        "evaluate": ("annotations",),
    }.get(flow_name, ())
    model = schema["definitions"][schema["properties"]["params"]["$ref"].rsplit("/", 1)[1]]
    for name in optional:
        assert model["properties"][name]["type"] in {"string", "array"}, name
        assert "default" not in model["properties"][name], name


@pytest.mark.parametrize("flow_name", sorted(LAUNCHED))
def test_the_launch_is_a_union_on_backend_with_only_the_chosen_backends_section(flow_name: str) -> None:
    schema = schema_of(flow_name)
    definitions = schema["definitions"]
    model = definitions[schema["properties"]["params"]["$ref"].rsplit("/", 1)[1]]
    launch = model["properties"]["launch"]
    assert launch["discriminator"]["propertyName"] == "backend"
    # anyOf, not pydantic's oneOf: the V1 UI draws only an anyOf as a selector (V2 either).
    variants = [ref["$ref"].rsplit("/", 1)[1] for ref in launch["anyOf"]]
    assert variants == ["LocalLaunch", "SlurmLaunch", "KubernetesLaunch"]
    assert sorted(launch["discriminator"]["mapping"]) == ["kubernetes", "local", "slurm"]
    sections = {name: set(definitions[name]["properties"]) & {"slurm", "kubernetes"} for name in variants}
    assert sections == {"LocalLaunch": set(), "SlurmLaunch": {"slurm"}, "KubernetesLaunch": {"kubernetes"}}
    for name, tag in zip(variants, ["local", "slurm", "kubernetes"], strict=True):
        # No `backend` property: the forms would draw it as a greyed "Backend is a const" input. A payload may still
        # name it, with its variant's tag alone; a cluster section comes with its defaults, so a form sends it.
        assert "backend" not in definitions[name]["properties"] and "backend" not in definitions[name].get(
            "required", []
        )
        assert definitions[name]["patternProperties"]["^backend$"] == {"enum": [tag]}
        if tag != "local":
            assert (
                definitions[name]["properties"][tag]["default"]
                == LAUNCH.validate_python({"backend": tag}).model_dump(mode="json", exclude_none=True)[tag]
            )
    # On a CPU run the form shows the torchrun settings and nothing of a cluster.
    local = definitions["LocalLaunch"]["properties"]
    assert sorted(local, key=lambda k: local[k]["position"]) == [
        "nproc_per_node",
        "nnodes",
        "rdzv_endpoint",
        "cuda_visible_devices",
        "timeout_hours",
        "retries",
        "gpu_slots",
    ]


def deployment_payloads() -> list[tuple[str, dict[str, Any]]]:
    project = yaml.safe_load((REPO / "deploy" / "prefect.yaml").read_text())
    return [(d["name"], d) for d in project["deployments"]]


@pytest.mark.parametrize("name,deployment", deployment_payloads(), ids=[n for n, _ in deployment_payloads()])
def test_prefect_yaml_parameters_pass_the_servers_validation(name: str, deployment: dict[str, Any]) -> None:
    """What `prefect deploy` registers (the server's `DeploymentCreate` checks the parameters without adding null
    branches: optional fields left empty are left out of prefect.yaml) and a run of it is checked against."""
    schema = schema_of(deployment["entrypoint"].split(":")[1].removesuffix("_flow"))
    DeploymentCreate(
        name=name,
        flow_id=uuid4(),
        parameters=deployment["parameters"],
        parameter_openapi_schema=schema,
        enforce_parameter_schema=True,
    )
    assert validate(deployment["parameters"], schema) == []


def test_registration_refuses_a_null_where_a_run_takes_it() -> None:
    """Why prefect.yaml leaves empty optional fields out, while a run's `null` (the form, --params) is fine."""
    schema = schema_of("pipeline")
    payload = {"params": {"slides": "/slides", "workdir": "/runs", "weights": None}}
    assert validate(payload, schema) == []
    with pytest.raises(ValueError, match="None is not of type 'string'"):
        DeploymentCreate(
            name="p",
            flow_id=uuid4(),
            parameters=payload,
            parameter_openapi_schema=schema,
            enforce_parameter_schema=True,
        )


def pipeline_payload(launch: dict[str, Any]) -> dict[str, Any]:
    return {"params": {"slides": "/slides", "workdir": "/runs/lab1", "launch": launch}}


# The single launch model's complete payloads always carried both cluster sections (the defaults when unused).
OLD_SLURM_DEFAULTS = {
    "partition": None,
    "account": None,
    "gpus_per_node": 0,
    "cpus_per_node": None,
    "mem": None,
    "time_limit": None,
    "extra_directives": [],
    "setup": [],
}
OLD_K8S_DEFAULTS = {
    "namespace": "wsidino",
    "image": "wsidino:gpu",
    "working_dir": "/opt/wsidino",
    "gpus_per_node": 8,
    "cpus_per_node": 64,
    "memory": "256Gi",
    "shm": "64Gi",
    "data_claim": "wsidino-data",
    "data_path": "/data",
    "node_selector": {"nvidia.com/gpu.present": "true"},
}


def variant_defaults(definitions: dict[str, Any], name: str) -> dict[str, Any]:
    """What a form switched to a launch variant sends: each drawn property's schema default (no `backend`)."""
    properties = definitions[name]["properties"]
    return {key: prop["default"] for key, prop in properties.items() if "default" in prop}


def shared_keys(definitions: dict[str, Any], name: str, value: dict[str, Any]) -> int:
    return len(set(value) & set(definitions[name]["properties"]))


def test_what_a_form_sends_for_each_backend_runs_on_that_backend() -> None:
    """Both Prefect UIs send the chosen variant's drawn fields, and show a value under the variant whose property
    names it shares most of (the first of equals): the cluster section decides, as it does for the flow."""
    schema = schema_of("pipeline")
    definitions = schema["definitions"]
    variants = {"local": LocalLaunch, "slurm": SlurmLaunch, "kubernetes": KubernetesLaunch}
    names = {"local": "LocalLaunch", "slurm": "SlurmLaunch", "kubernetes": "KubernetesLaunch"}
    for tag, kind in variants.items():
        sent = variant_defaults(definitions, names[tag])
        assert "backend" not in sent and (tag == "local") == ("slurm" not in sent and "kubernetes" not in sent)
        assert validate(pipeline_payload(sent), schema) == []  # the server creates the run
        assert type(pipeline_flow.validate_parameters(pipeline_payload(sent))["params"].launch) is kind
        counts = [shared_keys(definitions, name, sent) for name in names.values()]
        assert counts.index(max(counts)) == list(names).index(tag), (tag, counts)  # the form shows it back


def test_old_launch_payloads_still_run_when_the_unused_sections_are_defaults() -> None:
    schema = schema_of("pipeline")
    old_local = {"nproc_per_node": 2, "backend": "local", "slurm": OLD_SLURM_DEFAULTS, "kubernetes": OLD_K8S_DEFAULTS}
    old_slurm = {
        "nproc_per_node": 8,
        "nnodes": 2,
        "backend": "slurm",
        "slurm": {**OLD_SLURM_DEFAULTS, "partition": "gpu"},
        "kubernetes": OLD_K8S_DEFAULTS,
    }
    no_backend = {"nproc_per_node": 2, "retries": 0}  # local, as it always was
    for launch, kind in ((old_local, LocalLaunch), (old_slurm, SlurmLaunch), (no_backend, LocalLaunch)):
        assert validate(pipeline_payload(launch), schema) == []  # the server creates the run
        params = pipeline_flow.validate_parameters(pipeline_payload(launch))["params"]  # and the run takes it
        assert type(params.launch) is kind
    assert params.launch.nproc_per_node == 2 and params.launch.retries == 0
    assert LAUNCH.validate_python(old_slurm).slurm.partition == "gpu"


def test_an_old_payload_with_settings_for_a_backend_not_chosen_fails_naming_the_key_and_the_new_shape() -> None:
    launch = {"backend": "local", "nnodes": 1, "slurm": {**OLD_SLURM_DEFAULTS, "partition": "gpu"}}
    assert validate(pipeline_payload(launch), schema_of("pipeline")) == []  # left to the flow, which says why
    with pytest.raises(ParameterTypeError) as failed:
        pipeline_flow.validate_parameters(pipeline_payload(launch))
    message = str(failed.value)
    assert "launch.slurm is set but launch.backend is 'local'" in message
    assert '{"backend": "slurm", "slurm": {...}}' in message and "set backend to 'slurm' or remove 'slurm'" in message
    with pytest.raises(ValueError, match=r"launch\.kubernetes is set but launch\.backend is 'slurm'"):
        LAUNCH.validate_python({"backend": "slurm", "kubernetes": {**OLD_K8S_DEFAULTS, "image": "lab/wsidino:gpu"}})


def test_the_server_still_refuses_unknown_and_out_of_range_launch_keys() -> None:
    schema = schema_of("pipeline")
    bad = [
        {"nproc_per_nod": 2},
        {"backend": "slurm", "slurm": {"partitoin": "gpu"}},
        {"backend": "docker"},
        {"timeout_hours": 0},
        {"rdzv_endpoint": "no port"},
        {"backend": "kubernetes", "slurm": "gpu"},
    ]
    for launch in bad:
        assert validate(pipeline_payload(launch), schema), launch
        with pytest.raises(ParameterTypeError):
            pipeline_flow.validate_parameters(pipeline_payload(launch))


def test_the_local_launchs_processes_follow_the_host() -> None:
    """One process per GPU on a GPU host; on a CPU host the demo's 2 when it has the cores, else 1. The form (the
    schema's default) and a payload that leaves it out agree."""
    assert [default_processes(gpus=g, cores=c) for g, c in ((8, 2), (1, 64), (0, 16), (0, 2), (0, 1))] == [
        8,
        1,
        2,
        2,
        1,
    ]
    assert default_processes(gpus=128, cores=2) == 64  # the form's bound
    here = default_processes()
    assert LocalLaunch().nproc_per_node == here == LAUNCH.validate_python({}).nproc_per_node
    definitions = schema_of("pretrain")["definitions"]
    assert definitions["LocalLaunch"]["properties"]["nproc_per_node"]["default"] == here
    # A CPU box's form speaks of GPU slots only as what they do on a GPU host.
    local = definitions["LocalLaunch"]
    for text in [local["description"], *(p.get("description", "") for p in local["properties"].values())]:
        assert "GPU" not in text or "GPU host" in text, text
