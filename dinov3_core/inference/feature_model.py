"""The model extract and evaluate run: an exported ONNX model (ONNX Runtime) or a converted backbone (PyTorch).

Two ways in, same features:
- `FeatureModel.run(x)`: (N, 3, H, W) float32, already `normalise`d → (cls (N, D), patch tokens (N, P, D)) float32.
- `FeatureModel.prepare(tiles)` then `FeatureModel.infer(prepared, keep_patch)`: from uint8 tiles (N, T, T, 3), split
  where extract's reader threads hand batches to the model thread. On CPU `prepare` is `normalise` and `infer` is
  `run`; with PyTorch on CUDA `prepare` pins the uint8 tiles and `infer` copies them without blocking and normalises
  on the GPU (a quarter of the bytes of float32 over PCIe, and the arithmetic off the CPU), and the patch-token mean
  is taken on the GPU so the (N, P, D) tokens are copied back only when they are stored.

`compile=True` (PyTorch): the backbone runs through `torch.compile(dynamic=False)` (Inductor fuses the element-wise
work between the matmuls); every forward then has the same number of rows (`batch_size`, else the largest batch
seen): a smaller batch is padded with zero images and their rows dropped, so a slide's last batch does not recompile.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dinov3_core.data.augment_config import IMAGENET_MEAN, IMAGENET_STD
from dinov3_core.errors import WsidinoError
from dinov3_core.inference.backbone import BackboneFeatures, load_backbone
from dinov3_core.inference.onnx_runtime import INPUT_NAME, ort_session

__all__ = ["ExtractError", "FeatureModel", "Features", "file_hash", "normalise", "open_model", "torch_device"]

logger = logging.getLogger(__name__)

Features = tuple[np.ndarray, np.ndarray]  # cls (N, D), patch tokens (N, P, D), float32
Outputs = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # cls, mean patch token (N, D), patch tokens or None


class ExtractError(WsidinoError):
    """Bad extract input: tile store, model file or output."""


def file_hash(path: str | os.PathLike[str]) -> str:
    """sha256 (16 hex) of a model file and, for ONNX, its external data file."""
    h = hashlib.sha256()
    for p in (Path(path), Path(f"{path}.data")):
        if p.is_file():
            with p.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def normalise(tiles: np.ndarray) -> np.ndarray:
    """(N, T, T, 3) uint8 → (N, 3, T, T) float32, ImageNet mean / std (as in training)."""
    x = tiles.astype(np.float32).transpose(0, 3, 1, 2) / 255.0
    mean = np.asarray(IMAGENET_MEAN, np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(IMAGENET_STD, np.float32).reshape(1, 3, 1, 1)
    return np.ascontiguousarray((x - mean) / std)


def _pool(cls: np.ndarray, patch: np.ndarray, keep_patch: bool) -> Outputs:
    return cls, patch.mean(axis=1), patch if keep_patch else None


@dataclass
class FeatureModel:
    """A callable (N, 3, H, W) float32 → (cls, patch tokens) with its identity; `prepare` / `infer`: see the module."""

    backend: str
    path: Path
    hash: str
    run: Callable[[np.ndarray], Features]
    providers: list[str] = field(default_factory=list)
    patch_size: int | None = None  # known for the PyTorch backbone
    prepare: Callable[[np.ndarray], Any] = normalise
    infer: Callable[[Any, bool], Outputs] | None = None  # None: `run` on the prepared batch, mean taken in numpy
    device: torch.device | None = None  # the PyTorch backbone's device (None: ONNX Runtime, see `providers`)

    def __post_init__(self) -> None:
        if self.infer is None:
            run = self.run
            self.infer = lambda x, keep_patch: _pool(*run(x), keep_patch)


def torch_device(device: str | None) -> torch.device:
    """`device`, or CUDA when available, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def open_model(
    path: str | os.PathLike[str],
    backend: str = "auto",
    providers: list[str] | None = None,
    threads: int = 0,
    device: str | None = "cpu",
    precision: str = "fp32",
    device_id: int = 0,
    compile: bool = False,
    batch_size: int | None = None,
) -> FeatureModel:
    """`device` (PyTorch): None → CUDA when available; `precision` "bf16" / "fp16": PyTorch autocast (ONNX: export
    fp16); `device_id`: the GPU of ONNX Runtime's CUDA provider (one per rank of a job); `compile` (PyTorch):
    `torch.compile` the backbone, every forward padded to `batch_size` rows (None: the largest batch seen)."""
    p = Path(path)
    if not p.is_file():
        raise ExtractError(f"model file {p} not found; give a model.onnx (export) or backbone.pth (convert)")
    if backend == "auto":
        backend = "onnx" if p.suffix == ".onnx" else "torch"
    if backend == "onnx":
        if precision != "fp32":
            raise ExtractError(f"precision={precision} is for the torch backend; for ONNX export with fp16=true")
        if compile:
            raise ExtractError(
                f"compile=true applies to .pth / .safetensors models (torch backend) only, not to the "
                f"ONNX model {p}; drop compile=true, or give the backbone.pth"
            )
        return _onnx_model(p, providers, threads, device_id)
    if backend == "torch":
        return _torch_model(p, torch_device(device), precision, compile, batch_size)
    raise ExtractError(f"backend={backend!r}: use auto, onnx or torch")


