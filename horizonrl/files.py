"""Files written whole or not at all, and their digests: shared by the trajectory store and the checkpoints."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path


def write_json(obj: dict, path: str | Path) -> None:
    """Write ``obj`` as JSON atomically (temporary file, fsync, rename), e.g. an estimator's state."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        remove_temporary(tmp)


def remove_temporary(tmp: Path) -> None:
    """Remove a failed write's temporary file if it is there. Never raises: on a read-only disk the
    removal fails too, and the write's own error (naming the file) is the one to see."""
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)


def file_digest(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def folder_digest(path: str | Path) -> str:
    """The sha256 of a folder's contents: every file's relative path and sha256, in sorted order, so a
    model folder named by its path is also named by what it holds."""
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(root).as_posix()}\t{file_digest(f)}\n".encode())
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Flush every file directly under ``path`` to disk (before the folder is renamed into place)."""
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def machine_cache() -> Path:
    """This machine's cache folder of horizonrl (``$XDG_CACHE_HOME/horizonrl``, else ``~/.cache/horizonrl``):
    what is computed once per machine and keyed by content or version (an empty migrated MLflow store, vLLM's
    model information), shared by every run, data folder and test."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "horizonrl"
