"""Our whole SSL training step against Meta's official DINOv3 code (facebookresearch/dinov3), at equal configuration
on CPU, in one process, the variants alternating round after round.

    python benchmarks/upstream_step.py --upstream-src ~/src/dinov3 --rounds 5 --output bench-output
    python benchmarks/upstream_step.py --upstream-src ~/src/dinov3 --bf16      # also bf16 autocast rows
    python benchmarks/upstream_step.py --output bench-output                   # no checkout: upstream rows skipped

Upstream's code is never part of this repository: `--upstream-src` names a checkout (the directory that holds its
`dinov3/` package), imported from there at run time; its commit (`git rev-parse HEAD`, else a `COMMIT` file, else
"unknown") goes into the output. Without `--upstream-src` the upstream rows are skipped with a message and our rows
still run. `machine_limits.py --upstream-src DIR` appends the same rows to its train section.

Shapes (`--shapes`): **vit_small** — ViT-S/16, 2 × 112² global + 8 × 48² local crops, DINO and iBOT heads of 4,096
prototypes, batch 8 (the `cpu` recipe with machine_limits' `VITS_UPSTREAM_SHAPES` overrides); **vit_test** — the
`cpu` recipe as it is (64-d, 2 blocks, 2 × 64² + 2 × 32², 256 prototypes, batch 32). fp32 unless a row says bf16.

Equal configuration, by construction: upstream's config is `ssl_default_config.yaml` merged (OmegaConf) with
overrides read off OUR config — backbone flags from our arch's constructor kwargs (layer scale, storage tokens,
qkv/proj/ffn bias, k-bias mask, norm, FFN, every RoPE setting, drop path), crops, head dims, loss weights, mask
ratios, clip norm, layer decay, patch-embed lr multiplier, AdamW betas — and `equal_configuration` in the JSON lists
each pair; settings upstream hard-codes (student temperature 0.1, 3 Sinkhorn iterations, no DINO local reweighting)
are asserted equal to ours. Same weights: our student's backbone is written in the released layout
(`dinov3_core.models.backbone_state_dict`, what `convert` writes) and loaded strictly into upstream's student
backbone; the heads have the same keys and load strictly too; teacher = student in both. Same batch: the same crop
tensors and the same iBOT masks (ours, turned into upstream's collated dict). Same loss terms: DINO CLS (global +
local), iBOT masked patches, KoLeo; Sinkhorn-Knopp centring in both; gram off. Same threads, same process.

The step timed is each trainer's iteration without data loading, schedules, logging and checkpoints:
* ours (`dinov3_core.train.loop.Trainer.train_step`): `step.forward_backward` → `clip_gradients` (per submodule) →
  AdamW → `update_teacher` → `zero_grad`;
* upstream (`dinov3/train/train.py: do_train`): `zero_grad` → `SSLMetaArch.forward_backward` → `clip_grad_norm_` per
  submodule → AdamW (its fused param groups: `multi_tensor_optim`) → `update_ema`.
Learning rate, weight decay, EMA momentum (0.992) and teacher temperature (0.07) are fixed values set once in both
through their own schedule appliers. First-step loss terms of every variant are recorded (`first_step_losses`): all
variants start from the same weights, so they must agree; the table's footer prints ours vs upstream.

Variants (`--no-compile` leaves out the compiled ones): upstream eager; upstream with its `train.compile` (its
`compile_transformer` on both backbones and `wrap_compile_block` on the heads, as `ac_compile_parallelize` does); ours
eager; ours with `train.compile` (`compile_blocks` on both backbones, as machine_limits); ours with the whole step
compiled (`torch.compile(step.forward_backward)`, Inductor; not a config option: docs/benchmarks.md). `--bf16`: both
eager under `torch.autocast("cpu", bf16)` (ours through `forward_backward(bf16=True)`, which is that autocast on a
process without FSDP). Every variant's first call is timed apart (`first_call_s`; compile warm-up for the compiled ones
— Inductor's on-disk cache may already hold the kernels, so it is not always a cold compile) and left out of the rounds.
A round times `PER_ROUND` steps of each variant (4 for vit_test, whose step takes tens of milliseconds; 1 for
vit_small). The table gives the ratio of the medians to upstream eager, the median of the per-round ratios (paired: the
same round, the same box load), the ratio to upstream in the same mode, and the largest relative difference of the
first-step loss terms to upstream eager fp32 (~1e-7 in fp32; bf16 rows differ by bf16 rounding).

What was changed to run upstream on a CPU — at run time, from here; no upstream file is edited:
1. Imports. `termcolor` (upstream's log colouring) is replaced by a stub when it is not installed. When `torchvision`
   is not importable (this project's CPU torch pin has no matching wheel), `dinov3.data` is pre-registered as a stub
   package: its `__init__` imports the torchvision augmentations, while the step needs none of them (`SSLMetaArch`
   only names `DataAugmentationDINO` for building the data pipeline). The stub keeps the real `__path__`, so
   `dinov3.data.collate` / `dinov3.data.masking` are upstream's own; any other name is a placeholder that raises if
   it is ever called.
2. torch.distributed. `dinov3.distributed.enable()` hard-codes NCCL and `torch.cuda.set_device`. Instead a
   single-process gloo group is started here (MASTER_ADDR=127.0.0.1, a free MASTER_PORT, rank 0, world 1) and
   upstream's `_DEFAULT_PROCESS_GROUP` is set to it, which is what `enable()` does last. Upstream needs a group: its
   iBOT Sinkhorn all-reduces unconditionally. Our losses all-reduce whenever a group exists, so in this process our
   step pays the same kind of world-1 gloo all-reduces (~8 a step; `gloo_allreduce_us` in the JSON gives their cost).
3. No FSDP: `prepare_for_distributed_training` is skipped. It builds a CUDA device mesh and moves the model to CUDA;
   with one process it would shard nothing, and our single-process trainer has no FSDP either. Otherwise the model is
   built as `train.main` does: `SSLMetaArch(cfg)` under `torch.device("meta")`, then `to_empty(device="cpu")` (not
   "cuda") and upstream's `init_weights()`, then our weights. Consequence: upstream's FSDP `MixedPrecisionPolicy`
   (`compute_precision.param_dtype: bf16`) is not in play; fp32 rows are fp32 in both.
4. `forward_backward` moves the batch with `.cuda(non_blocking=True)`: `torch.Tensor.cuda` is replaced by the
   identity for the duration of that call only (a context manager restores it).
5. Compilation: upstream compiles only inside `ac_compile_parallelize` (with FSDP); its `compile_transformer` and
   `wrap_compile_block` are called directly instead, on student and teacher. Upstream's iBOT `SinkhornKnoppTeacher`
   is compiled by upstream at construction (`.compile()` in `iBOTPatchLoss.__init__`) and stays so in its "eager"
   rows too: that is its code; its compile is in `first_call_s`.
6. vit_test: upstream has no such architecture and `build_model` takes only the arch's name (embed_dim, depth and
   heads are not config keys), so a `vit_test` factory — upstream's own `DinoVisionTransformer` with our vit_test's
   patch 16, 64-d, 2 blocks, 4 heads, FFN ratio 4 — is added to upstream's `dinov3.models.vision_transformer`
   namespace for the run.
7. The batch: upstream's `collate_data_and_cast` draws its own random masks, so its dict is built here from our
   crops and our `IBOTMasks` with the same keys and layout (crop-major rows, flat mask indices, per-crop weights
   1/#masked, `n_masked_patches`, `upperbound`, `global_batch_size`); the weights are re-derived with collate's
   formula as a check.
Not a workaround, but a note on bf16: upstream's KoLeo disables autocast with `torch.autocast("cuda", enabled=False)`,
which does nothing on CPU, so under CPU autocast its KoLeo runs in autocast like the rest. In both codes the DINO
loss's `einsum` is autocast to bf16, so the first-step DINO terms of the bf16 rows are bf16 numbers (5.5625).

Output: a markdown table on stdout and `<output>/upstream_step.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from wsidino_dev.ports import free_port  # noqa: E402  (this checkout, put on sys.path above)

Step = Callable[[], None]
SKIP_MESSAGE = "upstream rows skipped: no --upstream-src (path of a facebookresearch/dinov3 checkout) given"
TEACHER_TEMP = 0.07
MOMENTUM = 0.992
LR, WD = 5e-4, 0.04
SHAPES = ("vit_small", "vit_test")
# Steps per variant per round: a vit_test step takes tens of milliseconds, too short to time alone on a shared box.
PER_ROUND = {"vit_small": 1, "vit_test": 4}
WHOLE_STEP = "ours whole step compiled (torch.compile(forward_backward))"
OURS_TO_UPSTREAM_LOSS = {
    "dino_global_loss": "dino_global_crops_loss",
    "dino_local_loss": "dino_local_crops_loss",
    "ibot_loss": "ibot_loss",
    "koleo_loss": "koleo_loss",
    "total_loss": "total_loss",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _timing() -> types.ModuleType:
    """benchmarks/step_timing.py (timing, FLOP counting and the row format, shared with machine_limits.py)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module("step_timing")


