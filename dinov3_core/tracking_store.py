"""The local MLflow store (a `sqlite:///…` tracking URI): checked once per process, created atomically, its
artifacts beside it. Servers are left to MLflow. Imports MLflow only to build a new schema; the tracking glue
(`dinov3_core.tracking`) calls `ensure_store` before every run it opens."""

from __future__ import annotations

import contextlib
import os
import shlex
import sqlite3
import tempfile
import threading
import urllib.parse
from pathlib import Path

from dinov3_core.errors import WsidinoError


class TrackingStoreError(WsidinoError):
    """The local MLflow store cannot be opened or created; the message names the file and the ways on."""


def local_store(uri: str) -> Path | None:
    """The file of a `sqlite:///…` tracking URI (None for a server or an in-memory store)."""
    if not uri.startswith("sqlite:///"):
        return None
    name = uri.removeprefix("sqlite:///").split("?", 1)[0]
    return None if name in ("", ":memory:") else Path(name).absolute()


_CHECKED: set[Path] = set()  # stores found sound (or made) by this process: later calls cost nothing
_CHECK_LOCK = threading.Lock()  # a background run opener and the main thread may both ask


def ensure_store(uri: str, *, create: bool = True) -> None:
    """Make sure a local SQLite store at `uri` is usable before MLflow touches it; servers are left to MLflow.

    Missing (or an empty file): its schema is built in a temporary file beside it and moved into place, so a
    creation that fails (a full disk) leaves nothing half-made and the next run simply creates it (`create`=False:
    leave that to a later call). Existing: checked once per process with SQLite itself; a file that is not a
    database, is damaged, or holds a half-made schema raises `TrackingStoreError` naming it and the ways on.
    """
    path = local_store(uri)
    if path is None or path in _CHECKED:
        return
    with _CHECK_LOCK:
        if path in _CHECKED:
            return
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = None
        except OSError as err:
            raise _store_error(path, err.strerror or str(err)) from None
        if size:
            _check_store(path)
        elif create:
            _create_store(path, uri)  # also replaces a 0-byte file: SQLite's empty database, nothing to lose
        else:
            return
        _CHECKED.add(path)


def _store_error(path: Path, cause: str) -> TrackingStoreError:
    aside = shlex.quote(f"{path}.broken")
    return TrackingStoreError(
        f"the MLflow store {path} cannot be opened ({cause}): move it aside (mv {shlex.quote(str(path))} {aside}) "
        "to start a new one, or run with tracking.enabled=false"
    )


def _check_store(path: Path) -> None:
    """SQLite's own quick check, then MLflow's schema version (alembic_version), read-only and without MLflow."""
    try:
        # mode=ro: a check never creates or changes the file; the timeout waits out another run's write.
        con = sqlite3.connect(f"file:{urllib.parse.quote(str(path))}?mode=ro", uri=True, timeout=30)
    except sqlite3.Error as err:
        raise _store_error(path, str(err)) from None
    try:
        with contextlib.closing(con):
            verdict = [row[0] for row in con.execute("PRAGMA quick_check")]
            if verdict != ["ok"]:
                raise _store_error(path, f"SQLite finds it damaged: {verdict[0]}")
            tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            versions = (
                con.execute("SELECT version_num FROM alembic_version").fetchall()
                if ("alembic_version" in tables)
                else []
            )
    except sqlite3.OperationalError as err:
        if "locked" in str(err):
            return  # another run holds it for longer than the timeout: busy, not broken; MLflow will wait too
        raise _store_error(path, str(err)) from None
    except sqlite3.DatabaseError as err:  # "file is not a database", "database disk image is malformed"
        raise _store_error(path, str(err)) from None
    if tables and not versions:
        # MLflow would create the tables again and stop at "table … already exists" on every run.
        raise _store_error(
            path, "its schema is half-made: MLflow tables without a schema version, left by a creation that failed"
        )


def _create_store(path: Path, uri: str) -> None:
    """Build MLflow's schema in a temporary file in the store's folder, then link it into place (atomic)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".creating", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        store = SqlAlchemyStore(f"sqlite:///{tmp}", artifact_location(uri))
        store.engine.dispose()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # fails when another process made the store meanwhile: theirs is kept
        except FileExistsError:
            if path.stat().st_size == 0:  # the empty file this creation replaces
                os.replace(tmp, path)
        except OSError:  # a file system without hard links
            os.replace(tmp, path)
        with contextlib.suppress(OSError):  # the new name survives a crash (not every platform opens folders)
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    except Exception as err:
        cause = str(getattr(err, "orig", None) or err).splitlines()[0][:200]
        raise TrackingStoreError(
            f"cannot create the MLflow store {path} ({type(err).__name__}: {cause}); nothing was left behind: free "
            "space or fix the folder's permissions and rerun, or run with tracking.enabled=false"
        ) from None
    finally:
        if tmp is not None:
            for leftover in (tmp, *(tmp.with_name(tmp.name + s) for s in ("-journal", "-wal", "-shm"))):
                with contextlib.suppress(OSError):
                    leftover.unlink()


def artifact_location(uri: str) -> str | None:
    """For a SQLite store, artifacts go beside the database (MLflow would use ./mlruns of the working directory)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()
    return None  # a tracking server decides


__all__ = ["TrackingStoreError", "artifact_location", "ensure_store", "local_store"]
