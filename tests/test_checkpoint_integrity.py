"""Fault drills on checkpoints (issue 50; docs/reliability.md, "Fault drills: checkpoints"): a checkpoint that
cannot be verified, one whose checksums file was rewritten to match a tampered shard, a resume under another schedule
or batch, and what convert and the model card say about the iteration they exported. Real tiny training runs, real
DCP checkpoints, real stage manifests written by the stage runner."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dinov3_core import checksums
from dinov3_core.config import load_config
from dinov3_core.convert.config import ConvertConfig
from dinov3_core.errors import WsidinoError
from tests import helpers
from tests.conftest import STAGE_RUN
from tests.test_verify import flip_bytes


@pytest.fixture
def run_copy(pretrain_run: Path, tmp_path: Path) -> Path:
    """A private copy of the session's tiny pretrain run (checkpoints ckpt/1 and ckpt/3, global batch 8)."""
    return Path(shutil.copytree(pretrain_run, tmp_path / "run", symlinks=True))


def _convert_config(source: Path, out: Path) -> ConvertConfig:
    return load_config(ConvertConfig, None, {"input": str(source), "output_dir": str(out), "tracking.enabled": False})


def test_a_checkpoint_without_checksums_is_never_resumed_nor_converted(
    run_copy: Path, stage_tile_store: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from dinov3_core.convert.convert import ConvertError, run_convert
    from dinov3_core.train.checkpoint import latest_intact_checkpoint
    from dinov3_core.train.pretrain import run_pretrain

    newest, older = run_copy / "ckpt" / "3", run_copy / "ckpt" / "1"
    flip_bytes(next(newest.glob("*.distcp")), 192)
    (newest / checksums.CHECKSUMS).unlink()  # the damage can no longer be seen: it must not count as intact
    with caplog.at_level("WARNING"):
        assert latest_intact_checkpoint(run_copy / "ckpt") == older
    assert f"checkpoint {newest} cannot be verified ({newest / checksums.CHECKSUMS} is missing" in caplog.text
    with pytest.raises(ConvertError, match=rf"convert input {newest} cannot be verified .*checksums.json is missing"):
        run_convert(_convert_config(newest, tmp_path / "model"))

    (older / checksums.CHECKSUMS).write_text("{not json")  # unreadable: no checkpoint left to trust
    cfg = helpers.pretrain_config(stage_tile_store, run_copy, **{**STAGE_RUN, "train.stop_at": 6})
    with helpers.torch_threads(), pytest.raises(WsidinoError, match=r"no checkpoint under .*ckpt can be resumed"):
        run_pretrain(cfg)
    assert sorted(p.name for p in (run_copy / "ckpt").iterdir()) == ["1", "3"]  # nothing overwritten


@pytest.mark.timeout(600)
def test_a_checksums_file_rewritten_to_match_a_tampered_shard_is_caught_by_the_stage_manifest(
    stage_tile_store: Path, tmp_path: Path
) -> None:
    from dinov3_core.runner import run_stage

    run = tmp_path / "run"
    run_stage("pretrain", helpers.pretrain_config(stage_tile_store, run, **STAGE_RUN))  # ckpt/1, ckpt/3
    manifest = json.loads((run / "stage_manifest.json").read_text())
    assert manifest["artifacts"]["last_checkpoint"]["path"] == str((run / "ckpt" / "3").resolve())
    tampered = run / "ckpt" / "3"
    flip_bytes(next(tampered.glob("*.distcp")), 192)
    checksums.write_checksums(tampered)  # the checkpoint's own checksums now agree with the tampered shard
    assert checksums.check_directory(tampered, full=True) == []

    # Through the stage runner, which rewrites the manifest as `running` before the training job starts.
    longer = helpers.pretrain_config(stage_tile_store, run, **{**STAGE_RUN, "train.stop_at": 6})
    run_stage("pretrain", longer)
    log = (run / "logs" / "log.txt").read_text()
    assert f"resumed from {run / 'ckpt' / '1'}: iteration 2" in log  # the tampered ckpt/3 was not trained on
    assert f"resumed from {tampered}:" not in log


def test_a_resume_under_another_schedule_or_batch_is_refused_naming_the_keys(
    run_copy: Path, stage_tile_store: Path
) -> None:
    from dinov3_core.train.pretrain import run_pretrain

    def resume(**overrides: object) -> None:
        with helpers.torch_threads():
            run_pretrain(helpers.pretrain_config(stage_tile_store, run_copy, **{**STAGE_RUN, **overrides}))

    with pytest.raises(WsidinoError) as info:
        resume(**{"train.global_batch_size": 4, "optim.epochs": 5, "optim.lr": 0.002})
    message = str(info.value)
    assert f"checkpoint {run_copy / 'ckpt' / '3'} was trained under another schedule or batch" in message
    assert "global batch 8 → 4" in message and "optim.lr 0.001 → 0.002" in message
    assert "optim.epochs 4 → 5" in message and "new output_dir" in message

    # A checkpoint written before meta.json recorded its schedule is compared with its run's config.yaml.
    newest = run_copy / "ckpt" / "3"
    meta = json.loads((newest / "meta.json").read_text())
    (newest / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "schedule"}))
    checksums.write_checksums(newest)
    with pytest.raises(WsidinoError, match=r"another schedule or batch than this config: optim\.epochs 4 → 5"):
        resume(**{"optim.epochs": 5})

    with pytest.raises(WsidinoError, match=r"is at iteration 3, past train\.stop_at=2"):
        resume(**{"train.stop_at": 2})
    assert json.loads((run_copy / "ckpt" / "3" / "meta.json").read_text())["iteration"] == 3  # nothing written

    resume(**{"train.stop_at": 4})  # the same schedule, already complete: a legitimate no-op resume


@pytest.mark.timeout(300)
def test_convert_records_the_iteration_it_exported_and_the_model_card_states_it(run_copy: Path, tmp_path: Path) -> None:
    import yaml

    from dinov3_core.export.model_card import write_model_card
    from dinov3_core.runner import run_stage

    flip_bytes(next((run_copy / "ckpt" / "3").glob("*.distcp")), 192)  # convert falls back to ckpt/1
    model = tmp_path / "model"
    outcome = run_stage("convert", _convert_config(run_copy, model))
    assert outcome.summary.iteration == 1 and outcome.summary.checkpoint == str(run_copy / "ckpt" / "1")
    assert yaml.safe_load((model / "config.yaml").read_text())["source"]["iteration"] == 1
    card = write_model_card(model / "model.onnx", model / "backbone.pth", {}).read_text()
    assert f"- Exported: the teacher of iteration 1 (`{run_copy / 'ckpt' / '1'}`), 2 iterations trained" in card
    assert "| 2 of " in card  # the training table counts the exported iterations, not the run's stop_at (4)
