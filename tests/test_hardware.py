"""The GPU recipes and docs/hardware.md: every recipe resolves, the table is what the memory planner says now, and
a recipe built on another (`base:`) gets the other's keys, with loops and unknown bases named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dinov3_core.config import ConfigError, load_config, packaged_config_dir
from dinov3_core.train import config as C
from tests.helpers import REPO

REQUIRED = {"student.pretrained_weights": "released.pth", "data.stores": ["tiles.zarr"], "output_dir": "run"}


@pytest.mark.parametrize("name", sorted(p.stem for p in (packaged_config_dir() / "pretrain").glob("*.yaml")))
def test_every_pretrain_recipe_resolves(name: str) -> None:
    cfg = load_config(C.PretrainConfig, name, REQUIRED, stage="pretrain")
    assert cfg.optim.epochs * cfg.train.epoch_length > 0


def test_the_hardware_table_is_current() -> None:
    done = subprocess.run([sys.executable, "docs/make_hardware_table.py", "--check"], cwd=REPO, check=False)
    stale = "the table in docs/hardware.md is stale: run .venv/bin/python docs/make_hardware_table.py"
    assert done.returncode == 0, stale


def test_one_gpu_recipes_halve_nothing_but_the_batch() -> None:
    one = load_config(C.PretrainConfig, "vitb16-1gpu", REQUIRED, stage="pretrain")
    node = load_config(C.PretrainConfig, "vitb16-continued", REQUIRED, stage="pretrain")
    assert (one.train.global_batch_size, node.train.global_batch_size) == (256, 1024)
    assert (one.student.arch, one.heads, one.optim) == (node.student.arch, node.heads, node.optim)


def test_a_base_loop_and_an_unknown_base_are_named(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"base: {b}\noptim: {{epochs: 3}}\n")
    b.write_text(f"base: {a}\n")
    with pytest.raises(ConfigError, match="goes round in a circle"):
        load_config(C.PretrainConfig, a, REQUIRED, stage="pretrain")
    b.write_text("base: vitb16-continuedd\n")
    with pytest.raises(ConfigError, match="no config named 'vitb16-continuedd'"):
        load_config(C.PretrainConfig, a, REQUIRED, stage="pretrain")
    b.write_text("base: cpu\ntrain: {epoch_length: 7}\n")
    cfg = load_config(C.PretrainConfig, a, REQUIRED, stage="pretrain")
    assert (cfg.optim.epochs, cfg.train.epoch_length, cfg.student.arch) == (3, 7, "vit_test")


def test_the_pipeline_help_states_the_gpu_sizes_of_the_hardware_table() -> None:
    """`wsidino pipeline --help` names the smallest GPU each one-GPU recipe fits: the planner's table must agree
    (it said 40 GB for vitb16-1gpu while the table fitted it in 24 GB)."""
    import importlib.util
    import re

    from dinov3_core.cli_chains import PIPELINE_EPILOG
    from dinov3_core.train.memory import model_shape

    spec = importlib.util.spec_from_file_location("make_hardware_table", REPO / "docs" / "make_hardware_table.py")
    assert spec and spec.loader
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)  # the generator of docs/hardware.md's table

    stated = dict(re.findall(r"(vi[tl]\w16-1gpu)\s+[^()]*\((\d+) GB or more\)", PIPELINE_EPILOG))
    assert sorted(stated) == ["vitb16-1gpu", "vitl16-1gpu", "vits16-1gpu"], PIPELINE_EPILOG
    for recipe, gb in stated.items():
        cfg = load_config(C.PretrainConfig, recipe, REQUIRED, stage="pretrain")
        shape = model_shape(cfg)
        fits = [size for size in table.GPU_GB if table.cell(cfg, shape, 1, size) != "does not fit"]
        assert fits and int(gb) == fits[0], (recipe, gb, fits)
