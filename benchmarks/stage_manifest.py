"""Cost of the "is this stage up to date?" check, which every flow run pays for every stage.

Side by side in one run: fingerprinting a large weights file by size + first/last MiB (what `dinov3_core.manifest`
does) vs hashing all of it; fingerprinting a run directory through its producer's manifest vs listing its tree;
and a whole `check_up_to_date` decision.

Usage: python benchmarks/stage_manifest.py [--quick] [--output DIR]   (writes DIR/stage_manifest.json)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dinov3_core import manifest as mf


def best_of(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def full_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench-output")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    size_mb = 256 if args.quick else 1024
    n_files = 500 if args.quick else 5000
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        weights = root / "backbone.pth"
        with weights.open("wb") as f:  # real bytes (not sparse), so both readers hit the page cache alike
            block = os.urandom(1 << 20)
            for _ in range(size_mb):
                f.write(block)
        full = best_of(lambda: full_sha256(weights), 3)
        sampled = best_of(lambda: mf.file_fingerprint(weights), 3)
        rows.append((f"{size_mb} MB weights file", "sha256 of all bytes", full, "size + first/last MiB", sampled))

        run = root / "pretrain"
        for i in range(n_files):
            d = run / "ckpt" / str(i // 100)
            d.mkdir(parents=True, exist_ok=True)
            (d / f"__{i}_0.distcp").write_bytes(b"x")
        tree = best_of(lambda: mf.fingerprint(run), 3)
        done = mf.StageManifest("pretrain", "complete", "h", {}, {"run_dir": str(run)}, finished_at=mf.now())
        done.output_fingerprint = mf.completion_fingerprint(done)
        mf.write_manifest(run / mf.MANIFEST_NAME, done)
        via_manifest = best_of(lambda: mf.fingerprint(run), 3)
        rows.append((f"run dir, {n_files} files", "tree listing", tree, "producer's manifest", via_manifest))

        out = root / "gram"
        out.mkdir()
        inputs = mf.fingerprint_inputs({"pretrain_dir": run, "teacher": weights})
        m = mf.StageManifest("gram", "complete", "h", inputs, {"run_dir": str(out)}, finished_at=mf.now())
        mf.write_manifest(out / mf.MANIFEST_NAME, m)

        def decide() -> None:
            current = mf.fingerprint_inputs({"pretrain_dir": run, "teacher": weights})
            assert mf.check_up_to_date(out / mf.MANIFEST_NAME, "h", current).up_to_date

        decision = best_of(decide, 5)
    lines = [
        "| input | baseline | s | wsidino | s | speed-up |",
        "|---|---|---|---|---|---|",
        *[f"| {what} | {a} | {ta:.4f} | {b} | {tb:.5f} | {ta / tb:.0f}× |" for what, a, ta, b, tb in rows],
        "",
        f"Whole skip decision for a gram stage (run dir + {size_mb} MB teacher file): {decision * 1e3:.1f} ms",
    ]
    print("\n".join(lines))
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "rows": [dict(zip(("input", "baseline", "baseline_s", "ours", "ours_s"), r, strict=True)) for r in rows],
        "decision_s": decision,
    }
    (out_dir / "stage_manifest.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
