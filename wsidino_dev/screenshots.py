"""Screenshots of the Prefect UI for the docs: the CPU pipeline deployment's run form and a finished run's page.

    python -m wsidino_dev screenshots                 # writes docs/images/prefect-pipeline-form.png, prefect-run.png
    python -m wsidino_dev screenshots --form-only     # the form alone (seconds, not minutes)

In a temporary serve directory it starts what `make serve` starts for a CPU box (a Prefect server with its UI, the
`wsidino-cpu` pool's deployments pointed at sample slides, a process worker; no MLflow server: the run logs into
its work directory's mlflow.db), runs `pipeline/pipeline` to completion, and has headless Chromium (Debian's
`chromium`, `make browser`) render both pages: the UI's default (V2) pages, under /v2. The run is the whole chain
with its training cut short (`SHORT_RUN`: the tiny configs, 4 iterations, small tiles; a few minutes on 2 cores;
`--full` runs the deployment's own parameters, the `cpu` recipe: 1000 iterations, an hour on a busy 2-core box).
The PNGs are reduced to a 256-colour palette, which keeps a UI page (flat colours, text) under 300 KB. Everything
it started is stopped at the end.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from wsidino_dev.serve.children import REPO_ROOT, Child, ServeError, stop_all, wait_exit
from wsidino_dev.serve.deployments import (
    CPU_POOL,
    DEMO_DEPLOYMENT,
    DEMO_FLOW,
    demo_pipeline_params,
    ensure_work_pools,
    register_deployments,
)
from wsidino_dev.serve.servers import start_prefect_server, start_sample_slides, start_worker, wait_prefect_server
from wsidino_dev.short_run import SHORT_RUN

OUT_DIR = REPO_ROOT / "docs" / "images"
FORM_PNG = "prefect-pipeline-form.png"
RUN_PNG = "prefect-run.png"


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise ServeError("needs Debian's chromium on PATH (make browser)")
    return found


def screenshot(url: str, out: Path, size: tuple[int, int], budget_ms: int = 30_000) -> Path:
    """`url` as headless Chromium renders it once the page's scripts have had `budget_ms` of virtual time (the UI
    is a single-page app: without it the shot is an empty shell), palette-reduced to stay small."""
    from PIL import Image

    out.parent.mkdir(parents=True, exist_ok=True)
    raw = out.with_suffix(".raw.png")
    command = [
        chromium(),
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size={size[0]},{size[1]}",
        f"--virtual-time-budget={budget_ms}",
        f"--screenshot={raw}",
        url,
    ]
    subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    with Image.open(raw) as image:
        image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
    raw.unlink()
    return out


def wait_final(api_url: str, flow_run_id: object, timeout: float) -> str:
    """The final state's name of a flow run, polled until it has one."""
    from prefect.client.orchestration import SyncPrefectClient

    deadline = time.monotonic() + timeout
    with SyncPrefectClient(api_url) as client:
        while time.monotonic() < deadline:
            state = client.read_flow_run(flow_run_id).state  # type: ignore[arg-type]
            if state is not None and state.is_final():
                return state.name
            time.sleep(2.0)
    raise ServeError(f"flow run {flow_run_id} did not finish within {timeout:.0f} s")


def take(out_dir: Path, serve_dir: Path, port: int, form_only: bool, full: bool, run_timeout: float) -> list[Path]:
    """Start the servers, register, shoot the form, run the pipeline, shoot its page; stop everything."""
    from prefect.client.orchestration import SyncPrefectClient

    children: list[Child] = []
    try:
        prefect = start_prefect_server(serve_dir, port, wait=False)
        children.append(prefect)
        slides = start_sample_slides(serve_dir, "test")
        if slides is not None:
            children.append(slides)
            wait_exit(slides)
            children.remove(slides)
        wait_prefect_server(prefect)
        api = prefect.extra["api_url"]
        ensure_work_pools(api, (CPU_POOL,))
        params = demo_pipeline_params(serve_dir)
        register_deployments(api, serve_dir, demo_params=params, pools=(CPU_POOL,))
        with SyncPrefectClient(api) as client:
            deployment = client.read_deployment_by_name(f"{DEMO_FLOW}/{DEMO_DEPLOYMENT}")
        ui = f"{prefect.url}/v2"  # a deep link without /v2 is served by the V1 UI
        shots = [screenshot(f"{ui}/deployments/deployment/{deployment.id}/run", out_dir / FORM_PNG, (1280, 2300))]
        if form_only:
            return shots
        children.append(start_worker(api, serve_dir, None, CPU_POOL))
        if not full:
            params = {**params, "overrides": [*params["overrides"], *SHORT_RUN]}
        with SyncPrefectClient(api) as client:
            run = client.create_flow_run_from_deployment(deployment.id, parameters={"params": params})
        final = wait_final(api, run.id, run_timeout)
        if final != "Completed":
            raise ServeError(f"the pipeline run ended {final}; logs under {serve_dir / 'logs'}")
        time.sleep(5.0)  # the run's last log lines reach the API in batches, after it has finished
        shots.append(screenshot(f"{ui}/runs/flow-run/{run.id}", out_dir / RUN_PNG, (1400, 1000)))
        return shots
    finally:
        stop_all(children)


def build_parser(prog: str = "python -m wsidino_dev.screenshots", add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], add_help=add_help)
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="where the PNGs go (default docs/images)")
    parser.add_argument("--serve-dir", type=Path, default=None, help="state directory (default: a temporary one)")
    parser.add_argument("--prefect-port", type=int, default=4290, help="the Prefect server's port (default 4290)")
    parser.add_argument("--form-only", action="store_true", help="only the run form: no pipeline run")
    parser.add_argument("--full", action="store_true", help="run the cpu recipe as deployed, not the short run")
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="seconds the pipeline run may take")
    return parser


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="wsidino-screenshots-") as tmp:
        serve_dir = (args.serve_dir or Path(tmp)).resolve()
        try:
            for path in take(
                args.out.resolve(), serve_dir, args.prefect_port, args.form_only, args.full, args.run_timeout
            ):
                print(f"{path}  ({path.stat().st_size // 1024} KB)")
        except (ServeError, subprocess.CalledProcessError) as err:
            print(f"screenshots: {err}", file=sys.stderr)
            return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
