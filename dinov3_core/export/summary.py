"""What the export stage records: its manifest's summary (`ExportSummary`, which evaluate reads to find the
candidate's registered version) and the tags it puts on a registered version (whoever uses the files later, a
cycle's warm start or extraction with the champion, checks them against these digests)."""

from __future__ import annotations

from dataclasses import dataclass

from dinov3_core.stage import Summary

ONNX_SHA_TAG = "wsidino.sha256"  # a registered version's model.onnx on disk
WEIGHTS_SHA_TAG = "wsidino.weights_sha256"  # the backbone.pth it was exported from


@dataclass
class ExportSummary(Summary):
    onnx: str | None = None
    n_nodes: int | None = None
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    fp16_max_rel_error: float | None = None
    huggingface: str | None = None
    hf_max_rel_error: float | None = None
    hf_as_loaded_rel_error: float | None = None
    model_uri: str | None = None
    registered_model: str | None = None
    model_version: str | None = None
    alias: str | None = None

    def note(self) -> str:
        if not self.registered_model:
            return ""
        return f"registered as {self.registered_model} v{self.model_version} @{self.alias}"


__all__ = ["ONNX_SHA_TAG", "WEIGHTS_SHA_TAG", "ExportSummary"]