# ------------------------------------------------------------------------------------------- upstream import


def upstream_commit(src: Path) -> str:
    """`git rev-parse HEAD` of a git checkout (its own, not that of a repository it sits in), else the content of
    its COMMIT file, else "unknown"."""
    src = src.resolve()

    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    top = git("rev-parse", "--show-toplevel")
    if top and Path(top).resolve() == src and (head := git("rev-parse", "HEAD")):
        return head
    commit = src / "COMMIT"
    if commit.is_file() and commit.read_text().strip():
        return commit.read_text().strip().split()[0]
    return "unknown"


class _Unavailable:
    """Placeholder for a `dinov3.data` name whose module needs torchvision (never used by the training step)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"dinov3.data.{self.name} needs torchvision, which is not installed (stubbed here)")


def _stub_data_package(src: Path) -> None:
    """`dinov3.data` without its `__init__` (which imports torchvision): real submodules, placeholders otherwise."""
    package = types.ModuleType("dinov3.data")
    package.__path__ = [str(src / "dinov3" / "data")]
    package.__file__ = str(src / "dinov3" / "data" / "__init__.py")

    def missing(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Unavailable(name)

    package.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules["dinov3.data"] = package
    package.collate_data_and_cast = importlib.import_module("dinov3.data.collate").collate_data_and_cast
    package.MaskingGenerator = importlib.import_module("dinov3.data.masking").MaskingGenerator


def import_upstream(src: Path) -> dict[str, Any]:
    """Upstream's modules from the checkout `src` (workaround 1 of the module docstring where needed)."""
    src = src.resolve()
    if not (src / "dinov3" / "__init__.py").is_file():
        raise SystemExit(f"--upstream-src {src}: no dinov3/__init__.py there (give the checkout's root directory)")
    sys.path.insert(0, str(src))
    stubs = []
    if importlib.util.find_spec("termcolor") is None:
        termcolor = types.ModuleType("termcolor")
        termcolor.colored = lambda text, *args, **kwargs: text  # type: ignore[attr-defined]
        sys.modules["termcolor"] = termcolor
        stubs.append("termcolor")
    dinov3 = importlib.import_module("dinov3")
    if not Path(dinov3.__file__).resolve().is_relative_to(src):
        raise SystemExit(f"`import dinov3` found {dinov3.__file__}, not the checkout {src}")
    if importlib.util.find_spec("torchvision") is None:
        _stub_data_package(src)
        stubs.append("dinov3.data (no torchvision)")
    mods = {
        "ssl_meta_arch": importlib.import_module("dinov3.train.ssl_meta_arch"),
        "train": importlib.import_module("dinov3.train.train"),
        "configs": importlib.import_module("dinov3.configs"),
        "vits": importlib.import_module("dinov3.models.vision_transformer"),
        "parallelize": importlib.import_module("dinov3.fsdp.ac_compile_parallelize"),
        "distributed": importlib.import_module("dinov3.distributed.torch_distributed_wrapper"),
        "collate": importlib.import_module("dinov3.data.collate"),
    }
    mods["stubs"] = stubs
    return mods


