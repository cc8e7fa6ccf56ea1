"""The health side of a training run (a component of `loop.Trainer.train`): the schedule's summary and warnings at
the start, the health probe on the evaluation schedule (`health_probe.HealthProbe`, the EMA teacher's label-free
scores), every iteration's values judged by `health.HealthWatch` (which raises under `health.policy=stop`, on every
rank alike), and the run's verdict written to `HEALTH_FILE` at the end."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from dinov3_core.train import config as C
from dinov3_core.train.distributed import DistEnv
from dinov3_core.train.health import HEALTH_FILE, HealthWatch, schedule_summary, schedule_warnings
from dinov3_core.train.health_probe import HealthProbe

logger = logging.getLogger(__name__)

Embed = Callable[[torch.Tensor], torch.Tensor]


class HealthSchedule:
    def __init__(
        self, cfg: C.PretrainConfig, env: DistEnv, stage: str, probe: HealthProbe | None, stop_iteration: int
    ) -> None:
        self.env, self.stage, self.probe = env, stage, probe
        self.watch = HealthWatch(cfg)
        if env.is_main:
            logger.info("%s: %s", stage, schedule_summary(cfg))
            for warning in schedule_warnings(cfg, stop_iteration):
                logger.warning("%s: %s", stage, warning)

    def observe(self, iteration: int, values: dict[str, float], *, probe_due: bool, embed: Embed) -> dict[str, float]:
        """Judge `iteration`'s values, with the probe's scores when it is due (collective: every rank calls it at
        the same iterations); returns those scores ({} when none ran)."""
        probe = self.probe.measure(embed) if probe_due and self.probe else {}
        alarm = self.watch.observe(iteration, {**values, **probe})  # raises under health.policy=stop, all ranks
        if alarm is not None and self.env.is_main:
            logger.warning("%s: %s", self.stage, alarm)
        return probe

    def finish(self, output_dir: Path, end_iteration: int) -> str:
        """The run's verdict, also written for the stage summary (dinov3_core.runner) and whoever looks at the run."""
        verdict = self.watch.verdict()
        if self.env.is_main:
            (output_dir / HEALTH_FILE).write_text(json.dumps({"iteration": end_iteration, "verdict": verdict}) + "\n")
        return verdict
