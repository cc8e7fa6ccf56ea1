"""The launch section of the training stages' forms: one pydantic union on `backend` (`LocalLaunch`,
`SlurmLaunch`, `KubernetesLaunch`), so Prefect's UI offers the backend first and then only that backend's fields.
Each variant is `dinov3_core.launch.training.LaunchSettings` plus its own cluster section; payloads of the old single
launch model (both cluster sections always present) are still read (`_from_single_model`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, GetJsonSchemaHandler, TypeAdapter, model_validator

from dinov3_core.forms import ui
from dinov3_core.launch.training import MAX_PROCESSES, PROCESSES_DESCRIPTION, LaunchSettings, local_gpu_count
from tasks.launch_k8s import KubernetesSettings
from tasks.launch_slurm import SlurmSettings

CPU_PROCESSES = 2  # a CPU host's default: the demo's (`make demo`: --nproc-per-node 2), gloo ranks sharing its cores


def default_processes(gpus: int | None = None, cores: int | None = None) -> int:
    """The Local launch's default processes per node, for the host the form is built on (where `prefect deploy`
    runs, or the flow run's host for a payload without it): one per GPU on a GPU host, else `CPU_PROCESSES` on a
    CPU host with that many cores, else 1."""
    gpus = local_gpu_count() if gpus is None else gpus
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    if gpus:
        return min(gpus, MAX_PROCESSES)
    return CPU_PROCESSES if cores >= CPU_PROCESSES else 1


BACKEND_DESCRIPTION = "Set by the choice of Local, SLURM or Kubernetes (not drawn in the forms: `_variant_schema`)."
CLUSTER_SECTIONS = {"slurm": SlurmSettings, "kubernetes": KubernetesSettings}  # backend → its own form section


def _variant_schema(backend: str) -> Callable[[dict[str, Any]], None]:
    """The JSON schema of one backend's launch model, as the forms draw it and the server validates a run's payload:

    - `backend` is not among its `properties`: both Prefect UIs draw a property with one constant value as a greyed
      input ("Backend is a const"), and they pick the variant a value shows by the property names it shares with
      each (the cluster section, `slurm` or `kubernetes`, tells them apart), switching by the selector above. A
      payload may still name it (`patternProperties`, which the forms do not draw): only with this variant's value;
    - a cluster backend's section carries its defaults in the schema, so a form switched to that backend sends it:
      a payload without `backend` means the backend whose section it holds, else local (`_from_single_model`);
    - the other backends' sections may be present (`{"backend": "local", "slurm": {...}}`: the single launch
      model's complete payloads), so the server passes them on to `_from_single_model`, which drops them when they
      only restate the defaults and names them otherwise; unknown keys are still refused.
    """
    others = [section for section in CLUSTER_SECTIONS if section != backend]

    def extra(schema: dict[str, Any]) -> None:
        del schema["properties"]["backend"]
        if backend in CLUSTER_SECTIONS:
            defaults = CLUSTER_SECTIONS[backend]().model_dump(mode="json", exclude_none=True)
            schema["properties"][backend]["default"] = defaults
        schema["patternProperties"] = {
            "^backend$": {"enum": [backend]},
            f"^({'|'.join(others)})$": {"type": "object"},
        }

    return extra


class LocalLaunch(LaunchSettings):
    """torchrun on the worker's host: its CPU cores, or on a GPU host one process per GPU (holding slots of
    `gpu_slots` while it runs)."""

    model_config = ConfigDict(extra="forbid", title="Local (this host)", json_schema_extra=_variant_schema("local"))

    nproc_per_node: int = Field(
        default_processes(),  # this host's, where the form's schema is made: `default_processes`
        ge=1,
        le=MAX_PROCESSES,
        title="Processes per node",
        description=f"{PROCESSES_DESCRIPTION} Default: one per GPU of the host the deployment was registered on, "
        f"else {CPU_PROCESSES}.",
        json_schema_extra=ui(0),
    )

    backend: Literal["local"] = Field(
        "local", title="Backend", description=BACKEND_DESCRIPTION, json_schema_extra=ui(7)
    )

    @model_validator(mode="after")
    def _multi_node_needs_endpoint(self) -> LocalLaunch:  # replaces LaunchSettings' check, naming the alternative
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("nnodes > 1 needs rdzv_endpoint (host:port of the c10d rendezvous), or a cluster backend")
        return self


class _ClusterLaunch(LaunchSettings):
    """What SLURM and Kubernetes launches share: the cluster places the nodes, so no rendezvous endpoint is asked."""

    @model_validator(mode="after")
    def _multi_node_needs_endpoint(self) -> _ClusterLaunch:  # the job's first node is the rendezvous: none to give
        return self


class SlurmLaunch(_ClusterLaunch):
    """One sbatch job of `nnodes` nodes, one torchrun per node (tasks.launch_slurm)."""

    model_config = ConfigDict(extra="forbid", title="SLURM", json_schema_extra=_variant_schema("slurm"))

    backend: Literal["slurm"] = Field(
        "slurm", title="Backend", description=BACKEND_DESCRIPTION, json_schema_extra=ui(7)
    )
    slurm: SlurmSettings = Field(default_factory=SlurmSettings, title="SLURM", json_schema_extra=ui(8))


class KubernetesLaunch(_ClusterLaunch):
    """A Kubernetes Indexed Job, one pod per node (tasks.launch_k8s)."""

    model_config = ConfigDict(extra="forbid", title="Kubernetes", json_schema_extra=_variant_schema("kubernetes"))

    backend: Literal["kubernetes"] = Field(
        "kubernetes", title="Backend", description=BACKEND_DESCRIPTION, json_schema_extra=ui(7)
    )
    kubernetes: KubernetesSettings = Field(
        default_factory=KubernetesSettings, title="Kubernetes", json_schema_extra=ui(8)
    )


def _from_single_model(value: Any) -> Any:
    """A launch payload → the union's shape: no `backend` means the backend whose section it holds (what the forms
    send: they do not show `backend`), else local (as it always did); the section of a backend not chosen, which
    payloads of the single launch model (one `slurm` and one `kubernetes` section always present) carried, is
    dropped when it only restates its defaults and is an error naming it otherwise."""
    if not isinstance(value, dict):
        return value
    sections = [key for key in CLUSTER_SECTIONS if key in value]
    value = {"backend": sections[0] if len(sections) == 1 else "local", **value}
    for key, section in CLUSTER_SECTIONS.items():
        if key not in value or key == value["backend"]:
            continue
        given = value.pop(key)
        try:
            unused = section.model_validate(given) == section()
        except ValueError:
            unused = False
        if not unused:
            raise ValueError(
                f"launch.{key} is set but launch.backend is {value['backend']!r}: each backend now carries only "
                f'its own section ({{"backend": "slurm", "slurm": {{...}}}}, {{"backend": "kubernetes", '
                f'"kubernetes": {{...}}}}, or {{"backend": "local"}} with neither); set backend to {key!r} or '
                f"remove {key!r}"
            )
    return value


class _AnyOf:
    """The union's variants as `anyOf` (pydantic writes `oneOf`): Prefect's V1 UI draws only an `anyOf` as a
    variant selector (a `oneOf` becomes a JSON editor there), the V2 UI either. The same payloads validate: one
    naming its `backend` matches that variant alone, one without matches each whose section it holds, which
    `_from_single_model` resolves the same way."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        schema = dict(handler(core_schema))
        schema["anyOf"] = schema.pop("oneOf")
        return schema


LaunchParams = Annotated[
    LocalLaunch | SlurmLaunch | KubernetesLaunch,
    Field(discriminator="backend"),
    BeforeValidator(_from_single_model),
    _AnyOf(),
]
"""How a stage's torchrun job is launched from Prefect, one of: on the worker's host (`LocalLaunch`), as one job of
the SLURM cluster the worker can submit to (`SlurmLaunch`: one sbatch job, one torchrun per node;
tasks.launch_slurm), or as a Kubernetes Indexed Job (`KubernetesLaunch`: one pod per node; tasks.launch_k8s). A
union on `backend`, so the form offers the backend first and then only that backend's fields."""
LAUNCH = TypeAdapter(LaunchParams)  # LAUNCH.validate_python({...}): a launch payload → its backend's model


__all__ = ["LAUNCH", "KubernetesLaunch", "LaunchParams", "LocalLaunch", "SlurmLaunch"]
