"""What a retraining cycle warm-starts from: the registry's champion (its backbone checked against the registered
digest and against the architecture the pretrain config trains), the released weights, or a random init."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dinov3_core.evaluate.summary import PROMOTION_TAG, set_by_gate
from dinov3_core.export.summary import WEIGHTS_SHA_TAG
from dinov3_core.retrain import registry
from dinov3_core.retrain.config import RetrainConfig, RetrainError
from dinov3_core.retrain.cycles import WarmStart


def decide_warm_start(cfg: RetrainConfig, champion: registry.Champion | None, pretrain: Any) -> WarmStart:
    """What a cycle warm-starts from (`warm_start`: auto, champion, released, scratch), checked: the champion's
    backbone on this machine, byte for byte the registered one, of the architecture the pretrain config trains."""
    mode = cfg.warm_start
    if mode in ("auto", "champion") and champion is not None:
        weights = champion.weights
        if weights is None or not weights.is_file():
            raise RetrainError(
                f"the champion ({cfg.register_name} v{champion.version}) has no backbone file on this "
                f"machine ({registry.WEIGHTS_TAG}={weights}); restore it, move @champion to a version whose "
                "files exist, or set warm_start=released|scratch"
            )
        if not set_by_gate(champion.tags) and not cfg.trust_unvetted_champion:
            raise RetrainError(
                f"@champion of {cfg.register_name} is v{champion.version}, which the evaluation gate never promoted "
                f"({PROMOTION_TAG}={champion.tags.get(PROMOTION_TAG)!r}): the alias was moved by hand or by another "
                "tool, and a cycle does not build on a model without evidence; move @champion back to a promoted "
                "version, or set trust_unvetted_champion=true to warm-start from it anyway (recorded in the cycle)"
            )
        champion.verified(weights, WEIGHTS_SHA_TAG)  # a replaced or damaged champion file is never trained on
        check_architecture(weights, pretrain, champion.version, cfg.register_name)
        unvetted = not set_by_gate(champion.tags)
        choice = WarmStart("champion", str(weights), champion.version, champion.cycle, unvetted=unvetted)
    elif mode == "champion":
        raise RetrainError(f"warm_start=champion, but {cfg.register_name} has no @champion yet")
    elif mode in ("auto", "released") and cfg.pretrained_weights:
        if not Path(cfg.pretrained_weights).is_file():
            raise RetrainError(f"pretrained_weights={cfg.pretrained_weights}: file not found")
        choice = WarmStart("released", str(Path(cfg.pretrained_weights).resolve()))
    else:
        if pretrain.student.arch == "auto":
            raise RetrainError(
                "nothing to warm-start from (no champion, no pretrained_weights) and student.arch=auto reads "
                "the architecture from those weights: set pretrain.student.arch (e.g. vitb16) or "
                "pretrained_weights"
            )
        choice = WarmStart("scratch")
    return choice


def check_architecture(weights: Path, pretrain: Any, version: str, name: str) -> None:
    """The champion must have the shape the pretrain config trains (checked on the constructor settings convert
    wrote beside the backbone, so it fails here and not inside the training job)."""
    from dinov3_core.train.model_config import structure_mismatch

    arch_file = weights.parent / "config.yaml"
    doc = (yaml.safe_load(arch_file.read_text()) if arch_file.is_file() else None) or {}
    theirs = doc.get("backbone_kwargs") or {}
    if pretrain.student.arch == "auto" or not theirs:
        return  # auto reads the architecture from the champion itself
    said = structure_mismatch(theirs, pretrain)
    if said:
        raise RetrainError(
            f"the champion ({name} v{version}, {weights}) does not have the architecture the pretrain config "
            f"trains (student.arch={pretrain.student.arch}: {said}, champion vs config). Set pretrain.student.arch "
            "to the champion's (or auto) to continue from it, or warm_start=released|scratch to train the new "
            "architecture from other weights; the evaluation then decides between them"
        )


__all__ = ["check_architecture", "decide_warm_start"]
