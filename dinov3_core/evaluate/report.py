"""What an evaluation leaves behind: `evaluation.json`, a markdown table, confusion matrices and embedding maps."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from dinov3_core.evaluate import probes as P
from dinov3_core.files import write_text_atomic

ROLES = ("candidate", "champion", "baseline")


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Atomic: a reader never sees half an evaluation."""
    write_text_atomic(path, json.dumps(doc, indent=1, default=_jsonable, allow_nan=True))


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def _ci(m: dict[str, float] | None) -> str:
    if not m or m["value"] is None or not math.isfinite(m["value"]):
        return "–"
    return f"{m['value']:.3f} [{m['ci_low']:.3f}, {m['ci_high']:.3f}]"


def markdown(evaluation: dict[str, Any]) -> str:
    """The table a person reads first: one row per model, then the comparisons and the decision."""
    lines = ["# Evaluation", ""]
    n = evaluation["labelled_tiles"]
    if n:
        split = evaluation.get("split", {})
        classes = ", ".join(f"{c} {k}" for c, k in evaluation["classes"].items())
        unit = split.get("by", "slide")
        lines += [f"{n} labelled tiles ({classes}); {split.get('folds')}-fold cross-validation by {unit} "
                  f"({split.get('scheme')}, seed {split.get('seed')}): every {unit} tested once, by probes fitted on "
                  f"the other folds; test {unit}s {split.get('test_groups')}. Values: point estimate [bootstrap 95 % "
                  f"interval over the {len(split.get('test_groups', []))} test {unit}s].", ""]  # fmt: skip
    else:
        lines += ["No annotations: label-free health only.", ""]
    head = ("| model | kNN bal. acc | linear bal. acc | linear macro-F1 | few-shot kNN | dense bal. acc | dense mIoU "
            "| CLS eff. rank | dense agreement | stain invariance |")  # fmt: skip
    lines += [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for role in ROLES:
        m = evaluation["models"].get(role)
        if m is None:
            continue
        if m.get("error"):
            lines.append(f"| {role} | not evaluated: {m['error'][:80]} | | | | | | | | |")
            continue
        probes, health = m.get("probes", {}), m.get("health", {})
        few = probes.get("few_shot", {})
        shots = max(few, key=int) if few else None
        few_text = f"{few[shots]['balanced_accuracy']:.3f} ({shots}/class)" if shots else "–"
        lines.append(
            f"| {role} | {_ci(probes.get('knn', {}).get('balanced_accuracy'))} "
            f"| {_ci(probes.get('linear', {}).get('balanced_accuracy'))} "
            f"| {_ci(probes.get('linear', {}).get('macro_f1'))} | {few_text} "
            f"| {_ci(probes.get('dense', {}).get('balanced_accuracy'))} | {_ci(probes.get('dense', {}).get('miou'))} "
            f"| {health.get('cls_effective_rank', math.nan):.3f} | {health.get('dense_agreement', math.nan):.3f} "
            f"| {health.get('stain_invariance', math.nan):.3f} |"
        )
    counts = next((m["probes"]["dense"]["counts"] for m in evaluation["models"].values()
                   if "dense" in m.get("probes", {})), None)  # fmt: skip
    if counts:
        lines.append(
            f"\nDense probe: {counts['tokens']} labelled patch tokens ({counts['grid']} grid, at most "
            f"{counts['tokens_per_tile']} per tile, none within half a token of a class boundary) of "
            f"{counts['tiles_with_tokens']} tiles, the tile probe's folds; mIoU from the pooled confusion "
            "matrix. Stain invariance: share of HED-jittered tiles whose CLS retrieves their original."
        )
    for name, diffs in evaluation.get("comparisons", {}).items():
        shown = [f"{label} {d['value']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
                 for key, label in (("linear.balanced_accuracy", "linear bal. acc"), ("dense.miou", "dense mIoU"))
                 if (d := diffs.get(key))]  # fmt: skip
        if shown:
            lines.append(f"\n{name.replace('_', ' ')}: {'; '.join(shown)}")
    if evaluation.get("site_predictability"):
        sp = ", ".join(f"{k} {v:.3f}" for k, v in evaluation["site_predictability"].items())
        lines.append(f"\nSite predictability (kNN bal. acc, lower is better): {sp}")
    d = evaluation.get("decision", {})
    verdict = "PROMOTED to @champion" if d.get("applied") else ("promote" if d.get("promote") else "not promoted")
    lines += ["", f"**Decision: {verdict}** — {d.get('reason', '')}"]
    e = evaluation.get("evidence") or d.get("evidence")
    if e and n:
        interval = e.get("interval")
        used = (f"; interval used: {e['comparison']} {e['metric']} {interval['value']:+.3f} "
                f"[{interval['ci_low']:+.3f}, {interval['ci_high']:+.3f}]") if interval else ""  # fmt: skip
        strength = {None: "not assessed", True: "sufficient", False: "insufficient"}[e.get("sufficient")]
        if e.get("point_estimate"):
            strength = "insufficient, decided on a point estimate (gate.allow_point_estimate=true)"
        lines.append(f"\nEvidence: {e['test_groups']} test {e['unit']}s (gate.min_test_slides {e['min_test_slides']}), "
                     f"{e['folds']} folds{used}; {strength}.")  # fmt: skip
    for w in evaluation.get("warnings", []):
        lines.append(f"\n⚠ {w}")
    return "\n".join(lines) + "\n"


def save_pictures(
    out: Path, y: np.ndarray, feats: dict[str, np.ndarray], preds: dict[str, dict[str, P.Predictions]]
) -> None:
    """Per model: the linear probe's confusion matrix (every labelled tile, each predicted by the fold that held
    its slide out), and a 2-D PCA map of all labelled tiles coloured by class."""
    # deferred: scikit-learn costs ~1 s at import, paid only by the probes
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.decomposition import PCA
    from sklearn.metrics import ConfusionMatrixDisplay

    out.mkdir(parents=True, exist_ok=True)
    classes = np.unique(y)
    for role, x in feats.items():
        fig, ax = plt.subplots(figsize=(4.5, 4))
        ConfusionMatrixDisplay.from_predictions(
            y, preds[role]["linear"].predicted, labels=classes, ax=ax, colorbar=False, xticks_rotation=30
        )
        ax.set_title(f"{role}: linear probe, held-out slides")
        fig.tight_layout()
        fig.savefig(out / f"confusion_{role}.png", dpi=110)
        plt.close(fig)
        xy = PCA(n_components=2, random_state=0).fit_transform(P.l2_normalise(x))
        fig, ax = plt.subplots(figsize=(4.5, 4))
        for k, c in enumerate(classes):
            sel = y == c
            ax.scatter(xy[sel, 0], xy[sel, 1], s=8, alpha=0.7, color=plt.get_cmap("tab10")(k % 10), label=f"{c}")
        ax.set_title(f"{role}: PCA of tile features")
        ax.legend(fontsize=7, markerscale=2)
        fig.tight_layout()
        fig.savefig(out / f"embedding_{role}.png", dpi=110)
        plt.close(fig)


__all__ = ["markdown", "save_pictures", "write_json"]
