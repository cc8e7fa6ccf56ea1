"""The pipeline as one plain function: `run_pipeline(cfg, runner)` runs the selected stages in order under one
MLflow run. `wsidino pipeline` and the `pipeline` flow differ only in the runner (`dinov3_core.run.run_stage` in
this process, or the Prefect stage tasks), so they share every rule: the stage manifests (a rerun skips what is
done), the lineage, `start_at` / `force`, and the checks below.

    <workdir>/tiles.zarr          tile store (QC pictures under slides/<id>/)
    <workdir>/pretrain/           pretraining run: ckpt/, eval/ (teacher-only checkpoints), metrics
    <workdir>/gram/               gram-anchoring run (gram_teacher_selection.json names the chosen teacher)
    <workdir>/model/              backbone.pth (released key layout), model.onnx, MODEL_CARD.md
    <workdir>/evaluation/         probes, health, the @champion decision (evaluation.json, evaluation.md)
    <workdir>/features.zarr       per-tile features, slide embeddings (PCA pictures beside it in features/)
    <workdir>/mlflow.db           MLflow runs and the model registry, unless a tracking server is configured

Bad input (no slide, a workdir that cannot be written, weights of another architecture, a key no stage knows)
fails before anything is written; a run whose first stage leaves nothing usable removes the workdir it created.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dinov3_core import tracking
from dinov3_core.config import ConfigError
from dinov3_core.errors import WsidinoError
from dinov3_core.pipeline.config import PipelineConfig, resolve_weights
from dinov3_core.stage_choice import build_stage_config

# (stage, its typed config, the pipeline's MLflow run id, force) → the stage outcome (`StageOutcome.as_dict`)
StageRunner = Callable[[str, Any, str | None, bool], dict[str, Any]]
PIPELINE_TAG = "wsidino.pipeline"
ATTEMPT_TAG = "wsidino.pipeline.attempt"
OUTCOME_KEYS = ("status", "reason", "mlflow_run_id", "summary")
OWNER = "the pipeline (each stage's paths under --workdir)"


def layout(workdir: str | Path) -> dict[str, Path]:
    """Where each stage writes, under the work directory."""
    root = Path(workdir).expanduser().resolve()
    return {
        "tile_store": root / "tiles.zarr",
        "pretrain": root / "pretrain",
        "gram": root / "gram",
        "model_dir": root / "model",
        "backbone": root / "model" / "backbone.pth",
        "onnx": root / "model" / "model.onnx",
        "evaluation": root / "evaluation",
        "features": root / "features.zarr",
    }


def stage_config(cfg: PipelineConfig, stage: str, weights: Path | None = None) -> Any:
    """The stage's typed config: its named config and overrides, with the pipeline's paths on top."""
    p = layout(cfg.workdir)
    paths: dict[str, Any]
    if stage == "tile":
        paths = {"input": cfg.slides, "output": str(p["tile_store"])}
    elif stage == "pretrain":
        paths = {"data.stores": [str(p["tile_store"])], "output_dir": str(p["pretrain"])}
        if weights is not None:
            paths["student.pretrained_weights"] = str(weights)
    elif stage == "gram":
        paths = {"pretrain_dir": str(p["pretrain"]), "output_dir": str(p["gram"])}
    elif stage == "convert":
        trained = p["gram"] if cfg.gram_anchoring else p["pretrain"]
        paths = {"input": str(trained), "output_dir": str(p["model_dir"])}
    elif stage == "export":
        paths = {"weights": str(p["backbone"]), "output": str(p["onnx"])}
    elif stage == "evaluate":
        paths = {"store": str(p["tile_store"]), "candidate": str(p["onnx"]), "output": str(p["evaluation"]),
                 "annotations": cfg.annotations}  # fmt: skip
    elif stage == "extract":
        paths = {"store": str(p["tile_store"]), "model": extraction_model(cfg), "output": str(p["features"])}
    else:
        raise ValueError(f"unknown stage {stage!r}")
    try:
        return build_stage_config(stage, cfg.choice(stage), paths, cfg.tracking, owner=OWNER)
    except ConfigError as err:
        if stage == "pretrain" and "student.pretrained_weights" in str(err):
            raise ConfigError(
                f"pretrain config {cfg.pretrain.config} continues released DINOv3 weights: give --weights FILE "
                "(or a preset such as vitb16 with weights_dir=DIR)"
            ) from None
        raise


def extraction_model(cfg: PipelineConfig) -> str:
    """The champion the evaluation settled on (the candidate when it was promoted or there is no champion yet),
    or the candidate when `extract_model` says so or nothing was evaluated."""
    p = layout(cfg.workdir)
    evaluation = p["evaluation"] / "evaluation.json"
    if cfg.extract_model == "champion" and evaluation.is_file():
        champion = json.loads(evaluation.read_text()).get("champion_model")
        if champion and Path(champion).is_file():
            return str(champion)
    return str(p["onnx"])


@dataclass
class PipelineResult:
    """What a pipeline run did: each stage's outcome, where everything is, one line to say it."""

    summary: dict[str, Any]
    message: str

    def as_dict(self) -> dict[str, Any]:
        return self.summary


