"""extract as a torchrun job: real torchrun, gloo, CPU ranks, the 2 sample slides (65 and 57 tiles), the tiny
converted backbone; the plan that splits the work; the Prefect extract flow running a 2-rank job on a real worker."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from dinov3_core.config import load_config
from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.extract.config import ExtractConfig
from dinov3_core.extract.extract import ATTRS_KEY, read_run_record, run_extract
from dinov3_core.extract.plan import committer, plan_work, split_slides
from dinov3_core.launch import TorchrunFailed
from dinov3_core.launch.training import LaunchSettings
from dinov3_core.runner import RunHooks, run_stage
from tests import event_hooks
from tests.prefect_deploy import deploy, flow_logs, trigger, wait_final, worker

__all__ = ["worker"]  # the module's process-worker fixture

# Batches of 8 and zarr chunks of 8 rows: with 3 ranks both slides are cut into ranges on different ranks.
SMALL = {"batch_size": 8, "chunk_rows": 8, "patch_tokens": True, "progress": False}


def cfg(**values: Any) -> ExtractConfig:
    values = {"tracking.enabled": False, **values}
    return load_config(ExtractConfig, "default", {k: str(v) for k, v in values.items()}, stage="extract")


def slides(path: Path) -> dict[str, dict[str, Any]]:
    root = zarr.open_group(str(path), mode="r")["slides"]
    out = {}
    for sid in root.group_keys():
        group = root[sid]
        arrays = {a: np.asarray(group[a][:]) for a in group.array_keys()}
        out[sid] = {"attrs": group.attrs.asdict()[ATTRS_KEY], **arrays}
    return out


@pytest.fixture(scope="module")
def single(stage_extract_store, converted, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The reference: one process, the same settings."""
    out = tmp_path_factory.mktemp("single") / "features.zarr"
    run_extract(cfg(store=stage_extract_store, model=converted, output=out, **SMALL))
    return slides(out)


def assert_same_features(got: dict[str, dict[str, Any]], ref: dict[str, dict[str, Any]], store: Path) -> None:
    """Every slide, every tile exactly once, in the store's row order, with the single process's features."""
    ds = TileDataset(store)
    assert sorted(got) == sorted(ref) == sorted(ds.slide_ids)
    for s, sid in enumerate(ds.slide_ids):
        n = int(ds.tile_counts[s])
        assert got[sid]["attrs"]["complete"] and got[sid]["attrs"]["n_tiles"] == n
        np.testing.assert_array_equal(got[sid]["coords"], ds.slide_coords(s))
        for name in ("cls", "mean_patch", "patch", "slide_embedding"):
            assert got[sid][name].shape == ref[sid][name].shape, (sid, name)
            np.testing.assert_allclose(got[sid][name], ref[sid][name], atol=1e-5, rtol=0, err_msg=f"{sid}/{name}")


# ------------------------------------------------------------------------------------------------- the plan


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_plan_covers_every_row_once_on_chunk_boundaries_and_balances(world: int) -> None:
    counts = {0: 65, 3: 57, 4: 5, 7: 1000}
    plan = plan_work(counts, world, align=8)
    assert plan == plan_work(counts, world, align=8)  # deterministic: every rank may compute it
    assert len(plan) == world
    rows = {s: np.zeros(n, int) for s, n in counts.items()}
    for units in plan:
        for u in units:
            rows[u.slide][u.start : u.stop] += 1
            assert u.whole or u.start % 8 == 0  # a range of a split slide starts on a chunk boundary
    assert all((r == 1).all() for r in rows.values())
    loads = [sum(u.size for u in units) for units in plan]
    if world == 1:
        assert loads == [sum(counts.values())] and all(u.whole for u in plan[0])
    else:  # the large slide is cut, so no rank holds much more than its share
        assert max(loads) <= sum(counts.values()) / world + 8 + 57
        assert set(split_slides(plan)) == {7}
    for s in split_slides(plan):  # the rank that commits a split slide holds its first rows
        assert any(u.slide == s and u.start == 0 for u in plan[committer(plan, s)])


