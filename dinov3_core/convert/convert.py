"""convert: a DCP training checkpoint → released-layout backbone (`backbone.pth`), readable by
`dinov3_core.models.load_released_backbone` in strict mode.

    cfg = load_config(ConvertConfig, None, {"input": "out/pretrain", "output_dir": "out/model"}, stage="convert")
    result = run_convert(cfg)      # result.backbone → out/model/backbone.pth

Only `model.<which>.backbone.*` is read: the tensors are chosen from the checkpoint's `.metadata` and loaded with
a partial-load planner in one CPU process (no optimizer state, any number of ranks wrote it;
docs/reference/dinov3.md#checkpoints, docs/reference/distributed.md#dcp). `full_consolidation: true` also writes every
key into `full.pt` (needs RAM for all).

A LoRA run's checkpoint holds peft keys (`….base_layer.weight`, `….lora_A.default.weight`): they are merged
(W + alpha/r · B@A, settings from the checkpoint's meta.json, else the run's config.yaml) so `backbone.pth` has the
released layout; `save_adapter: true` also writes the adapter alone (`adapter.safetensors` + `adapter.yaml`).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dinov3_core import tracking
from dinov3_core.config import load_config
from dinov3_core.config_tree import to_yaml
from dinov3_core.convert.config import ConvertConfig
from dinov3_core.errors import WsidinoError
from dinov3_core.files import atomic_path
from dinov3_core.gram.config import GramConfig
from dinov3_core.inference.backbone import ARCH_FILE
from dinov3_core.models import ReleasedWeightsError, backbone_kwargs, infer_backbone_kwargs
from dinov3_core.models.adaptation import LORA_KEY, merge_lora_state_dict
from dinov3_core.models.state_dict_check import check_backbone_state_dict
from dinov3_core.train import config as C
from dinov3_core.train import model_config as MC
from dinov3_core.train.checkpoint import (
    CKPT_DIR,
    complete_checkpoints,
    latest_intact_checkpoint,
    read_meta,
    verify_checkpoint,
)

__all__ = ["ConvertConfig", "ConvertError", "ConvertResult", "find_checkpoint", "read_dcp_backbone", "run_convert"]

logger = logging.getLogger(__name__)

BACKBONE_FILE = "backbone.pth"
SAFETENSORS_FILE = "backbone.safetensors"
FULL_FILE = "full.pt"
ADAPTER_FILE = "adapter.safetensors"
ADAPTER_CONFIG = "adapter.yaml"
# Training-only constructor settings: left out of the exported architecture.
_TRAINING_ONLY = ("drop_path_rate",)


# select=best_knn: the chosen eval checkpoint's (directory, backbone state dict, iteration, kNN curve)
Chosen = tuple[Path, dict[str, Tensor], int, Any]
ChooseCheckpoint = Callable[[str, str, str], Chosen]


class ConvertError(WsidinoError):
    """The input is not a usable checkpoint (or run directory)."""


@dataclass
class ConvertResult:
    checkpoint: Path  # the DCP directory read
    iteration: int | None
    backbone: Path
    arch_config: Path
    safetensors: Path | None
    full: Path | None
    adapter: Path | None  # adapter.safetensors (save_adapter on a LoRA run)
    n_tensors: int
    backbone_bytes: int
    checkpoint_bytes: int  # size of the DCP directory
    arch: str
    backbone_kwargs: dict[str, Any]
    seconds: float


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The DCP directory for `path`: itself (has `.metadata`), or the latest complete `ckpt/<it>/` of a run dir."""
    p = Path(path)
    if not p.exists():
        raise ConvertError(f"convert input {p} does not exist; give a pretrain output dir or its ckpt/<iteration>/")
    if (p / ".metadata").is_file():
        verdict, problems = verify_checkpoint(p)  # its files, and its checksums file against the stage manifest
        if verdict:
            trusted = " (or write its checksums, dinov3_core.checksums.write_checksums, if you know it is intact)"
            hint = trusted if verdict == "cannot be verified" else ""
            raise ConvertError(
                f"convert input {p} {verdict} ({'; '.join(problems)}); convert an intact checkpoint{hint}"
            )
        return p
    for root in (p / CKPT_DIR, p):
        if root.is_dir() and complete_checkpoints(root):
            found = latest_intact_checkpoint(root)  # a damaged latest one is named in a warning and skipped
            if found is None:
                raise ConvertError(
                    f"every checkpoint under {root} is damaged or cannot be verified (see the warnings); nothing to "
                    "convert"
                )
            return found
    raise ConvertError(
        f"convert input {p} is neither a DCP checkpoint (no .metadata) nor a pretrain output dir with a complete "
        f"checkpoint under {p / CKPT_DIR}/<iteration>/; point `input` at one (a crash leaves only .tmp-* dirs)"
    )