def run_pipeline(
    cfg: PipelineConfig,
    runner: StageRunner,
    *,
    attempt_key: str | None = None,
    log: Callable[[str], None] = print,
    tags: Mapping[str, str] | None = None,
) -> PipelineResult:
    """Run the selected stages in order; each is skipped when its manifest shows the same config and inputs.

    Args:
        cfg: The pipeline config (`load_pipeline_config`).
        runner: Runs one stage and returns its outcome (`StageRunner`).
        attempt_key: Same key, same MLflow parent run: a retried Prefect flow run reopens its run.
        log: Where progress lines go.
        tags: Extra tags of the pipeline's MLflow run (the Prefect flow run).

    Raises:
        WsidinoError: Bad input, named before anything is written; `TorchrunFailed`: a training job failed.
    """
    stages = cfg.selected()
    weights = resolve_weights(cfg)
    for stage in stages:  # every key checked against its stage's schema before anything runs
        stage_config(cfg, stage, weights)
    check_inputs(cfg, stages, weights)
    workdir = Path(cfg.workdir).expanduser().resolve()
    created = not workdir.exists()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"workdir {workdir}: cannot create it ({err.strerror}); choose another --workdir") from None
    log(f"pipeline: {' → '.join(stages)} on {cfg.slides} in {workdir}; MLflow {cfg.tracking.uri}")
    outcomes: dict[str, dict[str, Any]] = {}
    try:
        with pipeline_mlflow_run(cfg, tags or {}, attempt_key) as parent:
            for i, stage in enumerate(stages, 1):
                log(f"pipeline: stage {i}/{len(stages)}: {stage}")
                outcomes[stage] = runner(stage, stage_config(cfg, stage, weights), parent, stage in cfg.force)
                if stage == "tile":
                    check_tiled(cfg, outcomes[stage])
            summary = _summary(cfg, outcomes, parent)
            record(cfg, parent, summary)
    except WsidinoError:
        if created and not _kept_anything(outcomes):
            shutil.rmtree(workdir, ignore_errors=True)  # nothing usable was written: leave no half-made workdir
        raise
    return PipelineResult(summary, _message(summary))


