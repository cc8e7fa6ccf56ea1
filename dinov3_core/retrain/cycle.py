"""One retraining cycle, top to bottom. `wsidino retrain` and the `retrain` Prefect flow both call `run_cycle`;
they differ only in the `StageRunner` (the stage runner in this process, or the Prefect stage tasks).

    lock the root → open the cycle (resume it on a retry) → every stage of `STAGES` in order:
      the cohort's stages (`Place.scope == "cohort"`: tile, extract) every cycle,
      the cycle's own (pretrain … evaluate) only when the trigger says train,
    with what the cycle adds around a stage in `HOOKS`, keyed by stage:
      tile → snapshot, trigger?   (the training stages) → warm start, length, batch checks on the snapshot
      export → version tagged with cycle + snapshot   evaluate → the gate's decision recorded
      extract → with the champion, into its feature store
    → retention (a trained cycle)

A stage `STAGES` gains runs in every cycle by that rule; `stage_configs.NOT_IN_A_CYCLE` names those it must not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dinov3_core.chain import StageRunner, check_before_work, check_duration
from dinov3_core.evaluate.summary import EvaluateSummary
from dinov3_core.export.summary import ExportSummary
from dinov3_core.extract.summary import ExtractSummary
from dinov3_core.retrain import registry, retention
from dinov3_core.retrain import stage_configs as sc
from dinov3_core.retrain.config import RetrainConfig
from dinov3_core.retrain.cycle_run import cycle_mlflow_run, log_record, set_tags, summary_tags
from dinov3_core.retrain.cycles import (
    CLI_ATTEMPT,
    CycleLayout,
    CycleRecord,
    Decision,
    Retention,
    SnapshotSummary,
    StageRun,
    Trigger,
    list_cycles,
    open_cycle,
    root_lock,
    utc_now,
)
from dinov3_core.retrain.features import ChampionStore, champion_store, record_features
from dinov3_core.retrain.snapshot import (
    Snapshot,
    compare,
    log_dataset_input,
    read_snapshot,
    take_snapshot,
    write_snapshot,
)
from dinov3_core.retrain.warm_start import decide_warm_start
from dinov3_core.runner import StageOutcome
from dinov3_core.stages import Stage, get_stage
from dinov3_core.tiling.summary import TileSummary


@dataclass
class CycleResult:
    record: CycleRecord
    message: str  # one line: what the cycle did and why

    def as_dict(self) -> dict[str, Any]:
        return {"message": self.message, **asdict(self.record)}


@dataclass(frozen=True)
class Hooks:
    """What a cycle adds around one stage.

    config: the stage's config in this cycle; None when it does not run this time (the hook recorded why).
        Default: `stage_configs.build` on the snapshot's slides.
    after: what the cycle does with the stage's outcome (record it, tag it, decide on it).
    """

    config: Callable[[_Cycle, Stage[Any]], Any] | None = None
    after: Callable[[_Cycle, StageOutcome[Any]], None] | None = None


class _Cycle:
    def __init__(self, cfg: RetrainConfig, run: StageRunner, log: Callable[[str], None], world_size: int = 1) -> None:
        self.cfg, self.run_stage, self.log, self.world_size = cfg, run, log, world_size
        self.layout = CycleLayout(Path(cfg.root).resolve())
        self.record: CycleRecord
        self.parent: str | None = None
        self.resumed = False
        self.snap: Snapshot | None = None  # the cycle's data, fixed once recorded (after tile)
        self.champion: registry.Champion | None = None  # @champion when the cycle's training started
        self.configs: dict[str, Any] = {}  # each stage's config as it ran
        self.training: dict[str, Any] | None = None  # the cycle's own stages' configs, checked before the first
        self.target: ChampionStore | None = None  # where extract puts the champion's features
        self.candidate_version: str | None = None
        self.decided: bool | None = None  # the trigger's decision, once taken

    def save(self) -> None:
        self.record.save(self.layout)

    def run(self) -> None:
        """Every stage of the cycle in order, each with its hooks; the cycle's own stages only when it trains."""
        for name in self.cfg.chained(sc.cycle_stages()):
            stage = get_stage(name)
            if stage.place.scope == "cycle" and not self.trains():
                continue
            hooks = HOOKS.get(name, Hooks())
            if stage.place.scope == "cycle":
                cfg = self.training_configs()[name]
            else:
                cfg = (hooks.config or _Cycle.build)(self, stage)
            if cfg is None:
                continue
            self.configs[name] = cfg
            outcome = self.stage(name, cfg)
            if hooks.after is not None:
                hooks.after(self, outcome)

    def stage(self, name: str, cfg: Any) -> StageOutcome[Any]:
        start = time.perf_counter()
        self.record.stages[name] = StageRun("running", started_at=utc_now())
        self.save()
        outcome = self.run_stage(get_stage(name), cfg, self.parent)
        seconds = round(time.perf_counter() - start, 1)
        self.record.stages[name] = StageRun(
            outcome.status, self.record.stages[name].started_at, outcome.reason, seconds, outcome.mlflow_run_id
        )
        self.save()
        return outcome

    def build(self, stage: Stage[Any], **given: Any) -> Any:
        slide_ids = self.snap.slide_ids if self.snap is not None else None
        return sc.build(self.cfg, stage, self.layout, self.record.id, **{"slide_ids": slide_ids, **given})

    def training_configs(self) -> dict[str, Any]:
        """The configs of the cycle's own stages, built once before the first of them runs (the warm start is
        decided then) and checked together on the snapshot's tiles."""
        if self.training is None:
            assert self.snap is not None
            self.champion = registry.champion(self.cfg)
            names = [n for n in self.cfg.chained(sc.cycle_stages()) if get_stage(n).place.scope == "cycle"]
            built = {}
            for name in names:
                hooks = HOOKS.get(name, Hooks())
                built[name] = (hooks.config or _Cycle.build)(self, get_stage(name))
            tiles = self.layout.root / get_stage("tile").place.name
            check_before_work(built, tiles, self.world_size, when=f"on the snapshot's {self.snap.tiles} tiles")
            check_duration(built, self.world_size, yes=True, log=self.log)  # scheduled: said, never asked
            self.training = built
        return self.training

    # ------------------------------------------------------------------------------------------------ tile

    def tiled_or_recorded(self, stage: Stage[Any]) -> Any:
        """A resumed cycle trains on the snapshot it started with: its tiles are not looked at again."""
        recorded = read_snapshot(self.layout.cycle_dir(self.record.id)) if self.resumed else None
        if recorded is not None:
            self.log(f"retrain {self.record.id}: resumed on its recorded snapshot {recorded.hash}")
            self.snap = recorded
            return None
        return sc.build(self.cfg, stage, self.layout, self.record.id)

    def take_snapshot(self, tile: StageOutcome[TileSummary]) -> None:
        snap = take_snapshot(self.layout.root / get_stage("tile").place.name, cohort=cohort_ids(self.configs["tile"]))
        write_snapshot(snap, self.layout.cycle_dir(self.record.id))
        self.record.snapshot = SnapshotSummary(snap.hash, len(snap.slides), snap.tiles, tile.summary.failed_slides)
        if self.parent:
            log_dataset_input(snap, self.parent, registry_uri(self.cfg))
        self.snap = snap
        self.save()

    def reference(self) -> tuple[Snapshot | None, str]:
        """The snapshot new data is counted against: the newest trained cycle's (so a candidate that was not
        promoted is not retrained on the same slides every cycle)."""
        for c in reversed(list_cycles(self.layout)):
            if c.id != self.record.id and c.status == "trained":
                snap = read_snapshot(self.layout.cycle_dir(c.id))
                if snap is not None:
                    return snap, f"cycle {c.id}"
        return None, "no trained cycle yet"

    def trains(self) -> bool:
        """Whether this cycle trains: decided once on the snapshot (a resumed cycle keeps an attempt's decision
        to train)."""
        if self.decided is None:
            # an attempt that crashed decided to train: this one goes on training
            self.decided = (self.record.trigger is not None and self.record.trigger.train) or self.trigger()
        return self.decided

    def trigger(self) -> bool:
        assert self.snap is not None, "the trigger needs the snapshot: tile comes first"
        snap, t = self.snap, self.cfg.trigger
        reference, since = self.reference()
        change = compare(snap, reference)
        needs = f"needs ≥ {max(1, t.min_new_slides)} new slide(s)" + (
            f" and ≥ {t.min_new_tiles} new tiles" if t.min_new_tiles else ""
        )
        if not snap.slides:
            train, reason = False, f"the tile store under {self.layout.root} holds no tiles (check the slides)"
        elif t.force:
            train, reason = True, f"forced (trigger.force); since {since}: {change.describe()}"
        elif reference is None:
            train, reason = True, f"first cycle ({since}): {change.describe()}"
        else:
            train = change.added >= max(1, t.min_new_slides) and change.new_tiles >= t.min_new_tiles
            reason = f"since {since}: {change.describe()}" + ("" if train else f"; {needs}")
        if change.removed:
            self.log(f"retrain {self.record.id}: slides gone from the cohort since {since}: {change.removed}")
        self.record.trigger = Trigger(train, reason, since, change.as_dict())
        self.save()
        return train

    # ------------------------------------------------------------------------------------------- training

    def warm_start(self, pretrain: Any) -> str | None:
        """The weights this cycle starts from, recorded in the cycle (a resumed cycle keeps its choice)."""
        if self.record.warm_start is None:
            self.record.warm_start = decide_warm_start(self.cfg, self.champion, pretrain)
            self.save()
        return self.record.warm_start.path

    @property
    def warm_source(self) -> str | None:
        return self.record.warm_start.source if self.record.warm_start else None

    def warm_started(self, stage: Stage[Any]) -> Any:
        """pretrain from the cycle's warm start, as long as the cycle's length says."""
        assert self.snap is not None
        weights = self.warm_start(self.build(stage, weights="(warm start)"))
        length = sc.training_length(self.cfg, self.build(stage, weights=weights), self.snap.tiles)
        cfg = self.build(stage, weights=weights, length=length)
        self.log(
            f"retrain {self.record.id}: training {cfg.optim.epochs * cfg.train.epoch_length} iterations on "
            f"{len(self.snap.slides)} slides ({self.snap.tiles} tiles), warm start: {self.warm_source}"
        )
        return cfg

    def tag_version(self, export: StageOutcome[ExportSummary]) -> None:
        """Before the gate: the version carries its cycle whether it is promoted or not."""
        self.candidate_version = export.summary.model_version
        if self.candidate_version and self.snap is not None:
            tags = {
                registry.CYCLE_TAG: self.record.id,
                registry.SNAPSHOT_TAG: self.snap.hash,
                "wsidino.warm_start": self.warm_source,
            }
            registry.tag_version(self.cfg, str(self.candidate_version), tags)

    def decide(self, evaluate: StageOutcome[EvaluateSummary]) -> None:
        evaluation = evaluate.summary
        self.record.decision = Decision(
            bool(evaluation.promoted),
            evaluation.decision,
            evaluation.evidence,
            self.candidate_version,
            self.champion.version if self.champion else None,
        )
        self.save()

    # -------------------------------------------------------------------------------------------- features

    def with_champion(self, stage: Stage[Any]) -> Any:
        """Extract the cohort's features with the champion (whoever it is now), into its own store."""
        champion = registry.champion(self.cfg)
        self.record.decision = self.record.decision or Decision()
        self.record.decision.champion_after = champion.version if champion else None
        target = champion_store(self.layout, champion)
        if not isinstance(target, ChampionStore):
            self.log(f"retrain {self.record.id}: {target.reason}; no features extracted")
            self.record.features = target
            self.save()
            return None
        self.target = target
        return self.build(stage, model=target.onnx, output=target.store)

    def record_features(self, extract: StageOutcome[ExtractSummary]) -> None:
        assert self.target is not None
        delete = self.cfg.retention.delete_replaced_features
        self.record.features, replaced = record_features(
            self.layout, self.target, extract.status, extract.summary, delete
        )
        if replaced:
            self.log(
                f"retrain {self.record.id}: features of the previous champion ({replaced}) replaced by "
                f"{self.target.store}"
            )
        self.save()

    def retain(self) -> None:
        champion = registry.champion(self.cfg)
        files = [champion.weights, champion.weights.parent / "model.onnx"] if champion and champion.weights else []
        plan = retention.plan(
            self.layout,
            list_cycles(self.layout),
            self.cfg.retention,
            self.record.id,
            champion.cycle if champion else None,
            protected=files,
        )
        retention.apply(self.layout, plan)
        self.record.retention = Retention(**plan.as_dict(self.layout.root))
        for path in self.record.retention.deleted:
            self.log(f"retrain {self.record.id}: retention deleted {path}")
        self.save()


