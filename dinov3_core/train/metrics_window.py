"""What a training run reports, iteration by iteration (a component of `loop.Trainer.train`): every iteration's
values and timings go into a window, a metrics line is written with the window's means every `train.log_period`
iterations (and on the first, the last and every probe iteration), and the run's throughput and loss curve come
at the end. What a line holds is `metrics`'s."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dinov3_core.train import config as C
from dinov3_core.train import metrics as M
from dinov3_core.train.distributed import DistEnv
from dinov3_core.train.optim import Schedules

logger = logging.getLogger(__name__)

OnMetrics = Callable[[dict[str, Any]], None]


class MetricsWindow:
    def __init__(
        self,
        cfg: C.PretrainConfig,
        env: DistEnv,
        writer: M.MetricsWriter,
        schedules: Schedules,
        *,
        start_iteration: int,
        total_iterations: int,
        end_iteration: int | None = None,
        on_metrics: OnMetrics | None,
    ) -> None:
        self.cfg, self.env, self.writer, self.schedules = cfg, env, writer, schedules
        self.start_iteration, self.total_iterations = start_iteration, total_iterations
        self.end_iteration = end_iteration  # train.stop_at: the ETA counts to this run's end, not the schedule's
        self.on_metrics = on_metrics
        self.means = M.WindowMeans()
        self.first_step_seconds = 0.0  # compile warm-up, loader start-up: not throughput
        self.run_time = 0.0  # the iterations after the first

    def add(self, iteration: int, values: dict[str, float], *, iter_time: float, data_time: float) -> None:
        if iteration == self.start_iteration:
            self.first_step_seconds = iter_time
        else:
            self.run_time += iter_time
        self.means.add({**values, "iter_time": iter_time, "data_time": data_time})

    def line_due(self, iteration: int, *, last: bool) -> bool:
        return (iteration + 1) % self.cfg.train.log_period == 0 or iteration == self.start_iteration or last

    def write_line(self, iteration: int, extra: dict[str, float], batch: dict[str, int]) -> dict[str, Any]:
        """Write one metrics line of the window's means and `extra` (collective: every rank calls it at the same
        iterations), log it and hand it to `on_metrics` on rank 0. `batch`: the current split (`M.batch_fields`)."""
        record = M.step_record(
            iteration,
            {**self.means.flush(), **extra},
            self.schedules.at(iteration),
            self.env,
            global_batch=batch["global_batch_size"],
            micro_batch=batch["micro_batch_size"],
            accumulation_steps=batch["accumulation_steps"],
        )
        self.writer.write(record)
        if self.env.is_main:
            logger.info("%s", M.progress_line(record, self.total_iterations, self.end_iteration))
        self.report(record)
        return record

    def report(self, record: dict[str, Any]) -> None:
        """Hand a metrics line or event to `on_metrics` (rank 0)."""
        if self.on_metrics is not None and self.env.is_main:
            self.on_metrics(record)

    def images_per_second(self, global_batch: int, end_iteration: int) -> float:
        """Global batch / iteration time over the iterations after the first (the first alone when it is all)."""
        steady = end_iteration - self.start_iteration - 1
        return global_batch * steady / self.run_time if steady else global_batch / self.first_step_seconds

    def plot(self, output_dir: Path, stage: str) -> Path | None:
        """The run's loss curve (rank 0; None elsewhere)."""
        if not self.env.is_main:
            return None
        return M.plot_loss_curve(
            self.writer.path,
            output_dir / M.LOSS_CURVE_FILE,
            stage,
            run_name=f"{output_dir.parent.name}/{output_dir.name}",
            n_prototypes=self.cfg.heads.dino.n_prototypes,
            min_gap=self.cfg.health.min_gap,
            min_effective_rank=self.cfg.health.min_effective_rank,
        )
