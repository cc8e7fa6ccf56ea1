"""Parameter-efficient adaptation (student.lora, student.freeze_blocks) on a real tile store, tiny model, CPU:
only adapters / later blocks and the heads move, the optimizer holds state for them only, merged weights load
strictly in the released layout, convert merges a LoRA run, FSDP2 (2 gloo ranks) trains and resumes, and bad
settings fail with the key to change and nothing overwritten."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dinov3_core.config import ConfigError, load_config
from dinov3_core.convert.config import ConvertConfig
from dinov3_core.convert.convert import ConvertError, run_convert
from dinov3_core.models import build_backbone, load_released_backbone, save_backbone
from dinov3_core.models.adaptation import (
    LoRASettings,
    apply_adaptation,
    has_lora,
    lora_scalings,
    lora_state_dict,
    merge_lora,
    merge_lora_state_dict,
)
from dinov3_core.train.checkpoint import CheckpointError
from dinov3_core.train.memory import estimate_memory, model_shape, shape_of
from dinov3_core.train.optim import clip_gradients
from dinov3_core.train.pretrain import run_pretrain
from dinov3_core.train.ssl_model import build_ssl_model
from tests.helpers import PRETRAIN_RUNS_SCRIPT, load_dcp, pretrain_values, torchrun

pytestmark = pytest.mark.usefixtures("one_thread")

RUN: dict[str, Any] = {
    "train.batch_size_per_gpu": 4,
    "train.stop_at": 2,
    "checkpointing.period": 1,
    "checkpointing.max_to_keep": 5,
    "evaluation.eval_period_iterations": 2,
    "health.probe_tiles": 0,
}
LORA = {"student.lora.rank": 4, "student.lora.alpha": 8.0, "student.lora.targets": ["qkv", "proj", "ffn"]}
HEADS = ("dino_head.", "ibot_head.")


def released(path: Path) -> Path:
    """A released-style vit_test backbone (masked K bias, layer scale, storage tokens), K bias made non-zero."""
    torch.manual_seed(3)
    model = build_backbone("vit_test", n_storage_tokens=4, layerscale_init=1e-5, mask_k_bias=True)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.bias.normal_()
    return save_backbone(model, path)


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return released(tmp_path_factory.mktemp("released") / "vit_test.pth")


def warm(store: Path, out: Path, weights: Path, **extra: Any) -> dict[str, Any]:
    # The arch named (not auto), so that the gram stage can inherit it.
    arch = {
        "student.arch": "vit_test",
        "student.n_storage_tokens": 4,
        "student.layerscale": 1e-5,
        "student.backbone_overrides": {"mask_k_bias": True},
    }
    return pretrain_values(store, out, **{**RUN, **arch, "student.pretrained_weights": str(weights), **extra})


def cfg_of(values: dict[str, Any]):
    from dinov3_core.train.config import PretrainConfig

    return load_config(PretrainConfig, "tiny", values, stage="pretrain")


def initial_student(values: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The student's parameters at the start of the run: built as the Trainer builds it (same seed)."""
    cfg = cfg_of(values)
    torch.manual_seed(cfg.train.seed)
    return {k: v.detach().clone() for k, v in build_ssl_model(cfg).model.student.named_parameters()}


def changed(before: dict[str, torch.Tensor], model: dict[str, Any], prefix: str) -> set[str]:
    after = {k.removeprefix(prefix): v for k, v in model.items() if k.startswith(prefix)}
    assert set(before) <= set(after)  # the state dict also holds buffers
    return {k for k in before if not torch.equal(before[k], after[k])}


def optimizer_params(state: dict[str, Any]) -> set[str]:
    """Parameters with AdamW state (the checkpoint's flat optimizer keys: `state.student.<fqn>.exp_avg`)."""
    suffix = ".exp_avg"
    keys = state["optimizer"]
    return {k.removeprefix("state.student.").removesuffix(suffix) for k in keys if k.endswith(suffix)}


def images() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def arch_of(values: dict[str, Any]) -> dict[str, Any]:
    """The run's backbone kwargs (the preset's bf16 RoPE included: inferred from the file it would be fp32)."""
    from dinov3_core.models import backbone_kwargs
    from dinov3_core.train.model_config import backbone_overrides

    cfg = cfg_of(values)
    return backbone_kwargs(cfg.student.arch, **backbone_overrides(cfg))


