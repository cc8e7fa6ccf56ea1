"""`python -m dinov3_core.evaluate.embed_job --config FILE`: one rank of an evaluate embedding job.

    torchrun --standalone --nproc-per-node=8 -m dinov3_core.evaluate.embed_job --config evaluation/embed_jobs/X.json

The evaluate stage starts this (`launch_embedding`, through the one torchrun launcher `dinov3_core.launch`) for
each model whose features of the labelled tiles are not cached yet, when its launch settings ask for more than one
process (`wsidino evaluate --nproc-per-node N`, the Prefect evaluate flow's `launch`, a pipeline's launch). The job
file (`EmbedSpec`, JSON) and the tile indices (.npy) are written into `<evaluation>/embed_jobs/`, the per-rank logs
into `<evaluation>/torchrun_logs/`.

Every rank opens the model on its own device (`cuda:LOCAL_RANK` when there are GPUs; CPU ranks share the cores),
embeds a contiguous share of the indices with extract's reader threads (`features.compute`) and writes its part
atomically; once every rank is done (`Team.gather`), rank 0 concatenates the parts in index order into the cache
file the single-process path writes (atomically, so a file under that name is always complete) and removes the
parts. The stage then finds the cache and goes on in its own process: probes, gate and promotion run once.
Exit codes: 0 done, 2 bad input (message on stderr, no traceback); any other failure raises and `@record` hands it
to torchrun as the failing rank's root cause, which the launcher raises as `TorchrunFailed`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.elastic.multiprocessing.errors import record

from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.evaluate import features as F
from dinov3_core.evaluate.config import EvaluateError
from dinov3_core.evaluate.features import precision_of
from dinov3_core.files import atomic_path, write_text_atomic
from dinov3_core.inference.team import Team, rank_device, rank_main, rank_threads
from dinov3_core.launch import TorchrunJob, run_torchrun

MODULE = "dinov3_core.evaluate.embed_job"
JOBS_DIR, LOGS_DIR = "embed_jobs", "torchrun_logs"  # under the evaluation directory


@dataclass
class EmbedSpec:
    """What every rank embeds: the tiles `indices` (a .npy of global indices) of `store` with `model` (whose file
    must still hash to `model_hash`) into the cache file `output`."""

    store: str
    model: str
    model_hash: str
    indices: str
    output: str
    batch_size: int = 64
    num_threads: int = 0  # 0: this rank's share of the cores
    loader_threads: int = 2
    prefetch_batches: int = 2
    device: str | None = None  # torch backend; None → cuda:LOCAL_RANK when there are GPUs, else cpu
    precision: str = "fp32"
    tokens: str | None = None  # a .npy (N, K) of the patch tokens kept per tile for the dense probe; None: none
    mpp: float | None = None  # the tile store's µm/px level (None: the first)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> EmbedSpec:
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as err:
            raise EvaluateError(f"embed job file {path} cannot be read ({err})") from None


def parts_dir(output: Path) -> Path:
    return output.with_name(f".{output.stem}.parts")


def run_rank(spec: EmbedSpec, team: Any) -> Path | None:
    """This rank's share of the embedding; rank 0 writes `spec.output` once all shares are done (then returns it)."""
    output, indices = Path(spec.output), np.load(spec.indices)
    share = np.array_split(indices, team.world_size)[team.rank]  # contiguous: rank order is index order
    tokens = np.array_split(np.load(spec.tokens), team.world_size)[team.rank] if spec.tokens else None
    part = None
    if len(share):
        threads = rank_threads(spec.num_threads, team)
        if threads:
            torch.set_num_threads(threads)
        device, device_id = rank_device(spec.device, team)
        model = F.open_model(spec.model, threads=threads, device=device, precision=spec.precision, device_id=device_id)
        if model.hash != spec.model_hash:
            raise EvaluateError(
                f"model {spec.model} changed while the evaluation ran (hash {model.hash}, expected "
                f"{spec.model_hash}); rerun the evaluation"
            )
        ds = TileDataset(spec.store, image_format="numpy", mpp=spec.mpp)
        out = F.compute(model, ds, share, spec.batch_size, spec.loader_threads, spec.prefetch_batches, tokens=tokens)
        part = parts_dir(output) / f"part-{team.rank:05d}.npz"
        part.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(part) as tmp:
            np.savez(tmp, **out)
        print(f"embed rank {team.rank}: {len(share)} tiles on {', '.join(model.providers)}", flush=True)
    parts = team.gather(str(part) if part else None)  # every rank done
    if team.is_main:
        loaded = [F.load(Path(p)) for p in parts if p is not None]
        features = {k: np.concatenate([x[k] for x in loaded]) for k in loaded[0]}
        if len(features["cls"]) != len(indices):
            raise RuntimeError(f"embed job: {len(features['cls'])} features for {len(indices)} tiles")
        F.save(output, features)
        shutil.rmtree(parts_dir(output), ignore_errors=True)
    team.barrier()  # the ranks leave the process group together (gloo aborts a rank that leaves a peer behind)
    return output if team.is_main else None


