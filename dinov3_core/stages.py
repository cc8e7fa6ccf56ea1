"""The six stages as data: typed config schema, inputs, output location and outputs of each.

The orchestration layer (Prefect tasks, the CLI) uses this to fingerprint a stage's inputs, find its manifest
and decide whether a rerun may skip it, without knowing each stage's config layout:

    spec = STAGE_SPECS["export"]
    spec.inputs(cfg)        # {"weights": "/run/model/backbone.pth"}
    spec.manifest_path(cfg) # /run/model/model.onnx.stage_manifest.json
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dinov3_core import manifest as mf
from dinov3_core.config import config_hash
from dinov3_core.errors import WsidinoError
from dinov3_core.export.config import ConvertConfig, ExportConfig, ExtractConfig
from dinov3_core.manifest import manifest_path
from dinov3_core.tiling.config import TileConfig
from dinov3_core.train.config import PretrainConfig


def _gram_config() -> type:
    from dinov3_core.gram.config import GramConfig

    return GramConfig


@dataclass(frozen=True)
class StageSpec:
    name: str
    schema: Callable[[], type]
    distributed: bool  # launched as a torchrun job (else runs in the calling process)
    output_is_dir: bool
    output: Callable[[Any], str]  # the config's output path
    inputs: Callable[[Any], dict[str, str | None]]  # input name → path (None: not used by this config)
    outputs: Callable[[Any], dict[str, str]]  # after a successful run: name → path that must exist
    volatile: tuple[str, ...] = ("tracking.", "progress")  # config keys (prefixes) that do not change outputs

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
    from dinov3_core.tiling.stage import discover_slides

    inputs: dict[str, Any] = {"slides": cfg.input, "mpp_overrides": cfg.mpp_overrides}
    if Path(cfg.input).suffix.lower() in {".txt", ".csv"} and Path(cfg.input).is_file():
        inputs["listed_slides"] = [str(p) for p in discover_slides(cfg.input, cfg.extensions)]
    return inputs


def _export_outputs(cfg: ExportConfig) -> dict[str, str]:
    out = {"onnx": cfg.output}
    data = Path(f"{cfg.output}.data")
    if data.exists():
        out["onnx_data"] = str(data)
    return out


STAGE_SPECS: dict[str, StageSpec] = {
    "tile": StageSpec(
        "tile", lambda: TileConfig, False, True, lambda c: c.output, _slides_input,
        lambda c: {"store": c.output},  # fingerprinted by its slides' tile counts (dinov3_core.manifest)
        volatile=("tracking.", "progress", "workers"),
    ),
    "pretrain": StageSpec(
        "pretrain", lambda: PretrainConfig, True, True, lambda c: c.output_dir,
        lambda c: {**_stores(c), "pretrained_weights": c.student.pretrained_weights}, _pretrain_outputs,
        volatile=("tracking.", "progress", "train.num_threads", "data.num_workers", "data.prefetch_factor"),
    ),
    "gram": StageSpec(
        "gram", _gram_config, True, True, lambda c: c.output_dir, _gram_inputs, _gram_outputs,
        volatile=("tracking.", "progress", "train.num_threads", "data.num_workers", "data.prefetch_factor"),
    ),
    "convert": StageSpec(
        "convert", lambda: ConvertConfig, False, True, lambda c: c.output_dir, lambda c: {"checkpoint": c.input},
        lambda c: {"backbone": str(Path(c.output_dir) / "backbone.pth"),
                   "arch_config": str(Path(c.output_dir) / "config.yaml")},
    ),
    "export": StageSpec(
        "export", lambda: ExportConfig, False, False, lambda c: c.output, lambda c: {"weights": c.weights},
        _export_outputs,
    ),
    "extract": StageSpec(
        "extract", lambda: ExtractConfig, False, True, lambda c: c.output,
        lambda c: {"tile_store": c.store, "model": c.model}, lambda c: {"features": c.output},
        volatile=("tracking.", "progress", "num_threads", "batch_size", "providers"),
    ),
}  # fmt: skip


@contextlib.contextmanager
def manifest_guard(spec: StageSpec, cfg: Any, inputs: dict[str, dict[str, str]]) -> Iterator[mf.StageManifest]:
    """`running` manifest while the block runs; `complete` (with outputs and a new output fingerprint) after it,
    `failed` with the error when it raises. The caller fills `run_id` and `summary` on the yielded manifest."""
    path = spec.manifest_path(cfg)
    paths = [i["path"] for i in inputs.values()]
    m = mf.StageManifest(
        stage=spec.name,
        status="running",
        config_hash=spec.config_hash(cfg),
        inputs=inputs,
        lineage=mf.lineage_of(paths),
        started_at=mf.now(),
    )
    with mf.output_lock(path):  # one run per output: a second one fails at once, naming the holder
        mf.write_manifest(path, m)
        try:
            yield m
        except BaseException as err:
            m.status, m.error, m.finished_at = "failed", f"{type(err).__name__}: {err}"[:4000], mf.now()
            mf.write_manifest(path, m)
            raise
        m.outputs = {k: str(Path(v).resolve()) for k, v in spec.outputs(cfg).items()}
        missing = [k for k, v in m.outputs.items() if not Path(v).exists()]
        if missing:
            m.status, m.error = "failed", f"outputs missing after the run: {', '.join(missing)}"
            mf.write_manifest(path, m)
            raise WsidinoError(f"{spec.name}: {m.error} (see {path})")
        m.status, m.finished_at = "complete", mf.now()
        m.output_fingerprint = mf.completion_fingerprint(m)
        mf.write_manifest(path, m)


def run_once(
    stage: str,
    cfg: Any,
    run: Callable[[], dict[str, Any] | None],
    *,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> tuple[bool, mf.StageManifest]:
    """Run a stage under its manifest unless it is up to date (the CLI's path; Prefect tasks add MLflow nesting).

    Returns:
        (ran, manifest): whether `run` was called, and the manifest now on disk.
    """
    spec = STAGE_SPECS[stage]
    inputs, decision = spec.decide(cfg)
    if decision.up_to_date and not force:
        log(f"{stage}: up to date ({decision.reason}); skipped. Use --force to recompute.")
        assert decision.previous is not None
        return False, decision.previous
    with manifest_guard(spec, cfg, inputs) as m:
        m.summary = run() or {}
        m.mlflow_run_id = _last_mlflow_run_id(cfg)
    return True, m


def _last_mlflow_run_id(cfg: Any) -> str | None:
    if not cfg.tracking.enabled:
        return None
    import mlflow

    run = mlflow.last_active_run()
    return run.info.run_id if run is not None else None


# ------------------------------------------------------------------------------ in-process stage runners


def _convert(cfg: Any) -> tuple[Any, dict[str, Any]]:
    from dinov3_core.export.convert import run_convert

    r = run_convert(cfg)
    mb = {"backbone_mb": round(r.backbone_bytes / 1e6, 2), "checkpoint_mb": round(r.checkpoint_bytes / 1e6, 2)}
    return r, {"checkpoint": str(r.checkpoint), "iteration": r.iteration, "arch": r.arch, **mb}


def _export(cfg: Any) -> tuple[Any, dict[str, Any]]:
    from dinov3_core.export.onnx_export import run_export

    r = run_export(cfg)
    summary = {"onnx": str(r.path), "n_nodes": r.n_nodes, "max_abs_error": r.max_abs_error,
               "model_uri": r.model_uri, "registered_model": cfg.register_name if r.model_version else None,
               "model_version": r.model_version, "alias": cfg.register_alias if r.model_version else None}  # fmt: skip
    return r, {k: v for k, v in summary.items() if v is not None}


def _extract(cfg: Any) -> tuple[Any, dict[str, Any]]:
    from dinov3_core.export.extract import run_extract

    r = run_extract(cfg)
    return r, {"slides_extracted": len(r.extracted), "slides_up_to_date": len(r.skipped), "tiles": r.tiles,
               "tiles_per_s": round(r.tiles_per_s, 1), "model_hash": r.model_hash, "backend": r.backend}  # fmt: skip


# The stages that run in the calling process: stage function result and the summary kept in the manifest.
IN_PROCESS: dict[str, Callable[[Any], tuple[Any, dict[str, Any]]]] = {
    "convert": _convert,
    "export": _export,
    "extract": _extract,
}


__all__ = ["IN_PROCESS", "STAGE_SPECS", "StageSpec", "manifest_guard", "run_once"]
