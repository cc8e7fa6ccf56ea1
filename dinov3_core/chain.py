"""What every chain of stages shares (the pipeline in one work directory, a retraining cycle): each stage's named
config and overrides (`StageChoice`, in `ChainConfig.stages`), where the chain puts each stage (`chain_paths`), how
it turns them into the stage's typed config with its own paths on top (`chain_config`), the one `StageRunner`
signature, and the checks before work (`check_before_work`). Nothing here names a stage but gram (which
`gram_anchoring=false` leaves out): every stage of `STAGES` gets the same treatment.

    wsidino pipeline ... pretrain.train.stop_at=100      # → stages.pretrain.overrides += ["train.stop_at=100"]
    wsidino pipeline ... pretrain.config=vitb16-1gpu     # → stages.pretrain.config

A key that starts with a stage name and is not one of `StageChoice`'s own fields is that stage's override; it is
checked against the stage's schema when the chain builds the stage configs, before anything runs. Problems are
reported with the keys as the user types them in the chain (`gram.train.global_batch_size`).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from dinov3_core.config import ConfigError, load_config, named_config_keys, parse_overrides
from dinov3_core.stages import STAGES, ChainPaths, PreflightFacts, Problem, Stage, get_stage
from dinov3_core.tracking import TrackingConfig

if TYPE_CHECKING:
    from dinov3_core.runner import StageOutcome

_CHOICE_KEYS = {"config", "overrides"}


class StageRunner(Protocol):
    """Runs one stage of a chain: `dinov3_core.runner.run_stage` in this process (CLI), or the Prefect stage task.
    `parent` is the chain's MLflow run (the stage's run nests under it)."""

    def __call__(self, stage: Stage[Any], cfg: Any, parent: str | None, force: bool = False) -> StageOutcome[Any]: ...


@dataclass
class StageChoice:
    """A stage's named config (or YAML path) and its overrides, as in the pipeline's form."""

    config: str | None = None
    overrides: list[str] = field(default_factory=list)


def default_choices() -> dict[str, StageChoice]:
    """Every stage with its own default named config (`Stage.default_config`)."""
    return {s.name: StageChoice(s.default_config) for s in STAGES}


class ChainConfig:
    """What the pipeline's and the retraining cycle's configs share (each declares the fields, in its own order):
    the slides, the annotations, gram anchoring on or off, each stage's choice and MLflow."""

    # A named config of an earlier version put each stage's choice at the top level.
    MOVED_KEYS: ClassVar[dict[str, str]] = {s: f"stages.{s}" for s in STAGES.names}
    if TYPE_CHECKING:
        slides: str
        annotations: str | None
        gram_anchoring: bool
        stages: dict[str, StageChoice]
        tracking: TrackingConfig

    def __post_init__(self) -> None:
        for name in self.stages:
            get_stage(name, f"stages.{name}")  # a ConfigError naming the key and the closest stage

    def choice(self, stage: str) -> StageChoice:
        """The stage's choice; a stage added since the config was written gets its default."""
        if stage not in self.stages:
            self.stages[stage] = StageChoice(get_stage(stage).default_config)
        return self.stages[stage]

    def chained(self, stages: Iterable[str]) -> list[str]:
        """`stages` without those this chain leaves out (gram when gram anchoring is off)."""
        return [s for s in stages if s != "gram" or self.gram_anchoring]


