"""Each stage's typed config inside a cycle: the stage's named config and overrides from the retrain config, with
the paths of this cycle on top (`dinov3_core.chain.chain_config`; a cycle's outputs cannot be pointed elsewhere by
an override)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dinov3_core.chain import build_stage_config, check_before_work
from dinov3_core.retrain.config import RetrainConfig
from dinov3_core.retrain.cycles import CycleLayout
from dinov3_core.stages import STAGES, ChainPaths, Stage, get_stage

OWNER = "the cycle (paths of the cycle directory)"


def cycle_paths(
    cfg: RetrainConfig,
    layout: CycleLayout,
    cycle_id: str,
    *,
    weights: str | bool | None = False,
    slide_ids: list[str] | None = None,
    model: str | Path | None = None,
    output: str | Path | None = None,
) -> ChainPaths:
    """Where each stage of cycle `cycle_id` reads and writes, with what only the cycle knows by then: the
    warm-start weights (None: from scratch; False: not decided yet), the snapshot's slide ids, the model to extract
    with and its feature store."""
    dirs = layout.stage_dirs(cycle_id)
    return ChainPaths(
        slides=cfg.slides,
        tile_store=layout.tile_store,
        pretrain=dirs["pretrain"],
        gram=dirs["gram"],
        model_dir=dirs["model"],
        evaluation=dirs["evaluation"],
        features=Path(output) if output is not None else layout.features / f"{cycle_id}.zarr",
        annotations=cfg.annotations,
        gram_anchoring=cfg.gram_anchoring,
        register_name=cfg.register_name,
        weights=weights if isinstance(weights, str) else None,
        weights_decided=weights is not False,
        slide_ids=slide_ids,
        extract_model=str(model) if model is not None else None,
    )


def training_length(cfg: RetrainConfig, pretrain: Any, tiles: int) -> dict[str, Any]:
    """Overrides that give the pretraining run this cycle's length (its schedules keep their proportions: the
    recipe's epochs are kept and each epoch's length scaled)."""
    n = cfg.length.iterations
    if cfg.length.passes is not None:
        n = max(cfg.length.min_iterations, math.ceil(cfg.length.passes * tiles / pretrain.train.global_batch_size))
    if n is None:
        return {}
    return {"train.epoch_length": max(1, math.ceil(n / pretrain.optim.epochs))}


def build(
    cfg: RetrainConfig,
    stage: Stage[Any] | str,
    layout: CycleLayout,
    cycle_id: str,
    *,
    length: dict[str, Any] | None = None,
    **given: Any,
) -> Any:
    """The stage's config in cycle `cycle_id`. `given`: `cycle_paths`'s keywords; `length`: pretrain's length
    (`training_length`), set by the cycle like its paths."""
    stage = get_stage(stage)
    # The baseline is what a cycle would be without training: the released weights, else the architecture at
    # initialisation (not "auto", which would follow the warm start back to the previous champion).
    defaults = {"baseline": cfg.pretrained_weights or "init"} if stage.name == "evaluate" else None
    values = {**stage.chain_values(cycle_paths(cfg, layout, cycle_id, **given)), **(length or {})}
    return build_stage_config(stage, cfg.choice(stage.name), values, cfg.tracking, defaults=defaults, owner=OWNER)


def validate(cfg: RetrainConfig, layout: CycleLayout) -> None:
    """Load every stage's config once before anything runs, so a typo fails the cycle at its start; then the
    checks that need no tiles (the annotations readable)."""
    configs = {}
    for stage in STAGES:
        if stage.name == "gram" and not cfg.gram_anchoring:
            continue
        configs[stage.name] = build(
            cfg,
            stage,
            layout,
            "validate",
            weights="(warm start)",
            model="model.onnx",
            output=str(layout.features / "validate.zarr"),
        )
    checks = {"evaluate": configs["evaluate"]}
    if cfg.pretrained_weights:  # the released weights a cycle may warm-start from: opened and read now
        checks["pretrain"] = build(cfg, "pretrain", layout, "validate", weights=cfg.pretrained_weights)
    check_before_work(checks, None, 1, chain_keys={"pretrain.student.pretrained_weights": "pretrained_weights"})


__all__ = ["OWNER", "build", "cycle_paths", "training_length", "validate"]
