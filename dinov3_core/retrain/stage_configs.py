"""Each stage's typed config inside a cycle: the stage's named config and overrides from the retrain config, with
the paths of this cycle on top (a cycle's outputs cannot be pointed elsewhere by an override)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dinov3_core.retrain.config import RetrainConfig
from dinov3_core.retrain.cycles import CycleLayout
from dinov3_core.stage_choice import build_stage_config


def stage_config(cfg: RetrainConfig, stage: str, paths: dict[str, Any], defaults: dict[str, Any] | None = None) -> Any:
    """defaults ← the stage's named config ← its overrides ← `paths` (and the cycle's tracking settings)."""
    owner = "the cycle (paths of the cycle directory)"
    return build_stage_config(stage, cfg.choice(stage), paths, cfg.tracking, defaults=defaults, owner=owner)


def cycle_paths(layout: CycleLayout, cycle_id: str) -> dict[str, Path]:
    dirs = layout.stage_dirs(cycle_id)
    return {
        "tile_store": layout.tile_store,
        "pretrain": dirs["pretrain"],
        "gram": dirs["gram"],
        "model_dir": dirs["model"],
        "backbone": dirs["model"] / "backbone.pth",
        "onnx": dirs["model"] / "model.onnx",
        "evaluation": dirs["evaluation"],
    }


def training_length(cfg: RetrainConfig, pretrain: Any, tiles: int) -> dict[str, Any]:
    """Overrides that give the pretraining run this cycle's length (its schedules keep their proportions: the
    recipe's epochs are kept and each epoch's length scaled)."""
    n = cfg.length.iterations
    if cfg.length.passes is not None:
        n = max(cfg.length.min_iterations, math.ceil(cfg.length.passes * tiles / pretrain.train.global_batch_size))
    if n is None:
        return {}
    return {"train.epoch_length": max(1, math.ceil(n / pretrain.optim.epochs))}


def build(cfg: RetrainConfig, stage: str, layout: CycleLayout, cycle_id: str, **given: Any) -> Any:
    """The stage's config in cycle `cycle_id`. `given`: what only the cycle knows by then (warm-start weights,
    the snapshot's slide ids, the training length, the model to extract with and its feature store)."""
    p = cycle_paths(layout, cycle_id)
    if stage == "tile":
        return stage_config(cfg, stage, {"input": cfg.slides, "output": str(p["tile_store"])})
    if stage == "pretrain":
        paths = {
            "data.stores": [str(p["tile_store"])],
            "output_dir": str(p["pretrain"]),
            "student.pretrained_weights": given.get("weights"),
            "data.slide_ids": given.get("slide_ids"),
        }
        paths |= given.get("length", {})  # fmt: skip
        return stage_config(cfg, stage, paths)
    if stage == "gram":
        paths = {"pretrain_dir": str(p["pretrain"]), "output_dir": str(p["gram"]),
                 "data.stores": [str(p["tile_store"])], "data.slide_ids": given.get("slide_ids")}  # fmt: skip
        return stage_config(cfg, stage, paths)
    if stage == "convert":
        trained = p["gram"] if cfg.gram_anchoring else p["pretrain"]
        return stage_config(cfg, stage, {"input": str(trained), "output_dir": str(p["model_dir"])})
    if stage == "export":
        paths = {"weights": str(p["backbone"]), "output": str(p["onnx"]), "register_name": cfg.register_name,
                 "register_alias": "candidate"}  # fmt: skip
        return stage_config(cfg, stage, paths)
    if stage == "evaluate":
        # The baseline is what a cycle would be without training: the released weights, else the architecture
        # at initialisation (not "auto", which would follow the warm start back to the previous champion).
        defaults = {"baseline": cfg.pretrained_weights or "init"}
        paths = {"store": str(p["tile_store"]), "candidate": str(p["onnx"]), "output": str(p["evaluation"]),
                 "annotations": cfg.annotations, "register_name": cfg.register_name}  # fmt: skip
        return stage_config(cfg, stage, paths, defaults)
    if stage == "extract":
        paths = {"store": str(p["tile_store"]), "model": str(given["model"]), "output": str(given["output"]),
                 "slide_ids": given.get("slide_ids")}  # fmt: skip
        return stage_config(cfg, stage, paths)
    raise ValueError(f"unknown stage {stage!r}")


def validate(cfg: RetrainConfig, layout: CycleLayout) -> None:
    """Load every stage's config once before anything runs, so a typo fails the cycle at its start."""
    for stage in ("tile", "pretrain", "gram", "convert", "export", "evaluate", "extract"):
        if stage == "gram" and not cfg.gram_anchoring:
            continue
        build(
            cfg,
            stage,
            layout,
            "validate",
            weights="(warm start)",
            model="model.onnx",
            output=str(layout.features / "validate.zarr"),
        )


__all__ = ["build", "cycle_paths", "stage_config", "training_length", "validate"]
