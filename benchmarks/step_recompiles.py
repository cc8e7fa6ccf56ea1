"""How often a whole-step `torch.compile(forward_backward)` recompiles over a run, and whether it stays compiled.

    python benchmarks/step_recompiles.py --shape vit_test --steps 10 --n-micro 1 --output bench-output

Each step draws fresh iBOT masks (`IBOTMaskSampler`, the `cpu` recipe's ratios), so the number of masked patches M
changes every step, as in training. Dynamo specialises on M at the first compile; on the first change it recompiles
with M dynamic (automatic dynamic shapes) and should then reuse that graph. Dynamo's recompile limit is left at its
default (8) and `fail_on_recompile_limit_hit` is set: were the limit ever hit, this raises instead of silently running
the rest eagerly. Per step: graphs compiled (a counting wrapper around Inductor), seconds, M.

Output: a table on stdout and `<output>/step_recompiles.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def recompile_study(shape: str, steps: int, n_micro: int) -> dict[str, Any]:
    """Graphs compiled per step of a whole-step-compiled training step with fresh masks every step."""
    from torch._inductor.compile_fx import compile_fx
    from upstream_step import batch_size, build_ours, our_backbone_kwargs, our_config

    from dinov3_core.data.augment import MultiCrops
    from dinov3_core.data.masking import IBOTMaskSampler
    from dinov3_core.train.distributed import DistEnv
    from dinov3_core.train.ssl_model import LOSS_NAMES, SIGNAL_NAMES
    from dinov3_core.train.step import forward_backward

    graphs = 0

    def counting_inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        nonlocal graphs
        graphs += 1
        return compile_fx(gm, example_inputs)

    cfg, batch = our_config(shape), batch_size(shape)
    c = cfg.crops
    model, optimizer = build_ours(cfg, compiled=False)
    sampler = IBOTMaskSampler(
        c.global_size // our_backbone_kwargs(cfg)["patch_size"],
        mask_ratio=tuple(c.mask_ratio),
        mask_probability=c.mask_probability,
    )
    env = DistEnv(device=torch.device("cpu"))
    keys = (*LOSS_NAMES, *SIGNAL_NAMES)
    torch._dynamo.reset()
    step_fn = torch.compile(forward_backward, backend=counting_inductor)
    per_step = []
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        for i in range(steps):
            torch.manual_seed(i)
            crops = MultiCrops(
                torch.randn(c.n_global_crops, batch, 3, c.global_size, c.global_size),
                torch.randn(c.n_local_crops, batch, 3, c.local_size, c.local_size),
            )
            masks = sampler(batch, c.n_global_crops, rng=i)
            before, start = graphs, time.perf_counter()
            step_fn(
                model, None, env, crops, masks, keys=keys, n_micro=n_micro, teacher_temp=0.07, koleo_base=0, bf16=False
            )
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            per_step.append(
                {
                    "step": i,
                    "masked_patches": masks.n_masked_patches,
                    "graphs_compiled": graphs - before,
                    "seconds": time.perf_counter() - start,
                }
            )
    return {
        "shape": shape,
        "batch": batch,
        "n_micro": n_micro,
        "steps": per_step,
        "graphs_total": graphs,
        "recompile_limit": 8,
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="vit_test", help="vit_test or vit_small (upstream_step.py's shapes)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--n-micro", type=int, default=1, help="micro-batches a step (gradient accumulation)")
    parser.add_argument("--output", default="bench-output")
    args = parser.parse_args()
    doc = recompile_study(args.shape, args.steps, args.n_micro)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_recompiles.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\n{args.shape}, batch {doc['batch']}, {args.n_micro} micro-batch(es): {doc['graphs_total']} graphs\n")
    print("| step | masked patches | graphs compiled | seconds |\n|---:|---:|---:|---:|")
    for s in doc["steps"]:
        print(f"| {s['step']} | {s['masked_patches']} | {s['graphs_compiled']} | {s['seconds']:.2f} |")


if __name__ == "__main__":
    main()
