"""A stage's torchrun job as Kubernetes objects: a headless Service and an Indexed Job of `nnodes` pods, one torchrun
per pod with `nproc_per_node` ranks, the c10d rendezvous on pod 0 (`<name>-0.<name>:29400`).

    manifests = render(job, KubernetesSettings(image="registry.lab/wsidino:gpu", gpus_per_node=8), name="pretrain")
    print(to_yaml(manifests))          # kubectl apply -n wsidino -f -

`python -m tasks.launch_k8s pretrain --config NAME [key=value …] --nodes 2 --nproc-per-node 8 --image …` prints the
manifests of a stage's job (`deploy/kubernetes/pretrain-multinode.yaml` is this output, checked by the tests). The
input is a `TorchrunJob`, what the local and SLURM backends run, so the three describe one launch.

`KubernetesRunner` is the `kubernetes` launch backend of the Prefect tasks, with the SLURM backend's semantics over
`kubectl`: it applies the manifests (a fresh name per submission), streams pod 0's output (rank 0) into the Prefect
log, polls the Job, deletes it (and its Service) when the wait ends any other way than success (a cancelled flow run,
a timeout), and on failure raises the failing rank's error read from torchrun's logs, which the pods write to the
shared volume: the worker must see that volume at the same path (run it in a pod mounting the same claim). Only the
manifests are tested here (no cluster in CI); docs/cluster.md says what was run where.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from dinov3_core.errors import WsidinoError
from dinov3_core.launch import TorchrunFailed, TorchrunJob
from dinov3_core.launch.diagnose import diagnose_failure, new_run_dir

RDZV_PORT = 29400


class KubernetesSettings(BaseModel):
    """The pods of a job: image, GPUs and memory per pod, the shared volume every pod mounts."""

    model_config = ConfigDict(extra="forbid", title="Kubernetes")

    namespace: str = Field("wsidino", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", title="Namespace")
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
    args = [
        f"--nnodes={job.nnodes}",
        f"--nproc-per-node={job.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={name}",
        "--max-restarts=0",
    ]
    if job.log_dir is not None:
        args.append(f"--log-dir={job.log_dir}")
    args += ["-m", job.module, *job.args]
    env = {
        "PYTHONUNBUFFERED": "1",
        "NCCL_DEBUG": "WARN",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        **job.env,
    }
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
        "containers": [
            {
                "name": "torchrun",
                "image": settings.image,
                "workingDir": settings.working_dir,
                "command": ["torchrun"],
                "args": args,
                "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
                "ports": [{"name": "rendezvous", "containerPort": RDZV_PORT}],
                "resources": {
                    "requests": {"cpu": str(settings.cpus_per_node), "memory": settings.memory, **gpus},
                    "limits": {"memory": settings.memory, **gpus},
                },
                "volumeMounts": [
                    {"name": "dshm", "mountPath": "/dev/shm"},
                    {"name": "data", "mountPath": settings.data_path},
                ],
            }
        ],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm}},
            {"name": "data", "persistentVolumeClaim": {"claimName": settings.data_claim}},
        ],
    }
    job_manifest = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "completionMode": "Indexed",  # pod hostnames <name>-0 … -(N-1)
            "completions": job.nnodes,
            "parallelism": job.nnodes,  # every pod at once: the rendezvous waits for all nodes
            "backoffLimit": 0,  # a failed pod fails the job; a rerun resumes from the last checkpoint
            "ttlSecondsAfterFinished": 7 * 24 * 3600,  # kept a week to read, then removed with its pods
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
    from dinov3_core.stages import STAGES, get_stage

    p = argparse.ArgumentParser(prog="python -m tasks.launch_k8s", description=main.__doc__)
    p.add_argument("stage", choices=[s.name for s in STAGES if s.job_module])
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=8)
    p.add_argument("--image", default="wsidino:gpu")
    p.add_argument("--name", help="Service and Job name (default: wsidino-<stage>)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment (repeat)")
    args = p.parse_intermixed_args(argv)
    stage = get_stage(args.stage)
    load_config(stage.schema(), args.config, args.overrides, stage=args.stage)  # fails early
    name = args.name or f"wsidino-{args.stage}"
    # The pods resolve the named config and overrides themselves (configs/ is in the image): nothing is
    # written here, and the manifest reads as the command it runs.
    job = TorchrunJob(
        module=stage.job_module,
        args=["--config", args.config, *args.overrides],
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nodes,
        env=dict(item.split("=", 1) for item in args.env),
    )
    settings = KubernetesSettings(image=args.image, gpus_per_node=args.nproc_per_node)
    sys.stdout.write(to_yaml(render(job, settings, name=name)))
    return 0


class KubectlError(WsidinoError):
    """kubectl is missing or refused the manifests (bad namespace, image, quota): bad input, not retried."""


def kubectl(args: list[str], input_text: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(["kubectl", *args], input=input_text, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise KubectlError(
            "launch.backend=kubernetes but `kubectl` is not on this worker's PATH (with a kubeconfig "
            "or in-cluster credentials): see docs/cluster.md"
        ) from None
    if check and done.returncode != 0:
        raise KubectlError(
            f"kubectl {' '.join(args[:3])} failed: {done.stderr.strip()[:1000]}; check "
            "launch.kubernetes (namespace, image, data_claim, resources)"
        )
    return done


def dns_name(text: str) -> str:
    """A DNS-1123 label (Service and Job names, pod hostnames `<name>-<index>` included)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return name[:50].rstrip("-") or "wsidino"


