"""What an evaluation leaves behind: `evaluation.json`, a markdown table, confusion matrices and embedding maps."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dinov3_core import tracking
from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.evaluate import gate as G
from dinov3_core.evaluate import probes as P
from dinov3_core.evaluate.config import EvaluateConfig
from dinov3_core.evaluate.evaluation_json import EvaluationReport
from dinov3_core.qupath import write_qupath_tiles

ROLES = ("candidate", "champion", "baseline")


def _ci(m: dict[str, float] | None) -> str:
    if not m or m["value"] is None or not math.isfinite(m["value"]):
        return "–"
    return f"{m['value']:.3f} [{m['ci_low']:.3f}, {m['ci_high']:.3f}]"


def _p(d: dict[str, Any]) -> str:
    p = d.get("p_value")
    return "–" if p is None or not math.isfinite(p) else f"{p:.3g}"


def markdown(evaluation: EvaluationReport) -> str:
    """The table a person reads first: one row per model, then the comparisons and the decision."""
    lines = ["# Evaluation", ""]
    n = evaluation.labelled_tiles
    split = evaluation.split or {}
    unit = split.get("by", "slide")
    if n:
        classes = ", ".join(f"{c} {k}" for c, k in evaluation.classes.items())
        lines += [
            f"{n} labelled tiles ({classes}); {split.get('folds')}-fold cross-validation by {unit} "
            f"({split.get('scheme')}, seed {split.get('seed')}): every {unit} tested once, by probes fitted on "
            f"the other folds; test {unit}s {split.get('test_groups')}. Values: point estimate [bootstrap 95 % "
            f"interval over the {len(split.get('test_groups', []))} test {unit}s].",
            "",
        ]
    else:
        lines += ["No annotations: label-free health only.", ""]
    head = (
        "| model | kNN bal. acc | linear bal. acc | linear macro-F1 | few-shot kNN | dense bal. acc | dense mIoU "
        "| CLS eff. rank | dense agreement | stain invariance |"
    )
    lines += [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for role in ROLES:
        m = evaluation.models.get(role)
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
    counts = next(
        (m["probes"]["dense"]["counts"] for m in evaluation.models.values() if "dense" in m.get("probes", {})), None
    )
    if counts:
        lines.append(
            f"\nDense probe: {counts['tokens']} labelled patch tokens ({counts['grid']} grid, at most "
            f"{counts['tokens_per_tile']} per tile, none within half a token of a class boundary) of "
            f"{counts['tiles_with_tokens']} tiles, the tile probe's folds; mIoU from the pooled confusion "
            "matrix. Stain invariance: share of HED-jittered tiles whose CLS retrieves their original."
        )
    for name, diffs in evaluation.comparisons.items():
        shown = [
            f"{label} {d['value']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}], p = {_p(d)}"
            for key, label in (("linear.balanced_accuracy", "linear bal. acc"), ("dense.miou", "dense mIoU"))
            if (d := diffs.get(key))
        ]
        if shown:
            lines.append(
                f"\n{name.replace('_', ' ')}: {'; '.join(shown)} (paired permutation test over the test {unit}s)"
            )
    if evaluation.site_predictability:
        sp = ", ".join(f"{k} {v:.3f}" for k, v in evaluation.site_predictability.items())
        lines.append(f"\nSite predictability (kNN bal. acc, lower is better): {sp}")
    d = evaluation.decision or {}
    verdict = "PROMOTED to @champion" if d.get("applied") else ("promote" if d.get("promote") else "not promoted")
    lines += ["", f"**Decision: {verdict}** — {d.get('reason', '')}"]
    if d and n:
        decision = G.Decision.from_dict(d)
        e = decision.evidence
        strength = {None: "not assessed", True: "sufficient", False: "insufficient"}[e.sufficient]
        if e.point_estimate:
            strength = "insufficient, decided on a point estimate (gate.allow_point_estimate=true)"
        lines.append(
            f"\nEvidence: {G.evidence_line(decision)}. {e.test_groups} test {e.unit}s (the test needs "
            f"{e.min_test_slides} at α {e.alpha}), {e.folds} folds; {strength}. The interval is a bootstrap "
            "over the test slides, for display; the gate decides on the p-value."
        )
    for w in evaluation.warnings:
        lines.append(f"\n⚠ {w}")
    return "\n".join(lines) + "\n"


def normalised_confusion(y: np.ndarray, predicted: np.ndarray, classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row-normalised, counts): entry [i, j] is the share of the tiles of true class `classes[i]` predicted as
    `classes[j]`, so each row with tiles sums to 1 (its recall on the diagonal); a class without tiles is a row of 0."""
    index = {c: k for k, c in enumerate(classes.tolist())}
    counts = np.zeros((len(classes), len(classes)), np.int64)
    np.add.at(counts, ([index[c] for c in y.tolist()], [index[c] for c in predicted.tolist()]), 1)
    totals = counts.sum(axis=1, keepdims=True)
    return counts / np.maximum(totals, 1), counts


