"""Which slides a tile run covers, their ids, and which are already complete in the store.

Inputs name slides as a directory (searched recursively), a glob, one file, or a .txt/.csv list; ids are file
stems made unique; a slide is up to date when the store holds it complete from the same file content and the same
tiling parameters. Used by the tile engine and by the stage manifest's input fingerprint of listed slides.
"""

from __future__ import annotations

import glob
import hashlib
from collections.abc import Iterable
from pathlib import Path

from dinov3_core.config import ConfigError
from dinov3_core.tiling import store as ts
from dinov3_core.tiling.config import TileConfig
from dinov3_core.tiling.plan import SlideTask, slide_params_hash
from dinov3_core.tiling.slide import file_fingerprint, override_for


def discover_slides(spec: str, extensions: Iterable[str]) -> list[Path]:
    """Slides named by a directory (recursive), a glob, a single file, or a .txt/.csv list of paths.

    Paths listed in a list file are returned even when missing, so that they fail individually and visibly.
    """
    exts = {e.lower() for e in extensions}
    path = Path(spec).expanduser()
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in exts)
    elif path.is_file() and path.suffix.lower() in {".txt", ".csv"}:
        found = _read_slide_list(path)
    elif path.is_file():
        found = [path]
    elif any(ch in spec for ch in "*?["):
        found = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
    else:
        raise ConfigError(f"input {spec!r} does not exist; give a directory, a glob, a slide file or a list file")
    if not found:
        raise ConfigError(f"no slides found for input {spec!r} (extensions: {', '.join(sorted(exts))})")
    return found


def _read_slide_list(path: Path) -> list[Path]:
    lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if path.suffix.lower() == ".csv" and lines and lines[0].split(",")[0].strip().lower() in {"path", "slide"}:
        lines = [ln.split(",")[0].strip() for ln in lines[1:]]
    return [(path.parent / p if not Path(p).is_absolute() else Path(p)) for p in lines]


def assign_slide_ids(paths: Iterable[Path]) -> list[SlideTask]:
    """The file stem, made unique with a short hash of the path when two inputs share a stem."""
    paths = list(paths)
    stems: dict[str, int] = {}
    for p in paths:
        stems[p.stem] = stems.get(p.stem, 0) + 1
    tasks = []
    for p in paths:
        slide_id = p.stem
        if stems[p.stem] > 1:
            slide_id = f"{p.stem}-{hashlib.sha256(str(p.resolve()).encode()).hexdigest()[:8]}"
        tasks.append(SlideTask(slide_id=slide_id, path=p))
    return tasks


def is_up_to_date(root: Path, task: SlideTask, cfg: TileConfig, overrides: dict[str, float]) -> bool:
    """True when the store holds this slide complete, from the same file content and tiling parameters."""
    if task.slide_id not in ts.complete_slide_ids(root) or not task.path.is_file():
        return False
    attrs = ts.read_slide_attrs(root, task.slide_id)
    if not attrs.get("complete"):
        return False
    size, fingerprint = file_fingerprint(task.path)
    override = override_for(task.path, overrides)
    return (
        attrs.get("source_fingerprint") == fingerprint
        and attrs.get("source_size") == size
        and attrs.get("params_hash") == slide_params_hash(cfg, override)
    )