def adapted_teacher(values: dict[str, Any], ckpt: Path) -> nn.Module:
    """The LoRA teacher backbone of a DCP checkpoint, as the run had it."""
    cfg = cfg_of(values)
    model = build_ssl_model(cfg).model
    sd = load_dcp(ckpt)["model"]
    model.teacher.load_state_dict({k.removeprefix("teacher."): v for k, v in sd.items() if k.startswith("teacher.")})
    return model.teacher["backbone"].eval()


# ------------------------------------------------------------------------------------------- LoRA run


@pytest.fixture(scope="module")
def lora_run(stage_tile_store: Path, weights: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lora") / "run"
    values = warm(stage_tile_store, out, weights, **LORA)
    before = initial_student(values)
    result = run_pretrain(cfg_of(values))
    assert result.end_iteration == 2
    return {"out": out, "values": values, "before": before}


def test_lora_trains_only_adapters_and_heads(lora_run) -> None:
    state = load_dcp(lora_run["out"] / "ckpt" / "1")
    before = lora_run["before"]
    moved = changed(before, state["model"], "student.")
    adapters = {k for k in before if ".lora_" in k}
    heads = {k for k in before if k.startswith(HEADS)}
    assert adapters and moved - heads == adapters  # every adapter moved (B from zero), no base weight did
    assert heads & moved
    base = torch.load(lora_run["values"]["student.pretrained_weights"], weights_only=True)
    for key, value in base.items():  # bit-identical: the frozen base still is the released file, in both models
        module, _, leaf = key.rpartition(".")
        wrapped = f"student.backbone.{module}.base_layer.{leaf}"
        stored = wrapped if wrapped in state["model"] else f"student.backbone.{key}"
        assert torch.equal(state["model"][stored], value), key
        assert torch.equal(state["model"][stored.replace("student.", "teacher.", 1)], value), key
    trainable = {k for k in before if ".lora_" in k or k.startswith(HEADS)}
    assert optimizer_params(state) == trainable  # no AdamW state for any frozen parameter
    teacher_moved = changed(before, state["model"], "teacher.")
    assert {k for k in teacher_moved if k.startswith("backbone.")} == adapters  # the EMA follows the adapters only
    meta = json.loads((lora_run["out"] / "ckpt" / "1" / "meta.json").read_text())
    assert meta["adaptation"]["lora"]["rank"] == 4 and meta["adaptation"]["freeze_blocks"] == 0


def test_one_process_lora_resumes_like_an_uninterrupted_run(lora_run, tmp_path) -> None:
    """One process shares the frozen weights between student and teacher: DCP still saves and loads both names, and
    a run resumed from iteration 0 ends where the uninterrupted one did."""
    out = tmp_path / "resumed"
    values = {**lora_run["values"], "output_dir": str(out)}
    run_pretrain(cfg_of({**values, "train.stop_at": 1}))
    result = run_pretrain(cfg_of(values))
    assert result.start_iteration == 1 and result.end_iteration == 2
    got, ref = load_dcp(out / "ckpt" / "1")["model"], load_dcp(lora_run["out"] / "ckpt" / "1")["model"]
    assert set(got) == set(ref)
    assert max((got[k] - ref[k]).abs().max().item() for k in ref if torch.is_floating_point(ref[k])) < 1e-5


def test_merged_lora_loads_strictly_with_the_same_outputs(lora_run, tmp_path) -> None:
    out, values = lora_run["out"], lora_run["values"]
    teacher = adapted_teacher(values, out / "ckpt" / "1")
    with torch.no_grad():
        expected = teacher(images(), is_training=True)["x_norm_patchtokens"]
    # the eval teacher file: merged at save time, released layout, strict load
    eval_model = load_released_backbone(out / "eval" / "training_1" / "teacher_checkpoint.pth", arch_of(values))
    # convert: merged from the DCP checkpoint; save_adapter writes the adapter alone
    result = run_convert(
        load_config(ConvertConfig, None, {"input": str(out), "output_dir": str(tmp_path), "save_adapter": True})
    )
    converted = load_released_backbone(result.backbone, arch_of(values))
    # peft's own merge on the module
    merged = merge_lora(teacher)
    assert not has_lora(merged)
    for model in (eval_model, converted, merged):
        with torch.no_grad():
            got = model(images(), is_training=True)["x_norm_patchtokens"]
        assert (got - expected).abs().max().item() < 1e-5
    assert set(converted.state_dict()) == set(torch.load(values["student.pretrained_weights"]))
    from safetensors.torch import load_file

    adapter = load_file(result.adapter)
    assert adapter and all(".lora_" in k for k in adapter)
    assert (tmp_path / "adapter.yaml").is_file()


def test_resuming_a_lora_checkpoint_with_another_lora_setting_changes_nothing(lora_run, tmp_path) -> None:
    out = tmp_path / "run"
    shutil.copytree(lora_run["out"], out)
    snapshot = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    base = {**lora_run["values"], "output_dir": str(out), "train.stop_at": 3}
    for extra, text in (
        ({"student.lora.rank": 0}, "student.lora.rank=4"),
        ({"student.lora.rank": 2}, "student.lora.rank=4"),
        ({"student.lora.targets": ["qkv"]}, "student.lora.targets"),
    ):
        with pytest.raises(CheckpointError, match=text) as err:
            run_pretrain(cfg_of({**base, **extra}))
        assert "Nothing was changed" in str(err.value)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == snapshot


# ------------------------------------------------------------------------------------------ frozen blocks


@pytest.fixture(scope="module")
def frozen_run(stage_tile_store: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("frozen") / "run"
    values = pretrain_values(stage_tile_store, out, **{**RUN, "train.stop_at": 1, "student.freeze_blocks": 1})
    before = initial_student(values)
    run_pretrain(cfg_of(values))
    return {"out": out, "values": values, "before": before}


def test_freeze_blocks_trains_only_later_blocks(frozen_run) -> None:
    out, values, before = frozen_run["out"], frozen_run["values"], frozen_run["before"]
    state = load_dcp(out / "ckpt" / "0")
    moved = changed(before, state["model"], "student.")
    frozen = {
        k
        for k in before
        if k.startswith(
            (
                "backbone.blocks.0.",
                "backbone.patch_embed.",
                "backbone.cls_token",
                "backbone.storage_tokens",
                "backbone.mask_token",
            )
        )
    }
    assert not moved & frozen
    assert {k for k in moved if k.startswith("backbone.blocks.1.")}  # the trained block did move
    assert optimizer_params(state) == set(before) - frozen
    # resuming with another freeze_blocks: refused before anything is written
    snapshot = (out / "config.yaml").read_bytes()
    with pytest.raises(CheckpointError, match=r"student\.freeze_blocks"):
        run_pretrain(cfg_of({**values, "train.stop_at": 2, "student.freeze_blocks": 0}))
    assert (out / "config.yaml").read_bytes() == snapshot


def test_memory_estimate_counts_trainable_parameters_and_trained_depth(tmp_path: Path) -> None:
    values = pretrain_values(tmp_path / "tiles.zarr", tmp_path / "out", **{"student.freeze_blocks": 1})
    full, frozen = model_shape(cfg_of({**values, "student.freeze_blocks": 0})), model_shape(cfg_of(values))
    lora = model_shape(cfg_of({**values, **LORA}))
    for cfg_values, shape in ((values, frozen), ({**values, **LORA}, lora)):
        cfg = cfg_of(cfg_values)
        built = shape_of(build_ssl_model(cfg).model.student, cfg)  # meta build (peft on meta too) is exact
        assert (shape.trainable_params, shape.trained_depth) == (built.trainable_params, built.trained_depth)
    assert full.trainable_params == full.student_params and full.trained_depth == 2
    assert frozen.trained_depth == 1 and frozen.trainable_params < full.trainable_params
    assert lora.trained_depth == 1 and lora.student_params > full.student_params
    cfg = cfg_of(values)
    kw = {"micro_batch": 4, "step_batch": 4, "world_size": 1, "device_type": "cpu"}
    a, b = estimate_memory(cfg, full, **kw), estimate_memory(cfg, frozen, **kw)
    assert b.optimizer == 8 * frozen.trainable_params and b.grads == 4 * frozen.trainable_params
    assert b.weights == a.weights and b.activations < a.activations
    # One process: the teacher shares the frozen weights (only its trainable twins are its own); FSDP: full copies.
    assert b.teacher == 4 * frozen.trainable_params < a.teacher
    two = estimate_memory(cfg, frozen, **{**kw, "world_size": 2})
    assert two.teacher == 4 * frozen.student_params // 2


def test_one_process_shares_frozen_weights_between_student_and_teacher(tmp_path: Path) -> None:
    from dinov3_core.train.distributed import DistEnv, parallelize

    values = pretrain_values(tmp_path / "tiles.zarr", tmp_path / "out", **LORA)
    model = build_ssl_model(cfg_of(values)).model
    parallelize(model.student, model.teacher, DistEnv(), bf16=False, activation_checkpointing=False, compile=False)
    student = dict(model.student.named_parameters())
    for name, param in model.teacher.named_parameters():
        assert (param is student[name]) == (not student[name].requires_grad), name  # frozen shared, trained own
    shared = {id(p) for p in model.student.parameters()} & {id(p) for p in model.teacher.parameters()}
    assert shared and len(shared) < len(student)
    # The state dict (checkpoints, eval files) still lists every teacher weight under its own name.
    assert {f"teacher.{k}" for k in student} | {f"student.{k}" for k in student} <= set(model.state_dict())


# --------------------------------------------------------------------------------------------- units


def test_peft_wraps_the_masked_k_bias_qkv_and_merges_exactly(weights: Path) -> None:
    model = load_released_backbone(weights)
    reference = load_released_backbone(weights)
    apply_adaptation(model, freeze_blocks=0, freeze_patch_embed=True, lora=LoRASettings(rank=2, alpha=4.0))
    qkv = model.blocks[0].attn.qkv
    base = qkv.get_base_layer()
    assert type(base).__name__ == "LinearKMaskedBias" and base.bias_mask.sum() < base.bias.numel()
    x = torch.randn(3, model.embed_dim)
    with torch.no_grad():
        masked = torch.nn.functional.linear(x, base.weight, base.bias * base.bias_mask)
        assert torch.equal(qkv(x), masked)  # B = 0: exactly the base layer's forward, K bias masked
        assert not torch.equal(qkv(x), torch.nn.functional.linear(x, base.weight, base.bias))
        for layer in (m for m in model.modules() if hasattr(m, "lora_B")):
            layer.lora_B["default"].weight.normal_()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model))  # peft froze everything else
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    by_state = merge_lora_state_dict(sd, lora_scalings(model))
    with torch.no_grad():
        expected = model(images())
    merged = merge_lora(model)
    assert set(merged.state_dict()) == set(reference.state_dict())  # the released key layout again
    for k, v in merged.state_dict().items():
        assert torch.allclose(by_state[k], v, atol=1e-6), k
    with torch.no_grad():
        assert (merged(images()) - expected).abs().max().item() < 1e-5


