"""export: a released-layout backbone → ONNX with dynamic batch, height and width (multiples of the patch size).

    cfg = load_config(ExportConfig, None, {"weights": "out/model/backbone.pth", "output": "out/model/model.onnx"},
                      stage="export")
    result = run_export(cfg)       # result.max_abs_error: ONNX Runtime vs PyTorch, fp32

Outputs: `cls` [B, D] and `patch_tokens` [B, h*w, D] (final norm), or with `pooled: true` one output `pooled`
[B, 2D] = concat(cls, mean patch token). Input `pixel_values` [B, 3, H, W], float32, ImageNet-normalised.
Exported with the dynamo exporter in eval mode (docs/reference/onnx.md): RoPE is computed in the graph (Range /
Sin / Cos, no If / Tile / Loop: checked). The export runs in a spawned process killed after `timeout_s`.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from dinov3_core import tracking
from dinov3_core.errors import WsidinoError
from dinov3_core.export.config import ExportConfig
from dinov3_core.inference.backbone import BackboneFeatures, load_backbone
from dinov3_core.inference.onnx_runtime import INPUT_NAME, ort_session

__all__ = ["ExportConfig", "ExportError", "ExportResult", "run_export"]

logger = logging.getLogger(__name__)

FORBIDDEN_OPS = frozenset({"If", "Tile", "Loop"})
EXTERNAL_DATA_BYTES = 1_800_000_000  # protobuf's hard limit is 2 GiB


class ExportError(WsidinoError):
    """The backbone could not be exported, or the exported model disagrees with PyTorch."""


@dataclass
class ExportResult:
    path: Path
    data_path: Path | None  # external data file (weights), when written
    fp16_path: Path | None
    n_nodes: int
    op_types: list[str]
    outputs: list[str]
    # per (batch, size) and output: max abs error, the output's scale (max |PyTorch|) and their ratio
    parity: list[dict[str, Any]] = field(default_factory=list)
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0  # max abs error / output scale, worst over outputs and shapes
    fp16_max_abs_error: float | None = None
    fp16_max_rel_error: float | None = None
    export_seconds: float = 0.0
    model_uri: str | None = None
    model_version: str | None = None
    reused_version: bool = False  # the same weights and export settings were registered before: no new version


# ------------------------------------------------------------------------------------------ export (child)


def _export_onnx(
    weights: str,
    output: str,
    pooled: bool,
    half: bool,
    opset: int | None,
    max_side: int,
    example_size: int,
    external: str,
) -> dict[str, Any]:
    """Export one model file (runs in the child process)."""
    backbone = load_backbone(weights)
    model = BackboneFeatures(backbone, pooled).eval()
    dtype = torch.float16 if half else torch.float32
    if half:
        model = model.half()
    p = backbone.patch_size
    if example_size % p:
        raise ExportError(f"example_size={example_size} is not a multiple of the patch size {p}")
    n_params = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    use_external = external == "always" or (external == "auto" and n_params > EXTERNAL_DATA_BYTES)
    dims = {
        0: torch.export.Dim("batch", min=1, max=4096),
        2: p * torch.export.Dim("h_patches", min=1, max=max(2, max_side // p)),
        3: p * torch.export.Dim("w_patches", min=1, max=max(2, max_side // p)),
    }
    example = torch.randn(2, 3, example_size, example_size, dtype=dtype)
    names = ["pooled"] if pooled else ["cls", "patch_tokens"]
    # torch.onnx warns that torchvision's ops cannot be registered (we use none) and prints each export phase.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with torch.no_grad():
        program = torch.onnx.export(
            model,
            (example,),
            dynamo=True,
            verbose=False,
            dynamic_shapes=(dims,),
            input_names=[INPUT_NAME],
            output_names=names,
            opset_version=opset,
            external_data=use_external,
        )
    out = Path(output)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    program.save(str(tmp), external_data=use_external)
    ops = sorted({node.op_type for node in program.model_proto.graph.node})
    n_nodes = len(program.model_proto.graph.node)
    data = None
    if use_external:
        # The model refers to its data file by name: write it under the final name, then the model.
        written = tmp.with_name(tmp.name + ".data")
        data = out.with_name(out.name + ".data")
        if written.exists():
            proto = onnx.load(str(tmp), load_external_data=True)
            onnx.save(proto, str(tmp), save_as_external_data=True, location=data.name, all_tensors_to_one_file=True)
            written.unlink(missing_ok=True)
            # onnx.save wrote the data beside tmp under data.name already
    os.replace(tmp, out)
    return {"ops": ops, "n_nodes": n_nodes, "data": str(data) if data else None, "outputs": names}


def _child(queue: Any, kwargs: dict[str, Any]) -> None:
    try:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        queue.put(("ok", _export_onnx(**kwargs)))
    except BaseException as err:  # reported to the parent
        queue.put(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()[-4000:]}"))


def export_in_subprocess(timeout_s: float, **kwargs: Any) -> dict[str, Any]:
    """`_export_onnx` in a spawned process; ExportError when it fails or runs past `timeout_s`."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue, kwargs), daemon=True)
    proc.start()
    try:
        status, payload = queue.get(timeout=timeout_s)
    except Exception:  # queue.Empty: timed out (or the child died without reporting)
        alive = proc.is_alive()
        proc.kill()
        proc.join(10)
        if alive:
            raise ExportError(f"ONNX export did not finish within timeout_s={timeout_s:g} s; raise timeout_s") from None
        raise ExportError(f"ONNX export process died (exit code {proc.exitcode})") from None
    proc.join(30)
    if status != "ok":
        raise ExportError(f"ONNX export of {kwargs['weights']} failed: {payload}")
    return payload


