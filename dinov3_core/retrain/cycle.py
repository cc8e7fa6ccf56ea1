"""One retraining cycle, top to bottom. `wsidino retrain` and the `retrain` Prefect flow both call `run_cycle`;
they differ only in the `StageRunner` (the stage runner in this process, or the Prefect stage tasks).

    lock the root → open the cycle (resume it on a retry) → tile the cohort (new slides only) → snapshot →
    trigger? ─no→ skipped (extract new slides with the champion)
             └yes→ warm start → pretrain → gram → convert → export (candidate, tagged with cycle + snapshot)
                   → evaluate (the gate moves @champion or not) → extract with the champion → retention
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from dinov3_core.chain import StageRunner, check_before_work
from dinov3_core.retrain import registry, retention
from dinov3_core.retrain import stage_configs as sc
from dinov3_core.retrain.config import RetrainConfig, RetrainError
from dinov3_core.retrain.cycle_run import cycle_mlflow_run, log_record, set_tags
from dinov3_core.retrain.cycles import (
    CLI_ATTEMPT,
    CycleLayout,
    CycleRecord,
    list_cycles,
    open_cycle,
    root_lock,
    utc_now,
)
from dinov3_core.retrain.features import extract_with_champion
from dinov3_core.retrain.snapshot import (
    Snapshot,
    compare,
    log_dataset_input,
    read_snapshot,
    take_snapshot,
    write_snapshot,
)
from dinov3_core.runner import StageOutcome
from dinov3_core.stages import get_stage
from dinov3_core.stages.evaluate import EvaluateSummary
from dinov3_core.stages.export import WEIGHTS_SHA_TAG, ExportSummary
from dinov3_core.stages.tile import TileSummary


@dataclass
class CycleResult:
    record: CycleRecord
    message: str  # one line: what the cycle did and why

    def as_dict(self) -> dict[str, Any]:
        return {"message": self.message, **asdict(self.record)}


class _Cycle:
    def __init__(self, cfg: RetrainConfig, run: StageRunner, log: Callable[[str], None], world_size: int = 1) -> None:
        self.cfg, self.run_stage, self.log, self.world_size = cfg, run, log, world_size
        self.layout = CycleLayout(Path(cfg.root).resolve())
        self.record: CycleRecord
        self.parent: str | None = None

    def save(self) -> None:
        self.record.save(self.layout)

    def stage(self, name: str, cfg: Any) -> StageOutcome[Any]:
        start = time.perf_counter()
        self.record.stages[name] = {"status": "running", "started_at": utc_now()}
        self.save()
        outcome = self.run_stage(get_stage(name), cfg, self.parent)
        self.record.stages[name] = {
            "status": outcome.status,
            "reason": outcome.reason,
            "seconds": round(time.perf_counter() - start, 1),
            "mlflow_run_id": outcome.mlflow_run_id,
        }
        self.save()
        return outcome

    # ------------------------------------------------------------------------------------------------ steps

    def snapshot(self, resumed: bool) -> Snapshot:
        """The cycle's data, fixed once recorded: a resumed cycle trains on what it started with."""
        cycle_dir = self.layout.cycle_dir(self.record.id)
        recorded = read_snapshot(cycle_dir) if resumed else None
        if recorded is not None:
            self.log(f"retrain {self.record.id}: resumed on its recorded snapshot {recorded.hash}")
            return recorded
        tile_cfg = sc.build(self.cfg, "tile", self.layout, self.record.id)
        tile: StageOutcome[TileSummary] = self.stage("tile", tile_cfg)
        failed = tile.summary.failed_slides
        snap = take_snapshot(self.layout.tile_store, cohort=cohort_ids(tile_cfg))
        write_snapshot(snap, cycle_dir)
        self.record.snapshot = {
            "hash": snap.hash,
            "n_slides": len(snap.slides),
            "tiles": snap.tiles,
            "failed_slides": failed,
        }
        if self.parent:
            log_dataset_input(snap, self.parent, registry_uri(self.cfg))
        self.save()
        return snap

    def reference(self) -> tuple[Snapshot | None, str]:
        """The snapshot new data is counted against: the newest trained cycle's (so a candidate that was not
        promoted is not retrained on the same slides every cycle)."""
        for c in reversed(list_cycles(self.layout)):
            if c.id != self.record.id and c.status == "trained":
                snap = read_snapshot(self.layout.cycle_dir(c.id))
                if snap is not None:
                    return snap, f"cycle {c.id}"
        return None, "no trained cycle yet"

    def trigger(self, snap: Snapshot) -> bool:
        if self.record.trigger.get("train"):  # decided by the attempt that crashed
            return True
        t = self.cfg.trigger
        reference, since = self.reference()
        change = compare(snap, reference)
        needs = f"needs ≥ {max(1, t.min_new_slides)} new slide(s)" + (
            f" and ≥ {t.min_new_tiles} new tiles" if t.min_new_tiles else ""
        )
        if not snap.slides:
            train, reason = False, f"the tile store {self.layout.tile_store} holds no tiles (check the slides)"
        elif t.force:
            train, reason = True, f"forced (trigger.force); since {since}: {change.describe()}"
        elif reference is None:
            train, reason = True, f"first cycle ({since}): {change.describe()}"
        else:
            train = change.added >= max(1, t.min_new_slides) and change.new_tiles >= t.min_new_tiles
            reason = f"since {since}: {change.describe()}" + ("" if train else f"; {needs}")
        if change.removed:
            self.log(f"retrain {self.record.id}: slides gone from the cohort since {since}: {change.removed}")
        self.record.trigger = {"train": train, "reason": reason, "since": since, "change": change.as_dict()}
        self.save()
        return train

    def warm_start(self, champion: registry.Champion | None, pretrain: Any) -> str | None:
        """The weights this cycle starts from, recorded in the cycle (a resumed cycle keeps its choice)."""
        if self.record.warm_start:
            return self.record.warm_start.get("path")
        mode = self.cfg.warm_start
        if mode in ("auto", "champion") and champion is not None:
            weights = champion.weights
            if weights is None or not weights.is_file():
                raise RetrainError(
                    f"the champion ({self.cfg.register_name} v{champion.version}) has no backbone file on this "
                    f"machine ({registry.WEIGHTS_TAG}={weights}); restore it, move @champion to a version whose "
                    "files exist, or set warm_start=released|scratch"
                )
            champion.verified(weights, WEIGHTS_SHA_TAG)  # a replaced or damaged champion file is never trained on
            check_architecture(weights, pretrain, champion.version, self.cfg.register_name)
            choice = {"source": "champion", "path": str(weights), "version": champion.version, "cycle": champion.cycle}
        elif mode == "champion":
            raise RetrainError(f"warm_start=champion, but {self.cfg.register_name} has no @champion yet")
        elif mode in ("auto", "released") and self.cfg.pretrained_weights:
            if not Path(self.cfg.pretrained_weights).is_file():
                raise RetrainError(f"pretrained_weights={self.cfg.pretrained_weights}: file not found")
            choice = {"source": "released", "path": str(Path(self.cfg.pretrained_weights).resolve())}
        else:
            if pretrain.student.arch == "auto":
                raise RetrainError(
                    "nothing to warm-start from (no champion, no pretrained_weights) and student.arch=auto reads "
                    "the architecture from those weights: set pretrain.student.arch (e.g. vitb16) or "
                    "pretrained_weights"
                )
            choice = {"source": "scratch", "path": None}
        self.record.warm_start = choice
        self.save()
        return choice["path"]

    def train_and_gate(self, snap: Snapshot, champion: registry.Champion | None) -> None:
        cfg, layout, cid = self.cfg, self.layout, self.record.id
        probe = sc.build(cfg, "pretrain", layout, cid, slide_ids=snap.slide_ids, weights="(warm start)")
        weights = self.warm_start(champion, probe)
        length = sc.training_length(cfg, probe, snap.tiles)
        pretrain = sc.build(cfg, "pretrain", layout, cid, slide_ids=snap.slide_ids, weights=weights, length=length)
        self.log(
            f"retrain {cid}: training {pretrain.optim.epochs * pretrain.train.epoch_length} iterations on "
            f"{len(snap.slides)} slides ({snap.tiles} tiles), warm start: {self.record.warm_start['source']}"
        )
        training = {"pretrain": pretrain}
        if cfg.gram_anchoring:
            training["gram"] = sc.build(cfg, "gram", layout, cid, slide_ids=snap.slide_ids)
        check_before_work(training, layout.tile_store, self.world_size, when=f"on the snapshot's {snap.tiles} tiles")
        self.stage("pretrain", pretrain)
        if cfg.gram_anchoring:
            self.stage("gram", training["gram"])
        self.stage("convert", sc.build(cfg, "convert", layout, cid))
        export: StageOutcome[ExportSummary] = self.stage("export", sc.build(cfg, "export", layout, cid))
        version = export.summary.model_version
        if version:  # before the gate: the version carries its cycle whether it is promoted or not
            registry.tag_version(
                cfg,
                str(version),
                {
                    registry.CYCLE_TAG: cid,
                    registry.SNAPSHOT_TAG: snap.hash,
                    "wsidino.warm_start": self.record.warm_start["source"],
                },
            )
        evaluation: EvaluateSummary = self.stage("evaluate", sc.build(cfg, "evaluate", layout, cid)).summary
        self.record.decision = {
            "promoted": bool(evaluation.promoted),
            "reason": evaluation.decision,
            "evidence": evaluation.evidence,  # gate.evidence_line: the line the stage and the pipeline print
            "candidate_version": version,
            "champion_before": champion.version if champion else None,
        }
        self.save()

    def serve(self, snap: Snapshot) -> None:
        """Extract the cohort's features with the champion (whoever it is now)."""
        champion = registry.champion(self.cfg)
        self.record.decision["champion_after"] = champion.version if champion else None
        self.record.features = extract_with_champion(self, champion, snap.slide_ids)
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
        self.record.retention = plan.as_dict(self.layout.root)
        for path in self.record.retention["deleted"]:
            self.log(f"retrain {self.record.id}: retention deleted {path}")
        self.save()


