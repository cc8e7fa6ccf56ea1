"""Draw the pictures in docs/ (run: .venv/bin/python docs/make_figures.py [--health bench-output/training_health.json]).

`--health` redraws the healthy-vs-inert training picture from `benchmarks/training_health.py`'s measured curves.
"""

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
    ("export", "ONNX, dynamic\nbatch & size, ORT parity", "model.onnx\n@candidate"),
    ("evaluate", "probes on annotations\nvs @champion, baseline", "evaluation.json\n@champion (gate)"),
    ("extract", "features for every tile\nslide embeddings, PCA", "features.zarr\nPCA maps"),
]


def pipeline() -> None:
    width = 0.4 + len(STAGES) * 2.15
    fig, ax = plt.subplots(figsize=(width, 3.6))
    ax.set_xlim(0, width)
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
        width / 2,
        0.3,
        "flows/ (Prefect flows)  →  tasks/ (run-stage task, forms, MLflow parent run)  →  dinov3_core/ (stage runner, "
        "torchrun launcher, one plain function per stage, typed config)\nevery stage: a CLI command and a Prefect "
        "deployment through the same runner, one MLflow run, idempotent rerun",
        ha="center",
        fontsize=8,
        color="#3c4043",
    )
    fig.savefig(OUT / "pipeline.png", dpi=110, bbox_inches="tight")


def pipeline_parallel() -> None:
    """Left: who holds what with 2 pipeline stages × 2 data-parallel processes. Right: one optimizer step of 1F1B
    with 4 pipeline micro-batches (one accumulation step), with the whole-step teacher pass before it."""
    fig, (grid, time) = plt.subplots(1, 2, figsize=(13, 3.9), gridspec_kw={"width_ratios": [1, 1.55]})
    grid.set_xlim(0, 6.2)
    grid.set_ylim(0, 4.2)
    grid.axis("off")
    holds = [
        "patch embedding, tokens\nblocks 0 … k−1\n(FSDP shard of the stage)",
        "blocks k … depth−1, norms,\nDINO + iBOT heads, loss,\nteacher heads, Sinkhorn",
    ]
    for stage in range(2):
        for dp in range(2):
            x, y = 0.2 + stage * 3.0, 2.2 - dp * 2.0
            rank = stage * 2 + dp
            grid.add_patch(FancyBboxPatch((x, y), 2.7, 1.7, boxstyle="round,pad=0.04", fc="#e8f0fe", ec="#1a73e8"))
            grid.text(
                x + 1.35, y + 1.42, f"rank {rank}: stage {stage}, dp {dp}", ha="center", fontsize=9, weight="bold"
            )
            grid.text(x + 1.35, y + 0.75, holds[stage], ha="center", va="center", fontsize=7.5)
            grid.text(x + 1.35, y + 0.14, "+ that stage of the teacher", ha="center", fontsize=7, color="#5f6368")
        grid.add_patch(FancyArrowPatch((2.95, 3.05 - 2.0 * 0), (3.2, 3.05), arrowstyle="-|>", mutation_scale=12))
        grid.add_patch(FancyArrowPatch((2.95, 1.05), (3.2, 1.05), arrowstyle="-|>", mutation_scale=12))
    grid.text(3.1, 4.05, "activations →  ← gradients (pipeline group: same dp index)", ha="center", fontsize=8)
    grid.text(
        3.1,
        -0.05,
        "FSDP all-gather / reduce-scatter within a stage (data-parallel group: same stage)",
        ha="center",
        fontsize=8,
        color="#5f6368",
    )

    # 1F1B, 2 stages, 4 micro-batches: stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3; stage 1 F0 B0 F1 B1 … one slot later.
    slots = {
        0: ["F0", "F1", None, "B0", "F2", "B1", "F3", "B2", None, "B3"],
        1: [None, "F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", None],
    }
    time.set_xlim(-5.2, 11.3)
    time.set_ylim(-0.9, 2.4)
    time.axis("off")
    for stage, row in slots.items():
        y = 1.3 - stage * 1.1
        time.text(-5.1, y + 0.35, f"stage {stage}", fontsize=9, weight="bold", va="center")
        what = "teacher forward,\nwhole step" if stage == 0 else "teacher forward,\nheads, Sinkhorn"
        time.add_patch(FancyBboxPatch((-3.0, y), 2.8, 0.7, boxstyle="round,pad=0.02", fc="#fde7c8", ec="#e37400"))
        time.text(-1.6, y + 0.35, what, ha="center", va="center", fontsize=7)
        for t, op in enumerate(row):
            if op is None:
                time.add_patch(FancyBboxPatch((t, y), 0.92, 0.7, boxstyle="square,pad=0", fc="#f1f3f4", ec="#dadce0"))
                continue
            colour = "#c6dafc" if op[0] == "F" else "#ceead6"
            time.add_patch(FancyBboxPatch((t, y), 0.92, 0.7, boxstyle="square,pad=0", fc=colour, ec="#5f6368"))
            time.text(t + 0.46, y + 0.35, op, ha="center", va="center", fontsize=9)
    time.add_patch(FancyBboxPatch((10.05, 0.2), 1.0, 1.8, boxstyle="round,pad=0.02", fc="#fce8e6", ec="#d93025"))
    time.text(10.55, 1.1, "clip\nAdamW\nEMA\n(local)", ha="center", va="center", fontsize=7)
    note = "grey: the pipeline bubble, (p − 1)/(m + p − 1) of the schedule (here 1/5); each loss × 1/(GA·m)"
    time.text(4.5, -0.75, note, ha="center", fontsize=8, color="#3c4043")
    fig.savefig(OUT / "pipeline_parallel.png", dpi=110, bbox_inches="tight")


