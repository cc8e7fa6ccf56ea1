"""Released-weight files: strict loading, wrappers, arch inference, named errors, atomic saving.

No real released file is needed: a file in the released layout is a plain dict of tensors with the keys and
shapes of the hub model, which we write from a meta-built model filled with random values.
"""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path

import pytest
import torch

from dinov3_core.models import (
    HUB_SETTINGS,
    DinoVisionTransformer,
    ReleasedWeightsError,
    backbone_kwargs,
    build_backbone,
    build_student_teacher_from_released,
    infer_backbone_kwargs,
    load_released_backbone,
    read_backbone_state_dict,
    save_backbone,
)


def random_released_state_dict(name: str, **overrides) -> dict[str, torch.Tensor]:
    """What a released file holds: every key of the hub model, random values, real bias_mask and periods."""
    with torch.device("meta"):
        model = build_backbone(name, **overrides)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()  # correct buffers (bias_mask, periods)
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if "bias_mask" not in key and "periods" not in key:
                value.normal_(0, 0.1)
    return model.state_dict()


def write(path: Path, obj) -> Path:
    torch.save(obj, path)
    return path


@pytest.fixture(scope="module")
def vits16_file(tmp_path_factory) -> Path:
    return write(
        tmp_path_factory.mktemp("released") / "dinov3_vits16_pretrain_lvd1689m-08c60483.pth",
        random_released_state_dict("vits16"),
    )


def tiny_kwargs(**overrides):
    return backbone_kwargs("vit_test", **{**HUB_SETTINGS, **overrides})


# --- loading -----------------------------------------------------------------------------------------------


def test_vits16_layout_file_loads_strictly_with_inferred_arch(vits16_file: Path, tmp_path: Path) -> None:
    sd = torch.load(vits16_file, weights_only=True)
    name, kwargs = infer_backbone_kwargs(sd)
    assert name == "vits16" and kwargs == backbone_kwargs("vits16")

    model = load_released_backbone(vits16_file)
    assert not model.training
    assert model.norm.eps == 1e-5 and model.rope_embed.rescale_coords == 2.0  # hub settings, not in the keys
    loaded = model.state_dict()
    assert list(loaded) == list(sd)
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    out = model(torch.randn(1, 3, 64, 48))
    assert out.shape == (1, 384) and torch.isfinite(out).all()

    resaved = torch.load(save_backbone(model, tmp_path / "resaved.pth"), weights_only=True)
    assert list(resaved) == list(sd) and all(torch.equal(resaved[k], sd[k]) for k in sd)


def test_eval_checkpoint_and_model_wrappers(tmp_path: Path) -> None:
    sd = random_released_state_dict("vit_test", **HUB_SETTINGS)
    teacher_ckpt = {
        "teacher": {
            **{f"backbone.{k}": v for k, v in sd.items()},
            "dino_head.mlp.0.weight": torch.zeros(8, 64),
            "ibot_head.last_layer.weight": torch.zeros(16, 8),
        }
    }
    for name, obj in [
        ("eval.pth", teacher_ckpt),
        ("model.pth", {"model": sd}),
        ("ddp.pth", {f"module.{k}": v for k, v in sd.items()}),
    ]:
        path = write(tmp_path / name, obj)
        loaded = read_backbone_state_dict(path)
        assert list(loaded) == list(sd), name
        model = load_released_backbone(path, "vit_test", overrides=HUB_SETTINGS)
        assert torch.equal(model.state_dict()["blocks.1.mlp.fc2.weight"], sd["blocks.1.mlp.fc2.weight"])


