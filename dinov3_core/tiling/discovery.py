"""Which slides a tile run covers, their ids, and which are already complete in the store.

Inputs name slides as a directory (searched recursively), a glob, one file, or a .txt/.csv list; ids are file
stems made safe and unique (`slide_id_for`); a slide is up to date when the store holds it complete from the same
file content and the same tiling parameters. `find_repeats` recognises inputs that hold no slide of their own: a
byte-identical copy of another input, or one more file of a DICOM slide, so that the same tissue is tiled once
(and cannot land in both a training and a test split); of copies, the one the store already holds keeps its id, so
an id once in the store never moves to a copy added later. Used by the tile engine and by the stage manifest's input
fingerprint of listed slides.
"""

from __future__ import annotations

import glob
import hashlib
import os
import unicodedata
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dinov3_core.config import ConfigError
from dinov3_core.tiling import store as ts
from dinov3_core.tiling.config import TileConfig
from dinov3_core.tiling.plan import SlideTask, slide_params_hash
from dinov3_core.tiling.slide import file_fingerprint, override_for

# Longest slide id in UTF-8 bytes: a file name may be 255 bytes, and the store adds suffixes to ids under
# `.incoming/`; an id this long is unreadable anyway.
MAX_ID_BYTES = 128
HASH_CHARS = 8
# Unicode categories never kept in an id: control characters (newline, NUL, \x01), format characters (bidi
# overrides that make an id print as another), undecodable bytes (lone surrogates) and line/paragraph separators.
_UNSAFE_CATEGORIES = {"Cc", "Cf", "Cs", "Zl", "Zp"}
DICOM_SUFFIX = ".dcm"


def discover_slides(spec: str, extensions: Iterable[str]) -> list[Path]:
    """Slides named by a directory (recursive), a glob, a single file, or a .txt/.csv list of paths.

    Paths listed in a list file are returned even when missing, and a directory's symlink loops, broken links and
    unreadable subdirectories are returned too, so that each fails individually and visibly (a row naming it)
    instead of vanishing. A path named twice is returned once.
    """
    exts = {e.lower() for e in extensions}
    path = Path(spec).expanduser()
    if path.is_dir():
        found = _walk(path, exts)
    elif path.is_file() and path.suffix.lower() in {".txt", ".csv"}:
        found = _read_slide_list(path)
    elif path.is_file() or path.is_symlink():  # a link to nothing (or a loop): its row says so
        found = [path]
    elif any(ch in spec for ch in "*?["):
        found = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if not Path(p).is_dir())
    else:
        raise ConfigError(f"input {spec!r} does not exist; give a directory, a glob, a slide file or a list file")
    if not found:
        raise ConfigError(f"no slides found for input {spec!r} (extensions: {', '.join(sorted(exts))})")
    return list(dict.fromkeys(found, None))  # Path equality is lexical: the same path listed twice is one input


def _walk(top: Path, exts: set[str]) -> list[Path]:
    """Files under `top` with a slide extension, plus what cannot be looked into: entries that are neither file nor
    directory by the time they are stat'ed (symlink loops, broken links) and subdirectories that cannot be listed.
    Symlinked directories are not descended into (as before, with `rglob`): a link back up would loop."""
    unlisted: list[Path] = []

    def onerror(err: OSError) -> None:
        if Path(err.filename) == top:
            raise ConfigError(
                f"cannot list the input directory {str(top)!r} ({err.strerror}); check its permissions"
            ) from None
        unlisted.append(Path(err.filename))

    found = []
    for dirpath, _, filenames in os.walk(top, onerror=onerror):
        for name in filenames:  # os.walk puts everything that is not a directory here, loops included
            p = Path(dirpath) / name
            if p.suffix.lower() in exts:
                found.append(p)
    return sorted(found + unlisted)