# Orchestration: what each stage subflow runs, the manifest it writes, the MLflow child run it logs to.
ORCH = [
    (
        "tile",
        "run-stage task\n→ tile engine: slides\n+ shard ranges over\nworkers processes",
        "tiles.zarr/\nstage_manifest.json",
        "QC pictures, config,\nstore manifest.json\n+ manifest",
    ),
    (
        "pretrain",
        "run-stage task\n→ torchrun, N ranks\nrank 0 → Prefect log\nretries: crashes only",
        "pretrain/\nstage_manifest.json",
        "metrics, loss curve\n(one run across\nretries) + manifest",
    ),
    (
        "gram",
        "run-stage task\n→ torchrun, N ranks\nretries resume from\nlast DCP checkpoint",
        "gram/\nstage_manifest.json",
        "gram_loss, metrics,\nloss curve\n+ manifest",
    ),
    (
        "convert",
        "run-stage task\nin process\n(no retries)",
        "model/\nstage_manifest.json",
        "sizes, config.yaml\n+ manifest",
    ),
    (
        "export",
        "run-stage task\nin process\n(no retries)",
        "model/model.onnx.\nstage_manifest.json",
        "ONNX model → registry\nwsidino-backbone\n@candidate + manifest",
    ),
    (
        "evaluate",
        "run-stage task\nin process\n(no retries)",
        "evaluation/\nstage_manifest.json",
        "probes, health, gate;\n@champion moved when\nbetter + manifest",
    ),
    (
        "extract",
        "run-stage task\nin process\n(no retries)",
        "features.zarr/\nstage_manifest.json",
        "throughput, PCA maps\n+ manifest",
    ),
]


