"""Event listeners for the GPU tests (`WSIDINO_HOOKS=tests.gpu_hooks`): the ML core carries no test code.

On the first `train.step` the process's CUDA allocator is capped at what it holds then plus
`$WSIDINO_TEST_CUDA_HEADROOM_MB`: a smaller GPU, so that a step really runs out of memory.
"""

from __future__ import annotations

import os
from typing import Any

import torch

HEADROOM_ENV = "WSIDINO_TEST_CUDA_HEADROOM_MB"
_capped = False


def on_event(event: str, **fields: Any) -> None:
    global _capped
    if event != "train.step" or _capped:
        return
    _capped = True
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    cap = torch.cuda.memory_reserved(device) + int(os.environ[HEADROOM_ENV]) * 2**20
    torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0), device)
