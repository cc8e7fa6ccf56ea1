"""The table in docs/hardware.md: for each GPU recipe and GPU memory size, the micro-batch and gradient
accumulation `batch_size_per_gpu=auto` picks and the peak memory it expects (`dinov3_core.train.memory`).

    .venv/bin/python docs/make_hardware_table.py          # rewrite the table in docs/hardware.md
    .venv/bin/python docs/make_hardware_table.py --check  # exit 1 when the table is stale (tests/test_hardware.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DOCS = (Path(__file__).resolve().parent / "hardware.md",)  # every page that carries the table (the README links to it)
BEGIN, END = "<!-- hardware-table: begin -->", "<!-- hardware-table: end -->"
RECIPES = (  # (config, GPUs per run)
    ("vits16-1gpu", 1),
    ("vitb16-1gpu", 1),
    ("vitl16-1gpu", 1),
    ("vits16-continued", 8),
    ("vitb16-continued", 8),
    ("vitl16-continued", 8),
)
GPU_GB = (24, 40, 80)
BUDGET_SHARE = 0.9  # the planner's default budget: 90 % of the GPU's memory


def cell(cfg: object, shape: object, gpus: int, gb: int) -> str:
    from dinov3_core.errors import WsidinoError
    from dinov3_core.train.batch_plan import plan_batch
    from dinov3_core.train.memory_terms import GIB

    try:
        plan = plan_batch(cfg, shape, world_size=gpus, budget_bytes=int(BUDGET_SHARE * gb * GIB), device_type="cuda")  # type: ignore[arg-type]
    except WsidinoError:
        return "does not fit"
    return f"{plan.micro_batch} × {plan.accumulation_steps}, {plan.estimate.total / GIB:.1f} GiB"


def backbone_params(cfg: object) -> int:
    import torch

    from dinov3_core.models.vision_transformer import build_backbone
    from dinov3_core.train import model_config as MC

    with torch.device("meta"):
        return sum(p.numel() for p in build_backbone(cfg.student.arch, **MC.backbone_overrides(cfg)).parameters())  # type: ignore[attr-defined]


def table() -> str:
    from dinov3_core.config import load_config
    from dinov3_core.train import config as C
    from dinov3_core.train.memory import model_shape

    head = [
        "| recipe (`--config`) | backbone | global batch | GPUs | " + " | ".join(f"{g} GB GPU" for g in GPU_GB) + " |"
    ]
    head.append("|---|---|---|---|" + "---|" * len(GPU_GB))
    rows = []
    for name, gpus in RECIPES:
        values = {"student.pretrained_weights": "released.pth", "data.stores": ["tiles.zarr"], "output_dir": "run"}
        cfg = load_config(C.PretrainConfig, name, values, stage="pretrain")
        shape = model_shape(cfg)
        backbone = backbone_params(cfg)
        ckpt = ", act. ckpt" if cfg.train.activation_checkpointing else ""
        params = f"{cfg.student.arch}, {backbone / 1e6:.0f}M{ckpt}"
        cells = " | ".join(cell(cfg, shape, gpus, gb) for gb in GPU_GB)
        rows.append(f"| `{name}` | {params} | {cfg.train.global_batch_size} | {gpus} | {cells} |")
    return "\n".join(head + rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    current = table()
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        new = f"{text[:start]}\n{current}\n{text[end:]}"
        if new != text:
            stale.append(doc.name)
            if not args.check:
                doc.write_text(new)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