@pytest.mark.parametrize(
    "overrides",
    [
        dict(ffn_layer="swiglu", ffn_ratio=6.0),
        dict(ffn_layer="swiglu64", ffn_ratio=3.0, qkv_bias=False, untie_global_and_local_cls_norm=True),
        dict(norm_layer="rmsnorm", untie_cls_and_patch_norms=True, n_storage_tokens=2, layerscale_init=None),
        dict(mask_k_bias=False, n_storage_tokens=0, pos_embed_rope_dtype="bf16", norm_layer="layernorm"),
        dict(
            pos_embed_rope_base=None,
            pos_embed_rope_min_period=0.5,
            pos_embed_rope_max_period=20.0,
            proj_bias=False,
        ),
        dict(ffn_ratio=3.777777778, ffn_bias=False),
    ],
)
def test_arch_inference_reproduces_non_released_layouts(tmp_path: Path, overrides) -> None:
    defaults = {k: p.default for k, p in inspect.signature(DinoVisionTransformer).parameters.items()}
    kwargs = {**defaults, **tiny_kwargs(**overrides)}
    del kwargs["ignored_kwargs"]
    torch.manual_seed(0)
    original = DinoVisionTransformer(**kwargs).eval()
    path = save_backbone(original, tmp_path / "custom.pth")
    name, inferred = infer_backbone_kwargs(read_backbone_state_dict(path))
    assert name is None
    # swiglu64 at ratio 3 and dim 64 has the same hidden size as swiglu: only the family is identifiable.
    assert inferred["ffn_layer"][:3] == kwargs["ffn_layer"][:3]
    for key in (
        "qkv_bias",
        "proj_bias",
        "ffn_bias",
        "mask_k_bias",
        "n_storage_tokens",
        "untie_cls_and_patch_norms",
        "untie_global_and_local_cls_norm",
        "pos_embed_rope_dtype",
    ):
        if not (key == "mask_k_bias" and not kwargs["qkv_bias"]):  # no trace without a qkv bias
            assert inferred[key] == kwargs[key], key
    loaded = load_released_backbone(path)
    x = torch.randn(2, 3, 32, 48)
    # Only the norm eps (1e-5 vs 1e-6) cannot be read from a file; otherwise the networks are identical.
    torch.testing.assert_close(loaded(x), original(x).detach(), rtol=1e-4, atol=1e-4)


def test_vit7b16_layout_is_recognised_without_allocating() -> None:
    with torch.device("meta"):
        sd = build_backbone("vit7b16").state_dict()
    assert infer_backbone_kwargs(sd)[0] == "vit7b16"


# --- errors name the differing flag ------------------------------------------------------------------------


def test_mask_k_bias_file_into_unmasked_model(vits16_file: Path) -> None:
    arch = {**backbone_kwargs("vits16"), "mask_k_bias": False}
    with pytest.raises(ReleasedWeightsError) as err:
        load_released_backbone(vits16_file, arch)
    message = str(err.value)
    assert isinstance(err.value, ValueError)
    assert str(vits16_file) in message
    assert "unexpected keys, in the file but not the model (12): blocks.0.attn.qkv.bias_mask" in message
    assert "missing keys, in the model but not the file: none" in message
    assert "mask_k_bias=True" in message


def test_file_without_layerscale(tmp_path: Path) -> None:
    path = write(
        tmp_path / "no_ls.pth",
        random_released_state_dict("vit_test", **{**HUB_SETTINGS, "layerscale_init": None}),
    )
    with pytest.raises(
        ReleasedWeightsError, match=r"(?s)missing keys.*\(4\): blocks\.0\.ls1\.gamma.*layerscale_init=None"
    ):
        load_released_backbone(path, tiny_kwargs())


def test_storage_token_count_mismatch_is_a_shape_error(tmp_path: Path) -> None:
    path = write(tmp_path / "regs.pth", random_released_state_dict("vit_test", **HUB_SETTINGS))
    with pytest.raises(ReleasedWeightsError) as err:
        load_released_backbone(path, tiny_kwargs(n_storage_tokens=2))
    assert "storage_tokens file [1, 4, 64] vs model [1, 2, 64]" in str(err.value)
    assert "n_storage_tokens=4" in str(err.value)


def test_wrong_ffn_type_and_depth(vits16_file: Path) -> None:
    with pytest.raises(ReleasedWeightsError) as err:
        load_released_backbone(vits16_file, "vits16plus")
    assert "ffn_layer='mlp'" in str(err.value)
    with pytest.raises(ReleasedWeightsError, match="depth=12"):
        load_released_backbone(vits16_file, {**backbone_kwargs("vits16"), "depth": 13})