def test_update_teacher_moves_only_trainable_pairs_and_clipping_skips_gradless_parts(tmp_path: Path) -> None:
    values = pretrain_values(tmp_path / "tiles.zarr", tmp_path / "out", **LORA)
    model = build_ssl_model(cfg_of(values)).model
    with torch.no_grad():
        for p in model.student.parameters():
            p.add_(1.0)  # frozen ones too: a real step never changes them, so the EMA must not read them
    before = {k: v.clone() for k, v in model.teacher.state_dict().items()}
    model.update_teacher(0.5)
    names = {n for n, p in model.student.named_parameters() if p.requires_grad}
    moved = {k for k, v in model.teacher.state_dict().items() if not torch.equal(v, before[k])}
    assert moved == names
    student = nn.ModuleDict({"backbone": nn.Linear(2, 2).requires_grad_(False), "dino_head": nn.Linear(2, 2)})
    student["dino_head"](torch.ones(1, 2)).sum().backward()
    assert set(clip_gradients(student, 1.0)) == {"dino_head_grad_norm"}


def test_bad_settings_name_the_key(tmp_path: Path) -> None:
    values = pretrain_values(tmp_path / "tiles.zarr", tmp_path / "out")
    for extra, text in (
        ({"student.lora.rank": -1}, "student.lora.rank"),
        ({"student.lora.targets": ["q"]}, r"student.lora.targets.*valid"),
        ({"student.freeze_blocks": -1}, "student.freeze_blocks"),
    ):
        with pytest.raises(ConfigError, match=text):
            cfg_of({**values, **extra})
    with pytest.raises(ConfigError, match=r"student.freeze_blocks=3 .*only 2 blocks"):
        build_ssl_model(cfg_of({**values, "student.freeze_blocks": 3}))
    swiglu = {**values, **LORA, "student.lora.targets": ["fc1"], "student.backbone_overrides": {"ffn_layer": "swiglu"}}
    with pytest.raises(ConfigError, match=r"\['fc1'\] match no Linear.*valid"):
        build_ssl_model(cfg_of(swiglu))
    with pytest.raises(ConfigError, match=r"\['fc1'\] match no Linear"):
        model_shape(cfg_of(swiglu))