def short_label(name: object, width: int = 14) -> str:
    """A class name for an axis: wrapped at spaces to `width` characters a line, at most 2 lines (… if cut)."""
    import textwrap

    lines = textwrap.wrap(str(name), width) or [""]
    if len(lines) > 2:
        lines = [lines[0], lines[1][: width - 1] + "…"]
    return "\n".join(lines)


def plot_confusion(path: Path, y: np.ndarray, predicted: np.ndarray, classes: np.ndarray, title: str) -> np.ndarray:
    """The row-normalised confusion matrix (each true class sums to 1; the tile counts in small print under each
    share), wrapped and rotated class names, a colour bar, `title` on top; returns the normalised matrix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    share, counts = normalised_confusion(y, predicted, classes)
    n = len(classes)
    side = max(4.5, 1.0 + 0.75 * n)
    fig, ax = plt.subplots(figsize=(side + 1.2, side))
    image = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    small = n > 8
    for i in range(n):
        for j in range(n):
            colour = "white" if share[i, j] > 0.6 else "black"
            ax.text(
                j, i - 0.12, f"{share[i, j]:.2f}", ha="center", va="center", color=colour, fontsize=6 if small else 9
            )
            ax.text(
                j, i + 0.25, f"n={counts[i, j]}", ha="center", va="center", color=colour, fontsize=4.5 if small else 6
            )
    labels = [short_label(c) for c in classes]
    ax.set_xticks(range(n), labels, rotation=40, ha="right", rotation_mode="anchor", fontsize=7)
    ax.set_yticks(range(n), [f"{lab} (n={t})" for lab, t in zip(labels, counts.sum(1), strict=True)], fontsize=7)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class (tiles)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return share


TITLE_CHARACTERS = 48  # a title line's width at the embedding map's size and font
LEGEND_ENTRIES = 20  # more slides than this: the legend names the first ones and counts the rest


def embedding_figure(xy: np.ndarray, groups: np.ndarray, title: str, legend_title: str) -> Any:
    """A 2-D map of tiles (`xy`) coloured by `groups` (their class, or their slide): the title wrapped to the
    figure's width and the legend beside the map, both laid out inside the figure (constrained layout), so model
    descriptions and slide names of any length stay readable. The caller saves and closes the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = np.unique(groups)
    entries = min(len(names), LEGEND_ENTRIES) + (len(names) > LEGEND_ENTRIES)
    columns = 1 if entries <= 10 else 2  # a second legend column rather than one taller than the map
    height = max(4.2, 1.2 + 0.22 * math.ceil(entries / columns))
    fig, ax = plt.subplots(figsize=(6.0 + 2.2 * (columns - 1), height), layout="constrained")
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    for k, name in enumerate(names):
        sel = groups == name
        text = str(name) if len(str(name)) <= 28 else str(name)[:27] + "…"  # one line per entry
        ax.scatter(
            xy[sel, 0], xy[sel, 1], s=8, alpha=0.7, color=cmap(k % cmap.N), label=text if k < LEGEND_ENTRIES else None
        )
    if len(names) > LEGEND_ENTRIES:
        ax.scatter([], [], s=0, label=f"… {len(names) - LEGEND_ENTRIES} more")
    ax.set_title("\n".join(textwrap.wrap(title, TITLE_CHARACTERS)) or title, fontsize=9)
    ax.legend(
        title=legend_title,
        fontsize=7,
        title_fontsize=7,
        markerscale=2,
        ncols=columns,
        loc="upper left",
        bbox_to_anchor=(1, 1),
    )
    ax.set_xlabel("PC 1", fontsize=8)
    ax.set_ylabel("PC 2", fontsize=8)
    return fig