def _metadata(ckpt: Path) -> dict[str, Any]:
    try:
        return FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    except Exception as err:  # unpickling / IO errors come in many types
        raise ConvertError(f"checkpoint {ckpt}/.metadata is unreadable ({type(err).__name__}: {err})") from None


def read_dcp_backbone(ckpt: str | os.PathLike[str], which: str = "teacher") -> dict[str, Tensor]:
    """`model.<which>.backbone.*` of a DCP checkpoint as a released-layout state dict (prefix stripped).

    Metadata-driven partial load in this process: only these tensors are allocated and read.
    """
    if which not in ("teacher", "student"):
        raise ConvertError(f"which={which!r}: use teacher or student")
    ckpt = Path(ckpt)
    prefix = f"model.{which}.backbone."
    meta = _metadata(ckpt)
    wanted = {k: m for k, m in meta.items() if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    if not wanted:
        sample = ", ".join(sorted(meta)[:5])
        raise ConvertError(
            f"checkpoint {ckpt} has no {prefix}* tensors (keys start with: {sample} …); is it a wsidino pretrain "
            "checkpoint?"
        )
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in wanted.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(
            state,
            storage_reader=FileSystemReader(str(ckpt)),
            planner=DefaultLoadPlanner(allow_partial_load=True),
            no_dist=True,
        )
    return {k.removeprefix(prefix): v.contiguous() for k, v in state.items()}


def _run_config(ckpt: Path) -> Path | None:
    for candidate in (ckpt.parent.parent / "config.yaml", ckpt.parent / "config.yaml"):
        if candidate.is_file():
            return candidate
    return None


def resolve_backbone_kwargs(ckpt: Path, sd: dict[str, Tensor]) -> tuple[str, dict[str, Any]]:
    """(arch label, constructor kwargs): from the run's `config.yaml` (student.arch + overrides) when it fits the
    tensors, else inferred from keys and shapes."""
    run_cfg = _run_config(ckpt)
    if run_cfg is not None:
        try:
            doc = yaml.safe_load(run_cfg.read_text()) or {}
            schema = GramConfig if isinstance(doc, dict) and "gram" in doc else C.PretrainConfig
            cfg = load_config(schema, run_cfg)
            if cfg.student.arch != "auto":  # warm-started runs too: the check below proves it fits the tensors
                kwargs = backbone_kwargs(cfg.student.arch, **MC.backbone_overrides(cfg))
                kwargs = {k: v for k, v in kwargs.items() if k not in _TRAINING_ONLY}
                check_backbone_state_dict(kwargs, sd, str(ckpt), cfg.student.arch)
                return cfg.student.arch, kwargs
        except (WsidinoError, ValueError, TypeError, ReleasedWeightsError) as err:
            logger.warning("architecture from %s not usable (%s); inferring it from the tensors", run_cfg, err)
    name, kwargs = infer_backbone_kwargs(sd, str(ckpt))
    kwargs = {k: v for k, v in kwargs.items() if k not in _TRAINING_ONLY}
    check_backbone_state_dict(kwargs, sd, str(ckpt), name or "inferred")
    return name or "inferred", kwargs


def lora_settings(ckpt: Path) -> dict[str, Any]:
    """`student.lora` of the run that wrote `ckpt`: its meta.json (`adaptation.lora`), else its config.yaml."""
    lora = (read_meta(ckpt).get("adaptation") or {}).get("lora")
    if lora:
        return dict(lora)
    run_cfg = _run_config(ckpt)
    doc = yaml.safe_load(run_cfg.read_text()) if run_cfg is not None else None
    lora = ((doc or {}).get("student") or {}).get("lora") if isinstance(doc, dict) else None
    if not lora:
        raise ConvertError(
            f"checkpoint {ckpt} holds LoRA adapters but neither its meta.json nor the run's config.yaml records "
            "student.lora (alpha / rank are needed to merge them); put the run's config.yaml beside ckpt/"
        )
    return dict(lora)


def merge_checkpoint_lora(ckpt: Path, sd: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor], dict]:
    """(merged released-layout state dict, adapter tensors, LoRA settings); no LoRA keys: (sd, {}, {})."""
    adapter = {k: v for k, v in sd.items() if LORA_KEY in k}
    if not adapter:
        return sd, {}, {}
    settings = lora_settings(ckpt)
    rank = next(v.shape[0] for k, v in adapter.items() if ".lora_A." in k)
    if int(settings.get("rank", 0)) != rank:
        raise ConvertError(
            f"checkpoint {ckpt}: LoRA tensors have rank {rank} but the recorded student.lora.rank is "
            f"{settings.get('rank')}; the run's config.yaml does not belong to this checkpoint"
        )
    return merge_lora_state_dict(sd, float(settings["alpha"]) / rank), adapter, settings


def _save_tensors(sd: dict[str, Tensor], path: Path) -> None:
    with atomic_path(path) as tmp:
        if path.suffix == ".safetensors":
            save_file({k: v.clone().contiguous() for k, v in sd.items()}, str(tmp))
        else:
            torch.save(sd, tmp)