def _onnx_model(p: Path, providers: list[str] | None, threads: int, device_id: int = 0) -> FeatureModel:
    try:
        session = ort_session(p, providers, threads, device_id)
    except Exception as err:  # ORT raises its own exception types
        raise ExtractError(f"model {p} cannot be loaded by ONNX Runtime ({err})") from None
    outputs = [o.name for o in session.get_outputs()]
    if outputs != ["cls", "patch_tokens"]:
        raise ExtractError(f"model {p} outputs {outputs}; extract needs cls + patch_tokens (export pooled=false)")
    if "CUDAExecutionProvider" in session.get_providers():
        run = bound_runner(session, "cuda", _cuda_device_id(session))
    elif providers is None and torch.cuda.is_available():  # a GPU sits idle while the CPU does the work: say so
        logger.warning(
            "extract: this host has a GPU but ONNX Runtime runs %s on the CPU (providers %s): install onnxruntime-gpu "
            "in place of onnxruntime (docs/stages.md: Extraction on several GPUs), or give the backbone.pth beside it",
            p,
            session.get_providers(),
        )
    else:

        def run(x: np.ndarray) -> Features:
            cls, patch = session.run(None, {INPUT_NAME: x})
            return cls.astype(np.float32), patch.astype(np.float32)

    return FeatureModel("onnx", p, file_hash(p), run, session.get_providers())


def _cuda_device_id(session: Any) -> int:
    return int(session.get_provider_options().get("CUDAExecutionProvider", {}).get("device_id", 0))


def bound_runner(session: Any, device: str, device_id: int = 0) -> Callable[[np.ndarray], Features]:
    """`session.run` through I/O binding: the input bound from host memory, the outputs allocated by ORT on `device`
    and copied out once, so ORT neither stages the input nor syncs per output (used with the CUDA provider; "cpu"
    runs the same code on any machine)."""
    names = [o.name for o in session.get_outputs()]

    def run(x: np.ndarray) -> Features:
        binding = session.io_binding()
        binding.bind_cpu_input(INPUT_NAME, np.ascontiguousarray(x, np.float32))
        for name in names:
            binding.bind_output(name, device, device_id)
        session.run_with_iobinding(binding)
        cls, patch = binding.copy_outputs_to_cpu()
        return cls.astype(np.float32), patch.astype(np.float32)

    return run


def _torch_model(
    p: Path, device: torch.device, precision: str, compile: bool = False, batch_size: int | None = None
) -> FeatureModel:
    model = BackboneFeatures(load_backbone(p, device=str(device))).eval()
    runner = TorchRunner(model, device, AUTOCAST[precision], compile, batch_size)
    fm = FeatureModel(
        "torch", p, file_hash(p), runner.run, [f"torch-{device}"], model.backbone.patch_size, device=device
    )
    if device.type == "cuda":  # CPU keeps numpy's normalise and mean: the features stay what they were
        fm.prepare, fm.infer = runner.prepare_uint8, runner.infer_uint8
    return fm


AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # precision → autocast dtype


class TorchRunner:
    """The PyTorch backbone on `device`; `*_uint8`: tiles shipped as uint8 (pinned on CUDA), normalised there.
    `autocast`: run the blocks in that dtype (bf16 / fp16 autocast); the features come back as float32.
    `compile`: `torch.compile(model, dynamic=False)`, each forward padded to `rows` rows (`batch_size`, else the
    largest batch so far) so that one graph serves every batch; the padded rows are dropped from the outputs."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        autocast: torch.dtype | None = None,
        compile: bool = False,
        batch_size: int | None = None,
    ) -> None:
        self.device, self.autocast, self.compiled = device, autocast, compile
        self.model: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
        self.model = torch.compile(model, dynamic=False) if compile else model  # type: ignore[assignment]
        self.rows = batch_size  # compiled: the rows of every forward (None: set by the first batch)
        self.mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, dtype=torch.float32, device=device).view(1, 3, 1, 1)

    def _forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype, n = self.autocast or torch.bfloat16, x.shape[0]
        with torch.inference_mode(), torch.autocast(self.device.type, dtype, enabled=self.autocast is not None):
            if self.compiled:
                self.rows = max(self.rows or 0, n)  # a larger batch than `batch_size` compiles once more
                if n < self.rows:  # images are independent: zero images beside them leave their features as they are
                    x = torch.cat([x, x.new_zeros((self.rows - n, *x.shape[1:]))])
            cls, patch = self.model(x)
        return cls[:n].float(), patch[:n].float()

    def run(self, x: np.ndarray) -> Features:
        with torch.inference_mode():  # an inference tensor, like the padded batch: one compiled graph takes both
            t = torch.from_numpy(x).to(self.device)
        cls, patch = self._forward(t)
        return cls.cpu().numpy(), patch.cpu().numpy()

    def prepare_uint8(self, tiles: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(tiles))
        return t.pin_memory() if self.device.type == "cuda" else t  # pinned: the copy below can be asynchronous

    def infer_uint8(self, tiles: torch.Tensor, keep_patch: bool) -> Outputs:
        with torch.inference_mode():
            x = tiles.to(self.device, non_blocking=True).permute(0, 3, 1, 2).float() / 255.0
            x = ((x - self.mean) / self.std).contiguous()  # the op order of `normalise`
        cls, patch = self._forward(x)
        mean = patch.mean(dim=1)
        return cls.cpu().numpy(), mean.cpu().numpy(), patch.cpu().numpy() if keep_patch else None
