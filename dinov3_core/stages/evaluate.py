"""evaluate: frozen-feature probes of the candidate, the registry's champion and a baseline on the lab's
annotations, and the gate that moves `@champion`. Runs in this process; on several processes each model's labelled
tiles are embedded by a torchrun job (`dinov3_core.evaluate.embed_job`)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from dinov3_core.evaluate.summary import EvaluateSummary
from dinov3_core.stage import ChainPaths, CliOption, Place, PreflightFacts, Problem, RunHooks, Stage

EPILOG = """\
protocol:
  Tiles take the class of the annotation polygon their centre lies in (min_overlap=F: and F of their area).
  Slides (or patients, patients=CSV) are dealt into probe.folds folds (default 5, at most one per slide):
  each fold is tested by probes fitted on the other folds' slides, so every slide is tested once and no
  slide is ever on both sides. Each model embeds the same labelled tiles (cls+mean_patch, probe.features)
  and is scored by a kNN (k=20, cosine, temperature-weighted), a linear probe (logistic regression, C
  chosen on a validation split of each fold's training slides) and few-shot kNN (1-16 tiles per class);
  balanced accuracy and macro-F1 (AUROC for two classes) of the pooled predictions, with bootstrap 95 %
  intervals over all test slides. Dense probe: patch tokens labelled by the polygon under their centre
  (none within half a token of a class boundary; at most probe.dense_tokens_per_tile=16 per tile, from
  the same embedding pass) get the linear probe on the same folds: balanced accuracy and mIoU, with
  intervals. Label-free health (CLS effective rank, dense consistency, stain invariance: top-1 retrieval
  of HED-jittered tiles among the originals, stain.*) is reported for every model, annotations or not.

gate:
  The candidate becomes <register_name>@champion when an exact paired permutation test over the test
  slides (patients) gives p <= gate.alpha (0.025) for its difference to the champion on
  gate.primary_metric (default linear.balanced_accuracy; dense.miou for the dense probe), that
  difference exceeds gate.margin, it is not below the baseline, and its features did not collapse.
  The first model is tested against the baseline. On n slides the least p-value is 2^-n: fewer than
  6 test slides (at alpha 0.025) never promote, and the reason says how many the measured effect
  would need; gate.allow_point_estimate=true decides on the point estimate instead (recorded).
  The bootstrap intervals are for display.
  Without annotations promotion is off (gate.label_free=true opts into a health-only gate);
  gate.promote=false measures without moving aliases.

examples:
  wsidino evaluate --store tiles.zarr --candidate model/model.onnx --output evaluation \\
      --annotations annotations/ probe.bootstrap=2000 gate.margin=0.01
  wsidino evaluate ... patients=patients.csv sites=scanners.csv baseline=/weights/dinov3_vitb16.pth
"""


def schema() -> type:
    from dinov3_core.evaluate.config import EvaluateConfig

    return EvaluateConfig


def _inputs(cfg: Any) -> dict[str, Any]:
    from dinov3_core.evaluate.models import champion_state

    baseline = cfg.baseline if cfg.baseline not in (None, "auto", "init") else None
    return {
        "tile_store": cfg.store,
        "candidate": cfg.candidate,
        "annotations": cfg.annotations,
        "baseline": baseline,
        "patients": cfg.patients,
        "sites": cfg.sites,
        "champion": champion_state(cfg),
    }


def _work(cfg: Any, hooks: RunHooks) -> tuple[Any, EvaluateSummary]:
    from dinov3_core.evaluate.evaluation import run_evaluate
    from dinov3_core.evaluate.gate import evidence_line
    from dinov3_core.export.model_card import add_evaluation, describe_version

    embed_job = None
    if hooks.launch is not None and hooks.launch.nproc_per_node > 1:  # each model's labelled tiles: a job on this node
        from dinov3_core.evaluate.embed_job import launch_embedding

        embed_job = functools.partial(
            launch_embedding,
            cfg,
            hooks.launch,
            log=hooks.log,
            hold_resources=hooks.hold_resources,
            run_job=hooks.run_job,
        )
    r = run_evaluate(cfg, embed_job)
    for line in r.table.splitlines():
        hooks.log(line)
    d, cand = r.decision, r.report.models["candidate"]
    line = evidence_line(d)
    hooks.log(line)
    card = add_evaluation(Path(cfg.candidate), r.table, d.reason, line)
    describe_version(cfg, cfg.register_name, cand.get("version"), card)
    primary = cfg.gate.primary_metric.split(".")
    value = cand.get("probes", {}).get(primary[0], {}).get(primary[1], {}).get("value")
    return r, EvaluateSummary(
        labelled_tiles=r.report.labelled_tiles,
        promoted=d.applied,
        promote=d.promote,
        decision=d.reason,
        evidence=line,
        champion_model=r.champion_model,
        primary_metric=cfg.gate.primary_metric if value is not None else None,
        primary_value=value,
        cls_effective_rank=cand["health"].get("cls_effective_rank"),
        seconds=round(r.seconds, 1),
    )


def _preflight(cfg: Any, facts: PreflightFacts) -> list[Problem]:
    """Annotations that cannot label the slides are found before training, not after it (`annotations` is the key
    the user types, alone and in a pipeline: a chain passes its own through). In a chain, which knows its slides
    and how they will be tiled, every file is matched to a slide, its polygons checked against the slide and its
    classes counted in tiles; otherwise every file is read."""
    if not cfg.annotations:
        return []
    from dinov3_core.evaluate.annotation_check import check_annotations
    from dinov3_core.evaluate.labels import annotation_problems

    fix = "or move that file out of the annotations folder to evaluate without it"
    problems = annotation_problems(cfg.annotations)
    if not problems and facts.slides is not None and facts.tiling is not None:
        found = check_annotations(cfg.annotations, facts.slides, facts.tiling)
        problems = found.problems
        if facts.log is not None and not problems:
            facts.log(found.describe())
    return [Problem("annotations", said, fix) for said in problems]


def _chain_values(p: ChainPaths) -> dict[str, Any]:
    values: dict[str, Any] = {
        "store": str(p.output("tile")),
        "candidate": str(p.output("export")),
        "output": str(p.output("evaluate")),
        "annotations": p.annotations,
    }
    if p.register_name is not None:
        values["register_name"] = p.register_name
    return values


STAGE: Stage[EvaluateSummary] = Stage(
    name="evaluate",
    help="Frozen-feature probes of the candidate, the registry's champion and a baseline on your annotations; "
    "promotes the candidate to @champion only when it is better.",
    schema=schema,
    summary_type=EvaluateSummary,
    output=lambda c: c.output,
    output_is_dir=True,
    place=Place("evaluation", contents="evaluation.md, evaluation.json, confusion_*.png, embedding_*.png"),
    inputs=_inputs,
    outputs=lambda c: {"evaluation": str(Path(c.output) / "evaluation.json")},
    chain_values=_chain_values,
    work=_work,
    preflight=_preflight,
    # device and precision are not here: they change the features slightly, so they change the hash
    volatile=("tracking.", "progress", "num_threads", "batch_size", "loader_threads", "prefetch_batches"),
    options=(
        CliOption("--store", "store", "tile store with the annotated slides (tiles.zarr)"),
        CliOption("--candidate", "candidate", "the model to judge: model.onnx (export) or backbone.pth (convert)"),
        CliOption("--output", "output", "evaluation directory (evaluation.json, evaluation.md, pictures, cache)"),
        CliOption(
            "--annotations", "annotations", "folder of QuPath <slide_id>.geojson exports, or a CSV slide_id,x,y,label"
        ),
    ),
    launch_help="embedding",  # more than 1: each model's labelled tiles embedded by a torchrun job
    override_example="gate.margin=0.01 probe.bootstrap=2000",
    epilog=EPILOG,
    rerun_hint="embed again (models already embedded come from the cache)",
    review=lambda r: r.table,  # the probe table and the decision
)
