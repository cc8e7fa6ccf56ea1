"""The shortened run of the whole chain that the flow and command-line tests and the docs' screenshots share: a
complete run in a few minutes on 2 cores instead of the `cpu` recipe's hour of training."""

from __future__ import annotations

# One training stage (pretrain or gram) cut to 4 iterations: global batch 8 in micro-batches of 4, no warm-up and no
# frozen last layer (every step moves every weight), a checkpoint and an evaluation every 2 iterations.
SHORT_TRAIN = [
    "train.global_batch_size=8",
    "train.batch_size_per_gpu=4",
    "optim.warmup_epochs=0",
    "optim.freeze_last_layer_epochs=0",
    "train.stop_at=4",
    "checkpointing.period=2",
    "evaluation.eval_period_iterations=2",
]
# The export's ONNX parity check on one small size and batch.
SHORT_EXPORT = ["parity_sizes=[32]", "parity_batches=[2]"]
# Pipeline overrides: small tiles at 2 µm/px, both training stages on the tiny configs and `SHORT_TRAIN`, the short
# export check.
SHORT_RUN = [
    "tile.tile_size=64",
    "tile.mpp=2.0",
    "tile.workers=1",
    *(f"{stage}.{item}" for stage in ("pretrain", "gram") for item in ("config=tiny", *SHORT_TRAIN)),
    *(f"export.{item}" for item in SHORT_EXPORT),
]
