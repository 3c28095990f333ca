"""The autotuner's verdicts on disk: one JSON file per machine, shared by every process on it.

[Note: the on-disk cache]
Verdicts live in ``verdicts.json`` in one directory, ``~/.cache/dmuon/ns-autotune`` unless
``DMUON_NS_CACHE_DIR`` names another (``_environment``). Several processes write it at once
(the ranks of a job on one node, or two jobs), so:

* a write merges: it holds an exclusive lock on ``verdicts.lock`` (``fcntl.flock``), re-reads
  the file, adds its verdicts to what it finds and writes the union; a verdict another process
  wrote a moment earlier is kept, never clobbered;
* a write is atomic: the union goes to a temporary file in the same directory, is flushed to
  disk, and is renamed over ``verdicts.json`` (``os.replace``). A reader (readers take no lock)
  sees the old file or the new one, never a torn one; a writer killed half-way leaves a stray
  ``.verdicts.*.tmp`` at most, and the cache as it was;
* a file that cannot be parsed (written by hand, or by another format version) is ignored and
  replaced by the next write, and so is a verdict in it that is not a ``{"kernel": name, ...}``
  object; a directory that cannot be read or written leaves the verdicts in
  memory. Each of these is reported once per process (``logging`` and ``warnings``).

Where ``flock`` is missing (no ``fcntl``: Windows) or refused (some network filesystems),
writes still go through the temporary file and the rename, so the file is never corrupt; two
writers at the same instant may then lose one's verdicts, which costs a re-tune later.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dmuon_ns._environment import cache_dir_override
from dmuon_ns._warnings import warn

try:
    import fcntl
except ImportError:  # not POSIX: see the note
    fcntl = None  # type: ignore[assignment]

__all__ = ["AutotuneVerdict", "cache_dir", "delete", "read", "write"]

logger = logging.getLogger(__name__)

AutotuneVerdict = dict[str, Any]
"""JSON-friendly record of one problem's verdict (fields in ``_autotune``)."""

CACHE_FILE = "verdicts.json"
LOCK_FILE = "verdicts.lock"
FORMAT_VERSION = 1

_warned: set[str] = set()
_warned_lock = threading.Lock()


def cache_dir() -> Path:
    """The one directory holding autotune verdicts (``DMUON_NS_CACHE_DIR`` overrides)."""
    override = cache_dir_override()
    if override is not None:
        return override
    return Path.home() / ".cache" / "dmuon" / "ns-autotune"


def read() -> dict[str, AutotuneVerdict]:
    """Every verdict on disk (empty when there is no readable cache)."""
    path = cache_dir() / CACHE_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as err:
        _warn_once("read", f"could not read {path}: {err}")
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        _warn_once("corrupt", f"ignoring corrupt {path}: {err}")
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
        _warn_once("format", f"ignoring {path}: not a format-{FORMAT_VERSION} verdict file")
        return {}
    entries = data.get("verdicts")
    if not isinstance(entries, dict):
        return {}
    usable = {
        key: verdict
        for key, verdict in entries.items()
        if isinstance(verdict, dict) and isinstance(verdict.get("kernel"), str)
    }
    if len(usable) < len(entries):
        _warn_once(
            "entries",
            f"ignoring {len(entries) - len(usable)} malformed verdict(s) in {path} (each is"
            ' {"kernel": name, ...})',
        )
    return usable


def write(verdicts: Mapping[str, AutotuneVerdict]) -> None:
    """Merge ``verdicts`` into the file (see the note: locked, merged, atomic)."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with _exclusive(directory):
            entries = read()
            entries.update(verdicts)
            payload = json.dumps({"format": FORMAT_VERSION, "verdicts": entries}, indent=1)
            _replace_atomically(directory / CACHE_FILE, payload)
    except OSError as err:
        _warn_once("write", f"could not write {directory / CACHE_FILE}: {err}")


def delete() -> None:
    """Remove the file (the lock file stays: another process may hold it)."""
    path = cache_dir() / CACHE_FILE
    try:
        path.unlink(missing_ok=True)
    except OSError as err:
        _warn_once("delete", f"could not delete {path}: {err}")


@contextlib.contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """Hold the cache's write lock (see the note for where there is none)."""
    if fcntl is None:
        yield
        return
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:  # a filesystem without locks: write unlocked
            _warn_once("lock", f"could not lock {directory / LOCK_FILE}: {err}")
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _replace_atomically(path: Path, payload: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".verdicts.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)  # gone after the rename; a leftover otherwise


def _warn_once(kind: str, message: str) -> None:
    with _warned_lock:
        if kind in _warned:
            return
        _warned.add(kind)
    message = f"dmuon-ns autotune: {message}; verdicts are kept in memory"
    logger.warning("%s", message)
    warn(message, RuntimeWarning)
