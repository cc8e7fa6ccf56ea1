"""Tiles as QuPath objects: the GeoJSON QuPath imports (*File › Import objects*). Extract writes the tiles' clusters,
evaluate the probe's predictions; reading QuPath's annotation exports is `dinov3_core.evaluate.geojson`."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

# Distinct colours for up to 12 clusters (Tableau 10 + 2), as QuPath draws classes.
PALETTE = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
    (0, 0, 128),
    (128, 128, 0),
)


def write_qupath_tiles(
    path: Path,
    coords: np.ndarray,
    tile_level0: float,
    classes: list[str],
    labels: np.ndarray,
    measurements: dict[str, np.ndarray],
    colours: Mapping[str, Sequence[int]] | None = None,
) -> None:
    """Tiles as QuPath detections (File > Import objects, or drag the file onto the slide): one square per tile at
    its level-0 coordinates, classified `classes[labels[i]]` in its colour from `colours` (class → RGB: the lab's
    annotations', so a prediction looks like the annotation of its class) or else from `PALETTE`, with
    `measurements` (name → one value per tile) in QuPath's measurement list."""
    size = float(tile_level0)
    given = colours or {}
    rgb = [list(given.get(c) or PALETTE[k % len(PALETTE)])[:3] for k, c in enumerate(classes)]
    features = []
    for i, (x, y) in enumerate(np.asarray(coords, dtype=np.float64)):
        ring = [[x, y], [x + size, y], [x + size, y + size], [x, y + size], [x, y]]
        label = int(labels[i])
        features.append(
            {
                "type": "Feature",
                "geometry": {"type": "Polygon", "coordinates": [ring]},
                "properties": {
                    "objectType": "detection",
                    "classification": {"name": classes[label], "color": rgb[label]},
                    "measurements": {name: round(float(values[i]), 6) for name, values in measurements.items()},
                },
            }
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.incoming")
    partial.write_text(json.dumps({"type": "FeatureCollection", "features": features}))
    os.replace(partial, path)


__all__ = ["PALETTE", "write_qupath_tiles"]
