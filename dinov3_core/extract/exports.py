"""Features in other tools' formats, written beside the feature store: per-slide `.h5` for MIL code (TRIDENT / CLAM
layout); QuPath's GeoJSON is `dinov3_core.qupath`. Each file is written under a temporary name and renamed, so a
half-written file never has the final name."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from dinov3_core.tiling import store as ts


def h5_dir(output: str | os.PathLike[str]) -> Path:
    """Where `format=both` writes the per-slide .h5 files: beside the store (features.zarr → features_h5/)."""
    out = Path(output)
    return out.parent / f"{out.stem if out.suffix == '.zarr' else out.name}_h5"


def write_h5(
    path: Path,
    slide_id: str,
    features: np.ndarray,
    coords: np.ndarray,
    tile_attrs: dict[str, Any],
    tile_size: int,
    model: dict[str, Any],
) -> None:
    """One slide's features as TRIDENT / CLAM write them (h5py reads them as those tools do), written to a temporary
    name and renamed, so a half-written file never has the final name."""
    import h5py

    mpp = tile_attrs.get("mpp_effective") or tile_attrs.get("mpp_requested")
    level0_mpp = tile_attrs.get("level0_mpp")
    stride = tile_attrs.get("stride") or tile_size
    coord_attrs = {
        "name": slide_id,
        "patch_size": int(tile_size),  # px at the tiles' µm/px
        "patch_size_level0": int(tile_attrs.get("tile_size_level0") or tile_size),  # px at the slide's level 0
        "patch_level": int(tile_attrs.get("level_used") or 0),
        "overlap": int(tile_size - stride),
        "mpp": float(mpp) if mpp else -1.0,
        # Magnification by the usual convention 10 / (µm/px): 0.5 µm/px is 20×; -1 when the slide has no µm/px.
        "target_magnification": round(10.0 / mpp, 2) if mpp else -1,
        "level0_magnification": round(10.0 / level0_mpp, 2) if level0_mpp else -1,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.incoming")
    with h5py.File(partial, "w") as f:
        f.create_dataset("features", data=np.asarray(features, dtype=np.float32))
        c = f.create_dataset("coords", data=np.asarray(coords, dtype=np.int64))
        c.attrs.update(coord_attrs)
        f.attrs.update({"slide_id": slide_id, "created": ts.utc_now(), **model})
    os.replace(partial, path)


def cluster_tiles(features: np.ndarray, k: int, seed: int = 0) -> np.ndarray:
    """k-means cluster of each tile's CLS feature within its slide (ids are not comparable across slides)."""
    from sklearn.cluster import KMeans

    k = max(1, min(k, len(features)))
    return KMeans(n_clusters=k, n_init=3, random_state=seed).fit_predict(np.asarray(features, dtype=np.float64))


__all__ = ["cluster_tiles", "h5_dir", "write_h5"]