def test_convert_save_adapter_needs_a_lora_run(frozen_run, tmp_path: Path) -> None:
    cfg = load_config(
        ConvertConfig, None, {"input": str(frozen_run["out"]), "output_dir": str(tmp_path / "o"), "save_adapter": True}
    )
    with pytest.raises(ConvertError, match="save_adapter"):
        run_convert(cfg)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------ FSDP2, 2 processes


def test_lora_under_fsdp2_trains_and_resumes(stage_tile_store: Path, weights: Path, tmp_path: Path) -> None:
    out = tmp_path / "fsdp"
    first = warm(stage_tile_store, out, weights, **LORA, **{"train.batch_size_per_gpu": 2})
    second = {**first, "train.stop_at": 3}
    proc = torchrun(str(PRETRAIN_RUNS_SCRIPT), json.dumps(first), json.dumps(second), timeout=300)
    summaries = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"run"')]
    assert [s["world_size"] for s in summaries] == [2, 2]
    assert Path(summaries[1]["resumed_from"]).name == "1" and summaries[1]["end_iteration"] == 3
    before = initial_student(first)
    state = load_dcp(out / "ckpt" / "2")
    moved = changed(before, state["model"], "student.")
    assert {k for k in moved if not k.startswith(HEADS)} == {k for k in before if ".lora_" in k}
    assert optimizer_params(state) == {k for k in before if ".lora_" in k or k.startswith(HEADS)}
    teacher = adapted_teacher(first, out / "ckpt" / "2")
    with torch.no_grad():
        expected = teacher(images(), is_training=True)["x_norm_patchtokens"]
        got = load_released_backbone(out / "eval" / "training_2" / "teacher_checkpoint.pth", arch_of(first))(
            images(), is_training=True
        )["x_norm_patchtokens"]
    assert (got - expected).abs().max().item() < 1e-5  # gathered, merged eval teacher = the sharded LoRA teacher


