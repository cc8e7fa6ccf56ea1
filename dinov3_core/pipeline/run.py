"""The pipeline as one plain function: `run_pipeline(cfg, runner)` runs the selected stages in order under one
MLflow run, in one work directory. `wsidino pipeline` and the `pipeline` flow differ only in the runner
(`dinov3_core.runner.run_stage` in this process, or the Prefect stage task), so they share every rule: the stage
manifests (a rerun skips what is done), the lineage, `start_at` / `force`, and the checks below.

    <workdir>/tiles.zarr          tile store (QC pictures under slides/<id>/)
    <workdir>/pretrain/           pretraining run: ckpt/, eval/ (teacher-only checkpoints), metrics
    <workdir>/gram/               gram-anchoring run (gram_teacher_selection.json names the chosen teacher)
    <workdir>/model/              backbone.pth (released key layout), model.onnx, MODEL_CARD.md
    <workdir>/evaluation/         probes, health, the @champion decision (evaluation.json, evaluation.md)
    <workdir>/features.zarr       per-tile features, slide embeddings (PCA pictures beside it in features/)
    <workdir>/mlflow.db           MLflow runs and the model registry, unless a tracking server is configured

Each stage's output goes where its `Stage.place` says. Bad input (no slide, a workdir that cannot be written,
weights of another architecture, a key no stage knows, a batch larger than the tile store) fails before anything is
written, all problems at once, and the checks of the stages still to come run again after each stage that ran (once
the tiles exist, the batch is checked against them); a run whose first stage leaves nothing usable removes the
workdir it created.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dinov3_core import manifest as mf
from dinov3_core import tracking
from dinov3_core.chain import StageRunner, chain_config, chain_paths, check_before_work, check_duration
from dinov3_core.config import ConfigError
from dinov3_core.errors import WsidinoError
from dinov3_core.pipeline.config import PipelineConfig, resolve_weights
from dinov3_core.runner import StageOutcome
from dinov3_core.stages import ChainPaths, Stage, get_stage

PIPELINE_TAG = "wsidino.pipeline"
ATTEMPT_TAG = "wsidino.pipeline.attempt"
OWNER = "the pipeline (each stage's paths under --workdir)"
CHAIN_KEYS = {"pretrain.student.pretrained_weights": "weights"}  # what the user typed for what the pipeline sets
CHAIN_HINTS = {
    "pretrain.student.pretrained_weights": "it continues released DINOv3 weights: give --weights FILE (or a preset "
    "such as vitb16 with weights_dir=DIR)"
}


def layout(cfg: PipelineConfig, weights: Path | None = None, extract_model: str | None = None) -> ChainPaths:
    """Where each stage reads and writes: everything under the work directory (`Stage.place`)."""
    root = Path(cfg.workdir).expanduser().resolve()
    decided = {"weights": str(weights) if weights is not None else None, "extract_model": extract_model}
    return chain_paths(cfg, root, root, **decided)


def stage_config(
    cfg: PipelineConfig, stage: Stage[Any] | str, weights: Path | None = None, extract_model: str | None = None
) -> Any:
    """The stage's typed config: its named config and overrides, with the pipeline's paths on top."""
    stage = get_stage(stage)
    paths = layout(cfg, weights, extract_model)
    try:
        return chain_config(stage, cfg.choice(stage.name), paths, cfg.tracking, owner=OWNER)
    except ConfigError as err:
        missing = [
            k for k, user in CHAIN_KEYS.items() if k.startswith(f"{stage.name}.") and k.split(".", 1)[1] in str(err)
        ]
        if missing:
            raise ConfigError(
                f"{stage.name} config {cfg.choice(stage.name).config} needs {CHAIN_KEYS[missing[0]]}: "
                f"{CHAIN_HINTS[missing[0]]}"
            ) from None
        raise


def extraction_model(cfg: PipelineConfig, outcomes: Mapping[str, StageOutcome[Any]]) -> str | None:
    """The model extract uses: the champion the evaluation settled on (the candidate when it was promoted or there
    is no champion yet); None (this run's exported model) when `extract_model=candidate` or nothing was evaluated.
    The evaluation is this run's, else the one the work directory's evaluate manifest records (`--from extract`)."""
    if cfg.extract_model != "champion":
        return None
    evaluate = get_stage("evaluate")
    if "evaluate" in outcomes:
        evaluation = outcomes["evaluate"].summary
    else:
        try:
            found = mf.read_manifest(evaluate.manifest_path(stage_config(cfg, evaluate)))
        except (ConfigError, mf.ManifestError):  # not evaluated in a way this run can read: extract the candidate
            return None
        if found is None or found.status != "complete":
            return None
        evaluation = evaluate.summary(found.summary)
    champion = evaluation.champion_model
    return champion if champion and Path(champion).is_file() else None


@dataclass
class PipelineResult:
    """What a pipeline run did: each stage's outcome, where everything is, one line to say it."""

    workdir: Path
    paths: ChainPaths
    outcomes: dict[str, StageOutcome[Any]]
    mlflow_run_id: str | None
    tracking_uri: str | None
    message: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: what the `pipeline` flow returns and its summary artifact shows."""
        return {
            "workdir": str(self.workdir),
            "paths": {k: str(v) for k, v in self.paths.named().items()},
            "stages": {
                s: {
                    "status": o.status,
                    "reason": o.reason,
                    "mlflow_run_id": o.mlflow_run_id,
                    "summary": o.summary.to_json(),
                }
                for s, o in self.outcomes.items()
            },
            "mlflow_run_id": self.mlflow_run_id,
            "tracking_uri": self.tracking_uri,
        }


def run_pipeline(
    cfg: PipelineConfig,
    runner: StageRunner,
    *,
    attempt_key: str | None = None,
    log: Callable[[str], None] = print,
    tags: Mapping[str, str] | None = None,
    world_size: int = 1,
) -> PipelineResult:
    """Run the selected stages in order; each is skipped when its manifest shows the same config and inputs.

    Args:
        cfg: The pipeline config (`load_pipeline_config`).
        runner: Runs one stage and returns its outcome (`StageRunner`).
        attempt_key: Same key, same MLflow parent run: a retried Prefect flow run reopens its run.
        log: Where progress lines go.
        tags: Extra tags of the pipeline's MLflow run (the Prefect flow run).
        world_size: Processes of each training job (the runner's launch), for the batch checks.

    Raises:
        WsidinoError: Bad input, named before anything is written; `TorchrunFailed`: a training job failed.
    """
    stages = [get_stage(s) for s in cfg.selected()]
    weights = resolve_weights(cfg)
    configs = {s.name: stage_config(cfg, s, weights) for s in stages}  # every key checked against its schema
    check_inputs(cfg, configs)
    world = world_size
    tiles = layout(cfg).output("tile")  # the tile store the training stages read
    # A store tiled before: its tiles count now; the warm-start file is opened and its keys read; the annotations
    # are matched to the slides and checked against them.
    tiling = configs.get("tile") or stage_config(cfg, "tile")
    check_before_work(configs, tiles, world, chain_keys=CHAIN_KEYS, tiling=tiling, log=log)
    for key, user_key in CHAIN_KEYS.items():  # what the user gave a stage this run leaves out (--weights, --to tile)
        name = key.partition(".")[0]
        if name not in configs and getattr(cfg, user_key):
            check_before_work({name: stage_config(cfg, name, weights)}, None, world, chain_keys=CHAIN_KEYS, only={key})
    check_duration(configs, world, yes=cfg.yes, log=log)
    workdir = Path(cfg.workdir).expanduser().resolve()
    try:  # created by this run or not, decided by the one mkdir that wins (two runs may start at once)
        workdir.parent.mkdir(parents=True, exist_ok=True)
        workdir.mkdir()
        created = True
    except FileExistsError:
        created = False
    except OSError as err:
        raise ConfigError(f"workdir {workdir}: cannot create it ({err.strerror}); choose another --workdir") from None
    log(f"pipeline: {' → '.join(s.name for s in stages)} on {cfg.slides} in {workdir}; MLflow {cfg.tracking.uri}")
    outcomes: dict[str, StageOutcome[Any]] = {}
    try:
        with pipeline_mlflow_run(cfg, tags or {}, attempt_key) as parent:
            for i, stage in enumerate(stages, 1):
                log(f"pipeline: stage {i}/{len(stages)}: {stage.name}")
                model = extraction_model(cfg, outcomes)
                outcome = runner(stage, stage_config(cfg, stage, weights, model), parent, stage.name in cfg.force)
                outcomes[stage.name] = outcome
                unusable = outcome.summary.unusable() if outcome.status == "ran" else None
                if unusable:  # every later stage would fail on it
                    raise WsidinoError(f"{stage.name} on {cfg.slides}: {unusable}")
                later = {k: v for k, v in configs.items() if k not in outcomes}
                if outcome.status == "ran" and later:  # what they read exists now: e.g. the tiles, counted
                    check_before_work(
                        later, tiles, world, chain_keys=CHAIN_KEYS, when=f"once the {stage.name} stage ran"
                    )
            model = extraction_model(cfg, outcomes)
            result = PipelineResult(workdir, layout(cfg, weights, model), outcomes, parent, cfg.tracking.uri, "")
            result.message = _message(result)
            record(cfg, parent, result.as_dict())
    except WsidinoError:
        if created and not _kept_anything(outcomes):
            shutil.rmtree(workdir, ignore_errors=True)  # nothing usable was written: leave no half-made workdir
        raise
    return result


def check_inputs(cfg: PipelineConfig, configs: Mapping[str, Any]) -> None:
    """What can be known to fail before anything is written: the workdir, and each stage's own checks of its
    input (`Stage.check`: the tile stage names a folder that holds no slide). The stages' checks before work, the
    warm-start file included, follow in `check_before_work`."""
    workdir = Path(cfg.workdir).expanduser().resolve()
    existing = next(p for p in (workdir, *workdir.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"workdir {workdir}: {existing} is not a writable directory; choose another --workdir")
    for name, stage_cfg in configs.items():
        stage = get_stage(name)
        if stage.check_input is not None:
            stage.check_input(stage_cfg)


def _kept_anything(outcomes: Mapping[str, StageOutcome[Any]]) -> bool:
    return any(o.summary.unusable() is None for o in outcomes.values())


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


def _message(result: PipelineResult) -> str:
    done = ", ".join(f"{s} {o.status}" for s, o in result.outcomes.items())
    return f"pipeline finished in {result.workdir}: {done}"


__all__ = [
    "PipelineResult",
    "check_inputs",
    "extraction_model",
    "layout",
    "run_pipeline",
    "stage_config",
]
