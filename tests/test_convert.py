"""convert on real checkpoints: a tiny 1-process pretrain run and a 2-process (FSDP2) run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from dinov3_core import checksums
from dinov3_core.config import load_config
from dinov3_core.convert.config import ConvertConfig
from dinov3_core.convert.convert import find_checkpoint, run_convert
from dinov3_core.errors import WsidinoError
from dinov3_core.models import load_released_backbone, read_backbone_state_dict


def cfg(**values) -> ConvertConfig:
    return load_config(
        ConvertConfig, "default", {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}, stage="convert"
    )


def eval_backbone(run: Path, it: int) -> dict[str, torch.Tensor]:
    state = torch.load(run / "eval" / f"training_{it}" / "teacher_checkpoint.pth", weights_only=True)["teacher"]
    return {k.removeprefix("backbone."): v for k, v in state.items() if k.startswith("backbone.")}


def test_converted_teacher_equals_the_eval_teacher_and_loads_strictly(pretrain_run, tmp_path) -> None:
    result = run_convert(cfg(input=pretrain_run / "ckpt" / "3", output_dir=tmp_path, safetensors=True))
    assert result.iteration == 3 and result.arch == "vit_test"
    got = torch.load(result.backbone, weights_only=True)
    ref = eval_backbone(pretrain_run, 3)
    assert set(got) == set(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)

    model = load_released_backbone(result.backbone, yaml.safe_load(result.arch_config.read_text())["backbone_kwargs"])
    assert model.embed_dim == 64
    load_released_backbone(result.backbone)  # inferable without the config too
    st = read_backbone_state_dict(result.safetensors)
    assert all(torch.equal(st[k], ref[k]) for k in ref)
    print(f"\nconverted {result.backbone_bytes / 1e3:.0f} kB vs DCP dir {result.checkpoint_bytes / 1e3:.0f} kB")
    assert result.backbone_bytes < result.checkpoint_bytes / 4  # no optimizer state, no student, no heads
    assert not list(tmp_path.glob(".*tmp*"))


def test_run_dir_resolves_to_the_latest_checkpoint_and_student_differs(pretrain_run, converted, tmp_path) -> None:
    assert find_checkpoint(pretrain_run) == pretrain_run / "ckpt" / "3"
    teacher = torch.load(converted, weights_only=True)
    student = torch.load(run_convert(cfg(input=pretrain_run, output_dir=tmp_path, which="student")).backbone)
    assert set(student) == set(teacher)
    assert any(not torch.equal(student[k], teacher[k]) for k in teacher)


def test_full_consolidation_holds_every_key(pretrain_run, tmp_path) -> None:
    result = run_convert(cfg(input=pretrain_run / "ckpt" / "1", output_dir=tmp_path, full_consolidation=True))
    full = torch.load(result.full, weights_only=False)
    assert {"model", "optimizer", "train_state"} <= set(full)
    backbone = torch.load(result.backbone, weights_only=True)
    teacher = {
        k.removeprefix("teacher.backbone."): v for k, v in full["model"].items() if k.startswith("teacher.backbone.")
    }
    assert all(torch.equal(backbone[k], teacher[k]) for k in backbone)


def test_two_rank_checkpoint_converts_in_one_process(pretrain_run_2ranks, tmp_path) -> None:
    ckpt = find_checkpoint(pretrain_run_2ranks)
    assert len(list(ckpt.glob("*.distcp"))) == 2  # written by two ranks
    result = run_convert(cfg(input=pretrain_run_2ranks, output_dir=tmp_path))
    assert result.iteration == 1
    load_released_backbone(result.backbone, "vit_test")
    # the same tensors as a full consolidation of the sharded checkpoint
    full = tmp_path / "full"
    run_convert(cfg(input=ckpt, output_dir=full, full_consolidation=True))
    model = torch.load(full / "full.pt", weights_only=False)["model"]
    got = torch.load(result.backbone, weights_only=True)
    assert all(torch.equal(got[k], model[f"teacher.backbone.{k}"]) for k in got)


def test_bad_inputs_give_clear_errors(tmp_path) -> None:
    with pytest.raises(WsidinoError, match="does not exist"):
        run_convert(cfg(input=tmp_path / "nope", output_dir=tmp_path / "o"))
    (tmp_path / "run" / "ckpt" / ".tmp-4").mkdir(parents=True)
    with pytest.raises(WsidinoError, match="complete checkpoint"):
        run_convert(cfg(input=tmp_path / "run", output_dir=tmp_path / "o"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(WsidinoError, match="cannot be verified"):  # no checksums.json: damage could not be seen
        run_convert(cfg(input=bad, output_dir=tmp_path / "o"))
    checksums.write_checksums(bad)  # intact as written, unreadable as a checkpoint
    with pytest.raises(WsidinoError, match="unreadable"):
        run_convert(cfg(input=bad, output_dir=tmp_path / "o"))
    with pytest.raises(WsidinoError, match="which"):
        run_convert(cfg(input=bad, output_dir=tmp_path / "o", which="ema"))
    assert not (tmp_path / "o").exists()
