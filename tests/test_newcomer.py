"""What a newcomer meets first, run as they would: a recipe far too large for the machine is refused before
anything is written, in one message that says how long it would take and what to do instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dinov3_core import cli
from tests.helpers import by_name

VIT_L_ON_CPU = [
    "pretrain.student.arch=vitl16",
    "pretrain.train.device=cpu",
    "pretrain.crops.global_size=224",
    "pretrain.crops.local_size=96",
    "pretrain.crops.n_local_crops=8",
]


def test_a_recipe_of_days_on_this_cpu_asks_for_yes_before_anything_is_written(
    sample_slides: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slides = tmp_path / "slides"
    slides.mkdir()
    (slides / "tissue_40x.svs").symlink_to(by_name(sample_slides, "tissue_40x.svs"))
    args = ["pipeline", "--slides", str(slides), "--workdir", str(tmp_path / "run"), *VIT_L_ON_CPU]
    assert cli.main(args) == cli.EXIT_USAGE
    captured = capsys.readouterr()
    assert "time estimate: pretrain ≥" in captured.out and "days" in captured.out
    (message,) = [line for line in captured.err.splitlines() if line.strip()]  # one message
    assert "would take" in message and "on this machine's CPU" in message and "--yes" in message, message
    assert not (tmp_path / "run").exists()


def test_the_cpu_demo_recipe_is_not_asked_about(tmp_path: Path) -> None:
    """The estimate stays quiet under an hour: the demo's recipe starts without a question."""
    from dinov3_core.chain import check_duration
    from dinov3_core.pipeline.config import load_pipeline_config
    from dinov3_core.pipeline.run import stage_config

    cfg = load_pipeline_config("cpu", [f"slides={tmp_path}", f"workdir={tmp_path / 'w'}"])
    said: list[str] = []
    check_duration({s: stage_config(cfg, s) for s in ("pretrain", "gram")}, 2, yes=False, log=said.append)
    assert said == []