def start_gloo(up: dict[str, Any]) -> bool:
    """A single-process gloo group registered as upstream's default group (workaround 2). True if started here."""
    import torch.distributed as dist

    started = False
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
        started = True
    up["distributed"]._DEFAULT_PROCESS_GROUP = dist.group.WORLD
    return started


def gloo_allreduce_us(k: int, repeats: int = 200) -> float:
    """Median µs of one world-1 gloo all-reduce of a [1, k] fp32 tensor (what each Sinkhorn step pays here)."""
    import torch.distributed as dist

    t = torch.ones(1, k)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


@contextlib.contextmanager
def cuda_is_identity() -> Iterator[None]:
    """`Tensor.cuda(...)` returns the tensor itself for the duration (workaround 4)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


# ------------------------------------------------------------------------------------------ configurations


def our_config(shape: str) -> Any:
    """The `cpu` recipe (vit_test), or it at the ViT-S shapes of the upstream comparison (vit_small)."""
    from dinov3_core.config import load_config
    from dinov3_core.train import config as C

    overrides: dict[str, Any] = {"data.stores": ["unused"], "output_dir": "unused"}
    if shape == "vit_small":
        overrides.update(_timing().VITS_UPSTREAM_SHAPES)
    elif shape != "vit_test":
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return load_config(C.PretrainConfig, "cpu", overrides, stage="pretrain")


def batch_size(shape: str) -> int:
    return 8 if shape == "vit_small" else 32


# Our constructor kwarg → upstream's `student.*` key (`build_model` passes these to DinoVisionTransformer).
_STUDENT_KEYS = {
    "patch_size": "patch_size",
    "drop_path_rate": "drop_path_rate",
    "layerscale_init": "layerscale",
    "n_storage_tokens": "n_storage_tokens",
    "qkv_bias": "qkv_bias",
    "proj_bias": "proj_bias",
    "ffn_bias": "ffn_bias",
    "ffn_layer": "ffn_layer",
    "ffn_ratio": "ffn_ratio",
    "norm_layer": "norm_layer",
    "mask_k_bias": "mask_k_bias",
    "untie_cls_and_patch_norms": "untie_cls_and_patch_norms",
    "untie_global_and_local_cls_norm": "untie_global_and_local_cls_norm",
    "pos_embed_rope_base": "pos_embed_rope_base",
    "pos_embed_rope_min_period": "pos_embed_rope_min_period",
    "pos_embed_rope_max_period": "pos_embed_rope_max_period",
    "pos_embed_rope_normalize_coords": "pos_embed_rope_normalize_coords",
    "pos_embed_rope_shift_coords": "pos_embed_rope_shift_coords",
    "pos_embed_rope_jitter_coords": "pos_embed_rope_jitter_coords",
    "pos_embed_rope_rescale_coords": "pos_embed_rope_rescale_coords",
    "pos_embed_rope_dtype": "pos_embed_rope_dtype",
}
# Our constructor defaults for kwargs a preset leaves out (vision_transformer.DinoVisionTransformer's signature).
_OUR_DEFAULTS = {
    "drop_path_rate": 0.0,
    "layerscale_init": None,
    "n_storage_tokens": 0,
    "qkv_bias": True,
    "proj_bias": True,
    "ffn_bias": True,
    "ffn_layer": "mlp",
    "norm_layer": "layernorm",
    "mask_k_bias": False,
    "untie_cls_and_patch_norms": False,
    "untie_global_and_local_cls_norm": False,
    "pos_embed_rope_base": 100.0,
    "pos_embed_rope_min_period": None,
    "pos_embed_rope_max_period": None,
    "pos_embed_rope_normalize_coords": "separate",
    "pos_embed_rope_shift_coords": None,
    "pos_embed_rope_jitter_coords": None,
    "pos_embed_rope_rescale_coords": None,
    "pos_embed_rope_dtype": "bf16",
}


def our_backbone_kwargs(cfg: Any) -> dict[str, Any]:
    from dinov3_core.models import backbone_kwargs
    from dinov3_core.train import model_config as MC

    return {**_OUR_DEFAULTS, **backbone_kwargs(cfg.student.arch, **MC.backbone_overrides(cfg))}


def upstream_config(up: dict[str, Any], cfg: Any, batch: int) -> tuple[Any, list[dict[str, Any]]]:
    """Upstream's default config merged with overrides read off ours, and the (setting, ours, upstream) pairs."""
    from omegaconf import OmegaConf

    kw = our_backbone_kwargs(cfg)
    arch = cfg.student.arch
    if arch == "vit_test":  # workaround 6: upstream's own class at our vit_test's dimensions
        test_dims = {k: kw[k] for k in ("embed_dim", "depth", "num_heads", "ffn_ratio")}
        up["vits"].vit_test = lambda patch_size=16, **kwargs: up["vits"].DinoVisionTransformer(
            patch_size=patch_size, **test_dims, **kwargs
        )
    elif not hasattr(up["vits"], arch):
        raise SystemExit(f"upstream has no architecture {arch!r}")
    student = {theirs: kw[ours] for ours, theirs in _STUDENT_KEYS.items()}
    student["arch"] = arch
    heads = {}
    for name in ("dino", "ibot"):
        h = getattr(cfg.heads, name)
        heads[name] = {
            "head_n_prototypes": h.n_prototypes,
            "head_hidden_dim": h.hidden_dim,
            "head_bottleneck_dim": h.bottleneck_dim,
            "head_nlayers": h.nlayers,
        }
    losses, o, c = cfg.losses, cfg.optim, cfg.crops
    crops = {
        "global_crops_size": c.global_size,
        "local_crops_size": c.local_size,
        "local_crops_number": c.n_local_crops,
    }
    dino = {
        **heads["dino"],
        "loss_weight": losses.dino_weight,
        "koleo_loss_weight": losses.koleo_weight,
        "global_ignore_diagonal": True,
        "reweight_dino_local_loss": False,
    }
    ibot = {
        **heads["ibot"],
        "loss_weight": losses.ibot_weight,
        "mask_ratio_min_max": list(c.mask_ratio),
        "mask_sample_probability": c.mask_probability,
    }
    optim = {
        "clip_grad": o.clip_grad,
        "layerwise_decay": o.layer_decay,
        "patch_embed_lr_mult": o.patch_embed_lr_mult,
        "adamw_beta1": o.adamw_beta1,
        "adamw_beta2": o.adamw_beta2,
        "weight_decay": o.weight_decay,
    }
    train = {"batch_size_per_gpu": batch, "compile": False, "centering": "sinkhorn_knopp"}
    overrides = {
        "student": student,
        "crops": crops,
        "dino": dino,
        "ibot": ibot,
        "gram": {"use_loss": False},
        "train": train,
        "optim": optim,
    }
    ucfg = OmegaConf.merge(up["configs"].get_default_config(), OmegaConf.create(overrides))
    # What upstream hard-codes, against ours.
    fixed = {
        "student_temp": (losses.student_temp, 0.1),
        "sinkhorn_iterations": (losses.sinkhorn_iterations, 3),
        "local_loss_weight": (losses.local_loss_weight, 1.0),
        "n_global_crops": (c.n_global_crops, 2),
    }
    pairs = [{"setting": f"upstream hard-codes {k}", "ours": a, "upstream": b} for k, (a, b) in fixed.items()]
    for ours, theirs in _STUDENT_KEYS.items():
        pairs.append({"setting": f"student.{theirs}", "ours": kw[ours], "upstream": ucfg.student[theirs]})
    # The dimensions come with upstream's arch function (build_model passes no embed_dim, depth, heads or FFN
    # ratio: its `student.ffn_ratio` key is unused by the ViT presets), so read them off a meta-device instance.
    probe = getattr(up["vits"], arch)(patch_size=kw["patch_size"], device="meta")
    sizes = {
        "embed_dim": (kw["embed_dim"], probe.embed_dim),
        "depth": (kw["depth"], len(probe.blocks)),
        "num_heads": (kw["num_heads"], probe.num_heads),
        "ffn hidden": (round(kw["embed_dim"] * kw["ffn_ratio"]), probe.blocks[0].mlp.fc1.out_features),
    }
    for k, (a, b) in sizes.items():
        pairs.append({"setting": f"backbone {k} (upstream: its arch {arch})", "ours": a, "upstream": b})
    unequal = [p for p in pairs if p["ours"] != p["upstream"]]
    if unequal:
        raise SystemExit(f"configurations differ: {unequal}")
    return ucfg, pairs