@record
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__)
    parser.add_argument("--config", required=True, help="the embed job file (JSON, written by the evaluate stage)")
    args = parser.parse_args(argv)

    def work(team: Team) -> str | None:
        written = run_rank(EmbedSpec.read(args.config), team)
        return f"embed: {written} on {team.world_size} rank(s)" if written is not None else None

    return rank_main(work)


def launch_embedding(
    cfg: Any,
    launch: Any,
    model: Any,
    output: Path,
    indices: np.ndarray,
    *,
    log: Callable[[str], None] = print,
    hold_resources: Callable[[Any], contextlib.AbstractContextManager[Any]] | None = None,
    run_job: Callable[..., None] | None = None,
    tokens: np.ndarray | None = None,
) -> None:
    """Embed `indices` with `model` (an opened `FeatureModel`) into the cache file `output` as a torchrun job of
    `launch` (`LaunchSettings`) processes; `hold_resources`: the GPU-slot guard entered around it; `run_job`: what
    runs the job (None: `run_torchrun` on this host; the SLURM backend submits it); `tokens`: the patch tokens
    kept per tile for the dense probe (`features.compute`). Raises
    `TorchrunFailed` (the failing rank's error) when a rank fails."""
    out = Path(cfg.output)
    jobs = out / JOBS_DIR
    ids = jobs / f"{output.stem}.indices.npy"
    with atomic_path(ids) as tmp:
        np.save(tmp, np.ascontiguousarray(indices, np.int64))
    token_file = None
    if tokens is not None:
        token_file = jobs / f"{output.stem}.tokens.npy"
        with atomic_path(token_file) as tmp:
            np.save(tmp, np.ascontiguousarray(tokens, np.int64))
    spec = EmbedSpec(
        str(Path(cfg.store).resolve()),
        str(model.path.resolve()),
        model.hash,
        str(ids.resolve()),
        str(output.resolve()),
        cfg.batch_size,
        cfg.num_threads,
        cfg.loader_threads,
        cfg.prefetch_batches,
        cfg.device,
        precision_of(model.path, cfg.precision),
        str(token_file.resolve()) if token_file else None,
        cfg.mpp,
    )
    spec_path = write_text_atomic(jobs / f"{output.stem}.json", json.dumps(asdict(spec), indent=1))
    job = TorchrunJob(
        module=MODULE,
        args=["--config", str(spec_path.resolve())],
        # This node's processes only: the stage runs in one process on one node (its probes and promotion must run
        # once), so a multi-node launch (a pipeline's training) embeds on the GPUs of the node it runs on.
        nproc_per_node=launch.nproc_per_node,
        rdzv_id=f"wsidino-evaluate-{out.name}",
        cuda_visible_devices=launch.cuda_visible_devices,
        log_dir=out / LOGS_DIR,
        timeout_s=launch.timeout_hours * 3600 if launch.timeout_hours else None,
    )
    log(
        f"evaluate: embedding {len(indices)} tiles with {model.path.name}: torchrun {job.nproc_per_node} "
        f"process(es) × {job.nnodes} node(s), logs in {job.log_dir}"
    )
    guard = hold_resources(launch) if hold_resources is not None else contextlib.nullcontext()
    with guard:
        (run_job or run_torchrun)(job, log=log)
    if not output.is_file():
        raise EvaluateError(f"the embedding job of {model.path} ended without writing {output}; see {job.log_dir}")


__all__ = ["MODULE", "EmbedSpec", "launch_embedding", "main", "run_rank"]


if __name__ == "__main__":
    sys.exit(main())
