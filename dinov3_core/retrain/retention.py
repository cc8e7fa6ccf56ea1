"""What finished cycles keep, decided at the end of each trained cycle (under the root lock, so no other cycle
runs meanwhile):

* the champion's cycle: everything;
* the running cycle, and any cycle not finished: nothing is touched;
* cycles once promoted (`keep_previous_champions`): backbone, ONNX and evaluation, so a rollback can warm-start
  from them; their DCP checkpoints go when `delete_checkpoints`, their teacher-only eval checkpoints when
  `delete_eval_checkpoints` (the small records beside them stay);
* the last `keep_last` other trained cycles: the same;
* older trained, failed or abandoned cycles: everything but the records (cycle.json, snapshot.json and the
  evaluation's evaluation.json / evaluation.md).

Whatever holds the registry champion's files (`protected`: its backbone and ONNX, wherever its tags say they are)
is never deleted, whichever cycle it is in, even a champion registered outside any cycle or moved by hand.
Deletion goes through `_remove`, which refuses any path outside `<root>/cycles/<id>/` and removes a symbolic link
itself, never what it points to.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from dinov3_core.retrain.config import RetentionConfig
from dinov3_core.retrain.cycles import FINISHED, CycleLayout, CycleRecord

RECORDS = {"cycle.json", "snapshot.json"}
EVALUATION_RECORDS = {"evaluation.json", "evaluation.md"}


@dataclass
class RetentionPlan:
    delete: list[Path] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # cycle id → why it keeps what it keeps

    def as_dict(self, root: Path) -> dict[str, object]:
        return {"deleted": [str(p.relative_to(root)) for p in self.delete], "kept": self.kept}


def _checkpoints(cycle_dir: Path) -> list[Path]:
    return sorted(d for d in cycle_dir.glob("*/ckpt") if d.is_dir())  # every training stage's DCP checkpoints


def _eval_checkpoints(cycle_dir: Path) -> list[Path]:
    return sorted(cycle_dir.glob("*/eval/training_*/teacher_checkpoint.pth"))


def _all_but_records(cycle_dir: Path) -> list[Path]:
    out = [p for p in cycle_dir.iterdir() if p.name not in RECORDS and p.name != "evaluation"]
    evaluation = cycle_dir / "evaluation"
    if evaluation.is_dir():
        out += [p for p in evaluation.iterdir() if p.name not in EVALUATION_RECORDS]
    return sorted(out)


def plan(
    layout: CycleLayout,
    cycles: list[CycleRecord],
    cfg: RetentionConfig,
    running: str,
    champion_cycle: str | None,
    protected: Iterable[Path] = (),
) -> RetentionPlan:
    """What to delete. `protected`: files that must survive (the champion's), with every folder holding them."""
    result = RetentionPlan()
    others = 0
    for c in reversed(cycles):  # newest first: the last `keep_last` are the newest
        d = layout.cycle_dir(c.id)
        if c.id == running or c.status not in FINISHED or not d.is_dir():
            result.kept[c.id] = "running or not finished: untouched"
            continue
        if c.id == champion_cycle:
            result.kept[c.id] = "the champion's cycle: kept whole"
            continue
        if c.status == "skipped":
            continue  # a skipped cycle holds only its records
        keeps_models = c.status == "trained" and (
            (cfg.keep_previous_champions and c.promoted) or (not c.promoted and others < cfg.keep_last)
        )
        if c.status == "trained" and not c.promoted:
            others += 1
        if keeps_models:
            result.kept[c.id] = "backbone, ONNX and evaluation kept" + (" (once champion)" if c.promoted else "")
            if cfg.delete_checkpoints:
                result.delete += _checkpoints(d)
            if cfg.delete_eval_checkpoints:
                result.delete += _eval_checkpoints(d)
        else:
            result.kept[c.id] = "records only"
            result.delete += _all_but_records(d)
    keep = [Path(p).resolve() for p in protected]
    spared = [p for p in result.delete if any(k == p.resolve() or p.resolve() in k.parents for k in keep)]
    for p in spared:
        result.kept[str(p)] = "holds the champion's files"
    result.delete = [p for p in result.delete if p not in spared]
    return result


def _remove(layout: CycleLayout, path: Path) -> None:
    cycles = layout.cycles.resolve()
    # The entry itself (a symbolic link is judged and removed where it is, not where it points).
    target = path.parent.resolve() / path.name
    if cycles not in target.parents or target.parent == cycles:
        raise RuntimeError(f"retention refused to delete {target}: not inside a cycle directory under {cycles}")
    if target.is_symlink() or not target.is_dir():
        target.unlink(missing_ok=True)
    else:
        shutil.rmtree(target)  # removes links inside, never what they point to


def apply(layout: CycleLayout, retention: RetentionPlan) -> None:
    for path in retention.delete:
        _remove(layout, path)


__all__ = ["RetentionPlan", "apply", "plan"]