def orchestration() -> None:
    blue, blue_fc = "#1a73e8", "#e8f0fe"
    amber, amber_fc = "#e37400", "#fef7e0"
    green, green_fc = "#188038", "#e6f4ea"
    note = "#3c4043"
    width = 0.25 + len(ORCH) * 2.13 + 0.1  # one column per stage
    fig, ax = plt.subplots(figsize=(width, 8.4))
    ax.set_xlim(0, width)
    ax.set_ylim(0, 8.4)
    ax.axis("off")

    def band(y: float, h: float, ec: str, title: str, right: str, bottom: str) -> None:
        frame = FancyBboxPatch((0.08, y), width - 0.16, h, boxstyle="round,pad=0.02", fc="#fafafa", ec=ec, ls="--")
        ax.add_patch(frame)
        label = {"va": "center", "zorder": 5, "bbox": {"fc": "#fafafa", "ec": "none", "pad": 1.5}}
        ax.text(0.2, y + h - 0.2, title, ha="left", fontsize=10.5, weight="bold", color=ec, **label)
        ax.text(width - 0.2, y + h - 0.2, right, ha="right", fontsize=8, color=note, **label)
        if bottom:
            ax.text(width / 2, y + 0.2, bottom, ha="center", va="center", fontsize=8, color=note)

    def arrow(a: tuple[float, float], b: tuple[float, float], color: str) -> None:
        ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12, color=color, lw=1.1))

    band(
        5.45,
        2.85,
        blue,
        "run_pipeline: Prefect flow or wsidino pipeline",
        "slides, workdir, config, weights, start_at … stop_after, force[ ]   ·   "
        "a rerun or Retry resumes at the failed stage",
        "",
    )
    band(
        3.3,
        1.95,
        amber,
        "<workdir>: stage manifests",
        "a stage is skipped when its manifest is complete, with the same config_hash and input fingerprints, "
        "and its outputs exist",
        "→  the upstream manifest's output_fingerprint (config, inputs, output content) is the downstream input "
        "fingerprint: an upstream rerun with new outputs reruns what follows",
    )
    band(
        0.1,
        3.0,
        green,
        "MLflow experiment",
        "a skipped stage gets a child tagged wsidino.status=skipped, wsidino.reused_run_id",
        "every child: wsidino.stage, prefect.* tags and wsidino.lineage.<stage>_run_id of each upstream stage; "
        "torchrun rank 0 logs into its stage's child",
    )

    # MLflow parent run, spanning all stages.
    ax.add_patch(FancyBboxPatch((0.25, 2.2), width - 0.5, 0.4, boxstyle="round,pad=0.04", fc=green_fc, ec=green))
    ax.text(
        width / 2,
        2.4,
        "parent run  pipeline/<flow run name>:  pipeline parameters, pipeline_summary.json;  "
        "tags prefect.flow_run_id, prefect.flow_run_url, wsidino.workdir",
        ha="center",
        va="center",
        fontsize=8.5,
    )

    for i, (name, task_text, manifest, logged) in enumerate(ORCH):
        x, w = 0.25 + i * 2.13, 1.8
        cx = x + w / 2
        # The stage's task run and what it runs.
        ax.add_patch(FancyBboxPatch((x, 5.65), w, 2.1, boxstyle="round,pad=0.05", fc=blue_fc, ec=blue))
        ax.text(cx, 7.5, name, ha="center", va="center", fontsize=12, weight="bold")
        ax.text(cx, 6.4, task_text, ha="center", va="center", fontsize=7.8)
        if i < len(ORCH) - 1:
            arrow((x + w + 0.06, 6.7), (x + 2.13 - 0.06, 6.7), blue)
        # Its manifest.
        ax.add_patch(FancyBboxPatch((x + 0.1, 3.85), w - 0.2, 0.8, boxstyle="round,pad=0.04", fc=amber_fc, ec=amber))
        ax.text(cx, 4.25, manifest, ha="center", va="center", fontsize=7.5, family="monospace")
        arrow((cx, 5.6), (cx, 4.72), amber)
        if i < len(ORCH) - 1:
            arrow((x + w - 0.05, 4.25), (x + 2.13 + 0.05, 4.25), amber)
        # Its MLflow child run under the pipeline's parent run.
        ax.add_patch(FancyBboxPatch((x + 0.05, 0.6), w - 0.1, 1.3, boxstyle="round,pad=0.04", fc="white", ec=green))
        ax.text(cx, 1.66, f"child: {name}", ha="center", va="center", fontsize=9, weight="bold")
        ax.text(cx, 1.12, logged, ha="center", va="center", fontsize=7.5)
        ax.plot([cx, cx], [2.16, 1.96], color=green, lw=1.2)
    fig.savefig(OUT / "orchestration.png", dpi=110, bbox_inches="tight")


def training_health(measured: Path) -> None:
    """A healthy and an inert run of the same recipe, as `benchmarks/training_health.py` measured them."""
    import json
    import math

    runs = json.loads(measured.read_text())
    fig, (gap_ax, ent_ax) = plt.subplots(1, 2, figsize=(10, 3.4))
    for key, run in runs.items():
        if not key.startswith("cpu"):
            continue
        its = [p[0] for p in run["curve"]]
        label = f"{key.split(' / ')[1]}: {run['verdict'].split(':')[0]}"
        gap_ax.plot(its, [p[1] for p in run["curve"]], label=label)
        ent_ax.plot(its, [p[2] for p in run["curve"]], label=label)
    gap_ax.axhline(0.0, color="grey", lw=0.8)
    gap_ax.axhline(0.02, color="#d93025", lw=0.8, ls=":", label="health.min_gap")
    gap_ax.set_title(f"dino_gap = ln K − DINO loss (ln K = {math.log(256):.3f})", fontsize=10)
    gap_ax.set_xlabel("iteration")
    gap_ax.set_ylabel("nats below the no-information level")
    gap_ax.legend(fontsize=8)
    ent_ax.set_title("teacher_entropy (share of ln K; 1 = uniform targets)", fontsize=10)
    ent_ax.set_xlabel("iteration")
    ent_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "training_health.png", dpi=110)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--health", type=Path, help="benchmarks/training_health.py's JSON")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    pipeline()
    orchestration()
    pipeline_parallel()
    if args.health:
        training_health(args.health)