# ------------------------------------------------------------------------------------------------ models


def build_ours(cfg: Any, compiled: bool) -> tuple[Any, torch.optim.Optimizer]:
    from dinov3_core.train.optim import ScheduleValues, apply_schedules

    model, optimizer = _timing().build_ours(cfg, compiled)
    apply_schedules(optimizer, ScheduleValues(LR, LR, WD, MOMENTUM, TEACHER_TEMP))
    return model, optimizer


def build_upstream(up: dict[str, Any], ucfg: Any, ours: Any, compiled: bool) -> tuple[Any, torch.optim.Optimizer]:
    """Upstream's SSLMetaArch as `train.main` builds it, on CPU (workarounds 3, 5), with our student's weights."""
    from dinov3_core.models import backbone_state_dict

    with torch.device("meta"):
        model = up["ssl_meta_arch"].SSLMetaArch(ucfg)
    model.to_empty(device="cpu")
    model.init_weights()
    # Same weights: the released layout (what `convert` writes) is upstream's backbone layout; heads share keys.
    model.student.backbone.load_state_dict(backbone_state_dict(ours.student["backbone"]), strict=True)
    for head in ("dino_head", "ibot_head"):
        model.student[head].load_state_dict(ours.student[head].state_dict(), strict=True)
    model.teacher.load_state_dict(model.student.state_dict(), strict=True)
    if compiled:
        par = up["parallelize"]
        for sub in (model.student, model.teacher):
            for key in list(sub.keys()):
                if key == "backbone":
                    par.compile_transformer(ucfg, sub[key])
                else:
                    sub[key] = par.wrap_compile_block(sub[key], use_cuda_graphs=False, is_backbone_block=False)
    model.train()
    optimizer = up["train"].build_optimizer(ucfg, model.get_params_groups())
    up["train"].apply_optim_scheduler(optimizer, LR, WD, LR)
    return model, optimizer