def cohort_ids(tile_cfg: Any) -> set[str]:
    """The slide ids the slides folder (or list) names now, as the tile stage assigns them."""
    from dinov3_core.tiling.discovery import assign_slide_ids, discover_slides

    return {t.slide_id for t in assign_slide_ids(discover_slides(tile_cfg.input, tile_cfg.extensions))}


def registry_uri(cfg: RetrainConfig) -> str:
    from dinov3_core import tracking

    return tracking.tracking_uri(cfg.tracking)


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
    sc.validate(cfg, c.layout)
    registry.check_reachable(cfg)
    with root_lock(c.layout):
        c.record, resumed = open_cycle(c.layout, attempt_key)
        log(
            f"retrain {c.record.id}: {'resumed (attempt ' + str(c.record.attempts) + ')' if resumed else 'started'}"
            f" under {c.layout.root}"
        )
        try:
            with cycle_mlflow_run(cfg, c.record, tags or {}) as parent:
                c.parent = c.record.mlflow_run_id = parent
                c.save()
                snap = c.snapshot(resumed)
                champion = registry.champion(cfg)
                if c.trigger(snap):
                    c.train_and_gate(snap, champion)
                    c.serve(snap)
                    c.record.status = "trained"
                    c.retain()
                else:
                    c.serve(snap)
                    c.record.status = "skipped"
                c.record.finished_at = utc_now()
                c.save()
                set_tags(cfg, parent, _summary_tags(c.record))
                log_record(cfg, parent, c.record)
        except BaseException as err:
            c.record.status, c.record.error = "failed", f"{type(err).__name__}: {err}"[:2000]
            c.record.finished_at = utc_now()
            c.save()
            set_tags(cfg, c.parent, {**_summary_tags(c.record), "wsidino.error": c.record.error})
            raise
    return CycleResult(c.record, message(c.record))