def test_more_ranks_than_work_leaves_idle_ranks() -> None:
    plan = plan_work({0: 3, 1: 2}, 4, align=8)  # nothing to split below one chunk
    assert [len(units) for units in plan] == [1, 1, 0, 0]
    assert plan_work({}, 2, align=8) == [[], []]


def test_which_launches_make_extract_a_job() -> None:
    from dinov3_core.stages import get_stage

    extract = get_stage("extract")
    assert not extract.as_job(None) and not extract.as_job(LaunchSettings())  # one process: no torchrun
    assert extract.as_job(LaunchSettings(nproc_per_node=2))
    assert extract.as_job(LaunchSettings(nnodes=2, rdzv_endpoint="gpu01:29400"))
    assert extract.as_job(LaunchSettings(cuda_visible_devices="3"))  # only a job gets its own GPUs
    assert get_stage("pretrain").as_job(None) and not get_stage("export").as_job(LaunchSettings(nproc_per_node=8))


# -------------------------------------------------------------------------------------- real torchrun jobs


@pytest.mark.timeout(300)
def test_three_ranks_give_the_single_process_features(stage_extract_store, converted, single, tmp_path) -> None:
    """Both slides cut into ranges on different ranks (3 gloo ranks): the same rows as one process, each tile once,
    the manifest and the run record written once after every rank finished."""
    out = tmp_path / "features.zarr"
    c = cfg(store=stage_extract_store, model=converted, output=out, **SMALL)
    seen: list[tuple[int, int]] = []  # the job's progress, summed over the ranks (the Prefect progress artifact)
    outcome = run_stage(
        "extract",
        c,
        launch=LaunchSettings(nproc_per_node=3),
        hooks=RunHooks(log=lambda line: None, progress=lambda *count: seen.append(count)),
    )
    assert outcome.status == "ran" and outcome.manifest.status == "complete"
    n = len(TileDataset(stage_extract_store, image_format="numpy"))
    assert seen and seen[-1] == (n, n), seen
    assert_same_features(slides(out), single, stage_extract_store)
    record = read_run_record(out)
    assert sorted(record["extracted"]) == sorted(single) and record["tiles"] == n
    assert [r["rank"] for r in record["ranks"]] == [0, 1, 2] and sum(r["tiles"] for r in record["ranks"]) == n
    assert min(r["tiles"] for r in record["ranks"]) > 0  # every rank had a share
    assert outcome.manifest.summary["ranks"] == 3 and outcome.manifest.summary["tiles"] == n
    assert not any((out / ".incoming").iterdir())
    assert (out.with_suffix("") / "tissue_20x" / "pca.png").is_file()  # committed by the rank with its first rows

    again = run_stage("extract", c, launch=LaunchSettings(nproc_per_node=2))
    assert again.status == "skipped"  # the manifest: up to date, whatever the world size


@pytest.mark.timeout(300)
def test_a_killed_rank_fails_the_job_and_a_one_process_rerun_completes_the_store(
    stage_extract_store, converted, single, tmp_path, monkeypatch
) -> None:
    out = tmp_path / "features.zarr"
    c = cfg(store=stage_extract_store, model=converted, output=out, **SMALL)
    event_hooks.arm(monkeypatch, "kill_rank_mid_slide", tmp_path / "events")
    with pytest.raises(TorchrunFailed) as failed:
        run_stage("extract", c, launch=LaunchSettings(nproc_per_node=2))
    assert failed.value.rank == 1 and failed.value.rank_exit_code == -9, failed.value
    assert (tmp_path / "events" / "killed").exists()
    manifest = json.loads((out / "stage_manifest.json").read_text())
    assert manifest["status"] == "failed"
    for sid, slide in slides(out).items():  # whatever is under slides/ is whole
        assert slide["attrs"]["complete"] and len(slide["cls"]) == slide["attrs"]["n_tiles"], sid

    monkeypatch.delenv(event_hooks.HOOKS_ENV)
    rerun = run_stage("extract", c)  # one process this time
    assert rerun.status == "ran" and rerun.manifest.status == "complete"
    assert_same_features(slides(out), single, stage_extract_store)
    assert not any((out / ".incoming").iterdir())


