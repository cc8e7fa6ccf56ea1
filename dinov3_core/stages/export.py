"""export: backbone.pth → ONNX (dynamic batch and size) checked against PyTorch with ONNX Runtime, registered as
`<register_name>@candidate`; with huggingface=true also a transformers model directory, checked the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dinov3_core import checksums, tracking
from dinov3_core import manifest as mf
from dinov3_core.export.config import ExportConfig
from dinov3_core.export.summary import ONNX_SHA_TAG, WEIGHTS_SHA_TAG, ExportSummary
from dinov3_core.stage import ChainPaths, CliOption, Place, RunHooks, Stage


def _work(cfg: ExportConfig, hooks: RunHooks) -> tuple[Any, ExportSummary]:
    from dinov3_core.export.model_card import describe_version, write_model_card
    from dinov3_core.export.onnx_export import run_export

    r = run_export(cfg)
    hooks.log(
        f"export: {r.path} (ONNX Runtime vs PyTorch: max abs error {r.max_abs_error:.2e}, "
        f"{r.max_rel_error:.1e} of the output scale)"
    )
    card = write_model_card(
        r.path,
        Path(cfg.weights),
        {
            "outputs": r.outputs,
            "max_abs_error": r.max_abs_error,
            "max_rel_error": r.max_rel_error,
            "model_version": r.model_version,
            "registered_model": cfg.register_name,
        },
    )
    describe_version(cfg, cfg.register_name, r.model_version, card)
    s = ExportSummary(
        onnx=str(r.path),
        n_nodes=r.n_nodes,
        max_abs_error=r.max_abs_error,
        max_rel_error=r.max_rel_error,
        fp16_max_rel_error=r.fp16_max_rel_error,
        model_uri=r.model_uri,
        registered_model=cfg.register_name if r.model_version else None,
        model_version=r.model_version,
        alias=cfg.register_alias if r.model_version else None,
    )
    if cfg.huggingface:
        from dinov3_core.export.hf_export import write_hf_model
        from dinov3_core.export.model_card import HF_DIR

        h = write_hf_model(
            Path(cfg.weights),
            r.path.parent / HF_DIR,
            card=card.read_text(),
            atol=cfg.parity_tolerance,
            rtol=cfg.parity_rtol,
        )
        hooks.log(
            f"export: {h.path} (transformers vs PyTorch: {h.max_rel_error:.1e} of the output scale; as "
            f"loaded, with transformers' own RoPE frequencies: {h.as_loaded_rel_error:.1e})"
        )
        s.huggingface, s.hf_max_rel_error, s.hf_as_loaded_rel_error = (
            str(h.path),
            h.max_rel_error,
            h.as_loaded_rel_error,
        )
    return r, s


def _tag_model_version(cfg: ExportConfig, m: mf.StageManifest) -> None:
    """The registered ONNX model version carries the run ids it came from (registry → training → tiles) and the
    SHA-256 of its files on disk, so whoever uses them later (a cycle's warm start, extraction with the champion)
    can refuse a file that is not the one registered."""
    s = STAGE.summary(m.summary)
    if not s.model_version or not s.registered_model:
        return
    from mlflow import MlflowClient  # deferred: mlflow is slow to import

    client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking))
    # (the manifest records the same digests as the run closes: each file is read once per process)
    hashes = {ONNX_SHA_TAG: checksums.sha256(Path(cfg.output)), WEIGHTS_SHA_TAG: checksums.sha256(Path(cfg.weights))}
    for key, value in {**mf.lineage_tags(m.lineage), "wsidino.weights": str(cfg.weights), **hashes}.items():
        client.set_model_version_tag(s.registered_model, s.model_version, key, value)


def _outputs(cfg: ExportConfig) -> dict[str, str]:
    out = {"onnx": cfg.output}
    data = Path(f"{cfg.output}.data")
    if data.exists():
        out["onnx_data"] = str(data)
    if cfg.huggingface:
        out["huggingface"] = str(Path(cfg.output).parent / "hf" / "model.safetensors")
    return out


def _chain_values(p: ChainPaths) -> dict[str, Any]:
    values: dict[str, Any] = {"weights": str(p.output("convert") / "backbone.pth"), "output": str(p.output("export"))}
    if p.register_name is not None:  # a cycle's candidate, under the cycle's model name
        values |= {"register_name": p.register_name, "register_alias": "candidate"}
    return values


STAGE: Stage[ExportSummary] = Stage(
    name="export",
    help="backbone.pth → ONNX (dynamic batch and size), checked with ONNX Runtime; with huggingface=true also a "
    "transformers model directory (hf/), checked the same way.",
    schema=lambda: ExportConfig,
    summary_type=ExportSummary,
    output=lambda c: c.output,
    output_is_dir=False,
    place=Place("model/model.onnx", contents="ONNX, MODEL_CARD.md"),
    inputs=lambda c: {"weights": c.weights},
    outputs=_outputs,
    chain_values=_chain_values,
    work=_work,
    after_run=_tag_model_version,
    options=(
        CliOption("--weights", "weights", "backbone.pth or .safetensors (e.g. from wsidino convert)"),
        CliOption("--output", "output", "model.onnx path"),
    ),
    override_example="fp16=true huggingface=true register_alias=candidate",
)
