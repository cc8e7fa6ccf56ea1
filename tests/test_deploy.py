"""Deployment files: prefect.yaml parameters against the flow models, job templates, sbatch scripts, `make serve`.

Nothing here runs a flow: the checks read the files and use the real models, Prefect's templating, docker-py's
argument handling and bash; one registers `make serve`'s deployments on the session's Prefect server.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml
from pydantic import BaseModel

from dinov3_core.config import packaged_config_dir
from dinov3_core.pipeline.config import load_pipeline_config
from dinov3_core.pipeline.run import stage_config
from dinov3_core.stages import STAGE_NAMES as STAGES
from tasks.chain_params import PipelineParams, RetrainParams
from tasks.launch_params import LAUNCH, KubernetesLaunch, SlurmLaunch
from tasks.params import (
    ConvertParams,
    EvaluateParams,
    ExportParams,
    ExtractParams,
    GramParams,
    PretrainParams,
    StageOptions,
    TileParams,
)
from wsidino_dev import serve

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
PREFECT_FILE = DEPLOY / "prefect.yaml"
DOCKER_TEMPLATE = DEPLOY / "docker" / "docker-gpu-job-template.json"
K8S_TEMPLATE = DEPLOY / "kubernetes" / "k8s-gpu-job-template.json"
K8S_MULTINODE = DEPLOY / "kubernetes" / "pretrain-multinode.yaml"
SBATCH_SCRIPTS = sorted((DEPLOY / "slurm").glob("*.sbatch"))

# Entrypoint function → (flow name, parameter model).
FLOWS: dict[str, tuple[str, type[BaseModel]]] = {
    "tile_flow": ("tile", TileParams),
    "pretrain_flow": ("pretrain", PretrainParams),
    "gram_flow": ("gram", GramParams),
    "convert_flow": ("convert", ConvertParams),
    "export_flow": ("export", ExportParams),
    "evaluate_flow": ("evaluate", EvaluateParams),
    "extract_flow": ("extract", ExtractParams),
    "pipeline_flow": ("pipeline", PipelineParams),
    "retrain_flow": ("retrain", RetrainParams),
}
CPU_DEPLOYMENTS = {"tile", "convert", "export", "evaluate", "extract", "pipeline", "retrain-cpu"}
GPU_DEPLOYMENTS = {"pretrain", "gram", "extract-gpu", "pipeline-gpu", "retrain"}
SLURM_DEPLOYMENTS = {"pipeline-slurm"}  # on pool wsidino-slurm: a worker on a host that can sbatch
PLACEHOLDER = re.compile(r"{{\s*([A-Za-z_][A-Za-z0-9_]*)\s*}}")


@pytest.fixture(scope="module")
def project() -> dict[str, Any]:
    return yaml.safe_load(PREFECT_FILE.read_text())


@pytest.fixture(scope="module")
def deployments(project: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in project["deployments"]}


def model_for(deployment: dict[str, Any]) -> type[BaseModel]:
    function = deployment["entrypoint"].split(":", 1)[1]
    assert function in FLOWS, f"{deployment['name']}: unknown entrypoint {deployment['entrypoint']}"
    return FLOWS[function][1]


def nested_model(annotation: Any, discriminator: Any, value: Any) -> type[BaseModel] | None:
    """The model a field's value is an object of: its own type, or in a union on a tag (the launch's `backend`)
    the member whose tag the value names (the first, local, when it names none)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    members = [m for m in get_args(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
    if not members or not isinstance(discriminator, str) or not isinstance(value, dict):
        return None
    tag = value.get(discriminator, next(m.model_fields[discriminator].default for m in members))
    return next((m for m in members if m.model_fields[discriminator].default == tag), None)


def missing_fields(model: type[BaseModel], values: Any, where: str) -> list[str]:
    """Fields of `model` (recursively through nested models) that `values` does not spell out; an optional field
    left empty is left out (the server refuses a null when it registers a deployment)."""
    if not isinstance(values, dict):
        return [f"{where} is not an object"]
    missing = []
    for name, info in model.model_fields.items():
        if name not in values:
            if info.default is not None or info.default_factory is not None:
                missing.append(f"{where}.{name}")
            continue
        nested = nested_model(info.annotation, info.discriminator, values[name])
        if nested is not None and values[name] is not None:
            missing += missing_fields(nested, values[name], f"{where}.{name}")
    return missing


def check_params(deployment: dict[str, Any], parameters: dict[str, Any], where: str) -> BaseModel:
    """`parameters` is exactly {"params": <complete, valid object for the flow's model>}."""
    assert set(parameters) == {"params"}, f"{where}: the flows take one parameter, `params`; got {sorted(parameters)}"
    model = model_for(deployment)
    params = parameters["params"]
    assert not missing_fields(model, params, "params"), (
        f"{where}: a run or schedule replaces `params` whole, so spell every field out; missing "
        f"{missing_fields(model, params, 'params')}"
    )
    return model.model_validate(params)


def stage_configs(params: BaseModel) -> list[tuple[str, str]]:
    """(stage, config name) of every named config in a parameter object (retrain: its cycle config and the
    stage configs that one names)."""
    if isinstance(params, RetrainParams):
        cycle = yaml.safe_load((packaged_config_dir() / "retrain" / f"{params.config}.yaml").read_text())
        named = [
            (stage, choice["config"])
            for stage, choice in cycle.items()
            if isinstance(choice, dict) and choice.get("config")
        ]
        return [("retrain", params.config), *named]
    if isinstance(params, PipelineParams):
        cfg = load_pipeline_config(params.config, params.config_values())
        named = [(stage, cfg.choice(stage).config) for stage in STAGES if cfg.choice(stage).config]
        return [("pipeline", params.config), *named]
    stage = {
        TileParams: "tile",
        PretrainParams: "pretrain",
        GramParams: "gram",
        ConvertParams: "convert",
        ExportParams: "export",
        EvaluateParams: "evaluate",
        ExtractParams: "extract",
    }[type(params)]
    options = params.stage
    assert isinstance(options, StageOptions)
    return [(stage, options.config)] if options.config else []


# ------------------------------------------------------------------------------------------------ prefect.yaml


def test_prefect_yaml_deployments_and_pools(project: dict[str, Any], deployments: dict[str, dict[str, Any]]) -> None:
    import prefect

    assert project["prefect-version"] == prefect.__version__
    assert len(deployments) == len(project["deployments"]), "deployment names must be unique"
    assert set(deployments) == CPU_DEPLOYMENTS | GPU_DEPLOYMENTS | SLURM_DEPLOYMENTS
    for name, deployment in deployments.items():
        pool = deployment["work_pool"]["name"]
        expected = (
            "wsidino-gpu"
            if name in GPU_DEPLOYMENTS
            else "wsidino-slurm"
            if name in SLURM_DEPLOYMENTS
            else ("wsidino-cpu")
        )
        assert pool == expected, name
    for name in GPU_DEPLOYMENTS | SLURM_DEPLOYMENTS:  # one GPU training run at a time per deployment, the rest queue
        limit = deployments[name]["concurrency_limit"]
        assert limit == {"limit": 1, "collision_strategy": "ENQUEUE"}, name
    # No build/push, no explicit pull: `prefect deploy` records set_working_directory (the repo root).
    assert project["build"] is None and project["push"] is None and "pull" not in project


@pytest.mark.parametrize("name", sorted(CPU_DEPLOYMENTS | GPU_DEPLOYMENTS | SLURM_DEPLOYMENTS), ids=lambda n: n)
def test_deployment_params_are_complete_and_valid(deployments: dict[str, dict[str, Any]], name: str) -> None:
    deployment = deployments[name]
    params = check_params(deployment, deployment["parameters"], f"deployment {name}")
    for stage, config in stage_configs(params):
        assert (packaged_config_dir() / stage / f"{config}.yaml").is_file(), f"{name}: no configs/{stage}/{config}.yaml"


def test_gpu_deployments(deployments: dict[str, dict[str, Any]]) -> None:
    pretrain = PretrainParams.model_validate(deployments["pretrain"]["parameters"]["params"])
    assert pretrain.launch.gpu_slots == "gpu-slots" and pretrain.launch.nproc_per_node == 8
    assert pretrain.stage.config == "vitb16-continued"
    assert pretrain.pretrained_weights == "/models/dinov3/dinov3_vitb16_pretrain_lvd1689m-73cec8be.pth"
    gram = GramParams.model_validate(deployments["gram"]["parameters"]["params"])
    pipeline = PipelineParams.model_validate(deployments["pipeline-gpu"]["parameters"]["params"])
    for launch in (gram.launch, pipeline.launch):
        assert launch.gpu_slots == "gpu-slots" and launch.nproc_per_node == 8
    extract = ExtractParams.model_validate(deployments["extract-gpu"]["parameters"]["params"])
    assert extract.launch.nproc_per_node == 8 and extract.launch.gpu_slots == "gpu-slots"  # a rank per GPU
    assert "precision=bf16" in extract.stage.overrides
    cfg = load_pipeline_config(pipeline.config, pipeline.config_values())
    assert cfg.stages["pretrain"].config == "vitb16-continued" and cfg.weights == pretrain.pretrained_weights
    assert cfg.stages["tile"].config == "cohort-jpeg" and cfg.stages["tile"].overrides[-1] == "workers=16"


def test_cpu_pipeline_is_small_and_local(deployments: dict[str, dict[str, Any]]) -> None:
    params = PipelineParams.model_validate(deployments["pipeline"]["parameters"]["params"])
    cfg = load_pipeline_config(params.config, params.config_values())
    assert (
        cfg.stages["pretrain"].config == "cpu" and cfg.stages["gram"].config == "cpu"
    )  # gram: 20 % of the cpu pretraining
    assert stage_config(cfg, "pretrain").train.device == stage_config(cfg, "gram").train.device == "cpu"
    assert params.launch.nproc_per_node == 2 and params.launch.gpu_slots is None  # as make demo runs it
    # Relative to the checkout (the worker's working directory); make serve replaces them with absolute paths.
    assert not Path(params.slides).is_absolute() and not Path(params.workdir).is_absolute()


def test_schedules_carry_complete_params(deployments: dict[str, dict[str, Any]]) -> None:
    from prefect.client.schemas.schedules import CronSchedule

    scheduled = {name: d["schedules"] for name, d in deployments.items() if d.get("schedules")}
    assert set(scheduled) == {"retrain"}  # the pipeline reruns one work directory: scheduling it retrains nothing
    for name, schedules in scheduled.items():
        for schedule in schedules:
            assert "parameters" in schedule, f"{name}: a schedule without parameters runs the deployment defaults"
            check_params(deployments[name], schedule["parameters"], f"schedule {schedule.get('slug')} of {name}")
    (weekly,) = scheduled["retrain"]
    assert weekly["active"] is False, "the retraining schedule is registered paused"
    cron = CronSchedule(cron=weekly["cron"], timezone=weekly["timezone"])  # valid cron and time zone
    assert cron.cron == "0 2 * * 0"


def test_gpu_deployments_say_they_need_a_gpu_worker(deployments: dict[str, dict[str, Any]]) -> None:
    assert set(serve.GPU_DEPLOYMENTS) == GPU_DEPLOYMENTS
    for name in GPU_DEPLOYMENTS:
        assert "Needs a worker on pool wsidino-gpu" in deployments[name]["description"], name
    assert set(serve.SLURM_DEPLOYMENTS) == SLURM_DEPLOYMENTS
    for name in SLURM_DEPLOYMENTS:
        assert "Needs a worker on pool wsidino-slurm" in deployments[name]["description"], name


def test_the_slurm_pipeline_submits_its_jobs_to_slurm(deployments: dict[str, dict[str, Any]]) -> None:
    params = PipelineParams.model_validate(deployments["pipeline-slurm"]["parameters"]["params"])
    launch = params.launch
    assert isinstance(launch, SlurmLaunch) and launch.backend == "slurm"
    assert launch.nnodes == 2 and launch.rdzv_endpoint is None  # the script finds it
    assert launch.slurm.gpus_per_node == launch.nproc_per_node == 8 and launch.gpu_slots is None
    with pytest.raises(ValueError, match="rdzv_endpoint"):  # a local multi-node launch still needs its endpoint
        LAUNCH.validate_python({**launch.model_dump(exclude={"slurm"}), "backend": "local"})


def test_deployment_launches_carry_only_their_backends_section(deployments: dict[str, dict[str, Any]]) -> None:
    """prefect.yaml is in the union's shape: a local launch has no slurm/kubernetes section to fill in."""
    launches = {
        name: d["parameters"]["params"]["launch"]
        for name, d in deployments.items()
        if "launch" in d["parameters"]["params"]
    }
    assert len(launches) >= 8
    for name, launch in launches.items():
        own = {"local": set(), "slurm": {"slurm"}, "kubernetes": {"kubernetes"}}[launch["backend"]]
        assert set(launch) & {"slurm", "kubernetes"} == own, name


def test_retrain_deployments(deployments: dict[str, dict[str, Any]]) -> None:
    from dinov3_core.retrain.config import load_retrain_config

    gpu = RetrainParams.model_validate(deployments["retrain"]["parameters"]["params"])
    assert gpu.launch.gpu_slots == "gpu-slots" and gpu.launch.nproc_per_node == 8 and gpu.config == "vitb16"
    cfg = load_retrain_config(gpu.config, gpu.config_values())
    assert cfg.stages["pretrain"].config == "vitb16-continued" and cfg.pretrained_weights.endswith(".pth")
    cpu = RetrainParams.model_validate(deployments["retrain-cpu"]["parameters"]["params"])
    assert cpu.config == "tiny" and cpu.launch.gpu_slots is None and not Path(cpu.root).is_absolute()
    for name in ("retrain", "retrain-cpu"):  # one cycle at a time per root: later runs queue
        assert deployments[name]["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}


def test_entrypoints_exist_and_name_their_flows(deployments: dict[str, dict[str, Any]]) -> None:
    missing = []
    for name, deployment in deployments.items():
        path, function = deployment["entrypoint"].split(":", 1)
        file = REPO / path
        if not file.exists():
            missing.append(f"{name} ({path})")
            continue
        tree = ast.parse(file.read_text())
        defs = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert function in defs, f"{name}: {path} defines no function {function}"
        flow_names = [
            kw.value.value
            for deco in defs[function].decorator_list
            if isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "flow"
            for kw in deco.keywords
            if kw.arg == "name" and isinstance(kw.value, ast.Constant)
        ]
        assert flow_names == [FLOWS[function][0]], f"{name}: {function} should be @flow(name={FLOWS[function][0]!r})"
    if missing:
        pytest.skip(f"flow modules not written yet: {', '.join(missing)}")


# ------------------------------------------------------------------------------------------------ job templates


def placeholders(value: Any) -> set[str]:
    return set(PLACEHOLDER.findall(json.dumps(value)))


def render(template: dict[str, Any], **values: Any) -> dict[str, Any]:
    """The job configuration as a worker renders it: variable defaults, then `values` (Prefect's templating)."""
    from prefect.utilities.templating import apply_values

    defaults = {
        name: spec["default"] for name, spec in template["variables"]["properties"].items() if "default" in spec
    }
    return apply_values(template["job_configuration"], {**defaults, **values})


@pytest.mark.parametrize("path", [DOCKER_TEMPLATE, K8S_TEMPLATE], ids=lambda p: p.name)
def test_job_template_variables_match_placeholders(path: Path) -> None:
    template = json.loads(path.read_text())
    used = placeholders(template["job_configuration"])
    declared = set(template["variables"]["properties"])
    assert used <= declared, f"placeholders without a variable: {sorted(used - declared)}"
    assert declared <= used, f"variables never referenced (ignored by the worker): {sorted(declared - used)}"
    assert "gpu_count" in used


def test_docker_template_requests_gpus() -> None:
    from docker.models.containers import _create_container_args

    template = json.loads(DOCKER_TEMPLATE.read_text())
    assert "--gpus" not in DOCKER_TEMPLATE.read_text()  # not a docker-py argument (PrefectHQ/prefect#16144)
    kwargs = template["job_configuration"]["container_create_kwargs"]
    assert kwargs["device_requests"][0]["count"] == "{{ gpu_count }}"
    rendered = render(template, gpu_count=4)["container_create_kwargs"]
    assert rendered["device_requests"][0]["count"] == 4  # a whole-value placeholder keeps the integer type
    # docker-py accepts the rendered kwargs (unknown keys or bad values raise here, before any daemon is needed).
    host_config = _create_container_args({"image": "wsidino:gpu", "version": "1.44", **rendered})["host_config"]
    assert host_config["DeviceRequests"][0]["Count"] == 4
    assert host_config["DeviceRequests"][0]["Capabilities"] == [["gpu"]]
    assert host_config["ShmSize"] == 16 * 1024**3


def test_k8s_template_requests_gpus_and_selects_nodes() -> None:
    template = json.loads(K8S_TEMPLATE.read_text())
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "{{ gpu_count }}"
    selector = [{"key": "pool", "operator": "Equal", "value": "a100", "effect": "NoSchedule"}]
    job = render(template, gpu_count=2, node_selector={"gpu": "a100"}, tolerations=selector)["job_manifest"]
    pod = job["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 2 and resources["requests"]["nvidia.com/gpu"] == 2
    assert pod["nodeSelector"] == {"gpu": "a100"} and pod["tolerations"] == selector
    # What the kubernetes worker insists on (its base manifest): one container named prefect-job, Never restart.
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    assert pod["restartPolicy"] == "Never" and pod["containers"][0]["name"] == "prefect-job"
    assert pod["parallelism"] == 1 and pod["completions"] == 1


def test_k8s_multinode_manifest_rendezvous() -> None:
    service, job = yaml.safe_load_all(K8S_MULTINODE.read_text())
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    name, svc = job["metadata"]["name"], service["metadata"]["name"]
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == svc and service["spec"]["selector"] == {"job-name": name}
    args = pod["containers"][0]["args"]
    assert f"--rdzv-endpoint={name}-0.{svc}:29400" in args and "--rdzv-backend=c10d" in args
    assert f"--nnodes={job['spec']['completions']}" in args and job["spec"]["parallelism"] == job["spec"]["completions"]
    gpus = pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert f"--nproc-per-node={gpus}" in args


def test_the_kubernetes_backend_renders_a_stage_job_and_needs_kubectl(tmp_path: Path, monkeypatch) -> None:
    """The Prefect form's kubernetes backend: a multi-node launch without an endpoint, the stage's own job (its
    launch config and torchrun log dir on the shared volume, the MLflow run's environment) in the pods; a worker
    without kubectl gets bad input naming what to do, not a retry."""
    from dinov3_core.errors import WsidinoError
    from dinov3_core.stages import get_stage
    from tasks.launch_k8s import KubernetesRunner, dns_name, render
    from tests.helpers import pretrain_config

    launch = LAUNCH.validate_python({"backend": "kubernetes", "nproc_per_node": 4, "nnodes": 3})
    assert isinstance(launch, KubernetesLaunch)
    # 12 processes of 8: a global batch they split (the launcher refuses one they cannot, before any pod starts).
    cfg = pretrain_config(tmp_path / "tiles.zarr", tmp_path / "run", **{"train.global_batch_size": 96})
    job = get_stage("pretrain").torchrun_job(cfg, launch, env={"MLFLOW_RUN_ID": "r1"})
    service, manifest = render(job, launch.kubernetes, name=dns_name("wsidino-pretrain-RUN_1"))
    assert service["metadata"]["name"] == manifest["metadata"]["name"] == "wsidino-pretrain-run-1"
    assert manifest["spec"]["completions"] == manifest["spec"]["parallelism"] == 3
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert f"--log-dir={tmp_path / 'run' / 'torchrun_logs'}" in container["args"]
    assert container["args"][-2:] == ["--config", str((tmp_path / "run" / "launch_config.yaml").resolve())]
    assert {"name": "MLFLOW_RUN_ID", "value": "r1"} in container["env"]
    assert "--nproc-per-node=4" in container["args"] and "--rdzv-endpoint=wsidino-pretrain-run-1-0." in " ".join(
        container["args"]
    )
    monkeypatch.setenv("PATH", str(tmp_path))  # no kubectl here
    with pytest.raises(WsidinoError, match=r"kubectl` is not on this worker's PATH"):
        KubernetesRunner(launch.kubernetes)(job, log=lambda line: None)


def test_k8s_multinode_manifest_is_what_the_renderer_prints() -> None:
    """deploy/kubernetes/pretrain-multinode.yaml is generated (tasks/launch_k8s.py): its header names the command,
    and the command's output must be the file's manifests, so the example cannot drift from the code."""
    text = K8S_MULTINODE.read_text()
    command = " ".join(
        line.lstrip("# ").rstrip("\\ ")
        for line in text.splitlines()
        if line.startswith("#   python -m tasks.launch_k8s") or line.startswith("#     ")
    )
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "tasks.launch_k8s"], command
    done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    assert list(yaml.safe_load_all(done.stdout)) == list(yaml.safe_load_all(text))


# ------------------------------------------------------------------------------------------------ SLURM


def test_sbatch_scripts_parse() -> None:
    assert {p.name for p in SBATCH_SCRIPTS} == {"pretrain-multinode.sbatch", "prefect-gpu-worker.sbatch"}
    bash = shutil.which("bash")
    assert bash
    for script in SBATCH_SCRIPTS:
        result = subprocess.run([bash, "-n", str(script)], capture_output=True, text=True, check=False)
        assert result.returncode == 0, f"{script.name}: {result.stderr}"
    pretrain = (DEPLOY / "slurm" / "pretrain-multinode.sbatch").read_text()
    for needle in ("srun", "torchrun", '--nnodes="$SLURM_NNODES"', "--rdzv-backend=c10d", "-m dinov3_core.train"):
        assert needle in pretrain
    assert "--pool wsidino-gpu" in (DEPLOY / "slurm" / "prefect-gpu-worker.sbatch").read_text()


# ------------------------------------------------------------------------------------ make serve (wsidino_dev.serve)


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(serve.PortInUseError, match=rf"port {port} on 127\.0\.0\.1 \(for the MLflow server\)"):
            serve.check_port_free(port, "127.0.0.1", "MLflow server")
        with pytest.raises(serve.PortInUseError, match="already in use"):
            serve.start_prefect_server(Path("/nonexistent-serve-dir"), port=port, wait=False)
    serve.check_port_free(port, "127.0.0.1", "MLflow server")  # free again once closed


def test_serve_ports_and_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    defaults = serve.build_parser().parse_args([])
    assert (defaults.prefect_port, defaults.mlflow_port) == (4200, 5000)
    assert defaults.serve_dir == REPO / ".wsidino-serve"
    monkeypatch.setenv("WSIDINO_PREFECT_PORT", "4301")
    monkeypatch.setenv("WSIDINO_MLFLOW_PORT", "5001")
    monkeypatch.setenv("WSIDINO_SERVE_DIR", str(tmp_path))
    args = serve.build_parser().parse_args(["--mlflow-port", "5002"])
    assert (args.prefect_port, args.mlflow_port, args.serve_dir) == (4301, 5002, tmp_path)


def test_serve_demo_params_point_into_the_serve_dir(tmp_path: Path, deployments: dict[str, Any]) -> None:
    params = serve.demo_pipeline_params(tmp_path)
    assert params["slides"] == str(tmp_path / "slides")
    assert params["workdir"] == str(tmp_path / "runs" / "pipeline")
    assert params["annotations"] == str(tmp_path / "slides" / "annotations")
    check_params(deployments["pipeline"], {"params": params}, "make serve's pipeline params")
    assert (serve.DEMO_FLOW, serve.DEMO_DEPLOYMENT) == ("pipeline", "pipeline")


def test_serve_retrain_params_point_into_the_serve_dir(tmp_path: Path, deployments: dict[str, Any]) -> None:
    params = serve.demo_retrain_params(tmp_path)
    assert params["slides"] == str(tmp_path / "slides") and params["root"] == str(tmp_path / "runs" / "retrain")
    assert params["annotations"] == str(tmp_path / "slides" / "annotations") and params["config"] == "tiny"
    check_params(deployments["retrain-cpu"], {"params": params}, "make serve's retrain params")


def test_serve_child_stops_with_its_whole_group(tmp_path: Path) -> None:
    # A leader that ignores SIGTERM and a grandchild in its group: stop() must SIGKILL both.
    script = "import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    script += "subprocess.Popen(['sleep', '60']); time.sleep(60)"
    child = serve.spawn("test child", [sys.executable, "-c", script], serve.child_env(tmp_path), tmp_path / "c.log")
    deadline = time.monotonic() + 10
    while len(child.group_members()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(child.group_members()) == 2
    start = time.monotonic()
    child.stop(timeout=0.5)
    assert child.group_members() == [] and not child.running()
    assert time.monotonic() - start < 8
    env = serve.child_env(tmp_path, "http://127.0.0.1:1/api")
    assert env["PREFECT_HOME"] == str(tmp_path / "prefect-home") and env["PREFECT_API_URL"].endswith(":1/api")


def test_serve_writes_sample_slides_with_the_dev_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands: list[list[str]] = []
    monkeypatch.setattr(serve.servers, "spawn", lambda name, cmd, env, log, url=None: commands.append(list(cmd)))
    serve.start_sample_slides(tmp_path, "test")
    slides = tmp_path / "slides"
    assert commands == [
        [sys.executable, "-m", "wsidino_dev", "samples", str(slides), "--preset", "test", "--no-negatives"]
    ]
    slides.mkdir()
    (slides / "sample_slides.json").write_text("{}")
    assert serve.start_sample_slides(tmp_path) is None  # already written: nothing to start


def test_dev_command_line_serve_takes_the_serve_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from wsidino_dev.__main__ import build_parser, cmd_serve

    for name in ("WSIDINO_PREFECT_PORT", "WSIDINO_MLFLOW_PORT", "WSIDINO_SERVE_DIR"):
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(["serve", "--prefect-port", "4301", "--gpu-worker"])
    assert args.func is cmd_serve
    assert (args.prefect_port, args.mlflow_port, args.gpu_worker) == (4301, 5000, True)
    assert args.serve_dir == REPO / ".wsidino-serve" and args.sample_preset == "test"


def test_serve_registers_only_the_deployments_of_pools_it_runs_a_worker_for() -> None:
    """On a CPU box no deployment waits "Not Ready" for a GPU or SLURM worker that never comes."""
    assert set(serve.deployments_on(serve.served_pools())) == CPU_DEPLOYMENTS
    assert set(serve.deployments_on(serve.served_pools(gpu_worker=True))) == CPU_DEPLOYMENTS | GPU_DEPLOYMENTS
    everything = CPU_DEPLOYMENTS | GPU_DEPLOYMENTS | SLURM_DEPLOYMENTS
    assert set(serve.deployments_on(serve.served_pools(all_deployments=True))) == everything
    args = serve.build_parser().parse_args([])
    assert (args.gpu_worker, args.all_deployments) == (False, False)
    assert serve.build_parser().parse_args(["--all-deployments"]).all_deployments


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_registration_on_a_real_server(prefect_api: str, tmp_path: Path) -> None:
    """`make serve`'s registration against the session's Prefect server: the CPU pool's deployments with
    prefect.yaml's parameters (the server checks them against the stored schema), the demo's parameters, and an
    earlier session's GPU deployment removed unless it has flow runs (deleting it would delete them)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    serve.ensure_work_pools(prefect_api, serve.served_pools())
    with get_client(sync_client=True) as client:  # an earlier session's GPU deployments, one with a flow run
        client.create_work_pool(WorkPoolCreate(name=serve.GPU_POOL, type="process"), overwrite=True)
        for flow_name in ("pretrain", "gram"):
            stale = client.create_deployment(
                flow_id=client.create_flow_from_name(flow_name), name=flow_name, work_pool_name=serve.GPU_POOL
            )
        run = client.create_flow_run_from_deployment(stale)
    registration = serve.register_deployments(
        prefect_api, tmp_path, demo_params=serve.demo_pipeline_params(tmp_path), pools=serve.served_pools()
    )
    log = registration.log.read_text()[-3000:]
    assert registration.skipped == {}, log
    assert (registration.removed, registration.kept) == (["pretrain/pretrain"], ["gram/gram"])
    names = {full.split("/", 1)[1] for full in registration.deployments}
    assert names >= CPU_DEPLOYMENTS and not names & (GPU_DEPLOYMENTS | SLURM_DEPLOYMENTS) - {"gram"}, (names, log)
    with get_client(sync_client=True) as client:
        pipeline = client.read_deployment_by_name("pipeline/pipeline")
        assert client.read_flow_run(run.id).deployment_id == stale  # kept, with its run
        client.delete_deployment(stale)
    assert pipeline.parameters == {"params": serve.demo_pipeline_params(tmp_path)}
    assert pipeline.enforce_parameter_schema and pipeline.work_pool_name == serve.CPU_POOL
    launch = pipeline.parameter_openapi_schema["definitions"]["PipelineParams"]["properties"]["launch"]
    assert launch["discriminator"]["propertyName"] == "backend"


def test_the_screenshots_short_run_is_a_valid_pipeline(tmp_path: Path) -> None:
    """`python -m wsidino_dev screenshots` runs the CPU pipeline with `SHORT_RUN` added: every key must exist."""
    from wsidino_dev.screenshots import SHORT_RUN

    params = serve.demo_pipeline_params(tmp_path)
    params = PipelineParams.model_validate({**params, "overrides": [*params["overrides"], *SHORT_RUN]})
    cfg = load_pipeline_config(params.config, params.config_values())
    assert cfg.stages["pretrain"].config == cfg.stages["gram"].config == "tiny"
    for stage in STAGES:  # each stage's config loads, every override key checked against its dataclass
        stage_config(cfg, stage)
    assert stage_config(cfg, "pretrain").train.stop_at == stage_config(cfg, "gram").train.stop_at == 4


def test_makefile_serve_target() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^serve: venv\n\t\$\(BIN\)/python -m wsidino_dev serve \$\(SERVE_ARGS\)$", makefile, re.MULTILINE)
