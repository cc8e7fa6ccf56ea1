"""MODEL_CARD.md beside every exported model: what the model is, what it was trained from and on, how training
went, how it was evaluated, and what it is for. Written by export (and set as the registered version's
description), completed by evaluate. Everything in it is read from the stage manifests and run directories, so a
card never claims what the files do not show.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from dinov3_core import manifest as mf
from dinov3_core import tracking
from dinov3_core.files import write_text_atomic
from dinov3_core.tiling import store as ts

CARD_FILE = "MODEL_CARD.md"
HF_DIR, HF_CARD = "hf", "README.md"  # the Hugging Face copy of the model carries the same card as its README
SHAPE_KEYS = ("embed_dim", "depth", "num_heads", "patch_size", "n_storage_tokens")
EVALUATION_HEADING = "## Evaluation"
INTENDED_USE = """## Intended use and limits
- A frozen feature extractor for tiles of the kind it was trained on (stain, scanner, µm/px, tile size above):
  slide embeddings, multiple-instance learning, retrieval, probes. Features of other magnifications or stains are
  out of its domain.
- Research use. It is not a medical device and makes no diagnosis; any clinical use needs its own validation.
- Trained on the slides named above only: its features inherit their sites, scanners and cohort biases. The
  evaluation below is on the lab's own annotations, with slides kept apart between probe training and test.
"""

# Beside our gate the MLflow UI offers its own "Promote model" and alias buttons; this section says which one
# counts. It comes before the long sections so the registry's copy of the card (cut to its limit) keeps it.
PROMOTION = """## Promotion
- `@champion` is moved only by wsidino's evaluate gate. It compares this version with the champion (or, for the
  registry's first model, the baseline) on held-out slides and records its decision in one evidence line, e.g.
  `gate: <metric> candidate − champion <difference> [95 % CI …], p = … (paired permutation, <n> slides, α …):
  promoted to @champion`, in the Evaluation section below, in the evaluate run's `wsidino.promotion_reason` tag and
  in its evaluation.md.
- Moving `@champion` by hand in the MLflow UI ("Promote model", the aliases editor) bypasses that evaluation: the
  registry then serves a model no gate has passed.
- To roll back, point `@champion` at an earlier version the gate promoted (its evaluate run is tagged
  `wsidino.promotion=promoted`) and record why on that version:
  `MlflowClient(uri).set_registered_model_alias(name, "champion", version)` and
  `set_model_version_tag(name, version, "wsidino.rollback", "<why>")`. The next evaluate run sees the alias
  changed and evaluates the next candidate against the restored champion.
"""


def _yaml(path: Path) -> dict[str, Any]:
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def _last_metrics(run: Path) -> dict[str, Any]:
    path = run / "training_metrics.json"
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    steps = [r for r in map(json.loads, lines) if "event" not in r]  # event lines: memory re-plans
    return steps[-1] if steps else {}


def _data(doc: dict[str, Any]) -> dict[str, Any]:
    data = doc.get("data") or {}
    stores, wanted = data.get("stores") or [], data.get("slide_ids")
    slides: dict[str, int] = {}
    tiling: dict[str, Any] = {}
    for store in stores:
        for slide_id in ts.complete_slide_ids(store):
            if wanted is None or slide_id in wanted:
                attrs = ts.read_slide_attrs(store, slide_id)
                slides[slide_id] = int(attrs.get("tile_count") or 0)
                tiling = tiling or {"µm/px": attrs.get("mpp_effective"), "tile px": attrs.get("tile_size")}
    return {"stores": stores, "slides": slides, "tiling": tiling}


def _run(run: Path) -> dict[str, Any]:
    doc = _yaml(run / "config.yaml")
    last = _last_metrics(run)
    health = run / "health.json"
    train, optim = doc.get("train") or {}, doc.get("optim") or {}
    return {
        "stage": "gram" if "gram" in doc else "pretrain",
        "dir": str(run),
        "arch": (doc.get("student") or {}).get("arch"),
        "start": (doc.get("student") or {}).get("pretrained_weights") or doc.get("pretrain_dir") or "random init",
        "planned": (optim.get("epochs") or 0) * (train.get("epoch_length") or 0),
        "trained": (last.get("iteration", -1) + 1) if last else 0,
        "global_batch": train.get("global_batch_size"),
        "losses": {k: round(float(last[k]), 4) for k in ("total_loss", "dino_gap", "gram_loss") if k in last},
        "health": json.loads(health.read_text()).get("verdict") if health.is_file() else None,
        "data": _data(doc),
        "pretrain_dir": doc.get("pretrain_dir"),
    }


def training_record(weights: Path) -> list[dict[str, Any]]:
    """The training runs behind a converted backbone, newest first (gram, then the pretraining it continued)."""
    convert = mf.producer_manifest(weights)
    if convert is None or convert.stage != "convert" or "checkpoint" not in convert.inputs:
        return []
    run = Path(convert.inputs["checkpoint"]["path"])
    run = run if (run / "ckpt").is_dir() else run.parent.parent  # a ckpt/<it>/ directory → its run
    runs: list[dict[str, Any]] = []
    while run is not None and (run / "config.yaml").is_file() and len(runs) < 3:
        runs.append(_run(run))
        run = Path(runs[-1]["pretrain_dir"]) if runs[-1]["pretrain_dir"] else None
    return runs


def _training_section(runs: list[dict[str, Any]], source: dict[str, Any]) -> list[str]:
    """`source`: what convert recorded of the checkpoint it exported (its config.yaml): the newest run's row counts
    the iterations of that checkpoint, which may be an older one than the run's last (a damaged one skipped)."""
    if not runs:
        return ["## Training", "", "Not trained by wsidino (no convert manifest beside the weights).", ""]
    exported = source.get("iteration")
    if exported is not None:
        runs[0] = {**runs[0], "trained": int(exported) + 1}
    first = runs[-1]
    data = next((r["data"] for r in runs if r["data"]["slides"]), {"slides": {}, "stores": [], "tiling": {}})
    slides = data["slides"]
    lines = ["## Training", "", f"- Base weights: `{first['start']}`"]
    if exported is not None:
        lines.append(
            f"- Exported: the {source.get('which', 'teacher')} of iteration {exported} (`{source.get('checkpoint')}`), "
            f"{int(exported) + 1} iterations trained"
        )
    tiling = ", ".join(f"{k} {v}" for k, v in data["tiling"].items() if v is not None)
    lines.append(
        f"- Data: {len(slides)} slide(s), {sum(slides.values())} tiles ({tiling}) from "
        f"{', '.join(f'`{s}`' for s in data['stores'])}"
    )
    shown = ", ".join(f"{s} ({n})" for s, n in list(slides.items())[:30])
    lines.append(f"- Slides (tiles): {shown}{' …' if len(slides) > 30 else ''}")
    lines += ["", "| run | arch | iterations | global batch | final losses | health |", "|---|---|---|---|---|---|"]
    for r in reversed(runs):
        losses = ", ".join(f"{k} {v}" for k, v in r["losses"].items())
        lines.append(
            f"| {r['stage']} (`{r['dir']}`) | {r['arch']} | {r['trained']} of {r['planned']} | "
            f"{r['global_batch'] or '–'} | {losses} | {r['health'] or '–'} |"
        )
    return [*lines, ""]


