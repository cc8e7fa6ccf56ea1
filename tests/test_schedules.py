"""Schedules (endpoints, monotonicity, equality with upstream's array) and parameter groups (layer-wise lr
decay, patch-embed factor, no-weight-decay set) on a stand-in module with DINOv3 parameter names."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from dinov3_core.train.param_groups import build_param_groups, clean_param_name, count_blocks, layer_id
from dinov3_core.train.schedules import (
    linear_warmup_cosine,
    momentum_schedule,
    scaled_lr,
    teacher_temp_schedule,
    weight_decay_schedule,
)


def upstream_array(start, peak, end, warmup, total, cosine=None) -> np.ndarray:
    """dinov3.train.cosine_lr_scheduler.linear_warmup_cosine_decay, restated."""
    linear = np.linspace(start, peak, warmup, endpoint=False)
    cosine = total - warmup if cosine is None else cosine
    cos = (np.cos(np.linspace(0, np.pi, cosine)) + 1) / 2 * (peak - end) + end
    return np.concatenate([linear, cos, np.full(total - cosine - warmup, end)])


@pytest.mark.parametrize(
    ("start", "peak", "end", "warmup", "total", "cosine"),
    [
        (0.0, 1e-3, 1e-6, 10, 100, None),
        (0.0, 5e-5, 5e-5, 7, 40, None),
        (0.2, 1.0, 0.1, 5, 50, 20),
        (1, 1, 2, 0, 9, 1),
    ],
)
def test_warmup_cosine_equals_upstream(start, peak, end, warmup, total, cosine) -> None:
    sched = linear_warmup_cosine(start, peak, end, warmup, total, cosine)
    expected = upstream_array(start, peak, end, warmup, total, cosine)
    np.testing.assert_allclose(sched.as_array(), expected, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose([sched(i) for i in range(total)], expected, rtol=1e-12, atol=1e-15)
    assert len(sched) == total and sched(total + 10) == end


def test_lr_endpoints_and_monotonicity() -> None:
    sched = linear_warmup_cosine(0.0, 1e-3, 1e-6, warmup_iters=10, total_iters=100)
    values = sched.as_array()
    assert values[0] == 0.0 and values[10] == pytest.approx(1e-3) and values[-1] == pytest.approx(1e-6)
    assert np.all(np.diff(values[:11]) > 0) and np.all(np.diff(values[10:]) < 0)
    assert values.max() == pytest.approx(1e-3)
    with pytest.raises(ValueError):
        linear_warmup_cosine(0, 1, 0, warmup_iters=60, total_iters=100, cosine_iters=50)
    with pytest.raises(ValueError):
        sched(-1)


def test_teacher_temp_momentum_weight_decay() -> None:
    temp = teacher_temp_schedule(warmup_iters=30, total_iters=100)
    assert temp(0) == pytest.approx(0.04) and temp(30) == pytest.approx(0.07) and temp(99) == pytest.approx(0.07)
    assert np.all(np.diff(temp.as_array()[:31]) > 0) and np.allclose(temp.as_array()[30:], 0.07)

    mom = momentum_schedule(total_iters=1000)
    values = mom.as_array()
    assert values[0] == pytest.approx(0.992) and values[-1] == pytest.approx(1.0)
    assert np.all(np.diff(values) >= 0)
    t = 400 / 999
    assert mom(400) == pytest.approx(1 - (1 - 0.992) * (1 + math.cos(math.pi * t)) / 2)

    wd = weight_decay_schedule(total_iters=500)
    assert wd(0) == pytest.approx(0.04) and wd(499) == pytest.approx(0.4) and np.all(np.diff(wd.as_array()) >= 0)


def test_scaled_lr_rules() -> None:
    assert scaled_lr(1e-3, 1024) == pytest.approx(4e-3)
    assert scaled_lr(1e-3, 256) == pytest.approx(2e-3)
    assert scaled_lr(1e-3, 512, "linear_wrt_256") == pytest.approx(2e-3)
    assert scaled_lr(1e-3, 512, "none") == 1e-3
    with pytest.raises(ValueError):
        scaled_lr(1e-3, 512, "cubic")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        scaled_lr(1e-3, 0)


# ------------------------------------------------------------------------------------ parameter groups


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(d, 3 * d)
        self.ls1 = nn.Module()
        self.ls1.gamma = nn.Parameter(torch.ones(d))
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(d, 2 * d)


class _Backbone(nn.Module):
    def __init__(self, d: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.storage_tokens = nn.Parameter(torch.zeros(1, 2, d))
        self.mask_token = nn.Parameter(torch.zeros(1, d))
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(12, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(depth))
        self.norm = nn.LayerNorm(d)


class _Head(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, 4))
        self.last_layer = nn.Linear(4, 10, bias=False)


def _student() -> nn.ModuleDict:
    return nn.ModuleDict({"backbone": _Backbone(), "dino_head": _Head(), "ibot_head": _Head()})


def _by_name(groups) -> dict[str, dict]:
    return {name: group for group in groups for name in group["names"]}


def test_layerwise_lr_multipliers() -> None:
    groups = build_param_groups(_student(), layer_decay=0.9, patch_embed_lr_mult=0.2)
    by_name = _by_name(groups)
    lr = {name: g["lr_multiplier"] for name, g in by_name.items()}
    n = 3  # blocks
    assert lr["backbone.patch_embed.proj.weight"] == pytest.approx(0.2 * 0.9 ** (n + 1))
    assert lr["backbone.patch_embed.proj.bias"] == pytest.approx(0.2 * 0.9 ** (n + 1))
    for token in ("cls_token", "storage_tokens", "mask_token"):
        assert lr[f"backbone.{token}"] == pytest.approx(0.9 ** (n + 1))
    for i in range(n):
        assert lr[f"backbone.blocks.{i}.attn.qkv.weight"] == pytest.approx(0.9 ** (n - i))
        assert lr[f"backbone.blocks.{i}.norm1.weight"] == pytest.approx(0.9 ** (n - i))
    for top in ("backbone.norm.weight", "dino_head.mlp.0.weight", "ibot_head.last_layer.weight"):
        assert lr[top] == 1.0
    assert sum(len(g["params"]) for g in groups) == len(list(_student().parameters()))
    # One group per distinct setting, each group homogeneous.
    keys = [(g["lr_multiplier"], g["wd_multiplier"], g["is_last_layer"]) for g in groups]
    assert len(keys) == len(set(keys))
    assert build_param_groups(_student(), layer_decay=1.0, patch_embed_lr_mult=1.0)[0]["lr_multiplier"] == 1.0


def test_no_weight_decay_set_and_last_layer_flag() -> None:
    by_name = _by_name(build_param_groups(_student()))
    no_wd = {name for name, g in by_name.items() if g["wd_multiplier"] == 0.0}
    expected = {
        name for name, _ in _student().named_parameters() if name.endswith("bias") or "norm" in name or "gamma" in name
    }
    assert no_wd == expected
    assert "backbone.blocks.0.ls1.gamma" in no_wd and "backbone.norm.weight" in no_wd
    assert by_name["backbone.cls_token"]["wd_multiplier"] == 1.0  # tokens are decayed, as upstream
    assert by_name["backbone.blocks.1.attn.qkv.weight"]["wd_multiplier"] == 1.0
    last = {name for name, g in by_name.items() if g["is_last_layer"]}
    assert last == {"dino_head.last_layer.weight", "ibot_head.last_layer.weight"}


def test_frozen_params_wrappers_and_bare_backbone() -> None:
    student = _student()
    student["backbone"].mask_token.requires_grad_(False)
    names = {n for g in build_param_groups(student) for n in g["names"]}
    assert "backbone.mask_token" not in names
    assert clean_param_name("_orig_mod.backbone._fsdp_wrapped_module.blocks.2._checkpoint_wrapped_module.x") == (
        "backbone.blocks.2.x"
    )
    assert clean_param_name("module.dino_head.mlp.0.weight") == "dino_head.mlp.0.weight"
    bare = build_param_groups(_Backbone(depth=2))
    lr = {n: g["lr_multiplier"] for g in bare for n in g["names"]}
    assert lr["blocks.0.attn.qkv.weight"] == pytest.approx(0.81) and lr["norm.weight"] == 1.0
    assert count_blocks(["backbone.blocks.11.mlp.fc1.weight", "backbone.blocks.3.norm1.bias"]) == 12
    assert layer_id("backbone.pos_embed", 12) == 0 and layer_id("dino_head.mlp.0.weight", 12) == 13


# ------------------------------------------------------------------------------ schedules fitted to run length


def test_paced_temperature_is_the_same_at_every_run_length() -> None:
    from dinov3_core.train.schedules import UPSTREAM_TEMP_WARMUP_ITERS, paced_teacher_temp_schedule

    short, long = paced_teacher_temp_schedule(1000), paced_teacher_temp_schedule(500_000)
    np.testing.assert_allclose(short.as_array(), long.as_array()[:1000], rtol=1e-12)
    assert short(999) == pytest.approx(0.04 + 0.03 * 999 / UPSTREAM_TEMP_WARMUP_ITERS)  # part-way up, not 0.07
    # At upstream's length it is upstream's schedule: 0.04 → 0.07 over 30 × 1250 iterations, then constant.
    upstream = teacher_temp_schedule(warmup_iters=UPSTREAM_TEMP_WARMUP_ITERS, total_iters=125_000)
    np.testing.assert_allclose(paced_teacher_temp_schedule(125_000).as_array(), upstream.as_array(), rtol=1e-12)


def test_fitted_final_momentum_keeps_the_teacher_following() -> None:
    from dinov3_core.train.schedules import fitted_final_momentum, teacher_settled_from

    assert fitted_final_momentum(1000, 0.992) == 0.992  # never below the start value
    assert fitted_final_momentum(125_000, 0.992) == pytest.approx(1 - 1 / 6250)  # ≈ upstream's 1.0
    assert fitted_final_momentum(10**9, 0.992) < 1.0
    # The settled tail: a constant 0.992 keeps moving until the last ⌊ln 2 / 0.008⌋ = 86 iterations;
    # upstream's cosine to 1.0 settles over ~half of a 1,000-iteration run and ~9 % of 125k.
    assert teacher_settled_from(momentum_schedule(1000, base=0.992, final=0.992)) == 1000 - 86
    assert teacher_settled_from(momentum_schedule(1000)) == pytest.approx(509, abs=2)
    assert 1 - teacher_settled_from(momentum_schedule(125_000)) / 125_000 == pytest.approx(0.095, abs=0.005)
    for total in (1000, 5000, 125_000):
        fitted = momentum_schedule(total, final=fitted_final_momentum(total, 0.992))
        assert total - teacher_settled_from(fitted) < 0.1 * total


def test_auto_schedules_in_the_config(tmp_path) -> None:
    from dinov3_core.config import ConfigError
    from dinov3_core.train.optim import build_schedules
    from tests.helpers import pretrain_config

    auto = {
        f"teacher.{k}": "auto" for k in ("momentum_teacher", "final_momentum_teacher", "warmup_teacher_temp_epochs")
    }
    cfg = pretrain_config(tmp_path, tmp_path / "o", **{"train.epoch_length": 250, **auto})  # 1,000 iterations
    sched = build_schedules(cfg, global_batch=8)
    assert sched.momentum(0) == sched.momentum(999) == pytest.approx(0.98)  # time constant 50 = 5 % of the run
    assert sched.teacher_temp(999) == pytest.approx(0.0408, abs=1e-4)  # upstream's pace: 0.04 + 0.03 · 999 / 37,500
    explicit = pretrain_config(
        tmp_path,
        tmp_path / "o",
        **{"train.epoch_length": 250, "teacher.final_momentum_teacher": 1, "teacher.warmup_teacher_temp_epochs": 2},
    )
    sched = build_schedules(explicit, global_batch=8)
    assert sched.momentum(999) == 1.0 and sched.teacher_temp(500) == pytest.approx(0.07)
    with pytest.raises(ConfigError, match=r"teacher\.final_momentum_teacher: must be a number or 'auto', got 'soon'"):
        pretrain_config(tmp_path, tmp_path / "o", **{"teacher.final_momentum_teacher": "soon"})
    with pytest.raises(ConfigError, match=r"teacher\.final_momentum_teacher: must be in \[momentum_teacher"):
        pretrain_config(tmp_path, tmp_path / "o", **{"teacher.final_momentum_teacher": 0.9})


def test_the_start_line_says_how_long_the_run_is_and_where_its_weights_come_from() -> None:
    from dinov3_core.config import load_config
    from dinov3_core.train import config as C

    cfg = load_config(
        C.PretrainConfig, "cpu", {"data.stores": ["t.zarr"], "output_dir": "o", "train.stop_at": 100}, stage="pretrain"
    )
    assert C.length_summary(cfg) == (
        "1000 iterations = optim.epochs 4 × train.epoch_length 250; this run stops at train.stop_at=100 "
        "(the schedules keep the full length)"
    )
    assert C.start_summary(cfg) == "backbone from random initialisation (seed train.seed)"
    cfg.student.pretrained_weights = "/w/dinov3_vitb16.pth"
    assert C.start_summary(cfg).startswith("warm start from /w/dinov3_vitb16.pth (every backbone tensor matched")
    assert C.start_summary(cfg, "o/ckpt/249") == "resumes from its checkpoint o/ckpt/249"
