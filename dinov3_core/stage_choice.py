"""A stage's named config and overrides inside a multi-stage run (the pipeline, a retraining cycle), and how such
a run turns them into the stage's typed config with its own paths on top.

    wsidino pipeline ... pretrain.train.stop_at=100      # → pretrain.overrides += ["train.stop_at=100"]

A key that starts with a stage name and is not one of `StageChoice`'s own fields is that stage's override; it is
checked against the stage's schema when the run builds the stage configs, before anything runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dinov3_core.config import ConfigError, load_config, named_config_keys, parse_overrides
from dinov3_core.tracking import TrackingConfig

STAGES = ("tile", "pretrain", "gram", "convert", "export", "evaluate", "extract")
_CHOICE_KEYS = {"config", "overrides"}


@dataclass
class StageChoice:
    """A stage's named config (or YAML path) and its overrides, as in the pipeline's form."""

    config: str | None = None
    overrides: list[str] = field(default_factory=list)


def route_overrides(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Split `pretrain.train.stop_at=4` (a stage's override) from the run's own keys (`pretrain.config=cpu`,
    `workdir=…`): (the run's own values, each stage's extra overrides)."""
    own: dict[str, Any] = {}
    extra: dict[str, list[str]] = {}
    for key, value in values.items():
        stage, _, rest = key.partition(".")
        if stage in STAGES and rest and rest not in _CHOICE_KEYS:
            extra.setdefault(stage, []).append(f"{rest}={value if isinstance(value, str) else json.dumps(value)}")
        else:
            own[key] = value
    return own, extra


def add_stage_overrides(cfg: Any, extra: Mapping[str, list[str]]) -> None:
    """Append each stage's extra overrides after those its named config already lists (they win on a clash)."""
    for stage, items in extra.items():
        choice = getattr(cfg, stage)
        choice.overrides = [*choice.overrides, *items]


def tracking_values(t: TrackingConfig) -> dict[str, Any]:
    return {"tracking.enabled": t.enabled, "tracking.uri": t.uri, "tracking.experiment": t.experiment}


def build_stage_config(
    stage: str,
    choice: StageChoice,
    paths: Mapping[str, Any],
    tracking: TrackingConfig,
    *,
    defaults: Mapping[str, Any] | None = None,
    owner: str = "the run",
) -> Any:
    """defaults ← the stage's named config ← its overrides ← `paths` and the run's tracking settings.

    `paths` are what the run decides itself (where each stage reads and writes): an override of one of them is
    an error, so a stage's output cannot be pointed away from where the next stage looks for it.
    """
    try:
        user = parse_overrides(choice.overrides)
    except ConfigError as err:
        raise ConfigError(f"{stage}.overrides: {err}") from None
    clash = sorted(set(user) & set(paths))
    if clash:
        raise ConfigError(f"{stage}.overrides set {', '.join(clash)}: {owner} sets these itself; leave them out")
    named = named_config_keys(stage, choice.config)
    fallback = {k: v for k, v in (defaults or {}).items() if k not in named}  # the named config's value wins
    values = {**fallback, **user, **paths, **tracking_values(tracking)}
    from dinov3_core.stage_specs import STAGE_SPECS

    try:
        return load_config(STAGE_SPECS[stage].schema(), choice.config, values, stage=stage)
    except ConfigError as err:
        raise ConfigError(f"{stage} (config {choice.config or 'defaults'}): {err}") from None


__all__ = ["STAGES", "StageChoice", "add_stage_overrides", "build_stage_config", "route_overrides", "tracking_values"]
