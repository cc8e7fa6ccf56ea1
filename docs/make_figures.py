"""Draw the pictures in docs/ (run: .venv/bin/python docs/make_figures.py)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

OUT = Path(__file__).resolve().parent / "images"

STAGES = [
    ("tile", "WSIs → tissue mask →\nµm/px-exact tiles", "tiles.zarr\n+ manifest, QC PNGs"),
    ("pretrain", "DINO + iBOT + KoLeo\ntorchrun · FSDP2", "ckpt/<it>/ (DCP)\neval/training_<it>/"),
    ("gram", "gram anchoring\nauto-picked eval teacher", "ckpt/, eval/"),
    ("convert", "DCP → released\nkey layout", "backbone.pth"),
    ("export", "ONNX, dynamic\nbatch & size, ORT parity", "model.onnx"),
    ("extract", "features for every tile\nslide embeddings, PCA", "features.zarr\nPCA maps"),
]


def pipeline() -> None:
    fig, ax = plt.subplots(figsize=(13, 3.6))
    ax.set_xlim(0, 13)
    ax.set_ylim(0, 3.6)
    ax.axis("off")
    for i, (name, what, out) in enumerate(STAGES):
        x = 0.2 + i * 2.15
        ax.add_patch(FancyBboxPatch((x, 1.6), 1.8, 1.4, boxstyle="round,pad=0.05", fc="#e8f0fe", ec="#1a73e8"))
        ax.text(x + 0.9, 2.72, name, ha="center", va="center", fontsize=12, weight="bold")
        ax.text(x + 0.9, 2.12, what, ha="center", va="center", fontsize=8)
        ax.text(x + 0.9, 1.05, out, ha="center", va="center", fontsize=8, color="#5f6368", family="monospace")
        if i < len(STAGES) - 1:
            ax.add_patch(
                FancyArrowPatch((x + 1.85, 2.3), (x + 2.15, 2.3), arrowstyle="-|>", mutation_scale=14, color="#1a73e8")
            )
    ax.text(
        6.5,
        0.3,
        "flows/ (Prefect flows)  →  tasks/ (launch, torchrun, MLflow glue)  →  dinov3_core/ (one plain function per "
        "stage, typed config)        every stage: its own CLI, Prefect deployment, MLflow run, idempotent rerun",
        ha="center",
        fontsize=8,
        color="#3c4043",
    )
    fig.savefig(OUT / "pipeline.png", dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    pipeline()
