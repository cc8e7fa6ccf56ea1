"""Several pretrain runs in one torchrun launch (run by tests/test_pretrain.py with 2 gloo processes).

Each argument is a JSON object of config overrides on the `tiny` config; `run_pretrain` is called once per
argument inside one process group (set up here, so the stage keeps it between runs instead of creating and
destroying it each time). Rank 0 prints one JSON line per run: `{"run": i, "end_iteration", "world_size",
"micro_batch", "accumulation_steps", "resumed_from"}`.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from dinov3_core.config import load_config
from dinov3_core.train.config import PretrainConfig
from dinov3_core.train.pretrain import run_pretrain


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for i, arg in enumerate(sys.argv[1:]):
        cfg = load_config(PretrainConfig, "tiny", json.loads(arg), stage="pretrain")
        result = run_pretrain(cfg)
        if dist.get_rank() == 0:
            summary = {
                "run": i,
                "end_iteration": result.end_iteration,
                "world_size": result.world_size,
                "micro_batch": result.micro_batch,
                "accumulation_steps": result.accumulation_steps,
                "resumed_from": str(result.resumed_from) if result.resumed_from else None,
            }
            print(json.dumps(summary), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
