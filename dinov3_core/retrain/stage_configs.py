"""Each stage's typed config inside a cycle: the stage's named config and overrides from the retrain config, with
the paths of this cycle on top (`dinov3_core.chain.chain_config`; a cycle's outputs cannot be pointed elsewhere by
an override). Where a stage writes follows its `Stage.place`: the cohort's outputs under the root (the tile store),
the cycle's own under `cycles/<id>/`."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dinov3_core.chain import build_stage_config, chain_paths, check_before_work
from dinov3_core.retrain.config import RetrainConfig
from dinov3_core.retrain.cycles import CycleLayout
from dinov3_core.stages import STAGES, ChainPaths, Stage, get_stage

OWNER = "the cycle (paths of the cycle directory)"
UNDECIDED = False  # `weights` before the cycle decided its warm start (None: from scratch)


def cycle_paths(
    cfg: RetrainConfig,
    layout: CycleLayout,
    cycle_id: str,
    *,
    weights: str | bool | None = UNDECIDED,
    slide_ids: list[str] | None = None,
    model: str | Path | None = None,
    output: str | Path | None = None,
) -> ChainPaths:
    """Where each stage of cycle `cycle_id` reads and writes, with what only the cycle knows by then: the
    warm-start weights (None: from scratch), the snapshot's slide ids, the model to extract with and its feature
    store (`output`)."""
    return chain_paths(
        cfg,
        layout.root,
        layout.cycle_dir(cycle_id),
        register_name=cfg.register_name,
        weights=weights if isinstance(weights, str) else None,
        weights_decided=weights is not UNDECIDED,
        slide_ids=slide_ids,
        extract_model=str(model) if model is not None else None,
        placed={"extract": Path(output)} if output is not None else {},
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
    values = {**stage.chain_values(cycle_paths(cfg, layout, cycle_id, **given)), **(length or {})}
    defaults = cycle_defaults(cfg).get(stage.name)
    return build_stage_config(stage, cfg.choice(stage.name), values, cfg.tracking, defaults=defaults, owner=OWNER)


def cycle_defaults(cfg: RetrainConfig) -> dict[str, dict[str, Any]]:
    """Stage keys a cycle gives another default than the stage's own (a named config still wins), by stage.

    evaluate's baseline is what a cycle would be without training: the released weights, else the architecture
    at initialisation (not "auto", which would follow the warm start back to the previous champion)."""
    return {"evaluate": {"baseline": cfg.pretrained_weights or "init"}}


def validate(cfg: RetrainConfig, layout: CycleLayout, log: Callable[[str], None] | None = None) -> None:
    """Load every stage's config once before anything runs, so a typo fails the cycle at its start; then the
    checks that need no tiles (the annotations readable, the released weights a cycle may warm-start from)."""
    configs = {
        name: build(
            cfg,
            name,
            layout,
            "validate",
            weights=cfg.pretrained_weights or "(warm start)",
            model="model.onnx",
            output=str(layout.features / "validate.zarr"),
        )
        for name in cfg.chained(cycle_stages())
    }
    # The training stages' batch checks need the snapshot's tiles: the cycle runs them once it has them.
    checks = {k: v for k, v in configs.items() if not get_stage(k).always_job}
    if cfg.pretrained_weights:  # the released weights a cycle may warm-start from: opened and read now
        checks["pretrain"] = configs["pretrain"]
    keys = {"pretrain.student.pretrained_weights": "pretrained_weights"}
    check_before_work(checks, None, 1, chain_keys=keys, tiling=configs["tile"], log=log)


def cycle_stages() -> list[str]:
    """Every stage a cycle runs, in order: all of `STAGES` but those it leaves out by name."""
    return [s for s in STAGES.names if s not in NOT_IN_A_CYCLE]


NOT_IN_A_CYCLE: frozenset[str] = frozenset()  # stages a cycle never runs, by name (none so far)


__all__ = [
    "NOT_IN_A_CYCLE",
    "OWNER",
    "build",
    "cycle_defaults",
    "cycle_paths",
    "cycle_stages",
    "training_length",
    "validate",
]
