"""Stage manifests: what a stage run consumed and produced, so a rerun with the same inputs can skip it.

Every stage run writes `stage_manifest.json` into its output directory (or `<file>.stage_manifest.json` beside a
single-file output such as `model.onnx`):

    {"format": "wsidino-stage-manifest", "stage": "export", "status": "complete",
     "config_hash": "…", "inputs": {"weights": {"path": "…/backbone.pth", "fingerprint": "…"}},
     "outputs": {"onnx": "…/model.onnx"}, "output_fingerprint": "…", "mlflow_run_id": "…",
     "lineage": {"convert": "<run id>", "gram": "<run id>", "pretrain": "<run id>", "tile": "<run id>"}, …}

A stage is up to date when its manifest is `complete`, the config hash and every input fingerprint match, and
the recorded outputs exist and are what was written: `artifacts` keeps the SHA-256 of every file output and the
checksums file of every checkpoint directory (`dinov3_core.checksums`), checked on every skip decision (size and
mtime first, the content when they differ, always for model files) and wherever another stage reads them
(`fingerprint`): a damaged output makes its stage run again, saying why, and a replaced input is refused.
A training stage's checkpoint records outlive the next run's `running` manifest (`checkpoints`), so a resume can
tell a checkpoint whose checksums file was rewritten (`checkpoint_records`).

An input produced by another stage is fingerprinted by that stage's manifest (`output_fingerprint`: the
producer's config, inputs and output content), so a downstream stage reruns exactly when what it reads changed.
Other inputs are fingerprinted from file sizes and content samples (no full hashing of multi-GB files the project
did not write). `lineage` carries the MLflow run ids of every upstream stage (features → model → training → tiles).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from dinov3_core import locks
from dinov3_core.checksums import check_artifacts
from dinov3_core.errors import OutputBusy, WsidinoError, disk_full, is_disk_full
from dinov3_core.files import write_text_atomic

MANIFEST_NAME = "stage_manifest.json"
FORMAT = "wsidino-stage-manifest"
Status = Literal["running", "complete", "failed"]

_SAMPLE = 1 << 20  # bytes hashed at each end of a file


class ManifestError(WsidinoError):
    """A stage input is missing or a manifest is unreadable."""


def manifest_path(output: str | os.PathLike[str], *, is_dir: bool) -> Path:
    """Where the manifest of a stage writing `output` lives (inside a directory output, beside a file output)."""
    out = Path(output)
    return out / MANIFEST_NAME if is_dir else out.with_name(f"{out.name}.{MANIFEST_NAME}")


@dataclass
class StageManifest:
    stage: str
    status: Status
    config_hash: str
    inputs: dict[str, dict[str, str]]  # name → {"path", "fingerprint"}
    outputs: dict[str, str] = field(default_factory=dict)  # name → path
    artifacts: dict[str, dict[str, Any]] = field(default_factory=dict)  # output name → its content record
    # Checkpoint directories' records from the last complete run, kept while a later run is running or failed: the
    # runner rewrites the manifest before training starts, and the resume checks the checkpoint it picks against them.
    checkpoints: dict[str, dict[str, Any]] = field(default_factory=dict)  # resolved directory → its checksums record
    output_fingerprint: str | None = None  # set on completion; what downstream stages record as our fingerprint
    mlflow_run_id: str | None = None
    lineage: dict[str, str] = field(default_factory=dict)  # upstream stage → its MLflow run id
    summary: dict[str, Any] = field(default_factory=dict)  # small JSON-able figures (tiles, iterations, errors)
    error: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    host: str = field(default_factory=socket.gethostname)
    format: str = FORMAT
    version: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, default=str)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> StageManifest:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in doc.items() if k in known})


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def read_manifest(path: str | os.PathLike[str]) -> StageManifest | None:
    """The manifest at `path`, or None when there is none (a half-written one cannot exist: writes are atomic)."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # UnicodeDecodeError is a ValueError: name the file either way
        raise ManifestError(f"{p}: unreadable stage manifest ({err}); delete it to rerun the stage") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{p}: not a stage manifest (a JSON object was expected); delete it to rerun the stage")
    if doc.get("format") != FORMAT:
        return None
    return StageManifest.from_dict(doc)


def write_manifest(path: str | os.PathLike[str], manifest: StageManifest) -> Path:
    """Write atomically (temporary name, then rename): a reader never sees half a manifest. A manifest that is not
    complete keeps the checkpoint records of the one it replaces (`checkpoints`)."""
    if manifest.status != "complete" and not manifest.checkpoints:
        manifest = replace(manifest, checkpoints=checkpoint_records(path))
    return write_text_atomic(path, manifest.to_json())


