"""extract over a real tile store (2 sample slides) with the converted backbone (PyTorch) and its ONNX export."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch
import zarr

from dinov3_core.config import load_config
from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.errors import WsidinoError
from dinov3_core.extract.config import ExtractConfig
from dinov3_core.extract.extract import ATTRS_KEY, pictures_dir, run_extract
from dinov3_core.inference.backbone import BackboneFeatures, load_backbone
from dinov3_core.inference.feature_model import normalise


def cfg(**values) -> ExtractConfig:
    return load_config(
        ExtractConfig, "default", {"progress": False, **{k: str(v) for k, v in values.items()}}, stage="extract"
    )


@pytest.fixture(scope="module")
def torch_features(stage_extract_store, converted, tmp_path_factory):
    out = tmp_path_factory.mktemp("features") / "features.zarr"
    return run_extract(cfg(store=stage_extract_store, model=converted, output=out))


def test_stored_features_are_the_backbone_outputs(torch_features, stage_extract_store, converted) -> None:
    result = torch_features
    ds = TileDataset(stage_extract_store, image_format="numpy")
    assert sorted(result.extracted) == sorted(ds.slide_ids) and len(ds.slide_ids) == 2
    assert result.tiles == len(ds) and result.tiles_per_s > 0
    model = BackboneFeatures(load_backbone(converted)).eval()
    root = zarr.open_group(str(result.output), mode="r")
    for s, sid in enumerate(ds.slide_ids):
        g = root["slides"][sid]
        n = int(ds.tile_counts[s])
        assert g["cls"].shape == (n, 64) and g["mean_patch"].shape == (n, 64)
        np.testing.assert_array_equal(g["coords"][:], ds.slide_coords(s))
        rows = [0, n - 1]
        start = int(np.cumsum(np.r_[0, ds.tile_counts])[s])
        x = torch.from_numpy(normalise(ds.read_batch([start + r for r in rows])))
        with torch.no_grad():
            cls, patch = model(x)
        np.testing.assert_allclose(g["cls"][rows], cls.numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(g["mean_patch"][rows], patch.mean(1).numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(g["slide_embedding"][:], g["cls"][:].mean(0), atol=1e-6)
        attrs = g.attrs.asdict()[ATTRS_KEY]
        assert attrs["complete"] and attrs["model_hash"] == result.model_hash and attrs["n_tiles"] == n
        png = pictures_dir(result.output) / sid / "pca.png"  # beside the store: the store holds only zarr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert {p.name for p in (result.output / "slides" / sid).iterdir()} == {"zarr.json", *g.keys()}
        assert 0 < sum(attrs["pca_explained_variance"]) <= 1.0 + 1e-6
    assert not list((result.output / ".incoming").iterdir())
    assert (pictures_dir(result.output) / "extract_config.yaml").is_file()
    assert pictures_dir(result.output) == result.output.with_suffix("")


def test_onnx_and_torch_paths_agree(torch_features, stage_extract_store, exported, tmp_path) -> None:
    result = run_extract(
        cfg(store=stage_extract_store, model=exported.path, output=tmp_path / "f.zarr", patch_tokens=True, batch_size=7)
    )
    assert result.backend == "onnx"
    a = zarr.open_group(str(result.output), mode="r")["slides"]
    b = zarr.open_group(str(torch_features.output), mode="r")["slides"]
    worst = 0.0
    for sid in result.extracted:
        for name in ("cls", "mean_patch"):
            worst = max(worst, float(np.abs(a[sid][name][:] - b[sid][name][:]).max()))
        assert a[sid]["patch"].shape == (a[sid]["cls"].shape[0], 4, 64)  # 32 px tiles: 2 × 2 patches
        np.testing.assert_allclose(a[sid]["patch"][:].mean(1), a[sid]["mean_patch"][:], atol=1e-6)
    print(f"\nonnx vs torch max abs error {worst:.2e}")
    assert worst < 1e-4


def test_rerun_skips_finished_slides_and_redoes_unfinished(torch_features, stage_extract_store, converted) -> None:
    out = torch_features.output
    first, second = sorted(torch_features.extracted)
    created = zarr.open_group(str(out / "slides" / first), mode="r").attrs.asdict()[ATTRS_KEY]["created"]
    shutil.rmtree(out / "slides" / second)  # as if the run died before committing it
    (out / ".incoming" / second).mkdir(parents=True)  # with debris left behind
    result = run_extract(cfg(store=stage_extract_store, model=converted, output=out))
    assert result.skipped == [first] and result.extracted == [second]
    assert zarr.open_group(str(out / "slides" / first), mode="r").attrs.asdict()[ATTRS_KEY]["created"] == created
    assert (out / "slides" / second / "cls" / "zarr.json").is_file()
    assert not (out / ".incoming" / second).exists()


def test_shards_split_the_slides(stage_extract_store, converted, tmp_path) -> None:
    out = tmp_path / "f.zarr"
    ids = sorted(TileDataset(stage_extract_store).slide_ids)
    got = [
        run_extract(cfg(store=stage_extract_store, model=converted, output=out, num_shards=2, shard_index=i))
        for i in (0, 1)
    ]
    assert [r.extracted for r in got] == [[ids[0]], [ids[1]]]
    assert sorted(p.name for p in (out / "slides").iterdir() if p.is_dir()) == ids
    with pytest.raises(WsidinoError, match="shard_index"):
        run_extract(cfg(store=stage_extract_store, model=converted, output=out, num_shards=2, shard_index=2))


def test_missing_or_corrupt_inputs_give_clear_errors(stage_extract_store, converted, tmp_path) -> None:
    with pytest.raises(WsidinoError, match="no tile store"):
        run_extract(cfg(store=tmp_path / "nope.zarr", model=converted, output=tmp_path / "f.zarr"))
    corrupt = tmp_path / "corrupt.zarr"
    corrupt.mkdir()
    (corrupt / "zarr.json").write_text("{not json")
    with pytest.raises(WsidinoError, match=r"corrupt\.zarr"):
        run_extract(cfg(store=corrupt, model=converted, output=tmp_path / "f.zarr"))
    with pytest.raises(WsidinoError, match="not found"):
        run_extract(cfg(store=stage_extract_store, model=tmp_path / "m.onnx", output=tmp_path / "f.zarr"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("x")
    with pytest.raises(WsidinoError, match="not a feature store"):
        run_extract(cfg(store=stage_extract_store, model=converted, output=tmp_path / "other"))


def test_progress_in_a_log_file_has_rate_and_eta_and_no_carriage_return(stage_extract_store, converted, tmp_path):
    """Run as a deployment or with output redirected: no terminal, so progress is log lines, not a bar."""
    import subprocess
    import sys

    from tests.helpers import REPO

    log = tmp_path / "extract.log"
    cmd = [
        sys.executable,
        "-m",
        "dinov3_core.cli",
        "extract",
        "--store",
        str(stage_extract_store),
        "--model",
        str(converted),
        "--output",
        str(tmp_path / "f.zarr"),
        "progress_every_s=0",
        "batch_size=16",
        "tracking.enabled=false",
    ]
    with log.open("w") as out:
        assert subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=False).returncode == 0
    text = log.read_text()
    assert "\r" not in text
    lines = [line.split("extract: ", 1)[1] for line in text.splitlines() if re.search(r"extract: \d+/\d+ tiles", line)]
    assert any("tiles/s, ETA " in line for line in lines), text[-2000:]
    done, total = re.match(r"(\d+)/(\d+) tiles \(100 %\)", lines[-1]).groups()  # the last line: all done, with time
    assert done == total and " in 0:00:" in lines[-1]


def test_progress_lines_count_rate_and_eta() -> None:
    import io

    from dinov3_core.progress import Progress

    seen: list[str] = []
    calls: list[tuple[int, int]] = []
    with Progress(
        "extract",
        unit="tile",
        total=10,
        every_s=0,
        stream=io.StringIO(),
        log=seen.append,
        callback=lambda d, t: calls.append((d, t)),
    ) as p:
        p.update(4)
        p.update(6)
    assert seen[0].startswith("extract: 4/10 tiles (40 %), ") and "tiles/s, ETA 0:00:" in seen[0]
    assert seen[-1].startswith("extract: 10/10 tiles (100 %)") and " in 0:00:" in seen[-1]
    assert calls == [(4, 10), (10, 10)]


def test_a_phase_logs_its_start_its_end_and_its_loop_at_most_every_few_seconds() -> None:
    from dinov3_core.progress import Phase

    seen: list[str] = []
    with Phase("evaluate: probes", log=seen.append, every_s=3600) as phase:
        phase.tick("fold 1/2")  # not due: the last line was just now
        phase.tick("candidate done", always=True)
    assert seen[0] == "evaluate: probes: started" and len(seen) == 3
    assert seen[1].startswith("evaluate: probes: candidate done (") and seen[2].startswith("evaluate: probes: done in ")
    with pytest.raises(ValueError), Phase("evaluate: dense probe", log=seen.append, every_s=0) as phase:
        phase.tick("fold 1/2")  # due at once
        raise ValueError
    assert seen[-2].startswith("evaluate: dense probe: fold 1/2 (")
    assert seen[-1].startswith("evaluate: dense probe: failed after ")


# ------------------------------------------------------------------ overlapped reading / writing, ORT session, keys


def _slides(path) -> dict[str, dict[str, np.ndarray]]:
    root = zarr.open_group(str(path), mode="r")["slides"]
    return {sid: {name: np.asarray(root[sid][name][:]) for name in root[sid].array_keys()} for sid in root.group_keys()}


@pytest.mark.parametrize("which", ["torch", "onnx"])
def test_overlapped_extraction_is_bit_identical_to_serial(
    which, stage_extract_store, converted, exported, tmp_path
) -> None:
    """Reader threads, a read-ahead depth and the background writer change nothing in the output, row for row; small
    zarr chunks (10 rows, batches of 7) make batches straddle chunks, so the chunk buffering is exercised too."""
    model = converted if which == "torch" else exported.path
    common = {
        "store": stage_extract_store,
        "model": model,
        "batch_size": 7,
        "patch_tokens": True,
        "pca_map": False,
        "chunk_rows": 10,
    }
    serial = run_extract(cfg(**common, output=tmp_path / "serial.zarr", loader_threads=0))
    overlapped = run_extract(cfg(**common, output=tmp_path / "overlap.zarr", loader_threads=2, prefetch_batches=3))
    assert serial.backend == overlapped.backend == which
    a, b = _slides(serial.output), _slides(overlapped.output)
    assert sorted(a) == sorted(b) == sorted(serial.extracted) and len(a) == 2
    ds = TileDataset(stage_extract_store, image_format="numpy")
    for s, sid in enumerate(ds.slide_ids):
        assert sorted(a[sid]) == ["cls", "coords", "mean_patch", "patch", "slide_embedding"]
        for name in a[sid]:
            np.testing.assert_array_equal(a[sid][name], b[sid][name], err_msg=f"{sid}/{name}")
        if which == "torch":  # every row is the backbone's output for the store's tile at that row
            start = int(np.cumsum(np.r_[0, ds.tile_counts])[s])
            x = torch.from_numpy(normalise(ds.read_batch(np.arange(start, start + ds.tile_counts[s]))))
            with torch.no_grad():
                cls, _ = BackboneFeatures(load_backbone(converted)).eval()(x)
            np.testing.assert_allclose(b[sid]["cls"], cls.numpy(), atol=1e-5, rtol=0)


def _corrupt_tile(store, slide_id: str, row: int) -> None:
    """Overwrite the start of one stored tile (its zstd frame header) in its shard file, leaving the index intact."""
    import json

    tiles = store / "slides" / slide_id / "tiles"
    per_shard = json.loads((tiles / "zarr.json").read_text())["chunk_grid"]["configuration"]["chunk_shape"][0]
    (shard,) = [p for p in tiles.rglob("*") if p.is_file() and p.name != "zarr.json"]  # the sample slides: one shard
    assert row < per_shard
    data = bytearray(shard.read_bytes())
    index = np.frombuffer(bytes(data[-(per_shard * 16 + 4) : -4]), dtype="<u8").reshape(-1, 2)
    offset = int(index[row][0])
    data[offset : offset + 8] = b"\xff" * 8
    shard.write_bytes(bytes(data))


def test_a_read_error_in_a_background_batch_names_the_slide_and_leaves_no_half_written_slide(
    stage_extract_store, converted, tmp_path
) -> None:
    store = tmp_path / "tiles.zarr"
    shutil.copytree(stage_extract_store, store)
    ds = TileDataset(store, image_format="numpy")
    good, bad = ds.slide_ids
    _corrupt_tile(store, bad, 40)  # batch 5 of 8-tile batches: read ahead on a thread, after batches were written
    out = tmp_path / "f.zarr"
    with pytest.raises(WsidinoError, match=rf"tiles 40-47 of slide {bad} in tile store .* cannot be read"):
        run_extract(cfg(store=store, model=converted, output=out, batch_size=8, loader_threads=2, prefetch_batches=2))
    assert not (out / "slides" / bad).exists() and not (out / ".incoming" / bad).exists()
    assert not (pictures_dir(out) / bad / "pca.png").exists()
    assert zarr.open_group(str(out / "slides" / good), mode="r").attrs.asdict()[ATTRS_KEY]["complete"]


def test_tuned_ort_session_options_are_applied(exported) -> None:
    import os

    import onnxruntime as ort

    from dinov3_core.inference.onnx_runtime import ort_session

    opts = ort_session(exported.path).get_session_options()
    assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert opts.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert opts.intra_op_num_threads == len(os.sched_getaffinity(0))  # not ORT's 0 (= all physical cores)
    assert opts.inter_op_num_threads == 1
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert opts.enable_cpu_mem_arena and opts.enable_mem_pattern
    assert ort_session(exported.path, threads=1).get_session_options().intra_op_num_threads == 1


def test_gpu_code_paths_give_the_cpu_features_when_run_on_the_cpu(exported, converted, stage_extract_store) -> None:
    """The CUDA paths' code, run on the CPU: ORT I/O binding (outputs bound to a device, copied out) and the PyTorch
    uint8 path (tiles shipped as uint8, normalised on the device, patch mean taken there)."""
    from dinov3_core.inference.feature_model import TorchRunner, bound_runner, open_model
    from dinov3_core.inference.onnx_runtime import INPUT_NAME, ort_session

    tiles = TileDataset(stage_extract_store, image_format="numpy").read_batch(np.arange(5))
    x = normalise(tiles)
    session = ort_session(exported.path)
    want = session.run(None, {INPUT_NAME: x})
    for got, ref in zip(bound_runner(session, "cpu")(x), want, strict=True):
        np.testing.assert_array_equal(got, ref)
    model = open_model(converted, backend="torch")
    runner = TorchRunner(BackboneFeatures(load_backbone(converted)).eval(), torch.device("cpu"))
    cls, mean, patch = runner.infer_uint8(runner.prepare_uint8(tiles), keep_patch=True)
    ref_cls, ref_patch = model.run(x)
    np.testing.assert_allclose(cls, ref_cls, atol=1e-6, rtol=0)
    np.testing.assert_allclose(patch, ref_patch, atol=1e-6, rtol=0)
    np.testing.assert_allclose(mean, ref_patch.mean(1), atol=1e-6, rtol=0)
    assert runner.infer_uint8(runner.prepare_uint8(tiles), keep_patch=False)[2] is None
    assert model.prepare is normalise  # CPU: extract keeps numpy's normalise, so its features do not change


@pytest.mark.parametrize(
    ("key", "value"), [("loader_threads", -1), ("prefetch_batches", 0), ("num_threads", -2), ("precision", "fp8")]
)
def test_extract_config_rejects_bad_values(key, value) -> None:
    from dinov3_core.config import ConfigError

    with pytest.raises(ConfigError, match=key):
        cfg(store="s.zarr", model="m.onnx", output="f.zarr", **{key: value})


def test_bf16_is_refused_for_onnx(exported, stage_extract_store, tmp_path) -> None:
    with pytest.raises(WsidinoError, match="precision=bf16 is for the torch backend"):
        run_extract(cfg(store=stage_extract_store, model=exported.path, output=tmp_path / "f.zarr", precision="bf16"))


def test_pca_map_is_drawn_over_the_faded_slide(stage_extract_store, tmp_path) -> None:
    """The map's background is the tile store's QC thumbnail of the slide, faded, at the tiles' coordinates: tissue
    (darker) under the tiles, glass around; white where the store has no thumbnail."""
    from PIL import Image

    from dinov3_core.extract.feature_store import faded_thumbnail, write_pca_png
    from dinov3_core.tiling import store as ts

    ds = TileDataset(stage_extract_store, image_format="numpy")
    sid = ds.slide_ids[0]
    coords, attrs = ds.slide_coords(0), ds.slide_attrs(0)
    tile0, size = float(attrs["tile_size_level0"]), (attrs["level0_width"], attrs["level0_height"])
    thumbnail = ts.slide_dir(stage_extract_store, sid) / "qc_thumbnail.png"
    features = np.random.default_rng(0).normal(size=(len(coords), 16)).astype(np.float32)
    write_pca_png(tmp_path / "over.png", coords, features, tile0, 256, sid, thumbnail, size)
    write_pca_png(tmp_path / "white.png", coords, features, tile0, 256, sid, tmp_path / "none.png", size)
    over, white = np.asarray(Image.open(tmp_path / "over.png")), np.asarray(Image.open(tmp_path / "white.png"))
    scale = 256 / (float((coords.max(0) - coords.min(0)).max()) + tile0)
    side = max(1, round(tile0 * scale))
    xy = np.round((coords - coords.min(0)) * scale).astype(int)
    map_h, map_w = int(xy[:, 1].max()) + side, int(xy[:, 0].max()) + side
    tiles = np.zeros((map_h, map_w), bool)
    for x, y in xy:
        tiles[y : y + side, x : x + side] = True
    background = faded_thumbnail(thumbnail, size, coords.min(0), scale, (map_w, map_h))
    assert background is not None
    area_over, area_white = over[14 : 14 + map_h, :map_w], white[14 : 14 + map_h, :map_w]
    np.testing.assert_array_equal(area_over[tiles], area_white[tiles])  # the tiles: the same PCA colours
    np.testing.assert_array_equal(area_over[~tiles], background[~tiles])  # around them: the faded slide
    assert (area_white[~tiles] == 255).all() and (area_over[~tiles] < 250).any()
    assert background.min() >= 255 - 0.35 * 255 - 1, "faded: nothing darker than 35 % of black"
    # Aligned: what lies under the tiles is tissue, darker than the rest of the faded slide.
    grey = background.astype(float).mean(axis=-1)
    assert grey[tiles].mean() < grey[~tiles].mean() - 5