@dataclass
class KubernetesRunner:
    """Runs a `TorchrunJob` as a Kubernetes Indexed Job and follows it (the `RunHooks.run_job` of that backend)."""

    settings: KubernetesSettings = field(default_factory=KubernetesSettings)
    poll_s: float = 5.0
    submitted: list[str] = field(default_factory=list)

    def __call__(self, job: TorchrunJob, log: Callable[[str], None] = print) -> None:
        log_dir = Path(job.log_dir or Path.cwd() / "torchrun_logs").resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
        job = replace(job, log_dir=log_dir)
        runs_before = {p.name for p in log_dir.iterdir()}
        ns = self.settings.namespace
        name = dns_name(f"wsidino-{job.rdzv_id or job.module.rsplit('.', 1)[-1]}-{uuid.uuid4().hex[:6]}")
        kubectl(["apply", "-n", ns, "-f", "-"], to_yaml(render(job, self.settings, name=name)))
        self.submitted.append(name)
        log(f"kubernetes: created job {ns}/{name} ({job.nnodes} pod(s) × {job.nproc_per_node} process(es))")
        console: list[str] = []
        lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        follower: subprocess.Popen[str] | None = None
        state = "Pending"
        try:
            while True:
                new_state = _job_state(ns, name)
                if new_state != state:
                    log(f"kubernetes: job {name} {new_state.lower()}")
                    state = new_state
                if follower is None and state in ("Running", "Complete", "Failed"):
                    follower = _follow_rank0(ns, name, lines)
                while not lines.empty():
                    line = lines.get()
                    console.append(line)
                    log(line)
                if state in ("Complete", "Failed"):
                    break
                time.sleep(self.poll_s)
        except BaseException:
            kubectl(["delete", "-n", ns, "job,service", name, "--cascade=foreground", "--wait=true"], check=False)
            log(f"kubernetes: job {ns}/{name} deleted")
            raise
        finally:
            if follower is not None:
                follower.terminate()
        time.sleep(1.0)
        while not lines.empty():
            line = lines.get()
            console.append(line)
            log(line)
        kubectl(["delete", "-n", ns, "service", name], check=False)  # the rendezvous name; the Job stays to read
        if state == "Complete":
            return
        run_dir = new_run_dir(log_dir, runs_before)
        root_cause, rank, rank_code = diagnose_failure(run_dir, console, 1)
        raise TorchrunFailed(
            job.module,
            exit_code=1,
            root_cause=f"Kubernetes job {ns}/{name}: {root_cause}",
            log_dir=log_dir,
            rank=rank,
            rank_exit_code=rank_code,
            run_log_dir=run_dir,
        )


def _job_state(ns: str, name: str) -> str:
    """Pending, Running, Complete or Failed, from the Job's status."""
    status = json.loads(kubectl(["get", "job", "-n", ns, name, "-o", "json"]).stdout).get("status", {})
    for condition in status.get("conditions", []):
        if condition.get("status") == "True" and condition.get("type") in ("Complete", "Failed"):
            return str(condition["type"])
    return "Running" if status.get("active") else "Pending"


def _follow_rank0(ns: str, name: str, lines: queue.SimpleQueue[str]) -> subprocess.Popen[str]:
    """`kubectl logs -f` of pod 0 (torchrun's local rank 0 of node 0 is rank 0), line by line into `lines`."""
    selector = f"job-name={name},batch.kubernetes.io/job-completion-index=0"
    proc = subprocess.Popen(
        ["kubectl", "logs", "-n", ns, "-l", selector, "-f", "--tail=-1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            text = line.rstrip("\n")
            lines.put(text.split("]:", 1)[1] if text.startswith("[default") and "]:" in text[:20] else text)

    threading.Thread(target=pump, name=f"kubectl-logs-{name}", daemon=True).start()
    return proc


__all__ = ["KubectlError", "KubernetesRunner", "KubernetesSettings", "dns_name", "kubectl", "render", "to_yaml"]

if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
