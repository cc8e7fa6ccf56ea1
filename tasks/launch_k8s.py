"""A stage's torchrun job as Kubernetes objects: a headless Service and an Indexed Job of `nnodes` pods, one torchrun
per pod with `nproc_per_node` ranks, the c10d rendezvous on pod 0 (`<name>-0.<name>:29400`).

    manifests = render(job, KubernetesSettings(image="registry.lab/wsidino:gpu", gpus_per_node=8), name="pretrain")
    print(to_yaml(manifests))          # kubectl apply -n wsidino -f -

`python -m tasks.launch_k8s pretrain --config NAME [key=value …] --nodes 2 --nproc-per-node 8 --image …` prints the
manifests of a stage's job (`deploy/kubernetes/pretrain-multinode.yaml` is this output, checked by the tests). The
input is a `TorchrunJob`, what the local and SLURM backends run, so the three describe one launch. Applying and
following them from a Prefect task (the SLURM backend's follow / cancel / failure semantics over the Kubernetes API)
is not built yet: docs/cluster.md says how to apply them by hand.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from dinov3_core.launch import TorchrunJob

RDZV_PORT = 29400


class KubernetesSettings(BaseModel):
    """The pods of a job: image, GPUs and memory per pod, the shared volume every pod mounts."""

    model_config = ConfigDict(extra="forbid", title="Kubernetes")

    image: str = Field("wsidino:gpu", title="Image", description="deploy/docker/Dockerfile.gpu, pushed to a registry.")
    working_dir: str = Field("/opt/wsidino", title="Working directory", description="The checkout in the image.")
    gpus_per_node: int = Field(8, ge=0, le=64, title="GPUs per pod")
    cpus_per_node: int = Field(64, ge=1, title="CPUs per pod")
    memory: str = Field("256Gi", title="Memory request per pod")
    shm: str = Field("64Gi", title="/dev/shm size (NCCL, loader workers)")
    data_claim: str = Field("wsidino-data", title="PVC (ReadWriteMany) mounted at data_path in every pod")
    data_path: str = Field("/data", title="Where the PVC is mounted")
    node_selector: dict[str, str] = Field(default_factory=lambda: {"nvidia.com/gpu.present": "true"})


def render(job: TorchrunJob, settings: KubernetesSettings, *, name: str) -> list[dict[str, Any]]:
    """[Service, Job] for `job` (its env, module and arguments; its log dir on the shared volume)."""
    endpoint = f"{name}-0.{name}:{RDZV_PORT}"
    args = [f"--nnodes={job.nnodes}", f"--nproc-per-node={job.nproc_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={name}", "--max-restarts=0"]  # fmt: skip
    if job.log_dir is not None:
        args.append(f"--log-dir={job.log_dir}")
    args += ["-m", job.module, *job.args]
    env = {"PYTHONUNBUFFERED": "1", "NCCL_DEBUG": "WARN", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
           **job.env}  # fmt: skip
    gpus = {"nvidia.com/gpu": settings.gpus_per_node} if settings.gpus_per_node else {}
    labels = {"app": name}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "clusterIP": "None",  # headless: a DNS record per pod
            "publishNotReadyAddresses": True,  # resolvable before readiness (no probe)
            "selector": {"job-name": name},
            "ports": [{"name": "rendezvous", "port": RDZV_PORT}],
        },
    }
    pod = {
        "subdomain": name,  # = the Service: <pod hostname>.<name> resolves
        "restartPolicy": "Never",
        "nodeSelector": dict(settings.node_selector),
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [{
            "name": "torchrun",
            "image": settings.image,
            "workingDir": settings.working_dir,
            "command": ["torchrun"],
            "args": args,
            "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
            "ports": [{"name": "rendezvous", "containerPort": RDZV_PORT}],
            "resources": {"requests": {"cpu": str(settings.cpus_per_node), "memory": settings.memory, **gpus},
                          "limits": {"memory": settings.memory, **gpus}},
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                             {"name": "data", "mountPath": settings.data_path}],
        }],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm}},
                    {"name": "data", "persistentVolumeClaim": {"claimName": settings.data_claim}}],
    }  # fmt: skip
    job_manifest = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "completionMode": "Indexed",  # pod hostnames <name>-0 … -(N-1)
            "completions": job.nnodes,
            "parallelism": job.nnodes,  # every pod at once: the rendezvous waits for all nodes
            "backoffLimit": 0,  # a failed pod fails the job; a rerun resumes from the last checkpoint
            "template": {"metadata": {"labels": dict(labels)}, "spec": pod},  # a copy: no YAML anchors
        },
    }
    return [service, job_manifest]


def to_yaml(manifests: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(manifests, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    """`python -m tasks.launch_k8s STAGE --config FILE [key=value …] [--nodes N --nproc-per-node P --image I]`:
    print the Service and Indexed Job of a stage's torchrun job (kubectl apply -f -)."""
    import argparse

    from dinov3_core.config import load_config
    from dinov3_core.launch.training import JOB_MODULES
    from dinov3_core.stage_specs import STAGE_SPECS

    p = argparse.ArgumentParser(prog="python -m tasks.launch_k8s", description=main.__doc__)
    p.add_argument("stage", choices=["pretrain", "gram", "extract"])
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=8)
    p.add_argument("--image", default="wsidino:gpu")
    p.add_argument("--name", help="Service and Job name (default: wsidino-<stage>)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment (repeat)")
    args = p.parse_intermixed_args(argv)
    load_config(STAGE_SPECS[args.stage].schema(), args.config, args.overrides, stage=args.stage)  # fails early
    name = args.name or f"wsidino-{args.stage}"
    # The pods resolve the named config and overrides themselves (configs/ is in the image): nothing is written
    # here, and the manifest reads as the command it runs.
    job = TorchrunJob(module=JOB_MODULES[args.stage], args=["--config", args.config, *args.overrides],
                      nproc_per_node=args.nproc_per_node, nnodes=args.nodes,
                      env=dict(item.split("=", 1) for item in args.env))  # fmt: skip
    settings = KubernetesSettings(image=args.image, gpus_per_node=args.nproc_per_node)
    sys.stdout.write(to_yaml(render(job, settings, name=name)))
    return 0


__all__ = ["KubernetesSettings", "render", "to_yaml"]

if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
