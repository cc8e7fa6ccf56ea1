"""`train.compile: step`: the whole training step under one torch.compile, through the real trainer."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from tests.helpers import pretrain_config, torch_threads


def test_whole_step_compile_trains_like_eager_and_compiles_once(small_tile_store: Path, tmp_path: Path) -> None:
    from dinov3_core.train.metrics import read_metrics
    from dinov3_core.train.pretrain import run_pretrain
    from dinov3_core.train.ssl_model import LOSS_NAMES, SSLMetaArch

    runs = {}
    torch._dynamo.reset()
    with torch_threads():
        for mode in (False, "step"):
            cfg = pretrain_config(
                small_tile_store,
                tmp_path / str(mode),
                **{"train.stop_at": 3, "train.compile": mode, "train.log_period": 1},
            )
            result = run_pretrain(cfg)
            runs[mode] = (result, read_metrics(tmp_path / str(mode) / "training_metrics.json"))
    # What ran compiled is the step's own methods, each compiled once: the teacher temperature moves every
    # iteration and goes in as a tensor (a float would be a guard, and a recompilation at iteration 1).
    for method in (SSLMetaArch.teacher_targets, SSLMetaArch.forward_loss):
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(inspect.unwrap(method).__code__)
        assert len(entries) == 1, (method.__name__, len(entries))
    eager, compiled = runs[False][1], runs["step"][1]
    assert [r["iteration"] for r in compiled] == [r["iteration"] for r in eager] == [0, 1, 2]
    # Inductor fuses and reorders reductions: 1e-4 relative on the losses after three optimizer steps (the GPU test
    # compares one step's gradients, tests/test_gpu.py).
    for e, c in zip(eager, compiled, strict=True):
        for key in LOSS_NAMES:
            assert c[key] == pytest.approx(e[key], rel=1e-4), (e["iteration"], key)
    step = runs["step"][0]
    # The compile warm-up is the first step's time, kept out of the steady images/s.
    assert step.first_step_seconds > 8 * step.global_batch / step.images_per_second