def upstream_batch(up: dict[str, Any], crops: Any, masks: Any) -> dict[str, Any]:
    """Upstream's collated dict from our crops and masks (workaround 7)."""
    collated = masks.masks
    weight = (1 / collated.sum(-1).clamp(min=1.0)).unsqueeze(-1).expand_as(collated)[collated]  # collate's formula
    if not torch.allclose(weight, masks.masks_weight.to(weight.dtype)):
        raise AssertionError("our masks_weight differs from upstream collate's formula")
    return {
        "collated_global_crops": crops.global_stack.flatten(0, 1),
        "collated_local_crops": crops.local_stack.flatten(0, 1),
        "collated_masks": collated,
        "mask_indices_list": masks.mask_indices,
        "masks_weight": weight,
        "n_masked_patches": torch.full((1,), masks.n_masked_patches, dtype=torch.long),
        "upperbound": masks.n_masked_patches,  # our masks are exact: the requested counts are the counts
        "global_batch_size": masks.batch_size,
    }


def our_step(
    model: Any,
    optimizer: Any,
    cfg: Any,
    crops: Any,
    masks: Any,
    bf16: bool,
    first: dict[str, float],
    whole_step: bool = False,
) -> Step:
    from dinov3_core.train.distributed import DistEnv
    from dinov3_core.train.optim import clip_gradients
    from dinov3_core.train.ssl_model import LOSS_NAMES, SIGNAL_NAMES
    from dinov3_core.train.step import forward_backward

    env = DistEnv(device=torch.device("cpu"))
    keys = (*LOSS_NAMES, *SIGNAL_NAMES)
    # Whole-step compile: one torch.compile of forward_backward (its own wrapper, so no other variant is affected).
    fb = torch.compile(forward_backward) if whole_step else forward_backward

    def step() -> None:
        values = fb(
            model, None, env, crops, masks, keys=keys, n_micro=1, teacher_temp=TEACHER_TEMP, koleo_base=0, bf16=bf16
        )
        if not first:
            first.update({k: float(v) for k, v in zip(keys, values.tolist(), strict=False) if k in LOSS_NAMES})
        clip_gradients(model.student, cfg.optim.clip_grad)
        optimizer.step()
        model.update_teacher(MOMENTUM)
        optimizer.zero_grad(set_to_none=True)

    return step