# ------------------------------------------------------------------------------------------------ checks


def within_tolerance(err: float, scale: float, atol: float, rtol: float) -> bool:
    """The export gate for one output: finite, and abs error ≤ atol + rtol × the output's scale (max |value|)."""
    return bool(np.isfinite(err)) and err <= atol + rtol * scale


@dataclass
class Parity:
    """ONNX Runtime vs PyTorch on random inputs: per (batch, size) and output, the max abs error, the output's
    scale (max |PyTorch value|) and the relative error (abs / scale)."""

    rows: list[dict[str, Any]]
    worst_abs: float
    worst_rel: float

    def within(self, atol: float, rtol: float) -> bool:
        """Every output of every shape: abs error ≤ atol + rtol × its scale (and finite)."""
        return all(within_tolerance(e["abs"], e["scale"], atol, rtol) for r in self.rows for e in r["outputs"].values())


def check_parity(
    path: Path, model: nn.Module, sizes: list[int], batches: list[int], half: bool = False, seed: int = 0
) -> Parity:
    """ONNX Runtime vs PyTorch (fp32 reference) on random inputs of each batch and (non-square) size."""
    session = ort_session(path)
    names = [o.name for o in session.get_outputs()]
    gen = torch.Generator().manual_seed(seed)
    rows, worst_abs, worst_rel = [], 0.0, 0.0
    for b in batches:
        for i, s in enumerate(sizes):
            w = sizes[(i + 1) % len(sizes)]  # non-square as well
            x = torch.randn(b, 3, s, w, generator=gen)
            with torch.no_grad():
                ref = model(x)
            ref = ref if isinstance(ref, tuple) else (ref,)
            feed = x.half().numpy() if half else x.numpy()
            got = session.run(None, {INPUT_NAME: feed})
            outputs = {}
            for n, g, r in zip(names, got, ref, strict=True):
                want = r.float().numpy()
                err = float(np.abs(g.astype(np.float32) - want).max())
                scale = float(np.abs(want).max())
                outputs[n] = {"abs": err, "scale": scale, "rel": err / max(scale, 1e-12)}
                worst_abs, worst_rel = max(worst_abs, err), max(worst_rel, outputs[n]["rel"])
            rows.append({"batch": b, "height": s, "width": w, "outputs": outputs})
    return Parity(rows, worst_abs, worst_rel)


EXPORT_KEY_TAG = "wsidino.export_key"


def export_key(cfg: ExportConfig) -> str:
    """What makes two exports the same model: the weights' values (not the file's bytes: a file saved again, or
    repaired, with the same tensors is the same model) and the settings that change the graph."""
    settings = (weights_hash(cfg.weights), cfg.pooled, cfg.fp16, cfg.opset, cfg.max_side, cfg.external_data)
    return hashlib.sha256(repr(settings).encode()).hexdigest()[:20]