# ------------------------------------------------------------------------------------------------ gram


def test_gram_continues_a_lora_run_with_lora(lora_run, stage_tile_store: Path, tmp_path: Path) -> None:
    """The gram stage inherits student.lora, resumes the LoRA checkpoint and refreshes its (plain) gram teacher
    from the merged LoRA teacher."""
    from dinov3_core.gram.anchoring import run_gram
    from dinov3_core.gram.config import GramConfig

    values = {
        "tracking.enabled": False,
        "pretrain_dir": str(lora_run["out"]),
        "data.stores": [str(stage_tile_store)],
        "output_dir": str(tmp_path / "gram"),
        "train.batch_size_per_gpu": 4,
        "train.global_batch_size": 8,
        "train.stop_at": 2,
        "health.probe_tiles": 0,
        "gram.update_frequency": 1,  # a refresh after stage iteration 0: merges the LoRA teacher
    }
    result = run_gram(load_config(GramConfig, "tiny", values, stage="gram"))
    assert result.gram_updates >= 1
    state = load_dcp(tmp_path / "gram" / "ckpt" / str(result.end_iteration - 1))
    assert any(".lora_A." in k for k in state["model"])
    before = initial_student(lora_run["values"])
    moved = changed(before, state["model"], "student.")
    assert {k for k in moved if not k.startswith(HEADS)} == {k for k in before if ".lora_" in k}
