"""DINOv3 backbone and head: upstream-compatible construction, keys, numerics and training features.

Big presets are only built on the meta device; numerics use `vit_test` (64-d, 2 blocks).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from dinov3_core.models import (
    HUB_SETTINGS,
    PRESETS,
    RELEASED,
    DINOHead,
    DinoVisionTransformer,
    build_backbone,
)
from dinov3_core.models.layers import LinearKMaskedBias, RopePositionEmbedding, attention, rope_rotate_half

# Counts from the official code (docs/model.md, "Presets and released variants"): presets with constructor defaults.
EXPECTED_PARAMS = {
    "vit_small": 21_590_400,
    "vit_base": 85_648_128,
    "vit_large": 303_100_928,
    "vit_so400m": 415_344_384,
    "vit_huge2": 630_667_520,
    "vit_giant2": 1_134_448_128,
    "vit_7b": 6_716_018_688,
    "vits16": 21_601_152,
    "vits16plus": 28_697_472,
    "vitb16": 85_669_632,
    "vitl16": 303_154_176,
    "vitl16_sat": 303_156_224,
    "vitl16plus": 403_915_776,
    "vith16plus": 840_633_600,
    "vit7b16": 6_716_043_264,
}


def tiny(**overrides) -> DinoVisionTransformer:
    """vit_test with the released (hub) settings unless overridden (fp32 RoPE), seeded.

    Layer scale starts at 1 instead of 1e-5 so that the blocks, not just the embeddings, shape the outputs.
    """
    torch.manual_seed(0)
    return build_backbone("vit_test", **{**HUB_SETTINGS, "layerscale_init": 1.0, **overrides})


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- construction, presets, keys -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_parameter_counts_match_official(name: str) -> None:
    model = build_backbone(name, device="meta")
    assert n_params(model) == EXPECTED_PARAMS[name]


def test_every_preset_and_release_has_an_expected_count() -> None:
    assert set(PRESETS) - {"vit_test"} | set(RELEASED) == set(EXPECTED_PARAMS)
    assert n_params(build_backbone("vit_test")) < 200_000  # the CI model stays tiny


def test_constructor_defaults_are_upstream_defaults() -> None:
    defaults = {
        k: p.default for k, p in inspect.signature(DinoVisionTransformer).parameters.items() if k != "ignored_kwargs"
    }
    assert defaults == {
        "img_size": 224,
        "patch_size": 16,
        "in_chans": 3,
        "pos_embed_rope_base": 100.0,
        "pos_embed_rope_min_period": None,
        "pos_embed_rope_max_period": None,
        "pos_embed_rope_normalize_coords": "separate",
        "pos_embed_rope_shift_coords": None,
        "pos_embed_rope_jitter_coords": None,
        "pos_embed_rope_rescale_coords": None,
        "pos_embed_rope_dtype": "bf16",
        "embed_dim": 768,
        "depth": 12,
        "num_heads": 12,
        "ffn_ratio": 4.0,
        "qkv_bias": True,
        "drop_path_rate": 0.0,
        "layerscale_init": None,
        "norm_layer": "layernorm",
        "ffn_layer": "mlp",
        "ffn_bias": True,
        "proj_bias": True,
        "n_storage_tokens": 0,
        "mask_k_bias": False,
        "untie_cls_and_patch_norms": False,
        "untie_global_and_local_cls_norm": False,
        "device": None,
    }
    model = DinoVisionTransformer(device="meta")
    assert model.rope_embed.periods.dtype == torch.bfloat16
    assert model.norm.eps == 1e-6
    assert build_backbone("vits16", device="meta").norm.eps == 1e-5  # layernormbf16


def test_vits16_state_dict_keys_and_shapes() -> None:
    shapes = {k: tuple(v.shape) for k, v in build_backbone("vits16", device="meta").state_dict().items()}
    assert len(shapes) == 188
    assert list(shapes)[:6] == [
        "cls_token",
        "storage_tokens",
        "mask_token",
        "patch_embed.proj.weight",
        "patch_embed.proj.bias",
        "rope_embed.periods",
    ]
    expected = {
        "cls_token": (1, 1, 384),
        "storage_tokens": (1, 4, 384),
        "mask_token": (1, 384),
        "patch_embed.proj.weight": (384, 3, 16, 16),
        "patch_embed.proj.bias": (384,),
        "rope_embed.periods": (16,),
        "norm.weight": (384,),
        "norm.bias": (384,),
        "blocks.11.norm1.weight": (384,),
        "blocks.11.attn.qkv.weight": (1152, 384),
        "blocks.11.attn.qkv.bias": (1152,),
        "blocks.11.attn.qkv.bias_mask": (1152,),
        "blocks.11.attn.proj.weight": (384, 384),
        "blocks.11.ls1.gamma": (384,),
        "blocks.11.norm2.bias": (384,),
        "blocks.11.mlp.fc1.weight": (1536, 384),
        "blocks.11.mlp.fc2.bias": (384,),
        "blocks.11.ls2.gamma": (384,),
    }
    assert {k: shapes[k] for k in expected} == expected
    block0 = [k.removeprefix("blocks.0.") for k in shapes if k.startswith("blocks.0.")]
    assert block0 == [
        "norm1.weight",
        "norm1.bias",
        "attn.qkv.weight",
        "attn.qkv.bias",
        "attn.qkv.bias_mask",
        "attn.proj.weight",
        "attn.proj.bias",
        "ls1.gamma",
        "norm2.weight",
        "norm2.bias",
        "mlp.fc1.weight",
        "mlp.fc1.bias",
        "mlp.fc2.weight",
        "mlp.fc2.bias",
        "ls2.gamma",
    ]


def test_vit7b16_state_dict_layout() -> None:
    sd = build_backbone("vit7b16", device="meta").state_dict()
    assert len(sd) == 610
    assert "blocks.0.attn.qkv.bias" not in sd and "blocks.0.attn.qkv.bias_mask" not in sd
    assert sd["rope_embed.periods"].shape == (32,)
    assert {"local_cls_norm.weight", "local_cls_norm.bias"} <= set(sd) and "cls_norm.weight" not in sd
    assert sd["blocks.0.mlp.w1.weight"].shape == (8192, 4096)  # swiglu64, ratio 3


def test_unknown_names_and_values_fail_clearly() -> None:
    with pytest.raises(ValueError, match="did you mean 'vits16'"):
        build_backbone("vits61")
    with pytest.raises(ValueError, match="unknown norm_layer"):
        build_backbone("vit_test", norm_layer="batchnorm")
    with pytest.raises(ValueError, match="min,max"):
        build_backbone("vit_test", pos_embed_rope_min_period=0.1, pos_embed_rope_max_period=10.0)  # base too
    assert build_backbone("dinov3_vits16", device="meta").n_storage_tokens == 4


def test_meta_construction_then_init_weights() -> None:
    with torch.device("meta"):
        model = build_backbone("vit_test", **HUB_SETTINGS)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    sd = model.state_dict()
    assert all(torch.isfinite(v).all() for v in sd.values())
    assert torch.equal(sd["mask_token"], torch.zeros(1, 64))
    assert torch.equal(sd["blocks.0.ls1.gamma"], torch.full((64,), 1e-5))
    assert torch.equal(sd["blocks.0.attn.qkv.bias"], torch.zeros(192))
    assert torch.equal(sd["blocks.0.attn.qkv.bias_mask"], torch.tensor([1.0] * 64 + [0.0] * 64 + [1.0] * 64))
    assert torch.allclose(sd["rope_embed.periods"], 100.0 ** (torch.arange(4) / 4))
    w = torch.cat([sd[f"blocks.{i}.{n}.weight"].flatten() for i in range(2) for n in ("attn.qkv", "mlp.fc1")])
    assert abs(w.std().item() - 0.02) < 0.002
    bound = 1 / math.sqrt(3 * 16 * 16)  # patch embed: upstream's uniform(±1/sqrt(fan_in))
    assert sd["patch_embed.proj.weight"].abs().max() <= bound
    x = torch.randn(1, 3, 32, 32)
    assert torch.isfinite(model(x)).all()


# --- RoPE --------------------------------------------------------------------------------------------------


def test_rope_tables_follow_the_formula() -> None:
    """sin/cos of 2π·coord/period; [row angles | column angles] twice; coords 2(k+0.5)/n - 1."""
    rope = RopePositionEmbedding(64, num_heads=2, base=100.0, dtype=torch.float32)  # head_dim 32, 8 periods
    H, W = 3, 5
    sin, cos = rope(H=H, W=W)
    assert sin.shape == cos.shape == (H * W, 32)
    periods = 100.0 ** (2 * torch.arange(8, dtype=torch.float64) / 16)
    for i, j in [(0, 0), (1, 3), (2, 4)]:
        ch, cw = 2 * (i + 0.5) / H - 1, 2 * (j + 0.5) / W - 1
        half = torch.cat([2 * math.pi * ch / periods, 2 * math.pi * cw / periods])
        expected = torch.cat([half, half])
        assert torch.allclose(sin[i * W + j].double(), expected.sin(), atol=1e-6)
        assert torch.allclose(cos[i * W + j].double(), expected.cos(), atol=1e-6)


def test_rope_min_max_normalisation_and_period_parametrisation() -> None:
    rope = RopePositionEmbedding(
        64,
        num_heads=2,
        base=None,
        min_period=0.5,
        max_period=20.0,
        normalize_coords="max",
        dtype=torch.float32,
    )
    assert torch.allclose(rope.periods[[0, -1]], torch.tensor([0.5, 20.0]))
    sin, _ = rope(H=2, W=4)
    # "max": both axes divided by max(H, W) = 4, so the first row coordinate is 2 * 0.5/4 - 1.
    assert torch.allclose(sin[0, 0], torch.sin(torch.tensor(2 * math.pi * (2 * 0.5 / 4 - 1) / 0.5)), atol=1e-6)


def test_rope_rotation_pairs_halves() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert torch.equal(rope_rotate_half(x), torch.tensor([-4.0, -5.0, -6.0, 1.0, 2.0, 3.0]))


def test_rope_augmentations_change_outputs_only_in_training() -> None:
    aug = dict(pos_embed_rope_shift_coords=0.2, pos_embed_rope_jitter_coords=1.5, pos_embed_rope_rescale_coords=2.0)
    model = tiny(**aug)
    plain = tiny(pos_embed_rope_rescale_coords=None)
    plain.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 48, 64)
    with torch.no_grad():
        model.eval(), plain.eval()
        ref = plain(x)
        assert torch.equal(model(x), ref) and torch.equal(model(x), model(x))
        model.train(), plain.train()
        assert torch.allclose(plain(x), ref, atol=1e-6)  # train mode alone changes nothing
        a, b = model(x), model(x)
        assert not torch.allclose(a, b, atol=1e-4) and not torch.allclose(a, ref, atol=1e-4)


# --- forward semantics --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("h", "w"), [(224, 224), (160, 224), (64, 96), (16, 16)])
def test_shapes_for_square_and_non_square_inputs(h: int, w: int) -> None:
    model = tiny().eval()
    with torch.no_grad():
        out = model.forward_features(torch.randn(2, 3, h, w))
        (patches, cls, extra), *_ = model.get_intermediate_layers(
            torch.randn(2, 3, h, w), n=2, reshape=True, return_class_token=True, return_extra_tokens=True
        )
    hw = (h // 16) * (w // 16)
    assert out["x_norm_clstoken"].shape == (2, 64)
    assert out["x_storage_tokens"].shape == (2, 4, 64)
    assert out["x_norm_patchtokens"].shape == (2, hw, 64)
    assert out["x_prenorm"].shape == (2, 1 + 4 + hw, 64)
    assert out["masks"] is None
    assert patches.shape == (2, 64, h // 16, w // 16) and cls.shape == (2, 64) and extra.shape == (2, 4, 64)


def test_eval_outputs_are_deterministic_and_forward_is_the_normed_cls() -> None:
    model = tiny().eval()
    x = torch.randn(3, 3, 64, 96)
    with torch.no_grad():
        a, b = model(x), model(x)
        feats = model(x, is_training=True)
    assert torch.equal(a, b)
    assert torch.equal(a, feats["x_norm_clstoken"])
    assert torch.equal(a, tiny().eval()(x).detach())  # same seed, same weights, same numbers


def test_list_input_equals_separate_calls() -> None:
    model = tiny().eval()
    xg, xl = torch.randn(2, 3, 64, 64), torch.randn(3, 3, 32, 48)
    mask = torch.rand(2, 16) > 0.5
    with torch.no_grad():
        together = model.forward_features([xg, xl], [mask, None])
        separate = [model.forward_features(xg, mask), model.forward_features(xl)]
    for t, s in zip(together, separate, strict=True):
        for key in ("x_norm_clstoken", "x_storage_tokens", "x_norm_patchtokens", "x_prenorm"):
            torch.testing.assert_close(t[key], s[key], rtol=1e-5, atol=1e-5)
    assert together[0]["masks"] is mask


def test_masked_patches_are_replaced_by_the_mask_token() -> None:
    model = tiny().eval()
    with torch.no_grad():
        model.mask_token.normal_()  # zero at init; make it distinguishable
    x = torch.randn(2, 3, 64, 64)  # 4 × 4 patches
    masks = torch.zeros(2, 16, dtype=torch.bool)
    masks[:, [0, 5, 15]] = True
    tokens, _ = model.prepare_tokens_with_masks(x, masks)
    assert torch.equal(tokens[:, 5 + torch.tensor([0, 5, 15])], model.mask_token.expand(2, 3, 64))

    changed = x.clone()
    changed[:, :, 16:32, 16:32] = torch.randn(2, 3, 16, 16)  # patch 5 (row 1, column 1): masked
    with torch.no_grad():
        ref = model.forward_features(x, masks)["x_norm_patchtokens"]
        assert torch.equal(model.forward_features(changed, masks)["x_norm_patchtokens"], ref)
        changed[:, :, 0:16, 16:32] += 1.0  # patch 1: visible
        assert not torch.allclose(model.forward_features(changed, masks)["x_norm_patchtokens"], ref)


def test_k_bias_is_masked() -> None:
    layer = LinearKMaskedBias(4, 12)
    with torch.no_grad():
        layer.bias.fill_(1.0)
    out = layer(torch.zeros(1, 4))
    assert torch.equal(out, torch.tensor([[1.0] * 4 + [0.0] * 4 + [1.0] * 4]))


def test_untied_norms() -> None:
    model = tiny(untie_cls_and_patch_norms=True, untie_global_and_local_cls_norm=True)
    with torch.no_grad():
        for norm, value in ((model.norm, 1.0), (model.cls_norm, 2.0), (model.local_cls_norm, 3.0)):
            norm.weight.fill_(value)
            norm.bias.zero_()
    xg, xl = torch.randn(2, 3, 32, 32), torch.randn(2, 3, 16, 16)

    def ln(t: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(t, (64,), eps=1e-5)

    for training, local_scale in ((True, 3.0), (False, 2.0)):
        model.train(training)
        with torch.no_grad():
            g, loc = model.forward_features([xg, xl])
        torch.testing.assert_close(g["x_norm_clstoken"], 2.0 * ln(g["x_prenorm"][:, 0]))
        torch.testing.assert_close(loc["x_norm_clstoken"], local_scale * ln(loc["x_prenorm"][:, 0]))
        torch.testing.assert_close(loc["x_norm_patchtokens"], ln(loc["x_prenorm"][:, 5:]))


def test_intermediate_layers_match_forward_features() -> None:
    model = tiny().eval()
    x = torch.randn(2, 3, 32, 64)
    with torch.no_grad():
        feats = model.forward_features(x)
        (last,) = model.get_intermediate_layers(x)
        first, second = model.get_intermediate_layers(x, n=[0, 1], norm=False)
    torch.testing.assert_close(last, feats["x_norm_patchtokens"])
    torch.testing.assert_close(second, feats["x_prenorm"][:, 5:])
    assert not torch.allclose(first, second)
    with pytest.raises(ValueError, match="requested blocks"):
        model.get_intermediate_layers(x, n=[5])


# --- training features ----------------------------------------------------------------------------------


def test_drop_path_is_batch_subset_and_training_only() -> None:
    model = tiny(drop_path_rate=0.5, pos_embed_rope_rescale_coords=None)
    ref = tiny(pos_embed_rope_rescale_coords=None)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), ref.eval()(x))
        torch.manual_seed(0)
        out = model.train()(x)
    assert not torch.allclose(out, ref(x))


def test_activation_checkpointing_gives_identical_gradients() -> None:
    x = [torch.randn(2, 3, 32, 32), torch.randn(2, 3, 16, 16)]
    grads = []
    for checkpointing in (False, True):
        model = tiny(drop_path_rate=0.3).train()  # drop path: recomputation must replay the same randperm
        model.set_activation_checkpointing(checkpointing)
        torch.manual_seed(1)
        out = model(x, is_training=True)
        sum(o["x_norm_patchtokens"].square().mean() for o in out).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0, msg=name)


def test_bf16_autocast_forward_backward_on_cpu() -> None:
    model = tiny(pos_embed_rope_rescale_coords=None)
    x = torch.randn(2, 3, 64, 64)
    ref = model.eval()(x).detach()
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, is_training=True)
    out["x_norm_clstoken"].float().sum().backward()
    assert out["x_norm_patchtokens"].dtype == torch.float32  # fp32 residual stream and norms
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert F.cosine_similarity(out["x_norm_clstoken"].float(), ref).min() > 0.99


def test_bf16_attention_on_cpu_runs_in_fp32_inside_autocast() -> None:
    """`layers.attention` on CPU bf16: exactly fp32 attention of the same bf16 inputs, rounded to bf16 (not the fused
    bf16 kernel, which is several times slower here), also under autocast, with bf16 gradients for q, k and v."""
    q, k, v = (torch.randn(4, 2, 14, 16).bfloat16().requires_grad_() for _ in range(3))
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attention(q, k, v)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    got.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))
    x = torch.randn(4, 2, 14, 16)
    assert torch.equal(attention(x, x, x), F.scaled_dot_product_attention(x, x, x))  # fp32: untouched


@pytest.mark.slow  # inductor's C++ compilation: ~30 s cold on 2 cores, ~10 s with a warm cache
def test_torch_compile_matches_eager() -> None:
    model = tiny().eval()
    x = torch.randn(2, 3, 64, 96)
    compiled = torch.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~10-20 s: torch.export + ONNX translation
def test_onnx_export_has_dynamic_image_size_and_no_if_or_tile(tmp_path) -> None:
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")

    class Wrapper(torch.nn.Module):  # fixed signature: forward(*args) cannot carry dynamic_shapes by name
        def __init__(self, backbone: DinoVisionTransformer) -> None:
            super().__init__()
            self.backbone = backbone

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.backbone(x)

    model = Wrapper(tiny()).eval()
    dims = {
        0: torch.export.Dim("B"),
        2: 16 * torch.export.Dim("h", max=64),
        3: 16 * torch.export.Dim("w", max=64),
    }
    program = torch.onnx.export(model, (torch.randn(2, 3, 64, 96),), dynamo=True, dynamic_shapes=(dims,))
    ops = {node.op_type for node in program.model_proto.graph.node}
    assert not ops & {"If", "Tile", "Loop"}, ops
    program.save(tmp_path / "tiny.onnx")
    session = ort.InferenceSession(str(tmp_path / "tiny.onnx"))
    for shape in [(1, 3, 160, 224), (3, 3, 32, 16)]:
        x = torch.randn(*shape)
        (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        torch.testing.assert_close(torch.from_numpy(out), model(x).detach(), rtol=1e-4, atol=1e-5)


# --- heads ------------------------------------------------------------------------------------------------


def test_dino_head_layout_and_output() -> None:
    torch.manual_seed(0)
    head = DINOHead(64, out_dim=300, hidden_dim=128, bottleneck_dim=32, nlayers=3)
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    assert shapes == {
        "mlp.0.weight": (128, 64),
        "mlp.0.bias": (128,),
        "mlp.2.weight": (128, 128),
        "mlp.2.bias": (128,),
        "mlp.4.weight": (32, 128),
        "mlp.4.bias": (32,),
        "last_layer.weight": (300, 32),  # no bias, no weight-norm g/v
    }
    assert abs(head.last_layer.weight.std().item() - 0.02) < 0.002
    assert torch.equal(head.mlp[0].bias, torch.zeros(128))
    x = torch.randn(5, 64)
    z = head(x, no_last_layer=True)
    torch.testing.assert_close(z.norm(dim=-1), torch.ones(5))
    torch.testing.assert_close(head(x), head(z, only_last_layer=True))
    assert head(x).shape == (5, 300)
    assert len(DINOHead(64, out_dim=10, nlayers=1).state_dict()) == 3  # mlp = one Linear
