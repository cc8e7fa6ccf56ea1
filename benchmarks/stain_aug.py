"""Cost of the stain steps of the multi-crop augmentation: side by side in one run, interleaved.

One batch of 32 tiles of 224 px through `MultiCropAugmentation` with the stain steps off / HED jitter only /
RandStainNA (cohort re-targeting, `crops.stain_norm_p`) only / both, each at p = 1 so that every crop pays for them
(the recipes use 0.5). Crops of the `cpu` recipe (2 × 64 px + 2 × 32 px) and, without `--quick`, of the GPU recipes
(2 × 224 + 8 × 96). Rounds are interleaved (every variant once per round, in a rotating order) so that drift of a
shared machine hits all of them alike; the median of the rounds is reported.

The cohort is a fixed one, the stain statistics the tile stage records for the three test sample slides
(`CohortStain` numbers below): the cost does not depend on them.

Output: a markdown table on stdout (ms per crop, and the share of the augmentation the stain steps take) and
`<output>/stain_aug.json`.

Usage: python benchmarks/stain_aug.py [--quick] [--output DIR] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dinov3_core.data.augment import MultiCropAugmentation
from dinov3_core.data.augment_config import AugmentationConfig
from dinov3_core.data.stain import CohortStain

COHORT = CohortStain((69.16, 16.50, -5.10), (5.08, 5.02, 1.80), (19.25, 11.11, 4.62), (1.27, 2.46, 1.31), 3)
VARIANTS = {  # name → (stain_norm_p, hed_p)
    "off": (0.0, 0.0),
    "HED only": (0.0, 1.0),
    "RandStainNA only": (1.0, 0.0),
    "both": (1.0, 1.0),
}
RECIPES = {  # the crops of the `cpu` recipe and of the GPU recipes (configs/pretrain/*.yaml)
    "cpu": {"n_local_crops": 2, "global_size": 64, "local_size": 32},
    "gpu": {"n_local_crops": 8, "global_size": 224, "local_size": 96},
}


def time_recipe(recipe: str, images: torch.Tensor, rounds: int) -> list[dict[str, object]]:
    augs = {
        name: MultiCropAugmentation(AugmentationConfig(**RECIPES[recipe], stain_norm_p=p, hed_p=h), stain=COHORT)
        for name, (p, h) in VARIANTS.items()
    }
    crops = augs["off"].config.n_global_crops + augs["off"].config.n_local_crops
    times: dict[str, list[float]] = {name: [] for name in augs}
    names = list(augs)
    for r in range(rounds + 1):  # round 0 warms up (allocator, kernels)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            g = torch.Generator(images.device).manual_seed(r)
            if images.is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            augs[name](images, g)
            if images.is_cuda:
                torch.cuda.synchronize()
            if r:
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["off"])
    rows = []
    for name in names:
        t = statistics.median(times[name])
        rows.append(
            {
                "recipe": recipe,
                "variant": name,
                "batch_ms": round(t * 1e3, 2),
                "ms_per_crop": round(t * 1e3 / (crops * len(images)), 4),
                "stain_share": round(max(t - base, 0.0) / t, 3),  # of this variant's augmentation time
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (32, 224, 224, 3), generator=g, dtype=torch.uint8).to(device)
    rounds = 5 if args.quick else 15
    rows = []
    for recipe in ["cpu"] if args.quick else list(RECIPES):
        rows += time_recipe(recipe, images, rounds)

    print(
        f"Stain steps of the augmentation, 32 tiles of 224 px, {device}, {torch.get_num_threads()} threads, "
        f"median of {rounds} interleaved rounds, p = 1\n"
    )
    print("| crops | stain steps | ms / batch | ms / crop | stain share |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['recipe']} | {row['variant']} | {row['batch_ms']} | {row['ms_per_crop']} | "
            f"{100 * row['stain_share']:.0f} % |"
        )
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"device": str(device), "threads": torch.get_num_threads(), "rounds": rounds, "rows": rows}
    (out / "stain_aug.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