def route_overrides(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Split `pretrain.train.stop_at=4` (a stage's override) from the run's own keys (`pretrain.config=cpu` →
    `stages.pretrain.config`, `workdir=…`): (the run's own values, each stage's extra overrides)."""
    own: dict[str, Any] = {}
    extra: dict[str, list[str]] = {}
    for key, value in values.items():
        stage, _, rest = key.partition(".")
        if stage == "stages":  # stages.<stage>.config: the stage must exist (a typo gets the closest name)
            name = rest.partition(".")[0]
            get_stage(name, f"stages.{name}")
        close = difflib.get_close_matches(stage, STAGES.names, n=1, cutoff=0.8) if "." in rest else []
        if stage not in STAGES.names and close:  # a stage key with a typo in the stage's name
            raise ConfigError(f"{stage!r} is not a stage; did you mean '{close[0]}.{rest}'?", key=key)
        if stage in STAGES.names and rest and rest not in _CHOICE_KEYS:
            extra.setdefault(stage, []).append(f"{rest}={value if isinstance(value, str) else json.dumps(value)}")
        elif stage in STAGES.names and rest:
            own[f"stages.{key}"] = value
        else:
            own[key] = value
    return own, extra


def add_stage_overrides(cfg: ChainConfig, extra: Mapping[str, list[str]]) -> None:
    """Append each stage's extra overrides after those its named config already lists (they win on a clash)."""
    for stage, items in extra.items():
        choice = cfg.choice(stage)
        choice.overrides = [*choice.overrides, *items]


def chain_paths(
    cfg: ChainConfig, root: Path, cycle_dir: Path, runs: Sequence[str] | None = None, **decided: Any
) -> ChainPaths:
    """Where each stage of a chain reads and writes (`root` for the cohort's outputs, `cycle_dir` for the run's
    own), and what the chain decided for them (`ChainPaths`'s other fields)."""
    return ChainPaths(
        root=root,
        cycle_dir=cycle_dir,
        slides=cfg.slides,
        runs=tuple(cfg.chained(STAGES.names if runs is None else runs)),
        annotations=cfg.annotations,
        places=STAGES.places(),
        **decided,
    )


def tracking_values(t: TrackingConfig) -> dict[str, Any]:
    return {"tracking.enabled": t.enabled, "tracking.uri": t.uri, "tracking.experiment": t.experiment}


def build_stage_config(
    stage: Stage[Any] | str,
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
    stage = get_stage(stage)
    try:
        user = parse_overrides(choice.overrides)
    except ConfigError as err:
        raise ConfigError(f"{stage}.overrides: {err}") from None
    clash = sorted(set(user) & set(paths))
    if clash:
        raise ConfigError(f"{stage}.overrides set {', '.join(clash)}: {owner} sets these itself; leave them out")
    named = named_config_keys(stage.name, choice.config)
    fallback = {k: v for k, v in (defaults or {}).items() if k not in named}  # the named config's value wins
    values = {**fallback, **user, **paths, **tracking_values(tracking)}
    try:
        return load_config(stage.schema(), choice.config, values, stage=stage.name)
    except ConfigError as err:
        # The keys as the user types them in the chain: `pretrain.train.stop_at`, not the stage's own `train.stop_at`.
        said = re.sub(r"(config key |did you mean )'([^']+)'", rf"\1'{stage.name}.\2'", str(err))
        raise ConfigError(f"{stage} (config {choice.config or 'defaults'}): {said}") from None


def chain_config(
    stage: Stage[Any] | str,
    choice: StageChoice,
    paths: ChainPaths,
    tracking: TrackingConfig,
    *,
    defaults: Mapping[str, Any] | None = None,
    owner: str,
) -> Any:
    """The stage's typed config inside a chain: its named config and overrides, the chain's paths on top."""
    stage = get_stage(stage)
    return build_stage_config(stage, choice, stage.chain_values(paths), tracking, defaults=defaults, owner=owner)


# ---------------------------------------------------------------------------------------- checks before work


def check_before_work(
    configs: Mapping[str, Any],
    tile_store: Path | None,
    world_size: int,
    *,
    prefix: bool = True,
    when: str = "",
    chain_keys: Mapping[str, str] | None = None,
    tiling: Any = None,
    log: Callable[[str], None] | None = None,
    only: Collection[str] | None = None,
) -> None:
    """Every stage's checks before work (`Stage.preflight`: the batch and crops against the tiles, the annotations
    readable), all problems at once, each with the key as the user types it (`gram.train.global_batch_size` in a
    chain, `train.global_batch_size` alone) and a value that works.

    Args:
        configs: Stage name → its typed config, for the stages about to run.
        tile_store: The chain's tile store (a training config that names no store reads it).
        world_size: Processes of each training job.
        prefix: Name keys after their stage (a chain's keys).
        when: Said in the message (e.g. "once the tile stage ran").
        chain_keys: A stage key the chain sets from one of its own → that key (`pretrain.student.pretrained_weights`
            → `weights`: the user typed --weights).
        tiling: The chain's tile config: its slides are found and the stages' checks see them (the annotations
            matched to them) and how they will be cut.
        log: Where a check's findings that are not problems go (the classes' tile counts).
        only: Report only problems of these keys (as the stage names them, prefixed).

    Raises:
        ConfigError: Naming every problem found.
    """
    problems: list[Problem] = []
    slides = cohort(tiling) if tiling is not None else None
    for name, cfg in configs.items():
        stage = get_stage(name)
        if stage.preflight is None:
            continue
        facts = PreflightFacts(tile_store, world_size, f"{name}." if prefix else "", slides, tiling, log)
        for p in stage.preflight(cfg, facts):
            if only is not None and p.key not in only:
                continue
            user_key = (chain_keys or {}).get(p.key, p.key)
            problems.append(Problem(user_key, p.message, p.fix.replace(p.key, user_key)))
    if problems:
        head = f"{len(problems)} problem(s) found before any work{' ' + when if when else ''}"
        raise ConfigError(head + ":\n" + "\n".join(f"  {p}" for p in problems))


HOUR, DAY = 3600.0, 86400.0


def check_duration(configs: Mapping[str, Any], world_size: int, *, yes: bool, log: Callable[[str], None]) -> None:
    """Say how long the training stages will take at least on this machine when it is more than an hour, and stop
    a run that would take more than a day on a CPU unless `yes` (`--yes`): a GPU recipe started on the wrong box
    is found before its first step, not after hours without one."""
    found = [(name, d) for name, cfg in configs.items() if (d := _duration(name, cfg, world_size)) is not None]
    total = sum(d.seconds for _, d in found)
    if total < HOUR:
        return
    from dinov3_core.train.duration import human

    said = "; ".join(f"{name} {d.describe()}" for name, d in found)
    log(f"time estimate: {said}")
    if total > DAY and any(d.device.startswith("CPU") for _, d in found) and not yes:
        raise ConfigError(
            f"the training stages would take {human(total)} or more on this machine's CPU ({said}); use a GPU "
            "(the -1gpu configs, docs/hardware.md), shorten the run (pretrain.train.stop_at=…), or pass --yes "
            "(yes=true) to run it anyway"
        )


def _duration(name: str, cfg: Any, world_size: int) -> Any:
    stage = get_stage(name)
    return stage.duration(cfg, world_size) if stage.duration is not None else None


def cohort(tiling: Any) -> dict[str, str]:
    """The slides a tile config names, by the id the tile stage gives each (empty when its input names none: the
    tile stage says so)."""
    from dinov3_core.errors import WsidinoError
    from dinov3_core.tiling.discovery import assign_slide_ids, discover_slides

    try:
        return {t.slide_id: str(t.path) for t in assign_slide_ids(discover_slides(tiling.input, tiling.extensions))}
    except WsidinoError:
        return {}


__all__ = [
    "ChainConfig",
    "StageChoice",
    "StageRunner",
    "add_stage_overrides",
    "build_stage_config",
    "chain_config",
    "chain_paths",
    "check_before_work",
    "check_duration",
    "cohort",
    "default_choices",
    "route_overrides",
    "tracking_values",
]