def test_the_cli_takes_nproc_per_node_and_bad_input_fails_before_any_rank(stage_extract_store, tmp_path) -> None:
    from tests.helpers import REPO

    wsidino = [str(Path(__import__("sys").executable).with_name("wsidino"))]
    help_text = subprocess.run([*wsidino, "extract", "--help"], capture_output=True, text=True, cwd=REPO).stdout
    assert "--nproc-per-node" in help_text and "extraction processes per node" in help_text
    missing = tmp_path / "no-model.pth"

    def extract(output: Path) -> subprocess.CompletedProcess[str]:
        """`wsidino extract` on 2 processes with a model that does not exist, into `output`."""
        args = ["--store", str(stage_extract_store), "--model", str(missing), "--output", str(output)]
        cmd = [*wsidino, "extract", *args, "--nproc-per-node", "2", "tracking.enabled=false"]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)

    done = extract(tmp_path / "f.zarr")
    assert done.returncode == 2, done.stderr
    assert str(missing) in done.stderr and "Traceback" not in done.stderr
    taken = tmp_path / "notes"  # an output that is not a feature store: refused before a manifest or a rank
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    done = extract(taken)
    assert done.returncode == 2 and "is not a feature store" in done.stderr, done.stderr
    assert sorted(p.name for p in taken.iterdir()) == ["notes.txt"] and not taken.with_suffix(".pictures").exists()


# ----------------------------------------------------------------------------------------- Prefect worker


@pytest.mark.timeout(400)
def test_the_prefect_extract_flow_runs_a_two_rank_job_through_the_worker(
    worker, stage_extract_store, converted, single, mlflow_tracking, tmp_path
) -> None:
    """One slide, two ranks, default chunks: rank 1 has nothing to do and exits cleanly; rank 0 logs into the
    stage's MLflow run."""
    from mlflow import MlflowClient

    deploy("flows/extract.py:extract_flow", "extract-test")
    out = tmp_path / "features.zarr"
    params = {
        "store": str(stage_extract_store),
        "model": str(converted),
        "output": str(out),
        "stage": {"config": None, "overrides": ["slide_ids=[tissue_40x]", "batch_size=8", "patch_tokens=true"]},
        "launch": {"nproc_per_node": 2, "retries": 0},
        "tracking": {"tracking_uri": mlflow_tracking.uri, "experiment": mlflow_tracking.experiment},
    }
    run = wait_final(trigger("extract/extract-test", params), timeout=360)
    assert run.state.is_completed(), (run.state, flow_logs(run.id)[-3000:])
    logs = flow_logs(run.id)
    assert "extract: torchrun 2 process(es)" in logs, logs[-3000:]
    got = slides(out)
    assert sorted(got) == ["tissue_40x"]
    np.testing.assert_allclose(got["tissue_40x"]["cls"], single["tissue_40x"]["cls"], atol=1e-5, rtol=0)
    record = read_run_record(out)
    assert [r["tiles"] for r in record["ranks"]] == [57, 0]  # the idle rank finished cleanly
    manifest = json.loads((out / "stage_manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["summary"]["ranks"] == 2
    mlflow_run = MlflowClient(mlflow_tracking.uri).get_run(manifest["mlflow_run_id"])
    assert mlflow_run.data.metrics["tiles"] == 57 and mlflow_run.data.metrics["ranks"] == 2
    artifacts = [a.path for a in MlflowClient(mlflow_tracking.uri).list_artifacts(mlflow_run.info.run_id)]
    assert "pca" in artifacts and "config" in artifacts, artifacts