def _read_slide_list(path: Path) -> list[Path]:
    lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    if path.suffix.lower() == ".csv" and lines and lines[0].split(",")[0].strip().lower() in {"path", "slide"}:
        lines = [ln.split(",")[0].strip() for ln in lines[1:]]
    return [(path.parent / p if not Path(p).is_absolute() else Path(p)) for p in lines]


def _short_hash(text: str) -> str:
    # surrogatepass: a file name with undecodable bytes still hashes, always to the same value
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_CHARS]


def _clip(text: str, max_bytes: int) -> str:
    """`text` cut to at most `max_bytes` of UTF-8, on a character boundary."""
    return text.encode("utf-8")[:max_bytes].decode("utf-8", "ignore")


def safe_slide_id(name: str) -> str:
    """`name` as a slide id that is safe as one directory name under the store's `slides/`.

    A plain name (e.g. `tissue_20x`) is returned unchanged, so stores tiled before keep their ids. Otherwise the
    unsafe characters (path separators, control and format characters, undecodable bytes) become `_`, leading
    dots are dropped (no `.`, `..` nor hidden directory), the result is cut to `MAX_ID_BYTES` and a short hash of
    the original name is appended, so two names that clean up alike still differ and a rerun finds the same id:
    `..` → `slide-<hash8>`, `.svs` → `svs-<hash8>`, `a\\nb` → `a_b-<hash8>`.
    """
    cleaned = "".join(
        "_" if ch in "/\\" or unicodedata.category(ch) in _UNSAFE_CATEGORIES else ch for ch in name
    ).lstrip(".")
    if cleaned == name and name and len(name.encode("utf-8")) <= MAX_ID_BYTES:
        return name
    base = _clip(cleaned, MAX_ID_BYTES - HASH_CHARS - 1) or "slide"
    return f"{base}-{_short_hash(name)}"


def dicom_openers(paths: Iterable[Path]) -> dict[Path, Path]:
    """For each folder holding `.dcm` inputs, the one file its DICOM slide is opened from: the first in path order.
    OpenSlide reads one DICOM slide a folder and finds its other files (levels, frame sets) itself."""
    openers: dict[Path, Path] = {}
    for p in sorted(paths, key=str):
        if p.suffix.lower() == DICOM_SUFFIX:
            openers.setdefault(p.absolute().parent, p)
    return openers


def assign_slide_ids(paths: Iterable[Path]) -> list[SlideTask]:
    """Each path's safe id (`safe_slide_id` of its stem, or of its folder's name for the file a DICOM slide is
    opened from: DICOM file names are often just frame numbers), made unique with a short hash of the path when
    two inputs share it."""
    paths = list(paths)
    openers = set(dicom_openers(paths).values())
    base = [safe_slide_id(p.parent.name if p in openers and p.parent.name else p.stem) for p in paths]
    counts: dict[str, int] = defaultdict(int)
    for slide_id in base:
        counts[slide_id] += 1
    tasks, taken = [], set()
    for p, slide_id in zip(paths, base, strict=True):
        if counts[slide_id] > 1:
            slide_id = _with_hash(slide_id, str(p.resolve()))
        if slide_id in taken:  # two names of one resolved file (a symlink beside its target)
            slide_id = _with_hash(slide_id, str(p.absolute()))
        taken.add(slide_id)
        tasks.append(SlideTask(slide_id=slide_id, path=p))
    return tasks


def _with_hash(slide_id: str, text: str) -> str:
    return f"{_clip(slide_id, MAX_ID_BYTES - HASH_CHARS - 1)}-{_short_hash(text)}"


# ------------------------------------------------------------------------------------- one slide, several inputs


@dataclass(frozen=True)
class Repeat:
    """An input that is not tiled because another input (`of`) already covers its tissue; `why` says how."""

    task: SlideTask
    of: SlideTask
    why: str


