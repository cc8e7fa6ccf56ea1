"""The stages as data: typed config schema, inputs, output location and outputs of each.

The stage runner (`dinov3_core.run`, behind both the CLI and the Prefect tasks) uses this to fingerprint a
stage's inputs, find its manifest and decide whether a rerun may skip it, without knowing each stage's config
layout:

    spec = STAGE_SPECS["export"]
    spec.inputs(cfg)        # {"weights": "/run/model/backbone.pth"}
    spec.manifest_path(cfg) # /run/model/model.onnx.stage_manifest.json
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dinov3_core import manifest as mf
from dinov3_core.config import config_hash
from dinov3_core.export.config import ConvertConfig, ExportConfig, ExtractConfig
from dinov3_core.manifest import manifest_path
from dinov3_core.tiling.config import TileConfig


def _pretrain_config() -> type:
    # Imported when a pretrain config is loaded, not with this module: it pulls in torch (~2 s of every command).
    from dinov3_core.train.config import PretrainConfig

    return PretrainConfig


def _gram_config() -> type:
    from dinov3_core.gram.config import GramConfig

    return GramConfig


@dataclass(frozen=True)
class StageSpec:
    name: str
    schema: Callable[[], type]
    distributed: bool  # always launched as a torchrun job (else in the calling process, but see `can_launch`)
    output_is_dir: bool
    output: Callable[[Any], str]  # the config's output path
    inputs: Callable[[Any], dict[str, str | None]]  # input name → path (None: not used by this config)
    outputs: Callable[[Any], dict[str, str]]  # after a successful run: name → path that must exist
    volatile: tuple[str, ...] = ("tracking.", "progress")  # config keys (prefixes) that do not change outputs
    # Checks that must pass before the manifest is written into the output (tile: the output is a tile store).
    check: Callable[[Any], None] | None = None
    can_launch: bool = False  # a torchrun job when the launch settings ask for more than one process (extract)

    def as_job(self, launch: Any) -> bool:
        """Runs as a torchrun job with these `LaunchSettings` (None: the defaults, one process). A launch that names
        its GPUs is a job even with one process: only a job gets its own CUDA_VISIBLE_DEVICES."""
        if self.distributed:
            return True
        return self.can_launch and launch is not None and (launch.world_size > 1 or bool(launch.cuda_visible_devices))

    def manifest_path(self, cfg: Any) -> Path:
        return manifest_path(self.output(cfg), is_dir=self.output_is_dir)

    def decide(self, cfg: Any) -> tuple[dict[str, dict[str, str]], mf.Decision]:
        """Fingerprint the inputs and compare them and the config with the manifest: (inputs, decision)."""
        inputs = mf.fingerprint_inputs(self.inputs(cfg))
        return inputs, mf.check_up_to_date(self.manifest_path(cfg), self.config_hash(cfg), inputs)

    def config_hash(self, cfg: Any) -> str:
        from dinov3_core.config import flat_params

        volatile = [k for k in flat_params(cfg) if any(k == v or k.startswith(v) for v in self.volatile)]
        return config_hash(cfg, exclude=volatile)


def _stores(cfg: Any) -> dict[str, str | None]:
    return {f"tile_store[{i}]" if i else "tile_store": s for i, s in enumerate(cfg.data.stores)}


def _pretrain_outputs(cfg: Any) -> dict[str, str]:
    from dinov3_core.train.checkpoint import latest_checkpoint

    run = Path(cfg.output_dir)
    out = {"run_dir": str(run)}
    last = latest_checkpoint(run / "ckpt")
    if last is not None:
        out["last_checkpoint"] = str(last)
    evals = sorted((run / "eval").glob("training_*/teacher_checkpoint.pth"))
    if evals:
        out["last_eval_teacher"] = str(evals[-1])
    return out


def _gram_inputs(cfg: Any) -> dict[str, str | None]:
    return {"pretrain_dir": cfg.pretrain_dir, "teacher_path": cfg.gram.teacher_path, **_stores(cfg)}


def _gram_outputs(cfg: Any) -> dict[str, str]:
    out = _pretrain_outputs(cfg)
    selection = Path(cfg.output_dir) / "gram_teacher_selection.json"
    if selection.is_file():
        out["teacher_selection"] = str(selection)
    return out


def _slides_input(cfg: TileConfig) -> dict[str, Any]:
    """A slide list (.txt/.csv) is fingerprinted with the files it names, so a replaced slide counts."""
    from dinov3_core.tiling.discovery import discover_slides

    inputs: dict[str, Any] = {"slides": cfg.input, "mpp_overrides": cfg.mpp_overrides}
    if Path(cfg.input).suffix.lower() in {".txt", ".csv"} and Path(cfg.input).is_file():
        inputs["listed_slides"] = [str(p) for p in discover_slides(cfg.input, cfg.extensions)]
    return inputs


def _check_tile_output(cfg: TileConfig) -> None:
    """A bad output path or an input without slides fails here, before a stage manifest is written."""
    from dinov3_core.tiling.engine import prepare_store

    prepare_store(cfg)


def _check_extract_output(cfg: ExtractConfig) -> None:
    """An output that is not a feature store fails here, before a manifest is written into it or a job starts."""
    from dinov3_core.export.feature_store import check_output

    check_output(Path(cfg.output))


def _evaluate_config() -> type:
    from dinov3_core.evaluate.config import EvaluateConfig

    return EvaluateConfig


def _evaluate_inputs(cfg: Any) -> dict[str, Any]:
    from dinov3_core.evaluate.models import champion_state

    baseline = cfg.baseline if cfg.baseline not in (None, "auto", "init") else None
    return {"tile_store": cfg.store, "candidate": cfg.candidate, "annotations": cfg.annotations,
            "baseline": baseline, "patients": cfg.patients, "sites": cfg.sites,
            "champion": champion_state(cfg)}  # fmt: skip


def _export_outputs(cfg: ExportConfig) -> dict[str, str]:
    out = {"onnx": cfg.output}
    data = Path(f"{cfg.output}.data")
    if data.exists():
        out["onnx_data"] = str(data)
    if cfg.huggingface:
        out["huggingface"] = str(Path(cfg.output).parent / "hf" / "model.safetensors")
    return out


STAGE_SPECS: dict[str, StageSpec] = {
    "tile": StageSpec(
        "tile", lambda: TileConfig, False, True, lambda c: c.output, _slides_input,
        lambda c: {"store": c.output},  # fingerprinted by its slides' tile counts (dinov3_core.manifest)
        volatile=("tracking.", "progress", "workers"), check=_check_tile_output,
    ),
    "pretrain": StageSpec(
        "pretrain", _pretrain_config, True, True, lambda c: c.output_dir,
        lambda c: {**_stores(c), "pretrained_weights": c.student.pretrained_weights}, _pretrain_outputs,
        volatile=("tracking.", "progress", "train.num_threads", "data.num_workers", "data.prefetch_factor"),
    ),
    "gram": StageSpec(
        "gram", _gram_config, True, True, lambda c: c.output_dir, _gram_inputs, _gram_outputs,
        volatile=("tracking.", "progress", "train.num_threads", "data.num_workers", "data.prefetch_factor"),
    ),
    "convert": StageSpec(
        "convert", lambda: ConvertConfig, False, True, lambda c: c.output_dir,
        lambda c: {"checkpoint": c.input, "tile_store": c.store, "annotations": c.annotations},
        lambda c: {"backbone": str(Path(c.output_dir) / "backbone.pth"),
                   "arch_config": str(Path(c.output_dir) / "config.yaml")},
    ),
    "export": StageSpec(
        "export", lambda: ExportConfig, False, False, lambda c: c.output, lambda c: {"weights": c.weights},
        _export_outputs,
    ),
    "evaluate": StageSpec(
        "evaluate", _evaluate_config, False, True, lambda c: c.output, _evaluate_inputs,
        lambda c: {"evaluation": str(Path(c.output) / "evaluation.json")},
        # device and precision are not here: they change the features slightly, so they change the hash
        volatile=("tracking.", "progress", "num_threads", "batch_size", "loader_threads", "prefetch_batches"),
    ),
    "extract": StageSpec(
        "extract", lambda: ExtractConfig, False, True, lambda c: c.output,
        lambda c: {"tile_store": c.store, "model": c.model}, lambda c: {"features": c.output},
        volatile=("tracking.", "progress", "num_threads", "batch_size", "providers", "device", "loader_threads",
                  "prefetch_batches", "chunk_rows"),
        check=_check_extract_output, can_launch=True,
    ),
}  # fmt: skip


__all__ = ["STAGE_SPECS", "StageSpec"]