def upstream_step(
    model: Any, optimizer: Any, ucfg: Any, data: dict[str, Any], bf16: bool, first: dict[str, float]
) -> Step:
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with cuda_is_identity(), autocast():
            total, metrics = model.forward_backward(dict(data), teacher_temp=TEACHER_TEMP, iteration=0)
        if not first:
            first.update({k: float(torch.as_tensor(v).detach()) for k, v in metrics.items() if k.endswith("_loss")})
            first["total_loss"] = float(total.detach())
        for sub in model.student.values():  # do_train's per-submodule clipping
            torch.nn.utils.clip_grad_norm_(sub.parameters(), max_norm=ucfg.optim.clip_grad)
        optimizer.step()
        model.update_ema(MOMENTUM)

    return step


# -------------------------------------------------------------------------------------------------- rows


def _ratio(up_row: dict[str, Any] | None, row: dict[str, Any]) -> tuple[float | None, float | None]:
    """(throughput ratio of the medians, median of the per-round ratios) of `row` over `up_row`."""
    if up_row is None:
        return None, None
    paired = [u / s for u, s in zip(up_row["seconds"], row["seconds"], strict=True)]
    return row["items_per_s"] / up_row["items_per_s"], statistics.median(paired)


def shape_rows(
    shape: str, rounds: int, peak: float, up: dict[str, Any] | None, label: str, bf16: bool, compiled: bool = True
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows of one shape; `up` None: ours only. Also the shape's notes (config pairs, first-step losses)."""
    from dinov3_core.data.augment import MultiCrops
    from dinov3_core.data.masking import IBOTMaskSampler

    ml = _timing()
    cfg, batch = our_config(shape), batch_size(shape)
    c = cfg.crops
    torch.manual_seed(0)
    crops = MultiCrops(
        torch.randn(c.n_global_crops, batch, 3, c.global_size, c.global_size),
        torch.randn(c.n_local_crops, batch, 3, c.local_size, c.local_size),
    )
    grid = c.global_size // our_backbone_kwargs(cfg)["patch_size"]
    masks = IBOTMaskSampler(grid, mask_ratio=tuple(c.mask_ratio), mask_probability=c.mask_probability)(
        batch, c.n_global_crops, rng=0
    )
    described = f"{c.n_global_crops}×{c.global_size}² + {c.n_local_crops}×{c.local_size}²"
    notes: dict[str, Any] = {
        "shape": shape,
        "arch": cfg.student.arch,
        "batch": batch,
        "crops": described,
        "prototypes": cfg.heads.dino.n_prototypes,
        "masked_patches": masks.n_masked_patches,
    }
    log(f"[{shape}] building models")
    ml.fresh_dynamo()  # no earlier section's graphs: past Dynamo's recompile limit "compiled" silently runs eager
    # (name, upstream?, compiled: "" eager, "blocks" train.compile, "step" torch.compile(forward_backward), bf16?)
    variants: list[tuple[str, bool, str, bool]] = []
    if up is not None:
        ucfg, notes["equal_configuration"] = upstream_config(up, cfg, batch)
        data = upstream_batch(up, crops, masks)
        variants.append((f"{label} eager", True, "", False))
        if compiled:
            variants.append((f"{label} compiled (its train.compile)", True, "blocks", False))
        if bf16:
            variants.append((f"{label} eager, bf16 autocast", True, "", True))
        if bf16 and compiled:
            variants.append((f"{label} compiled, bf16 autocast", True, "blocks", True))
    variants.append(("ours eager", False, "", False))
    if compiled:
        variants.append(("ours compiled (train.compile)", False, "blocks", False))
        variants.append((WHOLE_STEP, False, "step", False))
    if bf16:
        variants.append(("ours eager, bf16 autocast", False, "", True))
    if bf16 and compiled:
        variants.append(("ours compiled, bf16 autocast", False, "blocks", True))
    # Every model starts from the same weights: ours built under one seed, upstream's copied from ours before any step.
    source = build_ours(cfg, compiled=False)[0]
    steps: dict[str, Step] = {}
    first: dict[str, dict[str, float]] = {}
    for name, is_upstream, mode, half in variants:
        first[name] = {}
        if is_upstream:
            steps[name] = upstream_step(*build_upstream(up, ucfg, source, bool(mode)), ucfg, data, half, first[name])
        else:
            model_opt = build_ours(cfg, mode == "blocks")
            steps[name] = our_step(*model_opt, cfg, crops, masks, half, first[name], whole_step=mode == "step")
    del source
    first_call: dict[str, float] = {}
    for name, step in steps.items():
        log(f"[{shape}] first call: {name}")
        start = time.perf_counter()
        step()  # at the shared initial weights: compile warm-up, first-step losses
        first_call[name] = time.perf_counter() - start
    flops = ml.counted_flops(steps["ours eager"])
    upstream_flops = None
    if up is not None:
        with contextlib.suppress(Exception):  # a check only; FlopCounterMode around upstream's compiled Sinkhorn
            upstream_flops = ml.counted_flops(steps[f"{label} eager"])
    log(f"[{shape}] timing {len(steps)} variants, {rounds} rounds")
    times = ml.interleaved(steps, rounds, PER_ROUND[shape])
    rows = []
    for name, seconds in times.items():
        r = ml.row(
            "train step",
            name,
            seconds,
            flops,
            peak,
            batch,
            "img/s",
            arch=cfg.student.arch,
            recipe="cpu",
            shape=shape,
            first_call_s=first_call[name],
            first_step_losses=first[name],
        )
        if "compiled" in name:
            r["compile_warmup_s"] = first_call[name]
        if up is not None:  # a numerics check: same weights and batch, so the first step's losses must agree
            reference = first[f"{label} eager"]
            diffs = [c["rel_diff"] for c in loss_check(first[name], reference, upstream=name.startswith(label))]
            r["first_step_max_rel_diff_vs_upstream_eager"] = max(d for d in diffs if d is not None)
        rows.append(r)
    by_name = {r["variant"]: r for r in rows}
    if up is not None:
        for r in rows:
            if r["variant"].startswith("ours"):
                same = r["variant"].replace("ours", label).replace("(train.compile)", "(its train.compile)")
                r["ratio_vs_upstream"], r["ratio_vs_upstream_paired"] = _ratio(by_name.get(f"{label} eager"), r)
                r["ratio_vs_upstream_same_mode"], _ = _ratio(by_name.get(same), r)
        notes["flops_ours"], notes["flops_upstream"] = flops, upstream_flops
        notes["loss_check"] = loss_check(first["ours eager"], first[f"{label} eager"])
    for r, step in zip(rows, steps.values(), strict=True):
        r["top_ops"] = ml.top_ops(step)
    notes["first_step_losses"] = first
    return rows, notes


def loss_check(ours: dict[str, float], theirs: dict[str, float], upstream: bool = False) -> list[dict[str, Any]]:
    """First-step loss terms of a variant (`upstream`: an upstream one, its own key names) vs upstream eager's."""
    out = []
    for k, u in OURS_TO_UPSTREAM_LOSS.items():
        a, b = ours.get(u if upstream else k), theirs.get(u)
        rel = abs(a - b) / max(abs(b), 1e-12) if a is not None and b is not None else None
        out.append({"term": k, "ours": a, "upstream": b, "rel_diff": rel})
    return out


def upstream_rows(
    upstream_src: Path,
    rounds: int,
    *,
    shapes: tuple[str, ...] = SHAPES,
    bf16: bool = False,
    compiled: bool = True,
    peak: float | None = None,
    notes: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Rows (machine_limits' `row` format, path "train step") of upstream's and our step at equal configuration.

    `notes`, if given, receives per shape: the configuration pairs, the first-step losses and their comparison.
    """
    up = import_upstream(Path(upstream_src))
    commit = upstream_commit(Path(upstream_src).resolve())
    label = f"upstream (facebookresearch/dinov3 {commit[:7]})"
    started = start_gloo(up)
    try:
        peak = peak or _timing().matmul_peak(2048, torch.float32, 10)
        allreduce_us = gloo_allreduce_us(4096)
        rows = []
        for shape in shapes:
            shape_out, shape_notes = shape_rows(shape, rounds, peak, up, label, bf16, compiled)
            for r in shape_out:
                r.update(
                    upstream_commit=commit,
                    upstream_src=str(upstream_src),
                    gloo_allreduce_us=allreduce_us,
                    upstream_stubs=up["stubs"],
                )
            rows += shape_out
            if notes is not None:
                notes.append({**shape_notes, "upstream_commit": commit, "gloo_allreduce_us": allreduce_us})
        return rows
    finally:
        if started:
            import torch.distributed as dist

            dist.destroy_process_group()
            up["distributed"]._DEFAULT_PROCESS_GROUP = None


# --------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--upstream-src",
        type=Path,
        default=None,
        help="a facebookresearch/dinov3 checkout (the directory holding dinov3/); without it the "
        "upstream rows are skipped",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--bf16", action="store_true", help="also bf16 autocast rows (eager, ours and upstream)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled rows (long warm-ups)")
    args = parser.parse_args()
    shapes = tuple(s for s in args.shapes.split(",") if s)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    ml = _timing()
    env = ml.environment(rounds=args.rounds, load_average_start=ml.load_average())
    peak = ml.matmul_peak(2048, torch.float32, 10)
    notes: list[dict[str, Any]] = []
    if args.upstream_src is None:
        log(SKIP_MESSAGE)
        rows = []
        for shape in shapes:
            shape_out, shape_notes = shape_rows(shape, args.rounds, peak, None, "", args.bf16, not args.no_compile)
            rows += shape_out
            notes.append(shape_notes)
        env["upstream"] = "skipped"
    else:
        rows = upstream_rows(
            args.upstream_src,
            args.rounds,
            shapes=shapes,
            bf16=args.bf16,
            compiled=not args.no_compile,
            peak=peak,
            notes=notes,
        )
        env["upstream"] = {"src": str(args.upstream_src), "commit": upstream_commit(args.upstream_src.resolve())}
    env["load_average_end"] = os.getloadavg()[0]
    doc = {"environment": env, "matmul_peak_gflops": {"fp32": peak}, "rows": rows, "notes": notes}
    (out / "upstream_step.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print_table(doc)


def print_table(doc: dict[str, Any]) -> None:
    env = doc["environment"]
    up = env["upstream"]
    source = "upstream skipped" if up == "skipped" else f"facebookresearch/dinov3 {up['commit']}"
    print(
        f"\n## train step vs upstream ({source}; torch {env['torch']}, {env['threads']} threads, "
        f"{env['cpu_capability']}; load {env['load_average_start']:.1f} → {env['load_average_end']:.1f}; "
        f"{env['rounds']} rounds)\n"
    )
    print(
        "| model | variant | throughput (median, min–max) | GFLOP/s | % of fp32 peak | first call s "
        "| × upstream eager (paired) | × upstream, same mode | first-step losses vs upstream eager |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in doc["rows"]:
        lo, hi = r["spread"]
        ratio = ""
        if r.get("ratio_vs_upstream") is not None:
            ratio = f"{r['ratio_vs_upstream']:.2f} ({r['ratio_vs_upstream_paired']:.2f})"
        same = f"{r['ratio_vs_upstream_same_mode']:.2f}" if r.get("ratio_vs_upstream_same_mode") else ""
        diff = r.get("first_step_max_rel_diff_vs_upstream_eager")
        diff = "" if diff is None else f"{diff:.1e}"
        speed = f"{r['items_per_s']:.2f} {r['unit']} ({lo:.2f}–{hi:.2f})"
        print(
            f"| {r['arch']} | {r['variant']} | {speed} | {r['gflops']:.0f} | {r['percent_of_peak']:.0f} "
            f"| {r['first_call_s']:.1f} | {ratio} | {same} | {diff} |"
        )
    for n in doc["notes"]:
        if "loss_check" not in n:
            continue
        print(f"\nFirst-step losses, {n['arch']} ({n['crops']}, batch {n['batch']}), same weights and batch:\n")
        print("| term | ours | upstream | relative difference |")
        print("|---|---:|---:|---:|")
        for c in n["loss_check"]:
            print(f"| {c['term']} | {c['ours']:.6f} | {c['upstream']:.6f} | {c['rel_diff']:.1e} |")


if __name__ == "__main__":
    main()
