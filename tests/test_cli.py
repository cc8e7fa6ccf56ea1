"""`wsidino <stage> --help` and `--print-config`: help that belongs to its stage, and a printed configuration that
reproduces the run when given back as `--config` (same config fingerprint as the stage manifest uses)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dinov3_core import cli
from dinov3_core.config import load_config, parse_overrides
from dinov3_core.stages import get_stage

# Each stage's required options, with placeholder paths (nothing runs: --print-config exits first).
REQUIRED = {
    "tile": ["--input", "slides/", "--output", "out/tiles.zarr"],
    "pretrain": ["--store", "out/tiles.zarr", "--output-dir", "out/pretrain"],
    "gram": ["--pretrain-dir", "out/pretrain", "--output-dir", "out/gram"],
    "convert": ["--input", "out/gram", "--output-dir", "out/model"],
    "export": ["--weights", "out/model/backbone.pth", "--output", "out/model/model.onnx"],
    "evaluate": ["--store", "out/tiles.zarr", "--candidate", "out/model/model.onnx", "--output", "out/evaluation"],
    "extract": ["--store", "out/tiles.zarr", "--model", "out/model/model.onnx", "--output", "out/features.zarr"],
}


def printed_config(stage: str, args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main([stage, *args, "--print-config"]) == cli.EXIT_OK
    return capsys.readouterr().out


@pytest.mark.parametrize("stage", sorted(REQUIRED))
def test_print_config_round_trips(stage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    examples = get_stage(stage).override_example.split()
    text = printed_config(stage, [*REQUIRED[stage], *examples], capsys)
    printed = tmp_path / f"{stage}.yaml"
    printed.write_text(text)
    spec = get_stage(stage)
    original = cli._config(spec, cli.build_parser().parse_args([stage, *REQUIRED[stage], *examples]))
    again = load_config(spec.schema(), printed)
    assert spec.config_hash(again) == spec.config_hash(original)
    # ... and the stage's own examples are keys of its schema (load_config names an unknown key).
    for key, value in parse_overrides(examples).items():
        assert text.count(key.split(".")[-1]) >= 1, (key, value)


@pytest.mark.parametrize("stage", sorted(REQUIRED))
def test_help_names_required_options_and_stage_examples(stage: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main([stage, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"e.g. {get_stage(stage).override_example}" in text
    options = REQUIRED[stage][::2]
    for option in options:
        assert option in text
    # gram's --pretrain-dir may be left out when student.pretrained_weights names the start instead
    required = [o for o in options if (stage, o) != ("gram", "--pretrain-dir")]
    assert text.count("(required, unless the --config file sets it)") == len(required)
    assert f"configs/{stage}/ (" in text


def test_a_bad_input_exit_leaves_nothing_behind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.pth"
    bad.write_text("not a weights file")
    fresh = tmp_path / "new" / "model"
    assert cli.main(["export", "--weights", str(bad), "--output", str(fresh / "model.onnx")]) == cli.EXIT_USAGE
    (said,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("wsidino export:")]
    assert "cannot be read as a weights file" in said and "give a backbone .pth" in said and len(said) < 400
    assert not (tmp_path / "new").exists()  # no empty folder, lock or failed manifest that looks like output
    existing = tmp_path / "existing"
    existing.mkdir()
    assert cli.main(["export", "--weights", str(bad), "--output", str(existing / "model.onnx")]) == cli.EXIT_USAGE
    failed = json.loads((existing / "model.onnx.stage_manifest.json").read_text())  # a folder of the user's: kept,
    assert failed["status"] == "failed" and "cannot be read" in failed["error"]  # the attempt marked failed