def check_inputs(cfg: PipelineConfig, stages: list[str], weights: Path | None) -> None:
    """What can be known to fail before anything is written: the workdir, the slides, the weights' shape."""
    workdir = Path(cfg.workdir).expanduser().resolve()
    existing = next(p for p in (workdir, *workdir.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"workdir {workdir}: {existing} is not a writable directory; choose another --workdir")
    if "tile" in stages:
        from dinov3_core.tiling.discovery import discover_slides

        tile = stage_config(cfg, "tile")
        discover_slides(tile.input, tile.extensions)  # names the folder when it holds no slide
    if weights is not None and "pretrain" in stages:
        check_weights(weights, stage_config(cfg, "pretrain", weights))


def check_weights(weights: Path, pretrain: Any) -> None:
    """The warm-start file must have the architecture the pretrain config trains (its shape, read from the
    file's keys), so a mismatch fails here and not minutes later inside the training job."""
    from dinov3_core.models.arch_inference import infer_backbone_kwargs
    from dinov3_core.models.released import read_backbone_state_dict
    from dinov3_core.models.state_dict_check import ReleasedWeightsError
    from dinov3_core.train.config import structure_mismatch

    if pretrain.student.arch == "auto":
        return
    try:
        name, theirs = infer_backbone_kwargs(read_backbone_state_dict(weights), source=str(weights))
    except ReleasedWeightsError as err:
        raise ConfigError(f"weights: {err}") from None
    said = structure_mismatch(theirs, pretrain)
    if said:
        raise ConfigError(
            f"weights {weights} ({name or 'not a released variant'}) do not fit the pretrain config's "
            f"student.arch={pretrain.student.arch} ({said}, file vs config); choose the --config of that model "
            "size (docs/hardware.md) or set pretrain.student.arch=auto"
        )


def check_tiled(cfg: PipelineConfig, outcome: Mapping[str, Any]) -> None:
    """Stop when no slide could be tiled: every later stage would fail on an empty store."""
    s = outcome.get("summary") or {}
    if outcome.get("status") == "ran" and not (s.get("ok", 0) + s.get("skipped", 0)):
        failed = ", ".join(s.get("failed_slides") or []) or "none"
        raise WsidinoError(
            f"no slide under {cfg.slides} could be tiled (failed: {failed}); the tile log above says why for each "
            "(e.g. no µm/px in the file: set tile.mpp_overrides; not a slide; no tissue)"
        )


def _kept_anything(outcomes: Mapping[str, Mapping[str, Any]]) -> bool:
    for stage, o in outcomes.items():
        s = o.get("summary") or {}
        if stage != "tile" or s.get("ok", 0) + s.get("skipped", 0):
            return True
    return False


@contextlib.contextmanager
def pipeline_mlflow_run(cfg: PipelineConfig, tags: Mapping[str, str], attempt_key: str | None) -> Iterator[str | None]:
    """The pipeline's parent run (None when tracking is off); stage runs nest under it. A retry with the same
    attempt key reopens its run. Ends FINISHED, or FAILED when the block raises."""
    all_tags = {
        **dict(tags),
        PIPELINE_TAG: "true",
        tracking.STAGE_TAG: "pipeline",
        "wsidino.workdir": str(Path(cfg.workdir).expanduser().resolve()),
        "wsidino.stages": ",".join(cfg.selected()),
        **({ATTEMPT_TAG: attempt_key} if attempt_key else {}),
    }
    name = tags.get("prefect.flow_run_name")
    find = f"tags.`{ATTEMPT_TAG}` = '{attempt_key}' and tags.`{PIPELINE_TAG}` = 'true'" if attempt_key else None
    with tracking.parent_run(cfg.tracking, f"pipeline/{name}" if name else "pipeline", all_tags, find=find) as run_id:
        yield run_id


def record(cfg: PipelineConfig, run_id: str | None, summary: Mapping[str, Any]) -> None:
    """The config (flattened, for comparing runs) and each stage's outcome on the pipeline's MLflow run."""
    if run_id is None:
        return
    from mlflow import MlflowClient

    tracking.log_config_params(cfg.tracking, run_id, cfg)
    MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking)).log_dict(
        run_id, dict(summary), "pipeline_summary.json"
    )


def _summary(cfg: PipelineConfig, outcomes: Mapping[str, Mapping[str, Any]], run_id: str | None) -> dict[str, Any]:
    return {
        "workdir": str(Path(cfg.workdir).expanduser().resolve()),
        "paths": {k: str(v) for k, v in layout(cfg.workdir).items()},
        "stages": {s: {k: o.get(k) for k in OUTCOME_KEYS} for s, o in outcomes.items()},
        "mlflow_run_id": run_id,
        "tracking_uri": cfg.tracking.uri,
    }


def _message(summary: Mapping[str, Any]) -> str:
    done = ", ".join(f"{s} {o.get('status')}" for s, o in summary["stages"].items())
    return f"pipeline finished in {summary['workdir']}: {done}"


__all__ = [
    "PipelineResult",
    "StageRunner",
    "check_inputs",
    "check_weights",
    "extraction_model",
    "layout",
    "run_pipeline",
    "stage_config",
]
