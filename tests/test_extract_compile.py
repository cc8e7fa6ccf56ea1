"""extract with `compile=true`: the backbone through torch.compile (Inductor), one graph for every batch of a store
whose slides end in a partial batch, and the features of the eager model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

from dinov3_core.config import ConfigError, load_config
from dinov3_core.data.tile_dataset import TileDataset
from dinov3_core.errors import WsidinoError
from dinov3_core.extract.config import ExtractConfig
from dinov3_core.extract.extract import run_extract


def cfg(**values) -> ExtractConfig:
    return load_config(
        ExtractConfig, "default", {"progress": False, **{k: str(v) for k, v in values.items()}}, stage="extract"
    )


def _partial_batch_size(counts: np.ndarray) -> int:
    """A batch size smaller than every slide that leaves every slide's last batch partial."""
    return next(b for b in range(5, int(counts.min())) if np.all(counts % b))


def test_compiled_extraction_matches_eager_without_recompiling_for_the_last_batch(
    stage_extract_store, converted, tmp_path
) -> None:
    counts = TileDataset(stage_extract_store, image_format="numpy").tile_counts
    batch = _partial_batch_size(counts)
    common = {
        "store": stage_extract_store,
        "model": converted,
        "batch_size": batch,
        "device": "cpu",
        "pca_map": False,
        "patch_tokens": True,
    }
    eager = run_extract(cfg(output=tmp_path / "eager.zarr", **common))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):  # a second graph for the partial batch raises
        compiled = run_extract(cfg(output=tmp_path / "compiled.zarr", compile=True, **common))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()
    a = zarr.open_group(str(eager.output), mode="r")["slides"]
    b = zarr.open_group(str(compiled.output), mode="r")["slides"]
    assert sorted(compiled.extracted) == sorted(eager.extracted) and len(eager.extracted) == 2
    for sid in eager.extracted:
        for name in ("cls", "mean_patch", "patch"):
            x, y = a[sid][name][:], b[sid][name][:]
            assert x.shape == y.shape and x.shape[0] in counts
            x, y = x.reshape(len(x), -1), y.reshape(len(y), -1)
            cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
            # Inductor on the CPU may reorder float ops (fused reductions): close, not bit-identical
            assert cos.min() > 0.9999, (sid, name, cos.min())
            np.testing.assert_allclose(y, x, atol=1e-3, rtol=0)


def test_compile_is_refused_for_onnx(exported, stage_extract_store, tmp_path) -> None:
    from dinov3_core.inference.feature_model import open_model

    with pytest.raises(ConfigError, match=r"^compile: applies to \.pth / \.safetensors models"):
        cfg(store=stage_extract_store, model=exported.path, output=tmp_path / "f.zarr", compile=True)
    with pytest.raises(ConfigError, match="compile"):
        cfg(store=stage_extract_store, model=exported.path, output=tmp_path / "f.zarr", compile=True, backend="onnx")
    with pytest.raises(WsidinoError, match=r"compile=true applies to \.pth / \.safetensors"):
        open_model(exported.path, compile=True)
