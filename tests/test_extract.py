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
from dinov3_core.export.config import ExtractConfig
from dinov3_core.export.extract import ATTRS_KEY, normalise, pictures_dir, run_extract
from dinov3_core.export.onnx_export import BackboneFeatures, load_backbone


def cfg(**values) -> ExtractConfig:
    return load_config(ExtractConfig, "default", {"progress": False, **{k: str(v) for k, v in values.items()}},
                       stage="extract")  # fmt: skip


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
    result = run_extract(cfg(store=stage_extract_store, model=exported.path, output=tmp_path / "f.zarr",
                             patch_tokens=True, batch_size=7))  # fmt: skip
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
    got = [run_extract(cfg(store=stage_extract_store, model=converted, output=out, num_shards=2, shard_index=i))
           for i in (0, 1)]  # fmt: skip
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
    cmd = [sys.executable, "-m", "dinov3_core.cli", "extract", "--store", str(stage_extract_store), "--model",
           str(converted), "--output", str(tmp_path / "f.zarr"), "progress_every_s=0", "batch_size=16",
           "tracking.enabled=false"]  # fmt: skip
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
    with Progress("extract", unit="tile", total=10, every_s=0, stream=io.StringIO(), log=seen.append,
                  callback=lambda d, t: calls.append((d, t))) as p:  # fmt: skip
        p.update(4)
        p.update(6)
    assert seen[0].startswith("extract: 4/10 tiles (40 %), ") and "tiles/s, ETA 0:00:" in seen[0]
    assert seen[-1].startswith("extract: 10/10 tiles (100 %)") and " in 0:00:" in seen[-1]
    assert calls == [(4, 10), (10, 10)]