def save_pictures(
    out: Path,
    y: np.ndarray,
    feats: dict[str, np.ndarray],
    preds: dict[str, dict[str, P.Predictions]],
    names: dict[str, str] | None = None,
    slides: np.ndarray | None = None,
) -> None:
    """Per model (`names`: role → what the model is, for the titles): the linear probe's row-normalised confusion
    matrix (every labelled tile, each predicted by the fold that held its slide out), a 2-D PCA map of all
    labelled tiles coloured by class and, given their `slides`, the same map coloured by slide: tiles that cluster
    by slide rather than by class show the features carry the stain or the site."""
    # deferred: importing scikit-learn is slow, paid only by the probes
    import matplotlib.pyplot as plt
    from sklearn.decomposition import PCA

    out.mkdir(parents=True, exist_ok=True)
    classes = np.unique(y)
    names = names or {}
    for role, x in feats.items():
        model = f"{role} ({names[role]})" if names.get(role) else role
        title = f"{model}\nlinear probe on held-out slides, rows normalised"
        plot_confusion(out / f"confusion_{role}.png", y, preds[role]["linear"].predicted, classes, title)
        xy = PCA(n_components=2, random_state=0).fit_transform(P.l2_normalise(x))
        maps = [("", y.astype(str), "class")]
        if slides is not None:
            maps.append(("_by_slide", np.asarray(slides).astype(str), "slide"))
        for suffix, groups, legend in maps:
            fig = embedding_figure(xy, groups, f"{model}: PCA of tile features, by {legend}", legend)
            fig.savefig(out / f"embedding_{role}{suffix}.png", dpi=110)
            plt.close(fig)


def qupath_predictions(
    out: Path,
    ds: TileDataset,
    idx: np.ndarray,
    y: np.ndarray,
    pred: P.Predictions,
    colours: Mapping[str, Sequence[int]] | None = None,
) -> str:
    """The candidate's linear-probe predictions on the annotated tiles, one GeoJSON per slide for QuPath: each tile a
    detection classified by its predicted class, with the confidence and the annotated class as measurements. Every
    prediction comes from a probe fitted on other slides' tiles (the cross-validation folds), as the metrics do.
    `colours`: class → RGB of the lab's annotations, so a predicted class is drawn as its annotations are."""
    folder = out / "qupath"
    slide_of, row_of = ds.locate_many(idx)
    classes = [str(c) for c in pred.classes]
    predicted = pred.scores.argmax(1)
    truth = np.searchsorted(pred.classes, y)
    for s in np.unique(slide_of):
        here = np.flatnonzero(slide_of == s)
        coords = ds.slide_coords(int(s))[row_of[here]]
        size = float(ds.slide_attrs(int(s)).get("tile_size_level0") or ds.tile_size)
        measures = {"confidence": pred.scores[here, predicted[here]], "correct": predicted[here] == truth[here]}
        measures |= {f"p({c})": pred.scores[here, k] for k, c in enumerate(classes)}
        target = folder / f"{ds.slide_ids[int(s)]}.geojson"
        write_qupath_tiles(target, coords, size, classes, predicted[here], measures, colours)
    return str(folder)


def flat_metrics(model: dict[str, Any]) -> dict[str, float]:
    flat = {f"health.{k}": float(v) for k, v in model.get("health", {}).items()}
    for probe in ("knn", "linear", "dense"):
        for metric, v in model.get("probes", {}).get(probe, {}).items():
            if not isinstance(v, dict) or "value" not in v:
                continue  # the dense probe's counts and chosen Cs
            flat[f"{probe}.{metric}"] = float(v["value"])
    return flat


def log_mlflow(cfg: EvaluateConfig, evaluation: EvaluationReport, out: Path) -> None:
    if not cfg.tracking.enabled:
        return
    with tracking.into_active_run(cfg.tracking, tags={"wsidino.stage": "evaluate"}) as run:
        if run is None:
            return
        for role, model in evaluation.models.items():
            tracking.log_metrics({f"{role}.{k}": v for k, v in flat_metrics(model).items() if np.isfinite(v)})
        for path in [*sorted(out.glob("*.png")), out / "evaluation.json", out / "evaluation.md"]:
            tracking.log_artifact(path)
        # the predictions for QuPath, under the folder name they have on disk: download it and import each file
        for path in sorted((out / "qupath").glob("*.geojson")):
            tracking.log_artifact(path, artifact_path="qupath")
        # deferred: importing mlflow is slow (docs/benchmarks.md, tile stage), paid only when tracking
        import mlflow

        if mlflow.active_run() is not None:
            decision = evaluation.decision or {}
            mlflow.set_tags(
                {
                    "wsidino.promotion": "promoted" if decision["applied"] else "kept",
                    "wsidino.promotion_reason": decision["reason"][:5000],
                }
            )


__all__ = [
    "embedding_figure",
    "flat_metrics",
    "log_mlflow",
    "markdown",
    "normalised_confusion",
    "plot_confusion",
    "qupath_predictions",
    "save_pictures",
    "short_label",
]
