"""ONNX export fidelity: how far ONNX Runtime (fp32 and fp16 exports) lands from PyTorch, beside how far PyTorch
fp32 itself lands from a float64 evaluation of the same weights (the floor any fp32 runtime shares).

Models: a randomly initialised released-size ViT-B/16 (`vitb16`, 86M) and, when given, trained weights
(`--trained model/backbone.pth`, e.g. the demo's). For each: `run_export` (fp32, then fp16), then on the same
random inputs the max abs error of each output, its scale (max |value|) and their ratio. ORT graph optimisations
on and off, to see whether the fusions move the error.

Usage: python benchmarks/onnx_parity.py [--quick] [--trained PATH] [--output DIR]   (writes DIR/onnx_parity.json)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
import yaml

from dinov3_core.config import load_config
from dinov3_core.export.config import ExportConfig
from dinov3_core.export.onnx_export import run_export
from dinov3_core.inference.backbone import INFERENCE_OVERRIDES, BackboneFeatures, load_backbone
from dinov3_core.models import backbone_kwargs, build_backbone, save_backbone


def random_model(root: Path, arch: str) -> Path:
    torch.manual_seed(0)
    weights = save_backbone(build_backbone(arch, **INFERENCE_OVERRIDES).eval(), root / arch / "backbone.pth")
    kwargs = backbone_kwargs(arch, **INFERENCE_OVERRIDES)
    (root / arch / "config.yaml").write_text(yaml.safe_dump({"arch": arch, "backbone_kwargs": kwargs}))
    return weights


def measure(weights: Path, onnx_path: Path, size: int, half: bool) -> dict[str, Any]:
    model = BackboneFeatures(load_backbone(weights)).eval()
    exact = BackboneFeatures(load_backbone(weights)).eval().double()
    x = torch.randn(2, 3, size, size + 16 * (size // 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref32, ref64 = model(x), exact(x.double())
    row: dict[str, Any] = {}
    for name, level in (
        ("ort", ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
        ("ort_no_opt", ort.GraphOptimizationLevel.ORT_DISABLE_ALL),
    ):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        got = session.run(None, {"pixel_values": (x.half() if half else x).numpy()})
        for out, g, r32, r64 in zip(("cls", "patch"), got, ref32, ref64, strict=True):
            scale = float(r64.abs().max())
            err = float(np.abs(g.astype(np.float64) - r64.numpy()).max())
            row[f"{name}.{out}"] = {"abs": err, "rel": err / scale}
            row[f"torch32.{out}"] = {"abs": float((r32.double() - r64).abs().max()), "scale": scale}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="vit_small instead of vitb16")
    parser.add_argument("--trained", type=Path, help="trained backbone.pth (with its config.yaml) to check as well")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--output", default="bench-output")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = {
            ("vits16" if args.quick else "vitb16") + " (random)": random_model(
                root, "vits16" if args.quick else "vitb16"
            )
        }
        if args.trained:
            models["trained " + str(args.trained)] = args.trained
        for label, weights in models.items():
            out = root / label.split()[0] / "model.onnx"
            values = {
                "weights": str(weights),
                "output": str(out),
                "fp16": True,
                "parity_sizes": [32],
                "parity_batches": [1],
                "tracking.enabled": False,
            }
            export = run_export(load_config(ExportConfig, None, values))
            results[label] = {
                "fp32": measure(weights, export.path, args.size, half=False),
                "fp16": measure(weights, export.fp16_path, args.size, half=True) if export.fp16_path else None,
            }
            print(f"{label}: done", file=sys.stderr, flush=True)
    Path(args.output).mkdir(parents=True, exist_ok=True)
    (Path(args.output) / "onnx_parity.json").write_text(json.dumps(results, indent=1))
    print("| model | export | output | scale | PyTorch fp32 vs fp64 | ORT vs fp64 | relative | ORT, no graph opt |")
    print("|---|---|---|---|---|---|---|---|")
    for label, by_kind in results.items():
        for kind, row in by_kind.items():
            if row is None:
                continue
            for out in ("cls", "patch"):
                t, o, n = row[f"torch32.{out}"], row[f"ort.{out}"], row[f"ort_no_opt.{out}"]
                print(
                    f"| {label} | {kind} | {out} | {t['scale']:.2f} | {t['abs']:.1e} | {o['abs']:.1e} | "
                    f"{o['rel']:.1e} | {n['abs']:.1e} |"
                )


if __name__ == "__main__":
    main()
