"""Shared by the losses: fp32-or-better compute, and collectives that are no-ops without torch.distributed."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: ProcessGroup | None) -> torch.Tensor:
    """In-place all-reduce over `group`; returns `tensor` so calls can be chained."""
    if is_distributed():
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def no_autocast(tensor: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """Autocast off on `tensor`'s device: upcast inputs stay fp32 through matrix products (an einsum or `@` under
    autocast would go back to bf16, 3 significant digits, whatever its inputs)."""
    return torch.autocast(tensor.device.type, enabled=False)


def upcast(tensor: torch.Tensor) -> torch.Tensor:
    """fp64 stays fp64 (tests, references); everything else is computed in fp32 (bf16 logits under AMP)."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()