# What a cycle adds around a stage, by stage name; a stage without an entry is built and run as it is.
HOOKS: dict[str, Hooks] = {
    "tile": Hooks(config=_Cycle.tiled_or_recorded, after=_Cycle.take_snapshot),
    "pretrain": Hooks(config=_Cycle.warm_started),
    "export": Hooks(after=_Cycle.tag_version),
    "evaluate": Hooks(after=_Cycle.decide),
    "extract": Hooks(config=_Cycle.with_champion, after=_Cycle.record_features),
}


def cohort_ids(tile_cfg: Any) -> set[str]:
    """The slide ids the slides folder (or list) names now, as the tile stage assigns them."""
    from dinov3_core.tiling.discovery import assign_slide_ids, discover_slides

    return {t.slide_id for t in assign_slide_ids(discover_slides(tile_cfg.input, tile_cfg.extensions))}


def registry_uri(cfg: RetrainConfig) -> str:
    from dinov3_core import tracking

    return tracking.tracking_uri(cfg.tracking)


def run_cycle(
    cfg: RetrainConfig,
    run: StageRunner,
    *,
    attempt_key: str = CLI_ATTEMPT,
    log: Callable[[str], None] = print,
    tags: Mapping[str, str] | None = None,
    world_size: int = 1,
) -> CycleResult:
    """One cycle under `cfg.root`: trained (and gated) or skipped, with the reason; see the module docstring.

    Args:
        cfg: The retrain config (`load_retrain_config`).
        run: Runs one stage (`StageRunner`).
        attempt_key: Identifies the attempt (the Prefect flow run id): the same key resumes its cycle.
        log: Where progress lines go.
        tags: Extra MLflow tags of the cycle's run (the Prefect flow run).
        world_size: Processes of each training job (the runner's launch), for the batch checks.

    Raises:
        RetrainError / WsidinoError: bad input, another cycle holds the root, the registry is unreachable.
    """
    c = _Cycle(cfg, run, log, world_size)
    sc.validate(cfg, c.layout, log)
    registry.check_reachable(cfg)
    with root_lock(c.layout):
        c.record, c.resumed = open_cycle(c.layout, attempt_key)
        log(
            f"retrain {c.record.id}: {'resumed (attempt ' + str(c.record.attempts) + ')' if c.resumed else 'started'}"
            f" under {c.layout.root}"
        )
        try:
            with cycle_mlflow_run(cfg, c.record, tags or {}) as parent:
                c.parent = c.record.mlflow_run_id = parent
                c.save()
                c.run()
                c.record.status = "trained" if c.trains() else "skipped"
                if c.record.status == "trained":
                    c.retain()
                c.record.finished_at = utc_now()
                c.save()
                set_tags(cfg, parent, summary_tags(c.record))
                log_record(cfg, parent, c.record)
        except BaseException as err:
            c.record.status, c.record.error = "failed", f"{type(err).__name__}: {err}"[:2000]
            c.record.finished_at = utc_now()
            c.save()
            set_tags(cfg, c.parent, {**summary_tags(c.record), "wsidino.error": c.record.error})
            raise
    return CycleResult(c.record, c.record.summary_line())


__all__ = ["CycleResult", "StageRunner", "run_cycle"]
