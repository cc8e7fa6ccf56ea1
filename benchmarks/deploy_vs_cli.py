"""Pretraining through the Prefect deployment vs the CLI: the same config on the same store, img/s side by side.

    python benchmarks/deploy_vs_cli.py --output bench-output                   # 2 runs each, 40 iterations
    python benchmarks/deploy_vs_cli.py --output bench-output --pairs 3 --iterations 60
    python benchmarks/deploy_vs_cli.py --output bench-output --quick       # 20 iterations a run

On a tile store of the test preset's sample slides (224 px tiles, `wsidino_dev.sample_slides`), the `pretrain`
stage with the `cpu` recipe runs `--iterations` iterations (`train.stop_at`; `train.log_period=5` so that there are
enough metrics lines to take a median of), MLflow on a local SQLite file, a fresh run directory per run:

* **CLI**: ``python -m dinov3_core.cli pretrain --config cpu --store … --output-dir … key=value…`` in a subprocess,
  what the ``wsidino`` console script runs (``dinov3_core.cli:run``);
* **deployment**: the real ``pretrain/pretrain`` deployment of deploy/prefect.yaml (registered with ``prefect deploy``
  on its pool ``wsidino-gpu``, the pool's job variables included), served by a local Prefect server with its own
  ``PREFECT_HOME`` and a real process worker (`wsidino_dev.serve`), triggered as the UI's Run does, with the
  deployment's own launch parameters except ``nproc_per_node=1`` (one rank, as on the CLI) and no retries.

Runs alternate CLI, deployment, CLI, deployment, … (``--pairs`` of each) so that a box whose load changes meets both
alike. img/s is the median of ``images_per_s`` over the run's ``training_metrics.json`` lines after the first two
(iteration 0 alone, then iterations 1-4: allocator and cache warm-up). While a run trains, its processes are sampled
once a second: the rank's ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``, its OS threads, CPU affinity and niceness, the
CPU seconds of the launching process (the CLI process, or the flow-run process) and, for the deployment, of the
worker and the Prefect server beside it. ``torch.get_num_threads()`` is what the rank's log line says (``on cpu (N
torch threads)``, `dinov3_core.train.trainer_setup.describe_start`).

Output: a markdown table on stdout and ``<output>/deploy_vs_cli.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from train_step import make_store  # the sibling script (its dir is sys.path[0]): 224 px tiles of the test preset

ROOT = Path(__file__).resolve().parents[1]
POOL = "wsidino-gpu"  # the pool deploy/prefect.yaml puts `pretrain` on
DEPLOYMENT = "pretrain/pretrain"
LOG_PERIOD = 5
SKIP_LINES = 2  # iteration 0 alone, then 1..4
# What would point a run at another server, profile or MLflow run than this benchmark's own.
CLEARED = (
    "PREFECT_API_URL",
    "PREFECT_API_KEY",
    "PREFECT_PROFILE",
    "PREFECT_PROFILES_PATH",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_RUN_ID",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_EXPERIMENT_ID",
    "WSIDINO_MLFLOW_PARENT_RUN_ID",
)
THREADS_LINE = re.compile(r" on cpu \((\d+) torch threads?\)")


class Sampler:
    """Once a second while a run trains: its rank, torchrun, the launching process and the given others."""

    def __init__(self, marker: str, others: dict[str, int]) -> None:
        self.marker, self.others = marker, others
        self.rank: dict[str, Any] = {}
        self.cpu_s: dict[str, float] = {}
        self.start_cpu: dict[str, float] = {}
        self.nproc: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        for name, pid in self.others.items():
            self.start_cpu[name] = self._cpu(pid) or 0.0
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _cpu(pid: int) -> float | None:
        try:
            t = psutil.Process(pid).cpu_times()
            return t.user + t.system
        except psutil.Error:
            return None

    def _run(self) -> None:
        launcher: int | None = None
        while not self._stop.wait(1.0):
            for proc in psutil.process_iter(["cmdline", "ppid"]):
                cmd = proc.info["cmdline"] or []
                if not any(self.marker in part for part in cmd):
                    continue
                try:
                    if "torch.distributed.run" in cmd:
                        launcher = proc.info["ppid"]
                        nproc = [c for c in cmd if c.startswith("--nproc-per-node=")]
                        self.nproc = int(nproc[0].split("=")[1]) if nproc else None
                    elif "dinov3_core.train" in cmd:
                        env = proc.environ()
                        self.rank = {
                            "pid": proc.pid,
                            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS"),
                            "MKL_NUM_THREADS": env.get("MKL_NUM_THREADS"),
                            "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": env.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING"),
                            "os_threads": max(proc.num_threads(), self.rank.get("os_threads", 0)),
                            "cpu_affinity": len(proc.cpu_affinity()),
                            "nice": proc.nice(),
                        }
                        cpu = self._cpu(proc.pid)
                        if cpu is not None:
                            self.cpu_s["rank"] = cpu
                except psutil.Error:
                    continue
            if launcher is not None:
                cpu = self._cpu(launcher)
                if cpu is not None:
                    self.cpu_s["launcher"] = cpu
            for name, pid in self.others.items():
                cpu = self._cpu(pid)
                if cpu is not None:
                    self.cpu_s[name] = cpu - self.start_cpu[name]


def throughput(run_dir: Path) -> tuple[float, int, list[float]]:
    """Median images/s of the metrics lines after the first `SKIP_LINES`, the last iteration, and those values."""
    records = [json.loads(line) for line in (run_dir / "training_metrics.json").read_text().splitlines() if line]
    steps = [r for r in records if "event" not in r]
    values = [float(r["images_per_s"]) for r in steps[SKIP_LINES:]]
    return statistics.median(values), int(steps[-1]["iteration"]), values


def torch_threads(run_dir: Path) -> int | None:
    log = run_dir / "logs" / "log.txt"
    found = THREADS_LINE.search(log.read_text()) if log.is_file() else None
    return int(found.group(1)) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--pairs", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--iterations", type=int, default=40, help="train.stop_at")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    parser.add_argument("--quick", action="store_true", help="20 iterations a run (make bench --quick)")
    args = parser.parse_args()
    if args.quick:
        args.iterations = min(args.iterations, 20)
    out = Path(args.output).resolve() / "deploy_vs_cli"
    shutil.rmtree(out / "runs", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)

    # Every child (server, worker, `prefect deploy`, flow runs, torchrun ranks, the CLI) imports this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(ROOT))
    for name in CLEARED:
        os.environ.pop(name, None)
    serve_dir = out / "serve"
    shutil.rmtree(serve_dir, ignore_errors=True)
    os.environ["PREFECT_HOME"] = str(serve_dir / "prefect-home")
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"

    from wsidino_dev.serve import (
        REPO_ROOT,
        child_env,
        ensure_gpu_slots,
        ensure_work_pools,
        prefect_cli,
        start_prefect_server,
        start_worker,
        stop_all,
    )

    assert REPO_ROOT == ROOT, f"wsidino_dev imported from {REPO_ROOT}, not this checkout {ROOT}"
    store = make_store(out / "work")
    tracking_uri = f"sqlite:///{out / 'work' / 'mlflow.db'}"
    overrides = [f"train.stop_at={args.iterations}", f"train.log_period={LOG_PERIOD}"]

    print("starting a Prefect server and a process worker …", flush=True)
    from wsidino_dev.ports import free_port

    server = start_prefect_server(serve_dir, port=free_port())
    api = server.extra["api_url"]
    os.environ["PREFECT_API_URL"] = api
    children = [server]
    rows: list[dict[str, Any]] = []
    try:
        ensure_work_pools(api, [POOL])
        ensure_gpu_slots(api)  # the deployment's launch holds slots of it
        deploy_log = serve_dir / "logs" / "deploy.log"
        with deploy_log.open("ab") as log:
            cmd = prefect_cli("--no-prompt", "deploy", "--prefect-file", "deploy/prefect.yaml", "--name", "pretrain")
            subprocess.run(
                cmd,
                cwd=ROOT,
                env=child_env(serve_dir, api),
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=300,
            )
        worker = start_worker(api, serve_dir, None, pool=POOL)
        children.append(worker)

        from prefect.client.orchestration import get_client
        from prefect.deployments import run_deployment

        with get_client(sync_client=True) as client:
            defaults = client.read_deployment_by_name(DEPLOYMENT).parameters["params"]

        def cli(run_dir: Path) -> dict[str, Any]:
            cmd = [
                sys.executable,
                "-m",
                "dinov3_core.cli",
                "pretrain",
                "--config",
                "cpu",
                "--store",
                str(store),
                "--output-dir",
                str(run_dir),
                *overrides,
                f"tracking.uri={tracking_uri}",
                f"tracking.experiment={defaults['tracking']['experiment']}",
            ]
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
            log = run_dir.parent / "cli.log"
            with log.open("w") as f:
                code = subprocess.run(
                    cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout, check=False
                ).returncode
            return {"state": "exit 0" if code == 0 else f"exit {code} ({log})"}

        def deployment(run_dir: Path) -> dict[str, Any]:
            params = {
                **defaults,
                "stores": [str(store)],
                "output_dir": str(run_dir),
                "stage": {"config": "cpu", "overrides": overrides},
                "launch": {**defaults["launch"], "nproc_per_node": 1, "retries": 0},
                "tracking": {**defaults["tracking"], "tracking_uri": tracking_uri},
            }
            params.pop("pretrained_weights", None)  # the cpu recipe's: none (random initialisation)
            run = run_deployment(DEPLOYMENT, parameters={"params": params}, timeout=0, as_subflow=False)
            deadline = time.monotonic() + args.timeout
            with get_client(sync_client=True) as client:
                while True:
                    state = client.read_flow_run(run.id).state
                    if state is not None and state.is_final():
                        return {"state": state.name, "flow_run": str(run.id)}
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"flow run {run.id} still {state.name if state else None}")
                    time.sleep(0.5)

        others = {"worker": worker.pid, "prefect server": server.pid}
        for i in range(args.pairs):
            for path, launch in (("CLI", cli), ("deployment", deployment)):
                run_dir = out / "runs" / f"{i}-{path}" / "pretrain"
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                print(f"  run {i + 1}/{args.pairs}: {path} …", flush=True)
                start = time.perf_counter()
                with Sampler(str(run_dir), others if path == "deployment" else {}) as sampler:
                    outcome = launch(run_dir)
                wall = time.perf_counter() - start
                img_s, last, values = throughput(run_dir)
                rows.append(
                    {
                        "path": path,
                        "pair": i + 1,
                        **outcome,
                        "img_s": img_s,
                        "img_s_lines": values,
                        "last_iteration": last,
                        "wall_s": wall,
                        "nproc_per_node": sampler.nproc,
                        "torch_threads": torch_threads(run_dir),
                        **{f"rank_{k}": v for k, v in sampler.rank.items()},
                        "cpu_s": sampler.cpu_s,
                        "load_avg_1m": os.getloadavg()[0],
                    }
                )
                print(f"    {img_s:.1f} img/s, {wall:.0f} s, {outcome['state']}", flush=True)
    finally:
        stop_all(children)

    print(table(rows, args.iterations))
    (out / "deploy_vs_cli.json").write_text(json.dumps(rows, indent=2))


def table(rows: list[dict[str, Any]], iterations: int) -> str:
    cli = statistics.median(r["img_s"] for r in rows if r["path"] == "CLI")
    dep = statistics.median(r["img_s"] for r in rows if r["path"] == "deployment")
    lines = [
        f"cpu recipe, {iterations} iterations, {os.cpu_count()} CPUs; img/s: median of the metrics lines after the "
        "first two",
        "",
        "| # | path | img/s | wall s | nproc | OMP_NUM_THREADS | torch threads | rank OS threads | rank CPU s | "
        "launcher CPU s | worker + server CPU s | load (1 min) |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cpu = r["cpu_s"]
        side = cpu.get("worker", 0.0) + cpu.get("prefect server", 0.0) if r["path"] == "deployment" else None
        lines.append(
            f"| {r['pair']} | {r['path']} | {r['img_s']:.1f} | {r['wall_s']:.0f} | {r['nproc_per_node']} | "
            f"{r.get('rank_OMP_NUM_THREADS') or 'unset'} | {r['torch_threads']} | {r.get('rank_os_threads')} | "
            f"{cpu.get('rank', 0):.0f} | {cpu.get('launcher', 0):.1f} | {'–' if side is None else f'{side:.1f}'} | "
            f"{r['load_avg_1m']:.1f} |"
        )
    lines += ["", f"median img/s: CLI {cli:.1f}, deployment {dep:.1f}; deployment / CLI = {dep / cli:.2f}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
