"""What verifying artifacts costs: seconds added to a no-op pipeline rerun and to a resume.

Side by side in one run, interleaved, best of N:

* **no-op rerun**: the skip decisions of convert, export, evaluate and extract as a rerun of `wsidino pipeline`
  makes them (`Stage.decide`-equivalent: `manifest.check_up_to_date` over each stage's inputs and outputs) with the
  content records the manifests now carry, vs the same manifests without them (what main did before). Model files
  of the given architecture's size (backbone.pth, model.onnx: fp32 weights), each stage reading the one before.
* **resume**: choosing the checkpoint to resume from, `latest_intact_checkpoint` (every file's CRC-32C) vs
  `latest_checkpoint` (the newest complete directory), on a DCP-sized directory: student + teacher + two AdamW
  moments of the architecture, in 4 shard files.

Usage: python benchmarks/verify_cost.py [--quick] [--output DIR]   (writes DIR/verify_cost.json)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dinov3_core import checksums
from dinov3_core import manifest as mf

PARAMS = {"vits16": 21.6e6, "vitb16": 85.7e6, "vitl16": 303.1e6}  # backbone parameters


def write_random(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        left = size
        while left:
            n = min(left, 1 << 24)
            f.write(os.urandom(n))
            left -= n
    return path


def fresh(fn: Callable[[], object]) -> float:
    """One timing with this process's digest memo emptied (every rerun is a new process)."""
    checksums._SEEN.clear()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def chain(root: Path, model_bytes: int, *, records: bool) -> list[tuple[Path | None, dict[str, Path]]]:
    """convert → export → evaluate → extract as their manifests and inputs stand after a pipeline run; `records`:
    the manifests carry content records (now) or not (before)."""
    model = root / "model"
    backbone = write_random(model / "backbone.pth", model_bytes)
    onnx = write_random(model / "model.onnx", model_bytes)
    store = root / "tiles.zarr"
    store.mkdir()

    def done(stage: str, path: Path, outputs: dict[str, Path], inputs: dict[str, Path]) -> Path:
        m = mf.StageManifest(stage=stage, status="complete", config_hash="h", inputs=mf.fingerprint_inputs(inputs))
        m.outputs = {k: str(v) for k, v in outputs.items()}
        m.artifacts = checksums.record_artifacts(m.outputs) if records else {}
        m.output_fingerprint = mf.completion_fingerprint(m)
        mf.write_manifest(path, m)
        return path

    convert = done("convert", model / mf.MANIFEST_NAME, {"backbone": backbone}, {})
    export = done("export", mf.manifest_path(onnx, is_dir=False), {"onnx": onnx}, {"weights": backbone})
    return [
        (convert, {}),
        (export, {"weights": backbone}),
        (None, {"candidate": onnx, "tile_store": store}),
        (None, {"model": onnx, "tile_store": store}),
    ]


def rerun(stages: list[tuple[Path | None, dict[str, Path]]]) -> None:
    """Each stage's skip decision: its inputs fingerprinted (a producer's file checked against its record) and its
    own manifest compared (its outputs checked against theirs)."""
    for path, inputs in stages:
        fingerprints = mf.fingerprint_inputs(inputs)
        if path is not None:
            assert mf.check_up_to_date(path, "h", fingerprints).up_to_date


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from dinov3_core.train.checkpoint import latest_checkpoint, latest_intact_checkpoint

    archs = ["vits16"] if args.quick else ["vits16", "vitb16"]
    rows = []
    for arch in archs:
        model_bytes = int(PARAMS[arch] * 4)
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            before, after = (
                chain(root / "before", model_bytes, records=False),
                chain(root / "after", model_bytes, records=True),
            )
            ckpt = root / "ckpt" / "99"  # student + teacher + two AdamW moments, in 4 shard files
            for i in range(4):
                write_random(ckpt / f"__{i}_0.distcp", model_bytes)
            (ckpt / ".metadata").write_bytes(b"m")
            checksums.write_checksums(ckpt)
            timings: dict[str, list[float]] = {
                "rerun_before": [],
                "rerun_after": [],
                "resume_before": [],
                "resume_after": [],
            }
            for _ in range(args.repeats):  # interleaved: the box's load hits both sides alike
                timings["rerun_before"].append(fresh(lambda: rerun(before)))  # noqa: B023
                timings["rerun_after"].append(fresh(lambda: rerun(after)))  # noqa: B023
                timings["resume_before"].append(fresh(lambda: latest_checkpoint(root / "ckpt")))  # noqa: B023
                timings["resume_after"].append(fresh(lambda: latest_intact_checkpoint(root / "ckpt")))  # noqa: B023
            best = {k: min(v) for k, v in timings.items()}
            sizes = {"model_mb": round(model_bytes / 1e6), "checkpoint_mb": round(4 * model_bytes / 1e6)}
            rows.append({"arch": arch, **sizes, **{k: round(v, 3) for k, v in best.items()}})
    print(
        "| backbone | model file | checkpoint | no-op rerun: before | after | added | resume pick: before | "
        "after | added |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['arch']} | {r['model_mb']} MB | {r['checkpoint_mb']} MB | {r['rerun_before']:.3f} s | "
            f"{r['rerun_after']:.3f} s | +{r['rerun_after'] - r['rerun_before']:.2f} s | "
            f"{r['resume_before']:.3f} s | {r['resume_after']:.3f} s | "
            f"+{r['resume_after'] - r['resume_before']:.2f} s |"
        )
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_cost.json").write_text(json.dumps({"rows": rows, "repeats": args.repeats}, indent=1))


if __name__ == "__main__":
    main()