def find_repeats(
    tasks: Sequence[SlideTask],
    held: Callable[[SlideTask], bool] | None = None,
    notes: dict[str, str] | None = None,
) -> tuple[list[SlideTask], list[Repeat]]:
    """The tasks to tile, and the inputs they already cover: the further files of a DICOM slide (every `.dcm`
    file of one folder is one slide, opened from the first in path order), then byte-identical copies (same size,
    same SHA-256). Of copies, the one kept is the first in path order that the store already `held` (under its id,
    from this content), else the first in path order: an id once in the store never moves to a copy added later.
    Copies the store already holds under ids of their own all stay tasks (they are up to date; nothing is removed),
    each with an entry in `notes` (id → note) naming the others. Files that cannot be read stay tasks: their rows
    say why."""
    order = sorted(tasks, key=lambda t: str(t.path))
    openers = dicom_openers(t.path for t in tasks)
    opener_task = {t.path: t for t in tasks if t.path in openers.values()}
    repeats: list[Repeat] = []
    kept: list[SlideTask] = []
    for task in order:
        if task.path.suffix.lower() == DICOM_SUFFIX:
            first = opener_task[openers[task.path.absolute().parent]]
            if first is not task:
                why = f"{task.path}: one more file of the DICOM slide opened from {first.path} (one slide a folder)"
                repeats.append(Repeat(task, first, why))
                continue
        kept.append(task)
    # Cheap first: only files of equal size and equal first and last MiB (`file_fingerprint`) are read whole.
    candidates: dict[tuple[int, str], list[SlideTask]] = defaultdict(list)
    for task in kept:
        fingerprint = _fingerprint(task.path)
        if fingerprint is not None:
            candidates[fingerprint].append(task)
    copies: set[str] = set()
    for alike in candidates.values():
        by_digest: dict[str, list[SlideTask]] = defaultdict(list)
        for task in alike if len(alike) > 1 else ():
            digest = _content_digest(task.path)
            if digest is not None:
                by_digest[digest].append(task)
        for same in by_digest.values():
            stored = [t for t in same if held is not None and _holds(held, t)]
            first = (stored or same)[0]
            for task in same:
                if task in stored:
                    if len(stored) > 1 and notes is not None:
                        others = ", ".join(str(t.path) for t in stored if t is not task)
                        notes[task.slide_id] = (
                            f"{task.path}: byte-identical to {others}, already in the store under its own id; "
                            "kept under both (an id in the store never moves): remove one file and re-tile into a "
                            "new store to hold the tissue once"
                        )
                    continue
                if task is not first:
                    why = f"{task.path}: byte-identical to {first.path} (slide {first.slide_id}); tiled once"
                    repeats.append(Repeat(task, first, why))
                    copies.add(task.slide_id)
    kept_ids = {t.slide_id for t in kept} - copies
    return [t for t in tasks if t.slide_id in kept_ids], repeats


def _holds(held: Callable[[SlideTask], bool], task: SlideTask) -> bool:
    try:
        return held(task)
    except (OSError, ValueError, KeyError):  # an unreadable store entry holds nothing we can keep
        return False


def holds_content(root: Path, task: SlideTask) -> bool:
    """True when the store holds `task`'s id complete, tiled from the file content `task.path` has now (the
    tiling parameters may differ: a re-tiling keeps the id)."""
    if task.slide_id not in ts.complete_slide_ids(root):
        return False
    attrs = ts.read_slide_attrs(root, task.slide_id)
    size, fingerprint = file_fingerprint(task.path)
    return bool(attrs.get("complete")) and (attrs.get("source_size"), attrs.get("source_fingerprint")) == (
        size,
        fingerprint,
    )


def _fingerprint(path: Path) -> tuple[int, str] | None:
    """`file_fingerprint` of a regular file, None for anything else or a file that cannot be read (it fails later,
    with a row saying why)."""
    try:
        return file_fingerprint(path) if path.is_file() else None
    except OSError:
        return None


def _content_digest(path: Path) -> str | None:
    """SHA-256 of the whole file (what proves two files equal), or None when it cannot be read."""
    try:
        with open(path, "rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError:
        return None


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
