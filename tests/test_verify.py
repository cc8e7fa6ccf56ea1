"""Every artifact is verified where it is used: a damaged output makes its stage run again (saying why), a replaced
input is refused naming the file, a damaged checkpoint is never resumed from, and a champion file that is not the
one registered is refused. Real DCP checkpoints, real backbone.pth and model.onnx, real stage manifests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dinov3_core import checksums
from dinov3_core import manifest as mf
from dinov3_core.config import load_config
from dinov3_core.convert.config import ConvertConfig
from dinov3_core.export.config import ExportConfig
from dinov3_core.runner import run_stage
from tests import helpers


def flip_bytes(path: Path, n: int = 64, *, keep_mtime: bool = True) -> None:
    """Corrupt `n` bytes in the middle of `path` in place, keeping its size (and, like bit rot, its mtime)."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(st.st_size // 2)
        chunk = f.read(n)
        f.seek(st.st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def run_copy(pretrain_run: Path, tmp_path: Path) -> Path:
    """A private copy of the session's tiny pretrain run (checkpoints ckpt/1 and ckpt/3)."""
    return Path(shutil.copytree(pretrain_run, tmp_path / "run", symlinks=True))


def test_a_checkpoint_carries_checksums_and_a_damaged_one_is_found(run_copy: Path) -> None:
    from dinov3_core.train.checkpoint import complete_checkpoints, latest_intact_checkpoint

    ckpts = complete_checkpoints(run_copy / "ckpt")
    assert [i for i, _ in ckpts] == [1, 3] and all(checksums.has_checksums(p) for _, p in ckpts)
    assert latest_intact_checkpoint(run_copy / "ckpt") == ckpts[-1][1]
    shard = next(ckpts[-1][1].glob("*.distcp"))
    flip_bytes(shard, 192)
    assert checksums.check_directory(ckpts[-1][1]) == []  # size and mtime kept: a cheap check cannot see it
    assert checksums.check_directory(ckpts[-1][1], full=True) == [
        f"{shard}: its content differs from what was written (CRC-32C)"
    ]
    assert latest_intact_checkpoint(run_copy / "ckpt") == ckpts[0][1]  # falls back, naming the damaged one


@pytest.mark.timeout(300)
def test_a_resume_never_trains_on_a_damaged_checkpoint(
    run_copy: Path, stage_tile_store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from dinov3_core.train.pretrain import run_pretrain
    from tests.conftest import STAGE_RUN

    damaged = run_copy / "ckpt" / "3"
    flip_bytes(next(damaged.glob("*.distcp")), 192)
    with helpers.torch_threads(), caplog.at_level("WARNING"):
        result = run_pretrain(helpers.pretrain_config(stage_tile_store, run_copy, **{**STAGE_RUN, "train.stop_at": 6}))
    assert result.start_iteration == 2  # resumed after ckpt/1, the newest intact one
    assert f"checkpoint {damaged} is damaged" in caplog.text


@pytest.mark.timeout(300)
def test_damaged_model_files_rerun_their_stage_and_a_replaced_input_is_refused(run_copy: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    convert_cfg = load_config(
        ConvertConfig, None, {"input": str(run_copy), "output_dir": str(model), "tracking.enabled": False}
    )
    first = run_stage("convert", convert_cfg)
    backbone = model / "backbone.pth"
    assert first.manifest.artifacts["backbone"]["sha256"] == checksums.sha256(backbone)
    export_cfg = load_config(
        ExportConfig,
        None,
        {
            "weights": str(backbone),
            "output": str(model / "model.onnx"),
            "parity_sizes": [32],
            "parity_batches": [2],
            "tracking.enabled": False,
        },
    )
    run_stage("export", export_cfg)
    assert run_stage("convert", convert_cfg).status == "skipped"

    flip_bytes(model / "model.onnx")  # same size, same mtime: only the content tells
    again = run_stage("export", export_cfg)
    assert again.status == "ran" and "outputs changed since they were written" in again.reason
    assert "model.onnx: its content differs" in again.reason

    flip_bytes(backbone)
    with pytest.raises(
        mf.ManifestError,
        match=r"weights: .*backbone.pth: its content differs .* not the output the "
        r"convert stage wrote\. Rerun convert",
    ):
        run_stage("export", export_cfg, force=True)  # not exported, not registered, even when forced
    redo = run_stage("convert", convert_cfg)  # the producer sees its own output damaged and writes it again
    assert redo.status == "ran" and "backbone.pth: its content differs" in redo.reason
    # The same checkpoint gives the same bytes again, so the model.onnx already exported from them is still current.
    assert run_stage("export", export_cfg).status == "skipped"


def test_a_registered_champion_file_that_is_not_the_registered_one_is_refused(tmp_path: Path) -> None:
    from dinov3_core.export.summary import ONNX_SHA_TAG
    from dinov3_core.retrain.config import RetrainError
    from dinov3_core.retrain.registry import Champion

    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"onnx bytes" * 100)
    champion = Champion("3", {ONNX_SHA_TAG: checksums.sha256(onnx)}, "models:/m/3")
    assert champion.verified(onnx, ONNX_SHA_TAG) == onnx
    flip_bytes(onnx, 8)
    with pytest.raises(RetrainError, match=rf"{onnx} is not the file champion v3 was registered with"):
        champion.verified(onnx, ONNX_SHA_TAG)


def test_a_small_record_edited_at_the_same_size_with_its_mtime_put_back_is_found(tmp_path: Path) -> None:
    """evaluation.json (a decision record) edited in place, same size, mtime restored: the skip rule hashes it."""
    record = tmp_path / "evaluation.json"
    record.write_text('{"promoted": false, "reason": "not better than the champion"}\n')
    (written,) = checksums.record_artifacts({"evaluation": record}).values()
    assert checksums.check_file(written) is None
    text = record.read_text().replace("false", "true ")  # same size
    st = record.stat()
    record.write_text(text)
    os.utime(record, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert record.stat().st_size == written["size"] and record.stat().st_mtime_ns == written["mtime_ns"]
    assert "its content differs from what was written" in (checksums.check_file(written) or "")
