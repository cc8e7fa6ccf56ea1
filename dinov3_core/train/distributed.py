"""Process-group setup, device choice and the FSDP2 wrapping of the SSL model.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE; without them (or with WORLD_SIZE=1) training
runs in this process with no process group at all. GPU: NCCL for tensors plus gloo for CPU-side collectives
(DCP, object gathers); CPU: gloo, with an explicit CPU device mesh
(docs/reference/distributed.md#cpu-training-with-gloo).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from dinov3_core.errors import WsidinoError
from dinov3_core.models import apply_activation_checkpointing, apply_fsdp, compile_blocks
from dinov3_core.models.adaptation import share_frozen_weights
from dinov3_core.train.parallel_config import ParallelismConfig
from dinov3_core.train.pp_stages import split_model


@dataclass
class DistEnv:
    """This process's place in the job. Processes form a (pipeline × data-parallel) grid, pipeline outermost:
    ranks `pp_rank·dp_size … (pp_rank+1)·dp_size − 1` hold pipeline stage `pp_rank`, so FSDP traffic stays among
    neighbouring ranks (one node) and only activations cross nodes. Without pipeline parallelism every process is
    a data-parallel rank (`dp_rank == rank`)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: DeviceMesh | None = None  # the data-parallel mesh FSDP shards over (None: one process per data shard)
    owns_process_group: bool = False  # created by `init_distributed` (and destroyed by `shutdown`)
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None  # the processes holding the other stages of this pipeline
    dp_group: dist.ProcessGroup | None = None  # the processes holding this stage (None: the whole world, no PP)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dp_size(self) -> int:
        """Data-parallel processes: how many ways the global batch is split."""
        return self.world_size // self.pp_size

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp_size

    @property
    def data_parallel(self) -> bool:
        return self.dp_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world() -> tuple[int, int, int, int]:
    """(rank, world_size, local_rank, local_world_size) from torchrun's environment, (0, 1, 0, 1) without."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return rank, world, local_rank, local_world


def choose_device(requested: str, local_rank: int, local_world_size: int, gpu_count: int | None = None) -> torch.device:
    """The training device of this process; refuses more GPU processes per node than GPUs."""
    gpus = torch.cuda.device_count() if gpu_count is None else gpu_count
    if requested == "cpu" or (requested == "auto" and gpus == 0):
        return torch.device("cpu")
    if gpus == 0:
        raise WsidinoError("train.device=cuda but no CUDA GPU is visible: set train.device=cpu or auto")
    if local_world_size > gpus:
        raise WsidinoError(
            f"{local_world_size} processes per node but only {gpus} GPU(s) visible: launch torchrun with "
            f"--nproc-per-node={gpus} or fewer (or check CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", local_rank)


def init_distributed(requested_device: str, pp_degree: int = 1) -> DistEnv:
    """This process's `DistEnv`; the (pp, dp) device mesh is built here, once. `pp_degree` must divide the world
    (the launcher and the config check it before any process starts: `train.batch_plan.check_parallelism`)."""
    rank, world, local_rank, local_world = env_world()
    device = choose_device(requested_device, local_rank, local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1:
        return DistEnv(0, 1, 0, 1, device, None)
    owns = not dist.is_initialized()  # a caller that set up the group keeps it (several runs per process)
    if owns:
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    if pp_degree == 1:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
        return DistEnv(rank, world, local_rank, local_world, device, mesh, owns)
    grid = init_device_mesh(device.type, (pp_degree, world // pp_degree), mesh_dim_names=("pp", "dp"))
    dp_mesh = grid["dp"]
    return DistEnv(
        rank,
        world,
        local_rank,
        local_world,
        device,
        mesh=dp_mesh if dp_mesh.size() > 1 else None,
        owns_process_group=owns,
        pp_size=pp_degree,
        pp_rank=grid.get_local_rank("pp"),
        pp_group=grid.get_group("pp"),
        dp_group=dp_mesh.get_group(),
    )


def shutdown(env: DistEnv) -> None:
    if env.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def parallelize(
    student: nn.ModuleDict,
    teacher: nn.ModuleDict,
    env: DistEnv,
    *,
    bf16: bool,
    activation_checkpointing: bool,
    compile: bool,
    parallelism: ParallelismConfig | None = None,
) -> tuple[nn.ModuleDict, nn.ModuleDict]:
    """All parallelism, in one place and upstream's order: [pipeline split] → activation checkpointing → per-block
    compile → FSDP2 per block + root. Returns the student and teacher this process holds: the whole ones, or their
    pipeline stages (`pp_stages.PPStage`, same parameter names) when `parallelism.pp_degree` > 1.

    One data-parallel process: the modules are simply moved to the device (bf16 then comes from autocast in the
    loop). Several: every block and head is sharded over the data-parallel mesh, the teacher too (resharded after
    its forward), so it costs 1/dp of its size per process.
    """
    if parallelism is not None and parallelism.enabled:
        student = split_model(student, parallelism, env.pp_rank)
        teacher = split_model(teacher, parallelism, env.pp_rank, features_only=True)  # cut at the same blocks
    if activation_checkpointing:
        apply_activation_checkpointing(student["backbone"])  # the teacher has no backward to save memory for
    if compile:
        compile_blocks(student["backbone"])
        compile_blocks(teacher["backbone"])
    if env.mesh is None:
        student.to(env.device)
        teacher.to(env.device)
        if not env.distributed:
            share_frozen_weights(student, teacher)  # LoRA / frozen blocks: one copy of what never changes
        return student, teacher
    # The backbone returns dicts of views (CLS = a slice of the normed tokens); nothing modifies them in
    # place, so FSDP's warning about in-place ops on views does not apply.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    for part in (student, teacher):
        if env.pp_size == 1:
            for module in part.values():
                apply_fsdp(module, env.mesh, mp_policy=mp)
        else:
            shard_pp_stage(part, env.mesh, mp)
    return student, teacher


def shard_pp_stage(stage: nn.ModuleDict, mesh: DeviceMesh, mp: MixedPrecisionPolicy | None) -> None:
    """FSDP2 on a pipeline stage: blocks and heads are their own units and the stage is the root. The root holds
    what the stage calls without going through the backbone's forward (patch embedding, tokens, norms), and the
    pipeline schedule, seeing an FSDP module, defers gradient reduce-scatters to the last micro-batch of a step."""
    kwargs = {"mesh": mesh, "mp_policy": mp or MixedPrecisionPolicy()}
    for block in stage["backbone"].blocks:
        fully_shard(block, **kwargs)
    for name in ("dino_head", "ibot_head"):
        if name in stage:
            apply_fsdp(stage[name], mesh, mp_policy=mp)
    fully_shard(stage, **kwargs)


def set_gradient_sync(student: nn.ModuleDict, enabled: bool) -> None:
    """FSDP: skip the reduce-scatter on non-final micro-batches (gradients accumulate unsharded)."""
    for module in student.values():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(enabled)


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX or AVX512-BF16); without, bf16 is emulated."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "amx_bf16" in flags or "avx512_bf16" in flags or torch.backends.cpu.get_cpu_capability() == "AVX512_BF16"


@contextlib.contextmanager
def autocast(env: DistEnv, bf16: bool) -> Iterator[None]:
    """bf16 autocast for training without FSDP (GPU or CPU); FSDP runs use its MixedPrecisionPolicy instead."""
    if bf16 and env.mesh is None:
        with torch.autocast(device_type=env.device.type, dtype=torch.bfloat16):
            yield
    else:
        yield


@torch.no_grad()
def gather_pp_state(module: nn.Module, env: DistEnv, *, everywhere: bool) -> dict[str, Tensor]:
    """The whole state dict of a pipelined (and possibly FSDP-sharded) module as CPU tensors: on every process
    (`everywhere`) or on rank 0 only (the others get {}). A collective over all processes.

    Tensor by tensor: the owning stage all-gathers it over its data-parallel peers, then its data-parallel rank 0
    broadcasts it over its pipeline, so no process ever holds more than one full tensor on the device. Buffers
    every stage holds (RoPE periods) come from the first stage that has them."""
    local = module.state_dict()
    layout = {k: (tuple(v.shape), v.dtype) for k, v in local.items()}
    layouts: list[dict[str, tuple[tuple[int, ...], torch.dtype]]] = [{} for _ in range(env.pp_size)]
    dist.all_gather_object(layouts, layout, group=env.pp_group)
    joins = everywhere or env.dp_rank == 0  # the pipelines that take part in the broadcasts
    keep = everywhere or env.rank == 0
    out: dict[str, Tensor] = {}
    seen: set[str] = set()
    for stage, stage_layout in enumerate(layouts):
        for name, (shape, dtype) in stage_layout.items():
            if name in seen:
                continue
            seen.add(name)
            if env.pp_rank == stage:
                value = local[name]
                value = value.full_tensor() if hasattr(value, "full_tensor") else value  # over the dp peers
                value = value.detach().contiguous()
            elif joins:
                value = torch.empty(shape, dtype=dtype, device=env.device)
            else:
                continue  # another pipeline's data-parallel rank 0 receives it
            if joins:
                dist.broadcast(value, src=dist.get_global_rank(env.pp_group, stage), group=env.pp_group)
            if keep:
                out[name] = value.to("cpu", copy=True)
    return out
