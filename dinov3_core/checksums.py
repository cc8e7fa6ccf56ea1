"""Content checks of what the stages write, so a damaged file is found where it is used instead of being trained,
exported or promoted from.

Two kinds of record, both cheap to keep:

* **a file's digest** (`file_record` / `check_file`): size, mtime and SHA-256 of the whole file. SHA-256 because a
  registered model version carries it (`wsidino.sha256`) and anyone can recompute it with `sha256sum`.
* **a directory's checksums file** (`write_checksums` / `check_directory`): `checksums.json` beside the files of a
  DCP checkpoint, one CRC-32C per file (Castagnoli, hardware-accelerated by google-crc32c: a multi-GB checkpoint is
  checked in seconds; it guards against corruption, not against an adversary, which SHA-256 is for).

"Cheap first": a check compares size and mtime and reads the content only when they differ, unless `full` asks
for it (model files always; a checkpoint about to be resumed from).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import google_crc32c

CHECKSUMS = "checksums.json"
_CHUNK = 1 << 22  # 4 MiB reads
MODEL_SUFFIXES = (".pth", ".pt", ".onnx", ".safetensors", ".data")  # always fully hashed when checked
# Files this small are hashed on every check: a record (evaluation.json) edited at the same size with its mtime put
# back is found, at the cost of reading a few kB.
ALWAYS_HASHED_BYTES = 1 << 20


_SEEN: dict[tuple[Any, ...], str] = {}  # this process's digests, by file identity and change time


def sha256(path: Path) -> str:
    """SHA-256 of the file's content. Within one process a file is read once: a no-op pipeline rerun checks a model
    file where it is written and again where each later stage reads it. Keyed on inode, size, mtime and ctime, and
    ctime cannot be set back by hand, so a file rewritten in between is read again."""
    st = path.stat()
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _SEEN:
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        _SEEN[key] = h.hexdigest()
    return _SEEN[key]


def crc32c(path: Path) -> str:
    c = google_crc32c.Checksum()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            c.update(chunk)
    return c.hexdigest().decode()


def _stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


# ------------------------------------------------------------------------------------------------- one file


def file_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a stage manifest keeps of one file it wrote: path, size, mtime and SHA-256."""
    p = Path(path).resolve()
    size, mtime = _stat(p)
    return {"path": str(p), "size": size, "mtime_ns": mtime, "sha256": sha256(p)}


def check_file(record: Mapping[str, Any], *, full: bool | None = None) -> str | None:
    """Why the file no longer is the one recorded (None: it is). `full` None: always for model files and small
    files (`ALWAYS_HASHED_BYTES`), else only when size or mtime changed."""
    p = Path(record["path"])
    if not p.is_file():
        return f"{p} is missing"
    size, mtime = _stat(p)
    if size != record["size"]:
        return f"{p} has {size} bytes, {record['size']} were written"
    if full is None:
        full = p.suffix in MODEL_SUFFIXES or size <= ALWAYS_HASHED_BYTES
    if not full and mtime == record["mtime_ns"]:
        return None
    if sha256(p) != record["sha256"]:
        return f"{p}: its content differs from what was written (SHA-256)"
    return None


# --------------------------------------------------------------------------------------- a directory of files


def write_checksums(directory: str | os.PathLike[str], exclude: Iterable[str] = ()) -> Path:
    """`<directory>/checksums.json`: size, mtime and CRC-32C of every file in it (recursively)."""
    root = Path(directory)
    skip = {CHECKSUMS, *exclude}
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name not in skip:
            size, mtime = _stat(p)
            files[str(p.relative_to(root))] = {"size": size, "mtime_ns": mtime, "crc32c": crc32c(p)}
    out = root / CHECKSUMS
    tmp = out.with_name(f".{CHECKSUMS}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"algorithm": "crc32c", "files": files}, indent=1))
    os.replace(tmp, out)
    return out


def has_checksums(directory: str | os.PathLike[str]) -> bool:
    return (Path(directory) / CHECKSUMS).is_file()


def _read_checksums(root: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the checksums document, None) or (None, why there is none to check against)."""
    path = root / CHECKSUMS
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"{path} is missing"
    except (OSError, ValueError) as err:
        return None, f"{path} is unreadable ({err})"
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        return None, f'{path} is not a checksums file (no "files" object)'
    return doc, None


def unverifiable(directory: str | os.PathLike[str]) -> str | None:
    """Why `directory` cannot be verified (its checksums file is missing or unreadable); None: it can be."""
    return _read_checksums(Path(directory))[1]


def check_directory(directory: str | os.PathLike[str], *, full: bool = False) -> list[str]:
    """What differs from `checksums.json` (empty: every recorded file is intact). `full`: read every file; else
    only the files whose size or mtime changed. A directory without a readable checksums file is reported as such:
    damage there could not be seen, so it never counts as intact."""
    root = Path(directory)
    doc, missing = _read_checksums(root)
    if doc is None:
        return [str(missing)]
    problems = []
    for name, rec in doc["files"].items():
        p = root / name
        if not p.is_file():
            problems.append(f"{p} is missing")
            continue
        size, mtime = _stat(p)
        if size != rec["size"]:
            problems.append(f"{p} has {size} bytes, {rec['size']} were written")
        elif (full or mtime != rec["mtime_ns"]) and crc32c(p) != rec["crc32c"]:
            problems.append(f"{p}: its content differs from what was written (CRC-32C)")
    return problems


# ------------------------------------------------------------------------------- a stage's outputs (its manifest)


def record_artifacts(outputs: Mapping[str, str | os.PathLike[str]]) -> dict[str, dict[str, Any]]:
    """Content records of a stage's outputs: every file's SHA-256, every checkpoint directory's checksums file
    (other directories, tile and feature stores, are fingerprinted by their own manifests)."""
    records: dict[str, dict[str, Any]] = {}
    for name, path in outputs.items():
        p = Path(path)
        if p.is_file():
            records[name] = file_record(p)
        elif p.is_dir() and has_checksums(p):
            records[name] = {"path": str(p.resolve()), "checksums": file_record(p / CHECKSUMS)}
    return records


def check_artifacts(
    records: Mapping[str, Mapping[str, Any]], *, within: str | os.PathLike[str] | None = None, full: bool = False
) -> list[str]:
    """What is no longer as recorded (empty: all intact), for every record (or those at or under `within`)."""
    root = Path(within).resolve() if within is not None else None
    problems: list[str] = []
    for record in records.values():
        path = Path(record["path"])
        if root is not None and path != root and root not in path.parents:
            continue
        if "checksums" in record:  # a checkpoint directory: its checksums file, then the files it lists
            said = check_file(record["checksums"], full=True)
            problems += [said] if said else check_directory(path, full=full)
        else:
            said = check_file(record, full=True if full else None)
            if said:
                problems.append(said)
    return problems


__all__ = [
    "ALWAYS_HASHED_BYTES",
    "CHECKSUMS",
    "MODEL_SUFFIXES",
    "check_artifacts",
    "check_directory",
    "check_file",
    "crc32c",
    "file_record",
    "has_checksums",
    "record_artifacts",
    "sha256",
    "unverifiable",
    "write_checksums",
]
