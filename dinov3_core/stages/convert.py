"""convert: a DCP training checkpoint → backbone.pth in the released DINOv3 key layout (+ config.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dinov3_core.convert.config import ConvertConfig
from dinov3_core.convert.summary import ConvertSummary
from dinov3_core.stage import ChainPaths, CliOption, Place, RunHooks, Stage


def _work(cfg: ConvertConfig, hooks: RunHooks) -> tuple[Any, ConvertSummary]:
    from dinov3_core.convert.convert import run_convert
    from dinov3_core.evaluate.checkpoints import best_knn_checkpoint

    r = run_convert(cfg, choose=best_knn_checkpoint)  # select=best_knn: the kNN curve of the run's eval checkpoints
    hooks.log(f"convert: {r.checkpoint} → {r.backbone}")
    return r, ConvertSummary(
        str(r.checkpoint), r.iteration, r.arch, round(r.backbone_bytes / 1e6, 2), round(r.checkpoint_bytes / 1e6, 2)
    )


def _chain_values(p: ChainPaths) -> dict[str, Any]:
    trained = p.output("gram" if "gram" in p.runs else "pretrain")  # the last training run of this chain
    return {"input": str(trained), "output_dir": str(p.output("convert"))}


STAGE: Stage[ConvertSummary] = Stage(
    name="convert",
    help="DCP checkpoint → backbone.pth with the released DINOv3 key layout.",
    schema=lambda: ConvertConfig,
    summary_type=ConvertSummary,
    output=lambda c: c.output_dir,
    output_is_dir=True,
    place=Place("model", contents="backbone.pth in the released key layout, config.yaml"),
    inputs=lambda c: {"checkpoint": c.input, "tile_store": c.store, "annotations": c.annotations},
    outputs=lambda c: {
        "backbone": str(Path(c.output_dir) / "backbone.pth"),
        "arch_config": str(Path(c.output_dir) / "config.yaml"),
    },
    chain_values=_chain_values,
    work=_work,
    options=(
        CliOption("--input", "input", "a ckpt/<iteration>/ directory, or a run directory (latest checkpoint)"),
        CliOption("--output-dir", "output_dir", "where backbone.pth and config.yaml go"),
    ),
    override_example="which=student safetensors=true",
)
