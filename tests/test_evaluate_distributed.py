"""evaluate's embedding through extract's code, in one process and as a torchrun job: real tile store (3 sample
slides at 32 px), real DAB annotations, a real (randomly initialised) backbone.pth, real torchrun with 2 gloo CPU
ranks. Each launch costs ~10 s on 2 cores: one stage run on 2 ranks, one failing job."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dinov3_core.config import load_config
from dinov3_core.evaluate import features as F
from dinov3_core.evaluate.config import EvaluateConfig
from dinov3_core.evaluate.evaluation_json import EvaluationReport
from dinov3_core.launch import TorchrunFailed
from dinov3_core.launch.training import LaunchSettings
from dinov3_core.runner import run_stage
from dinov3_core.stages import get_stage
from tests.helpers import by_name, tile_store
from tests.test_evaluate_stage import backbone, dab_annotations


@pytest.fixture(scope="module")
def setup(sample_slides: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("evaluate_dist")
    slides = [by_name(sample_slides, n) for n in ("tissue_40x.svs", "tissue_20x.svs", "tissue_generic.tiff")]
    store = tile_store(slides, root / "tiles.zarr", tile_size=32, mpp=2.0)
    dab_annotations(store, root / "annotations")
    return {"root": root, "store": store, "model": backbone(root / "model", colour_blind=False)}


def config(setup: dict[str, Any], output: str, **values: Any) -> EvaluateConfig:
    return load_config(
        EvaluateConfig,
        None,
        {
            "store": str(setup["store"]),
            "candidate": str(setup["model"]),
            "output": str(setup["root"] / output),
            "annotations": str(setup["root"] / "annotations"),
            "baseline": None,
            "champion": False,
            "tracking.enabled": False,
            "probe.bootstrap": 50,
            "probe.few_shot": [1],
            "probe.few_shot_draws": 1,
            "progress": False,
            "batch_size": 16,
            **values,
        },
    )


def cached(output: Path) -> dict[str, dict[str, np.ndarray]]:
    return {p.name: F.load(p) for p in sorted((output / "cache").glob("features-*.npz"))}


@pytest.fixture(scope="module")
def single(setup: dict[str, Any]) -> dict[str, Any]:
    """The reference: the stage in this process (reader threads on)."""
    outcome = run_stage("evaluate", config(setup, "one"))
    return {"outcome": outcome, "features": cached(setup["root"] / "one")}


def test_one_process_features_are_the_serial_loops_bit_for_bit(setup: dict[str, Any], single: dict[str, Any]) -> None:
    from dinov3_core.data.tile_dataset import TileDataset
    from dinov3_core.evaluate.evaluation import labelled_tiles

    cfg = config(setup, "one")
    assert cfg.loader_threads == 2  # the default: reader threads ahead of the model
    ds = TileDataset(setup["store"], image_format="numpy")
    idx = labelled_tiles(setup["store"], ds, cfg.annotations, [], max_tiles_per_slide=cfg.max_tiles_per_slide)[0]
    model = F.open_model(setup["model"], device="cpu")
    cls, mean = [], []
    for start in range(0, len(idx), cfg.batch_size):  # what evaluate did before: read, normalise, run, in turn
        c, patch = model.run(F.normalise(ds.read_batch(idx[start : start + cfg.batch_size])))
        cls.append(c)
        mean.append(patch.mean(axis=1))
    (name, got), *rest = single["features"].items()
    plain = F.cache_path(Path(), model, F.selection_key(setup["store"], idx)).stem
    assert not rest and name.startswith(f"{plain}-d")  # the dense probe's patch tokens are part of the key
    np.testing.assert_array_equal(got["cls"], np.concatenate(cls))
    np.testing.assert_array_equal(got["mean_patch"], np.concatenate(mean))


def test_two_ranks_embed_every_labelled_tile_once_as_one_process_does(
    setup: dict[str, Any], single: dict[str, Any]
) -> None:
    out = setup["root"] / "two"
    outcome = run_stage("evaluate", config(setup, "two"), launch=LaunchSettings(nproc_per_node=2))
    got, ref = cached(out), single["features"]
    assert list(got) == list(ref)  # the same cache file: same model hash, same selection
    (name, features), (_, expected) = next(iter(got.items())), next(iter(ref.items()))
    n = outcome.manifest.summary["labelled_tiles"]
    assert n == single["outcome"].manifest.summary["labelled_tiles"] > 40
    for k in (*F.FEATURES, "dense"):  # the dense probe's patch tokens come from the job too, split like the tiles
        assert features[k].shape == expected[k].shape and len(features[k]) == n, k
        np.testing.assert_allclose(features[k], expected[k], atol=1e-5, rtol=0, err_msg=k)
    # it was the job that embedded them: its spec, its ranks' logs; its parts are gone
    spec = json.loads((out / "embed_jobs" / f"{Path(name).stem}.json").read_text())
    assert spec["output"] == str((out / "cache" / name).resolve()) and spec["tokens"].endswith(".tokens.npy")
    logs = sorted((out / "torchrun_logs").rglob("stdout.log"))
    assert len(logs) == 2 and all("tiles on torch-cpu" in p.read_text() for p in logs), logs
    assert not list((out / "cache").glob(".*")), "parts or temporary files left"
    ev = EvaluationReport.from_json((out / "evaluation.json").read_text())
    ref_ev = EvaluationReport.from_json((setup["root"] / "one" / "evaluation.json").read_text())
    assert ev.split == ref_ev.split and ev.labelled_tiles == ref_ev.labelled_tiles
    # a rerun of the stage is up to date; launch settings do not change the config hash
    assert run_stage("evaluate", config(setup, "two"), launch=LaunchSettings(nproc_per_node=2)).status == "skipped"


def test_a_failing_rank_fails_the_job_and_leaves_no_cache(setup: dict[str, Any], tmp_path: Path) -> None:
    from dinov3_core.data.tile_dataset import TileDataset
    from dinov3_core.evaluate.embed_job import launch_embedding

    cfg = config(setup, str(tmp_path / "failing"))
    model = F.open_model(setup["model"], device="cpu")
    changed = dataclasses.replace(model, hash="0" * 16)  # the file no longer hashes to what the job was given
    idx = np.arange(len(TileDataset(setup["store"])), dtype=np.int64)
    path = F.cache_path(Path(cfg.output) / "cache", changed, "k")
    with pytest.raises(TorchrunFailed) as err:
        launch_embedding(cfg, LaunchSettings(nproc_per_node=2), changed, path, idx)
    assert err.value.rank_exit_code == 2 and "changed while the evaluation ran" in err.value.root_cause
    assert not path.exists() and not list(path.parent.glob("*"))


def test_bf16_features_get_their_own_cache_file(setup: dict[str, Any], tmp_path: Path) -> None:
    from dinov3_core.data.tile_dataset import TileDataset

    ds, idx = TileDataset(setup["store"], image_format="numpy"), np.arange(12, dtype=np.int64)
    fp32 = F.open_model(setup["model"], device="cpu")
    bf16 = F.open_model(setup["model"], device="cpu", precision="bf16")
    a = F.embed(fp32, ds, idx, tmp_path, "k", 4)
    b = F.embed(bf16, ds, idx, tmp_path, "k", 4, precision="bf16")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"features-{fp32.hash}-k.npz", f"features-{fp32.hash}-bf16-k.npz"]
    )
    assert not np.array_equal(a["cls"], b["cls"])  # autocast changed them: they must not pass for fp32
    np.testing.assert_array_equal(F.embed(fp32, ds, idx, tmp_path, "k", 4)["cls"], a["cls"])
    assert F.precision_of("model.onnx", "bf16") == "fp32"  # ONNX runs as exported
    spec, cfg = get_stage("evaluate"), config(setup, "h")
    same = [dataclasses.replace(cfg, loader_threads=0), dataclasses.replace(cfg, prefetch_batches=4)]
    other = [dataclasses.replace(cfg, precision="bf16"), dataclasses.replace(cfg, device="cpu")]
    assert {spec.config_hash(c) for c in same} == {spec.config_hash(cfg)}
    assert spec.config_hash(cfg) not in {spec.config_hash(c) for c in other}
