"""Scheduled retraining as users run it: the `retrain` flow deployed on a real Prefect server, a real process
worker, MLflow with its model registry on SQLite, real slides added between runs.

Four flow runs over one root, as a weekly schedule would make them:

1. two slides; training crashes after its first checkpoint (no task retry), the flow run fails; the UI's Retry
   resumes the same cycle, and training resumes from the checkpoint. The first model is gated label-free against
   an all-zero backbone (dense score 0, so the decision cannot flip) and becomes @champion;
2. a third slide: a new cycle warm-starts from the champion, trains on all three; the gate is told to promote
   (gate.margin=-1 against the champion, no baseline: 8 iterations can land below chance on one test slide), so
   the champion changes and every slide is re-extracted into the new champion's store,
   the old store is deleted, and retention drops cycle 1's DCP and eval checkpoints but keeps its models;
3. a fourth slide; the gate cannot be met (gate.margin=0.9): not promoted, so only the new slide is extracted,
   into the champion's store;
4. no new slides, one removed from the folder: skipped, with the reason (naming the removed slide), as the run's
   final message.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import by_name, read_json
from tests.prefect_deploy import deploy, flow_logs, retry, trigger, wait_final, worker
from tests.prefect_fixtures import MlflowTracking
from wsidino_dev import faults

__all__ = ["worker"]  # the module's process-worker fixture

REGISTER = "wsidino-retrain-test"
FAST = [
    "length.iterations=8",
    "tile.overrides=[tile_size=64,mpp=1.0,workers=1]",
    "pretrain.checkpointing.period=2",
    "pretrain.evaluation.eval_period_iterations=2",
    "evaluate.probe.bootstrap=20",
    "export.parity_sizes=[32]",
    "export.parity_batches=[2]",
    "extract.progress=false",
    f"register_name={REGISTER}",
]


def zero_backbone(path: Path) -> Path:
    """A vit_test backbone with every weight zero: constant features, chance-level probes (the first gate's
    baseline, so the first decision cannot depend on how 8 iterations went)."""
    import torch

    from dinov3_core.models.released import save_backbone
    from dinov3_core.models.vision_transformer import build_backbone

    model = build_backbone("vit_test")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return save_backbone(model, path)


@pytest.fixture(scope="module")
def retraining(
    worker: subprocess.Popen[str],
    sample_slides: Any,
    mlflow_tracking: MlflowTracking,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """The four flow runs; what each left behind, read right after it."""
    deploy("flows/retrain.py:retrain_flow", "retrain-test")
    base = tmp_path_factory.mktemp("retrain")
    cohort, root = base / "slides", base / "root"
    cohort.mkdir()
    annotations = next(iter(sample_slides.annotations.values())).parent
    baseline = zero_backbone(base / "zero" / "backbone.pth")

    def params(*extra: str, labels: Path | None = annotations) -> dict[str, Any]:
        return {
            "slides": str(cohort),
            "root": str(root),
            "annotations": str(labels) if labels else None,
            "config": "tiny",
            "overrides": [*FAST, f"evaluate.baseline={baseline}", *extra],
            "force": False,
            "launch": {"nproc_per_node": 1, "retries": 0},
            "tracking": {"tracking_uri": mlflow_tracking.uri, "experiment": mlflow_tracking.experiment},
        }

    def add(name: str, as_name: str | None = None) -> None:
        shutil.copy(by_name(sample_slides, name), cohort / (as_name or name))

    def snapshot_of(run: Any) -> dict[str, Any]:
        cycles = sorted((root / "cycles").iterdir())
        return {
            "run": run,
            "cycles": [c.name for c in cycles],
            "record": read_json(cycles[-1] / "cycle.json"),
            "features": read_json(root / "features" / "champion.json"),
            "stores": sorted(p.name for p in (root / "features").glob("*.zarr")),
            "logs": flow_logs(run.id),
        }

    out: dict[str, Any] = {"root": root}
    add("tissue_40x.svs")
    add("tissue_20x.svs")
    first = params("evaluate.gate.label_free=true", labels=None)
    run_id = trigger("retrain/retrain-test", first, env=faults.environment("pretrain@1"))
    out["crashed"] = snapshot_of(wait_final(run_id, timeout=600))
    retry(run_id)
    out["first"] = snapshot_of(wait_final(run_id, timeout=600))
    add("tissue_generic.tiff")
    # 3 slides are too few for the permutation test (2^-3 > 0.05): the point estimate decides (the opt-out)
    promote = ("evaluate.gate.margin=-1", "evaluate.baseline=null", "evaluate.gate.allow_point_estimate=true")
    keep = ("evaluate.gate.margin=0.9",)
    out["second"] = snapshot_of(wait_final(trigger("retrain/retrain-test", params(*promote)), 600))
    add("tissue_20x.svs", "tissue_20x_rescan.svs")
    with (cohort / "tissue_20x_rescan.svs").open("ab") as f:  # a re-scan is another file: byte-identical copies
        f.write(b"\0" * 1024)  # are one slide (the tile stage's duplicate rule); TIFF ignores trailing bytes
    out["third"] = snapshot_of(wait_final(trigger("retrain/retrain-test", params(*keep)), 600))
    (cohort / "tissue_20x_rescan.svs").unlink()
    out["fourth"] = snapshot_of(wait_final(trigger("retrain/retrain-test", params()), 300))
    return out


def training_iterations(run_dir: Path) -> list[int]:
    lines = (run_dir / "training_metrics.json").read_text().splitlines()
    return [json.loads(line)["iteration"] for line in lines if '"iteration"' in line]


def model_version(tracking: MlflowTracking, version: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking.uri).get_model_version(REGISTER, version)


@pytest.mark.timeout(2400)
def test_a_crashed_cycle_resumes_on_retry_and_its_model_becomes_champion(
    retraining: dict[str, Any], mlflow_tracking: MlflowTracking
) -> None:
    crashed, first, root = retraining["crashed"], retraining["first"], retraining["root"]
    assert crashed["run"].state.is_failed(), crashed["run"].state
    assert crashed["record"]["status"] == "failed" and "injected fault" in crashed["logs"]
    # The retry resumed the same cycle (no second cycle directory) and training resumed from its checkpoint.
    assert first["run"].state.is_completed(), first["run"].state
    assert first["cycles"] == crashed["cycles"] == [first["record"]["id"]]
    record = first["record"]
    assert record["status"] == "trained" and record["attempts"] == 2
    iterations = training_iterations(root / "cycles" / record["id"] / "pretrain")
    assert iterations.count(0) == 1 and max(iterations) == 7, iterations
    assert record["warm_start"]["source"] == "scratch"
    assert record["snapshot"]["n_slides"] == 2 and record["trigger"]["train"]
    assert record["decision"]["promoted"] and record["decision"]["champion_after"] == "1"
    assert first["features"]["version"] == "1" and record["features"]["slides_extracted"] == 2
    # The registered version says which cycle and which data made it; the flow run ends with the decision.
    tags = model_version(mlflow_tracking, "1").tags
    assert tags["wsidino.cycle"] == record["id"] and tags["wsidino.snapshot"] == record["snapshot"]["hash"]
    assert "promoted to @champion" in first["run"].state.message
    # The model card beside the model says what it was trained on and how it was judged; the registry shows it.
    card = (root / "cycles" / record["id"] / "model" / "MODEL_CARD.md").read_text()
    assert "- Data: 2 slide(s)" in card and "| pretrain (" in card and "| gram (" in card
    assert "Decision: label-free gate" in card and "Not evaluated yet" not in card
    assert model_version(mlflow_tracking, "1").description.startswith("# Model card: `model.onnx`")


@pytest.mark.timeout(300)
def test_the_next_cycle_warm_starts_from_the_champion_and_the_features_follow_the_decision(
    retraining: dict[str, Any],
) -> None:
    first, second, third, root = retraining["first"], retraining["second"], retraining["third"], retraining["root"]
    one, two, three = first["record"], second["record"], third["record"]
    assert second["run"].state.is_completed(), second["run"].state
    assert two["id"] != one["id"] and two["number"] == 2
    # Warm start from cycle 1's champion, on the old and the new slides.
    assert two["warm_start"] == {
        "unvetted": False,  # the gate promoted cycle 1's model
        "source": "champion",
        "path": str(root / "cycles" / one["id"] / "model" / "backbone.pth"),
        "version": "1",
        "cycle": one["id"],
    }
    pretrain_cfg = (root / "cycles" / two["id"] / "pretrain" / "config.yaml").read_text()
    for slide in ("tissue_40x", "tissue_20x", "tissue_generic"):
        assert f"- {slide}" in pretrain_cfg
    assert two["trigger"]["change"]["new"] == ["tissue_generic"]
    # Promoted: every slide extracted into the new champion's store; the old champion's store replaced.
    assert two["decision"]["promoted"] and two["decision"]["champion_after"] == two["decision"]["candidate_version"]
    assert two["features"]["slides_extracted"] == 3 and two["features"]["scope"].startswith("every slide")
    assert second["stores"] == [Path(second["features"]["store"]).name] and first["stores"] != second["stores"]
    # Retention: cycle 1 (once champion) keeps its models and evaluation, loses its DCP and eval checkpoints.
    cycle1 = root / "cycles" / one["id"]
    deleted = sorted(two["retention"]["deleted"])
    checkpoints = [p for p in deleted if p.endswith("/ckpt")]
    teachers = [p for p in deleted if p.endswith("/teacher_checkpoint.pth")]
    assert checkpoints == [f"cycles/{one['id']}/gram/ckpt", f"cycles/{one['id']}/pretrain/ckpt"]
    assert teachers and sorted(checkpoints + teachers) == deleted
    assert all(p.startswith(f"cycles/{one['id']}/") for p in deleted)
    assert (cycle1 / "model" / "backbone.pth").is_file() and (cycle1 / "model" / "model.onnx").is_file()
    assert (cycle1 / "evaluation" / "evaluation.json").is_file() and (cycle1 / "pretrain" / "eval").is_dir()

    # Cycle 3: not promoted, so the champion stays and only the new slide is extracted, into its store.
    assert third["run"].state.is_completed(), third["run"].state
    assert three["warm_start"]["version"] == two["decision"]["candidate_version"]
    assert not three["decision"]["promoted"] and "not promoted" in third["run"].state.message
    assert three["features"]["store"] == two["features"]["store"] and three["features"]["slides_extracted"] == 1
    assert three["features"]["scope"] == "new slides only (same champion)"
    # The cycle that is champion now (2) is kept whole; the candidate of cycle 3 keeps its models.
    assert (root / "cycles" / two["id"] / "pretrain" / "ckpt").is_dir()
    assert (root / "cycles" / three["id"] / "model" / "model.onnx").is_file()


@pytest.mark.timeout(300)
def test_a_cycle_without_new_slides_is_skipped_with_its_reason(
    retraining: dict[str, Any], mlflow_tracking: MlflowTracking
) -> None:
    from mlflow import MlflowClient

    fourth = retraining["fourth"]
    record = fourth["record"]
    assert fourth["run"].state.is_completed(), fourth["run"].state
    assert record["status"] == "skipped" and not record["trigger"]["train"]
    reason = record["trigger"]["reason"]
    assert "0 new slide(s)" in reason and "1 removed (tissue_20x_rescan)" in reason and "needs ≥ 1 new" in reason
    assert record["snapshot"]["n_slides"] == 3 and record["trigger"]["change"]["removed"] == ["tissue_20x_rescan"]
    assert fourth["run"].state.message.startswith(f"cycle {record['id']} skipped")
    assert set(record["stages"]) == {"tile", "extract"} and record["features"]["slides_extracted"] == 0
    # MLflow: one run per cycle with its decision; stage runs nest under it; the snapshot is its dataset input.
    client = MlflowClient(mlflow_tracking.uri)
    runs = {
        r.data.tags.get("wsidino.cycle"): r
        for r in client.search_runs([mlflow_tracking.experiment_id], "tags.`wsidino.retrain` = 'true'")
    }
    assert set(runs) >= {retraining[k]["record"]["id"] for k in ("first", "second", "third", "fourth")}
    skipped = runs[record["id"]]
    assert skipped.data.tags["wsidino.cycle_status"] == "skipped" and skipped.info.status == "FINISHED"
    trained = runs[retraining["first"]["record"]["id"]]
    assert trained.data.tags["wsidino.promoted"] == "True" and trained.data.tags["wsidino.warm_start"] == "scratch"
    assert trained.inputs.dataset_inputs[0].dataset.digest == retraining["first"]["record"]["snapshot"]["hash"]
    children = client.search_runs(
        [mlflow_tracking.experiment_id], f"tags.`mlflow.parentRunId` = '{trained.info.run_id}'"
    )
    assert {c.data.tags["wsidino.stage"] for c in children} == {
        "tile",
        "pretrain",
        "gram",
        "convert",
        "export",
        "evaluate",
        "extract",
    }