def checkpoint_records(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Resolved checkpoint directory → the record of its checksums file, from the manifest at `path` ({} without
    one): what the last complete run of that stage wrote, for a resume to compare the checkpoint's own file with."""
    found = read_manifest(path)
    if found is None:
        return {}
    written = {r["path"]: r["checksums"] for r in found.artifacts.values() if "checksums" in r}
    return {**found.checkpoints, **written}


@contextlib.contextmanager
def output_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """One run per stage output at a time (a scheduled and a manual run must never train into one directory):
    a `flock` on `.<manifest name>.lock` beside the manifest.

    Raises:
        OutputBusy: Another process holds the lock (its pid and host are named).
        ManifestError: The output's folder cannot be created or written (a read-only disk, no permission).
    """
    p = Path(path)
    lock = p.with_name(f".{p.name}.lock")
    try:  # the first write of a run: a folder it cannot write is named here, before anything else happens
        p.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()
    except OSError as err:
        if is_disk_full(err):
            raise disk_full(err, p.parent) from None
        where = err.filename if isinstance(err.filename, str) else p.parent
        raise ManifestError(
            f"{where}: cannot write there ({err.strerror or err}); choose an output on a writable file system, "
            "or make it writable, then rerun"
        ) from None

    def busy(holder: str) -> OutputBusy:
        return OutputBusy(f"{p.parent} is being written by {holder}; wait for that run to finish or cancel it")

    with locks.exclusive(lock, busy):
        yield


# ---------------------------------------------------------------------------------------------- fingerprints


def _sha(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def file_fingerprint(path: Path) -> str:
    """Size plus SHA-256 of the first and last MiB: catches replaced or rewritten files without reading GBs."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(_SAMPLE))
        if size > _SAMPLE:
            f.seek(max(_SAMPLE, size - _SAMPLE))
            h.update(f.read(_SAMPLE))
    return "file:" + h.hexdigest()[:20]


def producer_manifest(path: str | os.PathLike[str]) -> StageManifest | None:
    """The complete manifest of the stage that produced `path`: a directory output (its own manifest), a file
    output (`<file>.stage_manifest.json`), or a file listed among a directory stage's outputs (backbone.pth in
    the convert directory)."""
    p = Path(path)
    if p.is_dir():
        found = read_manifest(p / MANIFEST_NAME)
    else:
        found = read_manifest(manifest_path(p, is_dir=False))
        if found is None:
            found = read_manifest(p.parent / MANIFEST_NAME)
            if found is not None and str(p.resolve()) not in {str(Path(v).resolve()) for v in found.outputs.values()}:
                found = None
    return found if found is not None and found.status == "complete" and found.output_fingerprint else None


def _tile_store_fingerprint(store: Path) -> str | None:
    manifest = store / "manifest.json"
    if not manifest.is_file():
        return None
    doc = json.loads(manifest.read_text())
    if doc.get("format") != "tile-store-manifest":
        return None
    done = {"ok", "skipped"}  # "skipped" = already complete from an earlier run: the same content as "ok"
    slides = sorted(
        (
            s.get("slide_id"),
            "ok" if s.get("status") in done else s.get("status"),
            s.get("tile_count"),
            s.get("source_path"),
        )
        for s in doc.get("slides", [])
    )
    return "tiles:" + _sha(doc.get("tiling"), slides)


def _tree_fingerprint(root: Path, limit: int = 100_000) -> str:
    entries = []
    for n, p in enumerate(sorted(root.rglob("*"))):
        if n >= limit:
            break
        if p.is_file() and p.name != MANIFEST_NAME and not p.name.startswith("."):
            st = p.stat()
            entries.append((str(p.relative_to(root)), st.st_size, st.st_mtime_ns))
    return "tree:" + _sha(entries)


def fingerprint(path: str | os.PathLike[str], key: str = "input") -> str:
    """A fingerprint of one stage input: the producer's manifest when there is one (the file checked against what
    the producer wrote), else file/tree metadata.

    Raises:
        ManifestError: `path` does not exist, or is not what the stage that wrote it recorded (naming the config
            key it came from).
    """
    p = Path(path)
    producer = producer_manifest(p)
    if producer is not None:
        damaged = check_artifacts(producer.artifacts, within=p)
        if damaged:
            raise ManifestError(
                f"{key}: {'; '.join(damaged)}: not the output the {producer.stage} stage wrote. Rerun {producer.stage} "
                f"(e.g. --force {producer.stage}) to write it again, or copy the file elsewhere to use it as your own"
            )
        return f"stage:{producer.stage}:{producer.output_fingerprint}"
    if p.is_file():
        return file_fingerprint(p)
    if p.is_dir():
        return _tile_store_fingerprint(p) or _tree_fingerprint(p)
    matches = sorted(glob.glob(str(p)))  # a glob of slides
    if matches:
        return "glob:" + _sha([(m, os.path.getsize(m), os.stat(m).st_mtime_ns) for m in matches])
    raise ManifestError(f"{key}: {p} does not exist; check the path or run the stage that produces it first")


def files_fingerprint(paths: Iterable[str | os.PathLike[str]]) -> str:
    """Path, size and mtime of many files (slides listed in a .txt/.csv): cheap for thousands of large files;
    a missing file counts as such (it fails on its own in the stage)."""
    entries = []
    for p in paths:
        try:
            st = os.stat(p)
            entries.append((str(p), st.st_size, st.st_mtime_ns))
        except OSError:
            entries.append((str(p), None, None))
    return "files:" + _sha(entries)


@dataclass(frozen=True)
class StateInput:
    """An input that is no file: state held elsewhere (a registry alias), fingerprinted by its current value, so a
    stage reruns when it changes (an evaluation when the champion it was compared with was replaced)."""

    label: str  # what it is, shown as the input's "path" (e.g. models:/wsidino-backbone@champion)
    value: str  # what it is now (e.g. the version the alias points at, or "none")


InputPath = str | os.PathLike[str] | list[str] | StateInput | None


def fingerprint_inputs(inputs: Mapping[str, InputPath]) -> dict[str, dict[str, str]]:
    """name → {"path", "fingerprint"} for every input that is set (a list of paths gets one combined entry)."""
    out = {}
    for name, path in inputs.items():
        if not path:
            continue
        if isinstance(path, StateInput):
            out[name] = {"path": path.label, "fingerprint": "state:" + _sha(path.value)}
        elif isinstance(path, list):
            out[name] = {"path": f"{path[0]} (+{len(path) - 1} more)", "fingerprint": files_fingerprint(path)}
        else:
            out[name] = {"path": str(Path(path).resolve()), "fingerprint": fingerprint(path, name)}
    return out


def lineage_of(paths: Iterable[str | os.PathLike[str] | None]) -> dict[str, str]:
    """MLflow run ids of the stages that produced `paths` and of everything upstream of them."""
    lineage: dict[str, str] = {}
    for path in paths:
        if not path:
            continue
        producer = producer_manifest(path)
        if producer is None:
            continue
        for stage, run_id in producer.lineage.items():
            lineage.setdefault(stage, run_id)
        if producer.mlflow_run_id:
            lineage[producer.stage] = producer.mlflow_run_id
    return lineage


# -------------------------------------------------------------------------------------------------- decision


@dataclass(frozen=True)
class Decision:
    up_to_date: bool
    reason: str
    previous: StageManifest | None


def check_up_to_date(
    path: Path,
    config_hash: str,
    inputs: Mapping[str, Mapping[str, str]],
    failed_items: Callable[[Mapping[str, Any]], int] | None = None,
) -> Decision:
    """Compare the manifest at `path` with what a run would use now; `reason` says why it must (re)run.
    `failed_items`: how many items of its input the last run's summary says failed (`Summary.failures`)."""
    previous = read_manifest(path)
    if previous is None:
        return Decision(False, "no manifest (never run here)", None)
    if previous.status != "complete":
        return Decision(False, f"the last run is {previous.status}", previous)
    failed = failed_items(previous.summary) if failed_items is not None else 0
    if failed:  # e.g. unreadable slides: a rerun retries just those items
        return Decision(False, f"the last run had {failed} failed item(s)", previous)
    if previous.config_hash != config_hash:
        return Decision(False, "the config changed", previous)
    changed = sorted(
        set(inputs) ^ set(previous.inputs)
        | {k for k in inputs if k in previous.inputs and previous.inputs[k]["fingerprint"] != inputs[k]["fingerprint"]}
    )
    if changed:
        return Decision(False, f"inputs changed: {', '.join(changed)}", previous)
    missing = [name for name, out in previous.outputs.items() if not Path(out).exists()]
    if missing:
        return Decision(False, f"outputs missing: {', '.join(missing)}", previous)
    damaged = check_artifacts(previous.artifacts)
    if damaged:
        return Decision(False, f"outputs changed since they were written: {'; '.join(damaged)}", previous)
    return Decision(True, "same config and inputs as the complete run of " + str(previous.finished_at), previous)