def weights_hash(path: str | Path) -> str:
    """SHA-256 of a backbone's tensors: each key, dtype, shape and values, in key order."""
    from dinov3_core.models.released import read_backbone_state_dict

    digest = hashlib.sha256()
    for key, tensor in sorted(read_backbone_state_dict(Path(path)).items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def registered_version(client: Any, name: str, key: str) -> str | None:
    """The version of `name` already registered for this export key, if any."""
    # deferred: importing mlflow is slow (docs/benchmarks.md, tile stage), paid only when tracking
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name='{name}'")
    except MlflowException:
        return None
    same = [v for v in versions if (v.tags or {}).get(EXPORT_KEY_TAG) == key]
    return str(min(int(v.version) for v in same)) if same else None


def _log_mlflow(cfg: ExportConfig, result: ExportResult) -> None:
    # deferred: importing mlflow is slow (docs/benchmarks.md, tile stage), paid only when tracking
    import mlflow
    from mlflow import MlflowClient

    params = {"weights": cfg.weights, "pooled": cfg.pooled, "fp16": cfg.fp16, "n_nodes": result.n_nodes}
    with tracking.into_active_run(cfg.tracking, params=params, tags={"wsidino.stage": "export"}) as run:
        if run is None:  # called without the stage runner: it owns the run the model is registered from
            return
        tracking.log_metrics(
            {
                "max_abs_error": result.max_abs_error,
                "max_rel_error": result.max_rel_error,
                "export_seconds": result.export_seconds,
            }
        )
        client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking))
        key = export_key(cfg)
        existing = registered_version(client, cfg.register_name, key) if cfg.register_name else None
        if existing is not None:  # a rerun with unchanged weights: the registry already holds this model
            result.model_version, result.reused_version = existing, True
            result.model_uri = f"models:/{cfg.register_name}/{existing}"
            mlflow.set_tag("wsidino.reused_model_version", existing)
            logger.info(
                "export: %s v%s already holds these weights (%s %s): no new version",
                cfg.register_name,
                existing,
                EXPORT_KEY_TAG,
                key,
            )
            if cfg.register_alias:
                client.set_registered_model_alias(cfg.register_name, cfg.register_alias, existing)
            return
        info = mlflow.onnx.log_model(
            onnx.load(str(result.path)),
            name="model",
            registered_model_name=cfg.register_name or None,
            save_as_external_data=result.data_path is not None,
        )
        result.model_uri = info.model_uri
        if cfg.register_name:
            version = str(info.registered_model_version)
            client.set_model_version_tag(cfg.register_name, version, EXPORT_KEY_TAG, key)
            if cfg.register_alias:
                client.set_registered_model_alias(cfg.register_name, cfg.register_alias, version)
            result.model_version = version


def run_export(cfg: ExportConfig) -> ExportResult:
    """Export, check (`onnx.checker` on the path, forbidden ops, ORT parity) and optionally log / register."""
    model = BackboneFeatures(load_backbone(cfg.weights), cfg.pooled).eval()  # fails early on bad weights
    p = model.backbone.patch_size
    bad = [s for s in cfg.parity_sizes if s % p]
    if bad:
        raise ExportError(f"parity_sizes {bad} are not multiples of the patch size {p}")
    out = Path(cfg.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    common = {
        "weights": str(cfg.weights),
        "pooled": cfg.pooled,
        "opset": cfg.opset,
        "max_side": cfg.max_side,
        "example_size": cfg.example_size,
        "external": cfg.external_data,
    }
    start = time.perf_counter()
    info = export_in_subprocess(cfg.timeout_s, output=str(out), half=False, **common)
    seconds = time.perf_counter() - start
    onnx.checker.check_model(str(out))  # the path: works for models with external data too
    forbidden = FORBIDDEN_OPS & set(info["ops"])
    if forbidden:
        raise ExportError(f"exported graph has {sorted(forbidden)} nodes (TensorRT-hostile); RoPE must be in-graph")
    parity = check_parity(out, model, list(cfg.parity_sizes), list(cfg.parity_batches))
    worst = parity.worst_abs
    result = ExportResult(
        path=out,
        data_path=Path(info["data"]) if info["data"] else None,
        fp16_path=None,
        n_nodes=info["n_nodes"],
        op_types=info["ops"],
        outputs=info["outputs"],
        parity=parity.rows,
        max_abs_error=worst,
        max_rel_error=parity.worst_rel,
        export_seconds=seconds,
    )
    logger.info(
        "exported %s: %d nodes in %.1f s, vs PyTorch: max abs error %.2e, relative to the output scale %.2e",
        out,
        result.n_nodes,
        seconds,
        worst,
        parity.worst_rel,
    )
    if not parity.within(cfg.parity_tolerance, cfg.parity_rtol):
        raise ExportError(
            f"ONNX model {out} differs from PyTorch by {worst:.3g} (relative {parity.worst_rel:.3g}): more than "
            f"parity_tolerance={cfg.parity_tolerance:g} + parity_rtol={cfg.parity_rtol:g} × the output's scale "
            f"(per shape: {parity.rows})"
        )
    if cfg.fp16:
        half = out.with_name(f"{out.stem}_fp16{out.suffix}")
        export_in_subprocess(cfg.timeout_s, output=str(half), half=True, **common)
        onnx.checker.check_model(str(half))
        fp16 = check_parity(half, model, list(cfg.parity_sizes)[:1], [1], half=True)
        result.fp16_max_abs_error, result.fp16_max_rel_error = fp16.worst_abs, fp16.worst_rel
        result.fp16_path = half
        logger.info(
            "fp16 variant %s: vs fp32 PyTorch max abs error %.2e, relative %.2e", half, fp16.worst_abs, fp16.worst_rel
        )
    if cfg.tracking.enabled:
        _log_mlflow(cfg, result)
    return result
