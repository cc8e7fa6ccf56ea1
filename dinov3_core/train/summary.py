"""What a training run leaves, as its stage's manifest records it (pretrain and gram alike): `TrainingSummary`
(the last metrics line, the health probe's latest scores and verdict, for gram the chosen teacher) and the outputs
that must exist (`run_outputs`), both read from the run directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dinov3_core.stage import Summary

# The health figures the pipeline prints beside the evaluation, in this order.
HEALTH_FIGURES = ("iteration", "dino_gap", "teacher_entropy", "agreement", "effective_rank", "invariance")
# The last metrics line's figures a training stage's summary carries (losses, health signals, throughput, memory).
METRIC_KEYS = ("total_loss", "dino_gap", "teacher_entropy", "agreement", "images_per_s", "max_rss_mb", "gram_loss")


@dataclass
class TrainingSummary(Summary):
    iteration: int | None = None
    total_loss: float | None = None
    dino_gap: float | None = None
    teacher_entropy: float | None = None
    agreement: float | None = None
    images_per_s: float | None = None
    max_rss_mb: float | None = None
    gram_loss: float | None = None
    memory_replans: int | None = None
    effective_rank: float | None = None  # the health probe's latest scores (dinov3_core.train.health_probe)
    invariance: float | None = None
    health: str | None = None  # the verdict: learning, or not and why
    gram_teacher: str | None = None  # gram: the chosen teacher checkpoint
    gram_teacher_iteration: int | None = None

    def health_report(self) -> str | None:
        figures = self.to_json()
        values = ", ".join(f"{k} {figures[k]}" for k in HEALTH_FIGURES if k in figures)
        return f"{self.health or 'no verdict'}\n            {values}"

    def note(self) -> str:
        return f"teacher {self.gram_teacher}" if self.gram_teacher else ""


def training_summary(cfg: Any) -> TrainingSummary:
    """The last metrics line (iteration, losses, throughput, memory), the health probe's latest scores and
    verdict and, for gram, the chosen teacher."""
    out = Path(cfg.output_dir)
    s = TrainingSummary()
    metrics = out / "training_metrics.json"
    if metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        rows = [r for r in records if "event" not in r]  # event lines (memory re-plans) are not steps
        if rows:
            last = rows[-1]
            s.iteration = last.get("iteration")
            for key in METRIC_KEYS:
                if isinstance(last.get(key), int | float):
                    setattr(s, key, round(float(last[key]), 4))
            s.memory_replans = sum(1 for r in records if r.get("event") == "memory_replan") or None
            probed = [r for r in rows if isinstance(r.get("effective_rank"), int | float)]
            if probed:
                s.effective_rank = round(float(probed[-1]["effective_rank"]), 4)
                s.invariance = round(float(probed[-1]["invariance"]), 4)
    health = out / "health.json"
    if health.is_file():
        s.health = json.loads(health.read_text()).get("verdict")
    selection = out / "gram_teacher_selection.json"
    if selection.is_file():
        chosen = json.loads(selection.read_text()).get("chosen", {})
        s.gram_teacher = chosen.get("path")
        s.gram_teacher_iteration = chosen.get("iteration")
    return s


def run_outputs(cfg: Any) -> dict[str, str]:
    from dinov3_core.train.checkpoint import latest_checkpoint

    run = Path(cfg.output_dir)
    out = {"run_dir": str(run)}
    last = latest_checkpoint(run / "ckpt")
    if last is not None:
        out["last_checkpoint"] = str(last)
    evals = sorted((run / "eval").glob("training_*/teacher_checkpoint.pth"))
    if evals:
        out["last_eval_teacher"] = str(evals[-1])
    return out


__all__ = ["HEALTH_FIGURES", "METRIC_KEYS", "TrainingSummary", "run_outputs", "training_summary"]
