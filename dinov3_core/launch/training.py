"""How a stage runs as a torchrun job: `LaunchSettings` (processes, nodes, GPUs, limits) → one `TorchrunJob`.

Pretrain and gram always run as a job; extract does when the launch asks for more than one process (each stage's
`Stage.job_module`, `job_dir` and `job_check` say how, and `Stage.torchrun_job` builds the job). The same
settings come from `wsidino pretrain --nproc-per-node …` and from the Prefect forms (this pydantic model is the
form's "Launch" section), so every bound is declared here once. The resolved stage config is written to
`<job dir>/launch_config.yaml` (the run directory; for extract the folder beside the feature store) and every rank
loads it: ranks, retries and the stage manifest all see one config.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dinov3_core.forms import optional_field, ui

MAX_PROCESSES = 64  # per node
PROCESSES_DESCRIPTION = (
    "torchrun processes per node: one per GPU on a GPU host; on a CPU host, processes sharing its cores."
)


class LaunchSettings(BaseModel):
    """How a stage's torchrun job is launched: processes, nodes, GPUs, wall-clock limit and retries."""

    model_config = ConfigDict(extra="forbid", title="Launch")

    nproc_per_node: int = Field(
        1,
        ge=1,
        le=MAX_PROCESSES,
        title="Processes per node",
        description=PROCESSES_DESCRIPTION,
        json_schema_extra=ui(0),
    )
    nnodes: int = Field(
        1,
        ge=1,
        le=1024,
        title="Nodes",
        description="Nodes in the job; more than 1 needs a rendezvous endpoint, and the same launch on every node.",
        json_schema_extra=ui(1),
    )
    rdzv_endpoint: str | None = optional_field(
        2,
        "Rendezvous endpoint",
        "host:port of the c10d rendezvous (multi-node only), e.g. node001:29400.",
        pattern=r"^[A-Za-z0-9_.\-\[\]:]+:\d+$",
    )
    cuda_visible_devices: str | None = optional_field(
        3,
        "CUDA_VISIBLE_DEVICES",
        "GPU hosts: the GPUs this job may use, e.g. 0,1. Empty: the worker's own setting (none on a CPU host).",
        pattern=r"^[0-9, ]*$|^(GPU|MIG)-[A-Za-z0-9\-/,]+$",
    )
    timeout_hours: float | None = optional_field(
        4,
        "Wall-clock limit (hours)",
        "Kill the whole job after this long (it resumes from its last checkpoint when rerun). Empty: no limit.",
        gt=0,
        le=24 * 30,
    )
    retries: int = Field(
        1,
        ge=0,
        le=10,
        title="Retries",
        description="Relaunches after a crash (not after bad input); each resumes from the last checkpoint. "
        "Prefect runs only: on the command line, rerun the same command.",
        json_schema_extra=ui(5),
    )
    gpu_slots: str | None = optional_field(
        6,
        "GPU slot limit",
        "GPU hosts: a Prefect global concurrency limit counting GPUs (e.g. gpu-slots); the job occupies "
        "nproc_per_node slots while it runs, so jobs queue rather than share a GPU. Empty: no limit (a CPU host's).",
    )

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @model_validator(mode="after")
    def _multi_node_needs_endpoint(self) -> LaunchSettings:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("nnodes > 1 needs rdzv_endpoint (host:port of the c10d rendezvous)")
        return self


@functools.cache
def local_gpu_count() -> int:
    """NVIDIA GPUs this process may use: `nvidia-smi -L` (no torch: the launcher runs in thin processes), narrowed
    by CUDA_VISIBLE_DEVICES when set; 0 without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    count = 0
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False).stdout
            count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.TimeoutExpired):
            count = 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


__all__ = ["MAX_PROCESSES", "LaunchSettings", "local_gpu_count"]
