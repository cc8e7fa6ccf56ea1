"""What one `Trainer.train` invocation returns (`run_pretrain`'s result; the gram stage's extends it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class PretrainResult:
    output_dir: Path
    start_iteration: int  # first iteration trained by this invocation (> 0 after a resume)
    end_iteration: int  # iterations completed in total (the next one to train)
    total_iterations: int  # schedule length
    global_batch: int
    micro_batch: int
    accumulation_steps: int
    world_size: int
    resumed_from: Path | None
    last_checkpoint: Path | None
    eval_checkpoints: list[Path] = field(default_factory=list)
    metrics_path: Path | None = None
    loss_curve: Path | None = None
    final_losses: dict[str, float] = field(default_factory=dict)
    memory_replans: int = 0  # re-plans by the memory watch, this invocation and those it resumed
    # Global batch / iteration time over this invocation's iterations after its first; the first (compile warm-up,
    # loader start-up) is first_step_seconds.
    images_per_second: float = 0.0
    first_step_seconds: float = 0.0
    health: str = ""  # learning / not learning (and why) / not judged yet: dinov3_core.train.health