def output_content(path: str | os.PathLike[str]) -> str:
    """What a produced output looks like now: file content samples, a tile store's slides and tile counts, or
    (other directories: run dirs, feature stores) just the path; their named files carry the change."""
    p = Path(path)
    if p.is_file():
        return file_fingerprint(p)
    if p.is_dir():
        return _tile_store_fingerprint(p) or str(p)
    return "missing"


def completion_fingerprint(m: StageManifest) -> str:
    """What downstream stages record for this stage's output: config, inputs and the outputs' content, so a
    rerun that produced the same outputs (a retried slide that still fails, a forced export of the same
    weights) does not make every later stage rerun, while a different checkpoint or model file does."""
    return _sha(m.stage, m.config_hash, m.inputs, {k: [v, output_content(v)] for k, v in sorted(m.outputs.items())})


def lineage_tags(lineage: dict[str, str]) -> dict[str, str]:
    """A manifest's lineage (stage → MLflow run id) as MLflow tags."""
    return {f"wsidino.lineage.{stage}_run_id": run_id for stage, run_id in lineage.items()}


__all__ = [
    "MANIFEST_NAME",
    "Decision",
    "ManifestError",
    "StageManifest",
    "StateInput",
    "check_up_to_date",
    "checkpoint_records",
    "completion_fingerprint",
    "fingerprint",
    "fingerprint_inputs",
    "lineage_of",
    "lineage_tags",
    "manifest_path",
    "output_lock",
    "producer_manifest",
    "read_manifest",
    "write_manifest",
]
