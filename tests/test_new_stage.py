"""A new stage is its module and one `STAGES` entry: a throw-away stage, written here and nowhere else, runs in the
pipeline and in a retraining cycle with the paths each chain gives it, its manifest skipping a rerun. Nothing of
the chains, the configs or the CLI was told about it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from omegaconf import MISSING

from dinov3_core.cli_chains import local_runner
from dinov3_core.pipeline.config import load_pipeline_config
from dinov3_core.pipeline.run import run_pipeline
from dinov3_core.retrain import stage_configs as sc
from dinov3_core.retrain.config import load_retrain_config
from dinov3_core.retrain.cycle import run_cycle
from dinov3_core.runner import StageOutcome
from dinov3_core.stage import ChainPaths, Place, RunHooks, Stage, Summary
from dinov3_core.stages import STAGES
from dinov3_core.tracking import TrackingConfig
from tests.helpers import by_name, read_json

QUICK_TILES = "tile.overrides=[tile_size=64,mpp=2.0,workers=1,progress=false]"
SMALL_BATCHES = ("pretrain.train.global_batch_size=8", "gram.train.global_batch_size=8")  # a slide's 13 tiles


# ------------------------------------------------------------------------------ the throw-away stage, whole


@dataclass
class CensusConfig:
    store: str = MISSING
    output: str = MISSING
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


@dataclass
class CensusSummary(Summary):
    slides: int = 0
    tiles: int = 0


def _census(cfg: CensusConfig, hooks: RunHooks) -> tuple[dict[str, int], CensusSummary]:
    from dinov3_core.tiling import store as ts

    counts = {s: int(ts.read_slide_attrs(cfg.store, s)["tile_count"]) for s in ts.complete_slide_ids(cfg.store)}
    Path(cfg.output).write_text(json.dumps({"store": cfg.store, "tiles": counts}))
    return counts, CensusSummary(len(counts), sum(counts.values()))


def _chain_values(p: ChainPaths) -> dict[str, Any]:
    return {"store": str(p.output("tile")), "output": str(p.output("census"))}


CENSUS: Stage[CensusSummary] = Stage(
    name="census",
    help="Tiles per slide of the tile store.",
    schema=lambda: CensusConfig,
    summary_type=CensusSummary,
    output=lambda c: c.output,
    output_is_dir=False,
    place=Place("census.json", "cohort", "tiles per slide"),
    inputs=lambda c: {"tile_store": c.store},
    outputs=lambda c: {"census": c.output},
    chain_values=_chain_values,
    work=_census,
)


@pytest.fixture
def census() -> Any:
    with STAGES.added(CENSUS, after="tile") as stage:
        yield stage
    assert "census" not in STAGES.names


@pytest.fixture(scope="module")
def one_slide(sample_slides: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("census_slides")
    (folder / "tissue_40x.svs").symlink_to(by_name(sample_slides, "tissue_40x.svs"))
    return folder


# ---------------------------------------------------------------------------------------------- the chains


def test_a_new_stage_runs_in_the_pipeline_where_its_place_says(census: Stage[Any], one_slide: Path, tmp_path: Path):
    values = {"slides": str(one_slide), "workdir": str(tmp_path / "run"), "stop_after": "census"}
    cfg = load_pipeline_config("cpu", [f"{k}={v}" for k, v in values.items()] + [QUICK_TILES, "tracking.enabled=false"])
    assert cfg.selected() == ["tile", "census"] and cfg.stages["census"].config is None  # a choice of its own

    first = run_pipeline(cfg, local_runner(None, bars=False), log=lambda line: None)
    made = read_json(tmp_path / "run" / "census.json")
    assert made["store"] == str(tmp_path / "run" / "tiles.zarr")
    assert first.outcomes["census"].status == "ran" and first.outcomes["census"].summary.tiles == sum(
        made["tiles"].values()
    )
    assert first.paths.named()["census"] == tmp_path / "run" / "census.json"

    again = run_pipeline(cfg, local_runner(None, bars=False), log=lambda line: None)
    assert {s: o.status for s, o in again.outcomes.items()} == {"tile": "skipped", "census": "skipped"}


class _TrainingStopped(Exception):
    """The test's runner stops the cycle when its training starts: what comes before it is under test."""


def test_a_new_stage_runs_in_a_cycle_with_the_cohorts_paths(census: Stage[Any], one_slide: Path, tmp_path: Path):
    root = tmp_path / "retrain"
    cfg = load_retrain_config(
        "tiny",
        [f"slides={one_slide}", f"root={root}", QUICK_TILES, "tracking.enabled=false", *SMALL_BATCHES],
    )
    assert "census" in cfg.chained(sc.cycle_stages())
    ran: list[str] = []
    runner = local_runner(None, bars=False)

    def run_until_training(stage: Stage[Any], stage_cfg: Any, parent: str | None, force: bool = False):
        if stage.place.scope == "cycle":
            raise _TrainingStopped(stage.name)
        ran.append(stage.name)
        outcome: StageOutcome[Any] = runner(stage, stage_cfg, parent, force)
        return outcome

    with pytest.raises(_TrainingStopped, match="pretrain"):
        run_cycle(cfg, run_until_training, log=lambda line: None)
    assert ran == ["tile", "census"]
    (cycle,) = (root / "cycles").iterdir()
    record = read_json(cycle / "cycle.json")
    assert record["stages"]["census"]["status"] == "ran" and record["trigger"]["train"] is True
    made = read_json(root / "census.json")  # a cohort-wide output: beside the cohort's tile store
    assert made["store"] == str(root / "tiles.zarr") and sum(made["tiles"].values()) == record["snapshot"]["tiles"]


def test_a_cycle_runs_every_stage_or_names_the_ones_it_leaves_out() -> None:
    """A stage that is neither run by a cycle nor excluded by name would be validated and then never run."""
    for anchoring in (True, False):
        cfg = load_retrain_config("tiny", ["slides=s", "root=r", f"gram_anchoring={str(anchoring).lower()}"])
        left_out = set(sc.NOT_IN_A_CYCLE) | (set() if anchoring else {"gram"})
        assert set(cfg.chained(sc.cycle_stages())) | left_out == set(STAGES.names)
        assert not set(cfg.chained(sc.cycle_stages())) & left_out