def _summary_tags(r: CycleRecord) -> dict[str, Any]:
    return {
        "wsidino.cycle": r.id,
        "wsidino.cycle_status": r.status,
        "wsidino.trigger": r.trigger.get("reason"),
        "wsidino.snapshot": r.snapshot.get("hash"),
        "wsidino.warm_start": r.warm_start.get("source"),
        "wsidino.decision": r.decision.get("reason"),
        "wsidino.evidence": r.decision.get("evidence"),
        "wsidino.promoted": r.decision.get("promoted") if r.decision else None,
    }


def message(r: CycleRecord) -> str:
    """The cycle in one line: the flow run's final message and the CLI's last line."""
    if r.status == "skipped":
        return f"cycle {r.id} skipped: {r.trigger.get('reason')}"
    if r.status != "trained":
        return f"cycle {r.id} {r.status}: {r.error or ''}"
    verdict = "promoted to @champion" if r.promoted else "not promoted"
    return (
        f"cycle {r.id} trained ({r.trigger.get('reason')}; warm start: {r.warm_start.get('source')}); "
        f"candidate v{r.decision.get('candidate_version')} {verdict}: "
        f"{r.decision.get('evidence') or r.decision.get('reason')}"
    )


__all__ = ["CycleResult", "StageRunner", "check_architecture", "message", "run_cycle"]