def test_files_that_are_not_backbones(tmp_path: Path) -> None:
    with pytest.raises(ReleasedWeightsError, match="no `cls_token`"):
        load_released_backbone(write(tmp_path / "other.pth", {"weight": torch.zeros(2)}))
    with (tmp_path / "pickle.pth").open("wb") as f:
        pickle.dump({"cls_token": object()}, f, protocol=2)  # torch.load's protocol: no warning
    with pytest.raises(ReleasedWeightsError, match="cannot be read as a weights file"):
        load_released_backbone(tmp_path / "pickle.pth")
    with pytest.raises(FileNotFoundError):
        load_released_backbone(tmp_path / "absent.pth")


# --- saving ------------------------------------------------------------------------------------------------


def test_save_round_trip_is_exact_and_in_released_layout(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_backbone("vit_test", **HUB_SETTINGS).eval()
    path = save_backbone(torch.compile(model), tmp_path / "out" / "backbone.pth")  # `_orig_mod.` stripped
    assert sorted(p.name for p in path.parent.iterdir()) == ["backbone.pth"]  # no temporary left behind

    raw = torch.load(path, weights_only=True)
    assert type(raw) is dict and list(raw) == list(model.state_dict())
    assert all(v.device.type == "cpu" for v in raw.values())
    assert torch.equal(raw["blocks.0.attn.qkv.bias_mask"], model.blocks[0].attn.qkv.bias_mask)

    loaded = load_released_backbone(path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in raw.items())
    x = torch.randn(2, 3, 48, 32)
    assert torch.equal(loaded(x), model(x))

    with torch.no_grad():
        model.cls_token.add_(1.0)
    save_backbone(model, path)  # overwrite in place
    assert torch.equal(torch.load(path, weights_only=True)["cls_token"], model.cls_token.detach())


def test_safetensors(tmp_path: Path) -> None:
    model = build_backbone("vit_test", **HUB_SETTINGS)
    try:
        import safetensors  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="safetensors"):
            save_backbone(model, tmp_path / "b.safetensors")
        assert not list(tmp_path.iterdir())
        pytest.skip("safetensors is not installed")
    path = save_backbone(model, tmp_path / "b.safetensors")
    assert torch.equal(load_released_backbone(path).cls_token, model.cls_token)


# --- warm start ------------------------------------------------------------------------------------------


def test_student_teacher_warm_start(tmp_path: Path) -> None:
    path = write(tmp_path / "tiny.pth", random_released_state_dict("vit_test", **HUB_SETTINGS))
    official_ibot_section = {
        "loss_weight": 1.0,
        "head_n_prototypes": 96,
        "head_bottleneck_dim": 16,
        "head_nlayers": 3,
        "head_hidden_dim": 32,
        "separate_head": True,
    }
    ws = build_student_teacher_from_released(
        path,
        dino_head_cfg={"out_dim": 128, "hidden_dim": 64, "bottleneck_dim": 32},
        ibot_head_cfg=official_ibot_section,
        arch=tiny_kwargs(),
        student_overrides={"drop_path_rate": 0.2},
    )
    student, teacher = ws.student.state_dict(), ws.teacher.state_dict()
    assert list(student) == list(teacher)
    assert all(torch.equal(student[k], teacher[k]) for k in student)
    assert student["dino_head.last_layer.weight"].shape == (128, 32)
    assert student["ibot_head.last_layer.weight"].shape == (96, 16)
    assert torch.equal(student["backbone.cls_token"], torch.load(path, weights_only=True)["cls_token"])
    assert ws.student.training and not ws.teacher.training
    assert all(p.requires_grad for p in ws.student.parameters())
    assert not any(p.requires_grad for p in ws.teacher.parameters())
    assert ws.student["backbone"].blocks[0].sample_drop_ratio == 0.2
    assert ws.teacher["backbone"].blocks[0].sample_drop_ratio == 0.0
