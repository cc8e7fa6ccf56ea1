"""A chain's keys as the user types them: stage keys after the stage's name, stage choices under `stages:`, and
every hint naming the key in the form that works when pasted back into the same command."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dinov3_core.config import ConfigError
from dinov3_core.pipeline.config import load_pipeline_config
from dinov3_core.pipeline.run import stage_config
from dinov3_core.retrain import stage_configs as sc
from dinov3_core.retrain.config import load_retrain_config
from dinov3_core.retrain.cycles import CycleLayout

PATHS = ["slides=s", "workdir=w"]


def test_a_typo_in_a_stage_key_is_hinted_with_the_stage_in_front(tmp_path: Path) -> None:
    cfg = load_pipeline_config("cpu", [*PATHS, "pretrain.train.stop_a=100"])
    with pytest.raises(ConfigError, match=r"did you mean 'pretrain\.train\.stop_at'\?"):
        stage_config(cfg, "pretrain")
    retrain = load_retrain_config("tiny", ["slides=s", "root=r", "gram.train.stop_a=4"])
    with pytest.raises(ConfigError, match=r"unknown config key 'gram\.train\.stop_a'.*'gram\.train\.stop_at'\?"):
        sc.validate(retrain, CycleLayout(tmp_path))


def test_a_typo_in_the_stage_name_is_hinted_with_the_whole_key() -> None:
    with pytest.raises(ConfigError, match=r"'pretrian' is not a stage; did you mean 'pretrain\.train\.stop_at'\?"):
        load_pipeline_config("cpu", [*PATHS, "pretrian.train.stop_at=100"])


def test_stage_choices_are_set_by_stage_name_and_land_under_stages() -> None:
    cfg = load_pipeline_config("cpu", [*PATHS, "tile.config=cohort-jpeg", "pretrain.train.stop_at=9"])
    assert cfg.stages["tile"].config == "cohort-jpeg" and cfg.stages["pretrain"].overrides[-1] == "train.stop_at=9"
    assert stage_config(cfg, "pretrain").train.stop_at == 9


def test_print_config_needs_no_paths_and_shows_every_stages_resolved_values(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dinov3_core import cli

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # as on a user's machine

    assert cli.main(["pipeline", "--print-config", "pretrain.train.stop_at=100", "--to", "gram"]) == cli.EXIT_OK
    printed = capsys.readouterr().out
    head, _, resolved = printed.partition("# What each stage will run with")
    assert "slides: ???" in head and "workdir: ???" in head and "uri: null" in head
    assert "#   train:" in resolved and "#     stop_at: 100" in resolved  # pretrain's, resolved
    assert "# gram:" in resolved and "# extract:" not in resolved  # the stages the run covers


def test_key_values_are_taken_anywhere_on_the_line(capsys: pytest.CaptureFixture[str]) -> None:
    from dinov3_core import cli

    argv = ["pipeline", "--to", "tile", "pretrain.train.stop_at=3", "--force", "tile", "gram.train.stop_at=2"]
    assert cli.main([*argv, "--print-config"]) == cli.EXIT_OK
    printed = capsys.readouterr().out
    assert "- train.stop_at=3" in printed and "- train.stop_at=2" in printed
    with pytest.raises(SystemExit):  # anything else unknown is still refused
        cli.main([*argv, "--bogus"])


def test_the_warm_start_file_is_checked_even_when_pretraining_is_not_in_this_run(
    sample_slides: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dinov3_core import cli
    from tests.helpers import by_name

    slides = tmp_path / "slides"
    slides.mkdir()
    (slides / "tissue_40x.svs").symlink_to(by_name(sample_slides, "tissue_40x.svs"))
    bad = tmp_path / "not_weights.pth"
    bad.write_text("not a checkpoint")
    argv = ["pipeline", "--slides", str(slides), "--workdir", str(tmp_path / "run"), "--to", "tile", "--weights"]
    assert cli.main([*argv, str(bad)]) == cli.EXIT_USAGE
    assert f"weights: {bad}: cannot be read as a weights file" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