def run_convert(cfg: ConvertConfig, choose: ChooseCheckpoint | None = None) -> ConvertResult:
    """Convert per `cfg`; raises `ConvertError` (a WsidinoError) for bad input before writing anything.

    `choose` (needed with select=best_knn): (run dir, tile store, annotations) → the eval checkpoint to convert;
    the convert stage passes `dinov3_core.evaluate.checkpoints.best_knn_checkpoint` (export never imports
    evaluate)."""
    start = time.perf_counter()
    curve = None
    if cfg.select == "best_knn":
        ckpt, sd, iteration, curve = _best_knn_checkpoint(cfg, choose)
    else:
        ckpt = find_checkpoint(cfg.input)
        sd = read_dcp_backbone(ckpt, cfg.which)

        iteration = read_meta(ckpt).get("iteration", int(ckpt.name) if ckpt.name.isdigit() else None)
    sd, adapter, lora = merge_checkpoint_lora(ckpt, sd)
    if cfg.save_adapter and not adapter:
        raise ConvertError(
            f"save_adapter=true but {ckpt} holds no LoRA adapters (trained without student.lora, or an eval "
            "checkpoint, whose adapters are already merged): set save_adapter=false"
        )
    arch, kwargs = resolve_backbone_kwargs(ckpt, sd)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    backbone = out / BACKBONE_FILE
    _save_tensors(sd, backbone)
    st = None
    if cfg.safetensors:
        st = out / SAFETENSORS_FILE
        _save_tensors(sd, st)
    full = None
    if cfg.full_consolidation:
        full = out / FULL_FILE
        with atomic_path(full) as tmp:
            dcp_to_torch_save(ckpt, tmp)
    adapter_path = None
    if cfg.save_adapter:
        adapter_path = out / ADAPTER_FILE
        _save_tensors(adapter, adapter_path)
        doc = {
            "lora": lora,
            "scaling": float(lora["alpha"]) / int(lora["rank"]),
            "target_modules": sorted({k.split(".lora_")[0] for k in adapter}),
            "base": {"arch": arch, "backbone_kwargs": kwargs},
            "source": str(ckpt.resolve()),
        }
        with atomic_path(out / ADAPTER_CONFIG) as tmp:
            tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
    arch_doc = {
        "arch": arch,
        "backbone_kwargs": kwargs,
        "source": {"checkpoint": str(ckpt.resolve()), "which": cfg.which, "iteration": iteration},
        "lora_merged": lora or None,
        "convert_config": yaml.safe_load(to_yaml(cfg)),
    }
    arch_path = out / ARCH_FILE
    with atomic_path(arch_path) as tmp:
        tmp.write_text(yaml.safe_dump(arch_doc, sort_keys=False))
    result = ConvertResult(
        checkpoint=ckpt,
        iteration=iteration,
        backbone=backbone,
        arch_config=arch_path,
        safetensors=st,
        full=full,
        adapter=adapter_path,
        n_tensors=len(sd),
        backbone_bytes=backbone.stat().st_size,
        checkpoint_bytes=dir_bytes(ckpt),
        arch=arch,
        backbone_kwargs=kwargs,
        seconds=time.perf_counter() - start,
    )
    logger.info(
        "converted %s (%s, it %s) → %s: %d tensors, %.1f MB (checkpoint %.1f MB)",
        ckpt,
        cfg.which,
        iteration,
        backbone,
        len(sd),
        result.backbone_bytes / 1e6,
        result.checkpoint_bytes / 1e6,
    )
    if cfg.tracking.enabled:
        params = {
            "which": cfg.which,
            "arch": arch,
            "checkpoint": str(ckpt),
            "iteration": iteration,
            "select": cfg.select,
        }
        with tracking.into_active_run(cfg.tracking, params=params) as run:
            if run is None:  # called without the stage runner: nothing to log into
                return result
            tracking.log_metrics(
                {"backbone_mb": result.backbone_bytes / 1e6, "checkpoint_mb": result.checkpoint_bytes / 1e6}
            )
            tracking.log_artifact(arch_path)
            for point in curve.points if curve is not None else []:
                tracking.log_metrics({"eval_knn_balanced_accuracy": point.knn_balanced_accuracy}, step=point.iteration)
            if curve is not None:
                for name in ("knn_curve.json", "knn_curve.png"):
                    tracking.log_artifact(Path(cfg.input) / "eval" / name, "knn_curve")
    return result


def _best_knn_checkpoint(cfg: ConvertConfig, choose: ChooseCheckpoint | None) -> Chosen:
    if cfg.which != "teacher":
        raise ConvertError("select=best_knn converts eval checkpoints, which hold the teacher only: use which=teacher")
    if choose is None:
        raise ValueError("select=best_knn needs `choose` (the convert stage passes evaluate's best_knn_checkpoint)")
    return choose(cfg.input, cfg.store, cfg.annotations)  # type: ignore[arg-type]