def write_model_card(onnx: Path, weights: Path, export: dict[str, Any]) -> Path:
    """The card beside `onnx` (export's summary: outputs, parity, registry version); no evaluation yet."""
    arch = _yaml(weights.parent / "config.yaml")
    shape = ", ".join(f"{k} {v}" for k, v in (arch.get("backbone_kwargs") or {}).items() if k in SHAPE_KEYS)
    head = [
        f"# Model card: `{onnx.name}`",
        "",
        f"- Architecture: {arch.get('arch', 'see the backbone config')} ({shape})",
        f"- Files: `{onnx}` (ONNX, outputs {', '.join(export.get('outputs', []))}; max abs difference to PyTorch "
        f"{export.get('max_abs_error', float('nan')):.1e}, {export.get('max_rel_error', float('nan')):.1e} of the "
        f"output scale), weights `{weights}` (released DINOv3 key layout)",
        "- Input: RGB tiles scaled to [0, 1], normalised with ImageNet mean (0.485, 0.456, 0.406) and std "
        "(0.229, 0.224, 0.225); side a multiple of the patch size",
    ]
    if export.get("model_version"):
        head.append(f"- Registry: `{export.get('registered_model')}` version {export['model_version']}")
    text = "\n".join(
        [
            *head,
            "",
            PROMOTION,
            *_training_section(training_record(weights), arch.get("source") or {}),
            EVALUATION_HEADING,
            "",
            "Not evaluated yet (the evaluate stage fills this in).",
            "",
            INTENDED_USE,
        ]
    )
    return write_text_atomic(onnx.parent / CARD_FILE, text)


def add_evaluation(candidate: Path, table: str, decision: str, evidence: str | None = None) -> Path | None:
    """Replace the card's evaluation section with this evaluation (the card beside the candidate, if any): the table,
    the decision and the gate's evidence line."""
    card = candidate.parent / CARD_FILE
    if not card.is_file():
        return None
    text = card.read_text()
    before, _, rest = text.partition(EVALUATION_HEADING)
    after = rest[rest.index("## Intended use") :] if "## Intended use" in rest else INTENDED_USE
    body = table.replace("# Evaluation\n", "").strip()
    said = f"Decision: {decision}\n\n" + (f"Evidence: {evidence}\n\n" if evidence else "")
    text = f"{before}{EVALUATION_HEADING}\n\n{body}\n\n{said}{after}"
    if (card.parent / HF_DIR / HF_CARD).is_file():
        write_text_atomic(card.parent / HF_DIR / HF_CARD, text)
    return write_text_atomic(card, text)


def describe_version(cfg: Any, name: str, version: str | None, card: Path | None) -> None:
    """The model card as the registered version's description (what the MLflow UI shows on its page)."""
    if not version or card is None or not cfg.tracking.enabled:
        return
    from mlflow import MlflowClient  # deferred: mlflow is slow to import, and most commands never need it

    client = MlflowClient(tracking_uri=tracking.tracking_uri(cfg.tracking))
    client.update_model_version(name, str(version), description=registry_description(card.read_text(), card.name))


DESCRIPTION_LIMIT = 5000  # characters MLflow's SQL registry stores for a version's description


def registry_description(card: str, name: str = "MODEL_CARD.md", limit: int = DESCRIPTION_LIMIT) -> str:
    """The card as it fits the registry: whole, or cut before the first section that does not fit (never inside a
    table or a sentence), with a line saying where the full card is."""
    if len(card) <= limit:
        return card
    note = f"\n\n_The registry keeps {limit:,} characters: the full card is {name} beside the model file._\n"
    room = limit - len(note)
    cut = card.rfind("\n## ", 0, room)
    return card[: cut if cut > 0 else card.rfind("\n", 0, room)].rstrip() + note


__all__ = [
    "CARD_FILE",
    "DESCRIPTION_LIMIT",
    "HF_CARD",
    "HF_DIR",
    "PROMOTION",
    "add_evaluation",
    "describe_version",
    "registry_description",
    "training_record",
    "write_model_card",
]
