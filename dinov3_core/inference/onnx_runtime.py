"""ONNX Runtime sessions for an exported model (export's parity check, extract, evaluate)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["INPUT_NAME", "ort_session", "session_options", "usable_cores"]

INPUT_NAME = "pixel_values"  # the exported graph's one input: [B, 3, H, W] float32, ImageNet-normalised


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask on Linux), else the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def session_options(threads: int = 0) -> Any:
    """The ORT session options for inference: every graph optimisation (fusions, constant folding), the intra-op
    pool sized to the cores this process may run on (`threads` if given; ORT's own default counts the machine's
    physical cores, which oversubscribes a CPU-limited container or a process pinned with taskset), one inter-op
    thread and sequential execution (a ViT is one chain of ops: a parallel executor only adds a second pool).
    Idle intra-op threads sleep instead of spinning: spinning burns the cores that extract's reader threads (and
    anything else on a shared machine) need, and a ViT's ops are long enough that waking costs nothing measurable
    (docs/benchmarks.md, "Extract"). The memory arena and memory patterns stay on (ORT's defaults): the arena off
    halves throughput, memory patterns made no difference."""
    # deferred: onnxruntime, only where an ONNX model runs
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.intra_op_num_threads = threads or usable_cores()
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def ort_session(
    path: str | os.PathLike[str], providers: list[str] | None = None, threads: int = 0, device_id: int = 0
) -> Any:
    """An ONNX Runtime session with `session_options`; providers None → CUDA when available (on GPU `device_id`:
    `onnxruntime-gpu`, the `gpu` extra), then CPU."""
    # deferred: onnxruntime, only where an ONNX model runs
    import onnxruntime as ort

    available = ort.get_available_providers()
    if providers is None:
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
    chosen: list[Any] = [(p, {"device_id": device_id}) if p == "CUDAExecutionProvider" else p for p in providers]
    return ort.InferenceSession(str(path), sess_options=session_options(threads), providers=chosen)
