"""The terms of the memory estimate (`memory`, `pp_memory`): the model's shape, the estimate's parts, and the bytes
of each part per image or per step. The model behind these numbers: `memory`'s docstring."""

from __future__ import annotations

from dataclasses import dataclass

from dinov3_core.train import config as C

# fp32 (CPU): elements a block saves for backward per token, per embedding dim, plus per attention head (the
# attention probabilities of CPU's attention kernels, RoPE tables); fit with saved-tensor hooks on vit_test/vit_small.
PER_TOKEN_D = 17.3
PER_TOKEN_HEAD = 125.0
# bf16 on CUDA, in bytes: measured peaks on an H100 (2026-11-26, official crops, docs/benchmarks.md). Flash attention
# keeps O(1) per head and token (no per-head term). Without checkpointing a block keeps 39.7 bytes per token and
# embedding dim of the samples its branches run on: stochastic depth runs them on a (1 - drop_path_rate) subset of
# the batch (ViT-L/16, rate 0.2: 47.6 GiB measured at micro-batch 64; ViT-B/16, rate 0.1: 71.5 GiB at 256; a fit of
# both to within 1 %, where a constant per dim without the subset was off by 10 % on ViT-B and let ViT-S/16 at 512
# run out of memory). A checkpointed block's input costs 3 bytes per element (the fp32 residual stream and bf16
# copies; ViT-L/16, 31.0 GiB at micro-batch 256).
# Those were measured with `train.compile` on. Eager, a block with stochastic depth keeps more: ViT-B/16 (rate
# 0.1) without checkpointing held 83.1 GiB eager against 71.5 compiled at micro-batch 256 (an H200 and an H100,
# 2026-11-27 and -26), ViT-L/16 (0.2) with checkpointing 33.0 against 31.0; ViT-S/16 (rate 0) held the same either
# way (80.1 and 80.2 GiB at 512, H200). The subset each branch runs on is gathered from the fp32 residual stream, and
# eager autograd keeps those copies (about 4 bytes per element and branch on CPU with saved-tensor hooks), where
# Inductor recomputes the gather. EAGER_BLOCK_FACTOR scales the per-block bytes of an eager run with stochastic depth.
CUDA_BF16_BLOCK_BYTES_PER_D = 39.7
CUDA_BF16_CHECKPOINTED_INPUT_BYTES = 3.0
CUDA_BF16_EAGER_BLOCK_FACTOR = 1.18
HEAD_SAFETY = 1.2  # iBOT masked-patch count: expected value × this
SAFETY = 1.15  # activations: backward transients (gradient of the largest activation, allocator slack)
GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    embed_dim: int
    depth: int
    num_heads: int
    patch_size: int
    n_storage_tokens: int
    student_params: int
    teacher_params: int
    trainable_params: int  # student parameters with requires_grad: what gets gradients and AdamW states
    trained_depth: int  # blocks whose activations backward needs (depth − frozen leading blocks)
    dino_prototypes: int
    ibot_prototypes: int
    head_hidden: int
    head_bottleneck: int
    # Parameters per part of the student, for pipeline stages (`pp_memory`); the rest (none today) is on every
    # stage. (params, trainable) of: the patch embedding and cls/storage/mask tokens (first stage), each block,
    # the final norms and both heads (last stage). Empty / 0 in a shape built without them.
    embed_params: tuple[int, int] = (0, 0)
    block_params: tuple[tuple[int, int], ...] = ()
    last_params: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank for one configuration; `total` is what must fit the budget."""

    weights: int
    grads: int
    optimizer: int
    teacher: int
    activations: int  # micro-batch activations (× SAFETY)
    step_buffers: int
    loader: int
    workspace: int
    micro_batch: int
    step_batch: int
    stage: int | None = None  # pipeline parallelism: the stage this is for (the one needing the most memory)

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.teacher
            + self.activations
            + self.step_buffers
            + self.loader
            + self.workspace
        )

    def describe(self) -> str:
        parts = ("weights", "grads", "optimizer", "teacher", "activations", "step_buffers", "loader", "workspace")
        listed = ", ".join(f"{p} {getattr(self, p) / GIB:.2f}" for p in parts)
        where = "" if self.stage is None else f" at pipeline stage {self.stage}, the largest"
        return f"{self.total / GIB:.2f} GiB per rank{where} (micro-batch {self.micro_batch}: {listed} GiB)"


def tokens_per_image(cfg: C.PretrainConfig, shape: ModelShape) -> tuple[int, int]:
    """(global-crop tokens, local-crop tokens) per image, all crops of each kind together."""
    prefix = 1 + shape.n_storage_tokens
    g = cfg.crops.n_global_crops * (prefix + (cfg.crops.global_size // shape.patch_size) ** 2)
    lo = cfg.crops.n_local_crops * (prefix + (cfg.crops.local_size // shape.patch_size) ** 2)
    return g, lo


def masked_patches_per_image(cfg: C.PretrainConfig, shape: ModelShape) -> float:
    n_patches = (cfg.crops.global_size // shape.patch_size) ** 2
    mean_ratio = sum(cfg.crops.mask_ratio) / 2
    return cfg.crops.n_global_crops * cfg.crops.mask_probability * mean_ratio * n_patches * HEAD_SAFETY


def block_bytes_per_token(cfg: C.PretrainConfig, shape: ModelShape, *, bf16: bool) -> tuple[float, float]:
    """(bytes one block saves per token for backward, bytes per token of a checkpointed block's input).
    In bf16 on CUDA: the student's stochastic-depth rate counts (its branches see that much less of the batch), and
    an eager run (`train.compile` off) with stochastic depth keeps more per block. The fp32 CPU constants were fit
    eager without stochastic depth, which over-estimates (the safe side)."""
    if bf16:
        block = CUDA_BF16_BLOCK_BYTES_PER_D * shape.embed_dim * (1.0 - cfg.student.drop_path_rate)
        if not cfg.train.compile and cfg.student.drop_path_rate > 0:
            block *= CUDA_BF16_EAGER_BLOCK_FACTOR
        return block, CUDA_BF16_CHECKPOINTED_INPUT_BYTES * shape.embed_dim
    return 4.0 * (PER_TOKEN_D * shape.embed_dim + PER_TOKEN_HEAD * shape.num_heads), 4.0 * shape.embed_dim


def backbone_activation_bytes(cfg: C.PretrainConfig, shape: ModelShape, *, bf16: bool, checkpointing: bool) -> float:
    """Bytes the student backbone saves for backward per image (all its crops)."""
    tokens = sum(tokens_per_image(cfg, shape))
    block, checkpointed_input = block_bytes_per_token(cfg, shape, bf16=bf16)
    depth = shape.trained_depth  # frozen leading blocks save nothing: backward stops before them
    if checkpointing:  # each block's input is kept; one block's activations are recomputed at a time
        return tokens * (depth * checkpointed_input + block)
    return tokens * depth * block


def head_row_elements(shape: ModelShape, n_prototypes: int) -> float:
    """Elements one head row (a CLS token or a masked patch) saves: MLP activations, logits, log-softmax."""
    return 4 * shape.head_hidden + 3 * shape.head_bottleneck + 2 * n_prototypes


def activation_bytes_per_image(cfg: C.PretrainConfig, shape: ModelShape, *, bf16: bool, checkpointing: bool) -> float:
    """Saved activations of one image (all its crops) in the student forward, plus its head rows."""
    backbone = backbone_activation_bytes(cfg, shape, bf16=bf16, checkpointing=checkpointing)
    return backbone + head_activation_elements(cfg, shape) * (2.5 if bf16 else 4.0)  # norms, softmax stay fp32


def head_activation_elements(cfg: C.PretrainConfig, shape: ModelShape) -> float:
    """Elements both heads save per image: its DINO rows (one per crop) and expected iBOT masked rows."""
    dino_rows = cfg.crops.n_global_crops + cfg.crops.n_local_crops
    heads = dino_rows * head_row_elements(shape, shape.dino_prototypes)
    heads += masked_patches_per_image(cfg, shape) * head_row_elements(shape, shape.ibot_prototypes)
    return heads


def crop_bytes(cfg: C.PretrainConfig, step_batch: int) -> float:
    """The step's augmented crops (fp32)."""
    crops = cfg.crops
    pixels = crops.n_global_crops * crops.global_size**2 + crops.n_local_crops * crops.local_size**2
    return pixels * 3 * 4 * step_batch


def step_buffer_bytes(cfg: C.PretrainConfig, shape: ModelShape, step_batch: int, world_size: int) -> float:
    """Crops, teacher targets (×2: the Sinkhorn transient) and KoLeo features of a whole step (`world_size`: the
    processes KoLeo gathers over with koleo_scope=global)."""
    crops = cfg.crops
    targets = (
        4
        * 2
        * (
            crops.n_global_crops * step_batch * shape.dino_prototypes
            + masked_patches_per_image(cfg, shape) * step_batch * shape.ibot_prototypes
        )
    )
    koleo_rows = step_batch * (world_size if cfg.losses.koleo_scope == "global" else 1)
    koleo = 4 * crops.n_global_crops * koleo_rows * shape.embed_dim
    return crop_bytes(cfg, step_batch) + targets + koleo


def loader_bytes(cfg: C.PretrainConfig, step_batch: int, tile_size: int) -> float:
    per_step = step_batch * tile_size * tile_size * 3
    workers = cfg.data.num_workers
    return workers * (350 * 2**20 + cfg.data.prefetch_factor * per_step) + 2 * per_step
