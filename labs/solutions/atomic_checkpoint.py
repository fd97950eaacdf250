"""Reference solution of lab 10 (``labs/10_atomic_checkpoint.ipynb``): an atomic, verified checkpoint writer.

    save:  temp file in the SAME directory ─ write ─ flush ─ fsync ─► os.replace onto the name ─► fsync the dir
           then the same for ``<name>.manifest.json`` (size + sha256 of the file): the manifest is the commit record
    load:  newest ``step-*.pt`` first; good = manifest present, size and sha256 match, torch.load(weights_only=True)
           succeeds; each newer one skipped with a warning naming why; none good: raise

The library's version, with per-rank shards, one manifest per step, keep-k pruning and async save, is
``workbench.checkpoint`` (``save``, ``verify``, ``latest_good``, ``load``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MANIFEST_SUFFIX = ".manifest.json"


def _fsync_dir(folder: Path) -> None:
    """A rename lives in the directory's own data: fsync the directory to make it survive a power cut."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(target: Path, write: Callable[[Any], None]) -> None:
    # Same directory: os.replace is atomic only within one filesystem (POSIX rename(2)).
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk BEFORE the name points at them
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def save_atomic(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` so that a crash at any instant leaves the old file or the new one, never half,
    then commit it with a manifest of its size and sha256."""
    path = Path(path)
    _atomic_write(path, lambda f: torch.save(state, f))
    manifest = {"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}
    _atomic_write(path.with_name(path.name + MANIFEST_SUFFIX), lambda f: f.write(json.dumps(manifest).encode()))


def _problem(path: Path) -> str | None:
    """Why the checkpoint at ``path`` is not good, or None."""
    try:
        manifest = json.loads(path.with_name(path.name + MANIFEST_SUFFIX).read_text())
    except FileNotFoundError:
        return "no manifest (the save did not finish)"
    except (OSError, ValueError) as e:
        return f"unreadable manifest ({e})"
    size = path.stat().st_size
    if size != manifest.get("bytes"):
        return f"truncated or wrong size ({size} bytes, the manifest says {manifest.get('bytes')})"
    if _sha256(path) != manifest.get("sha256"):
        return "sha256 mismatch (the file is corrupt)"
    return None


def load_verified(directory: str | os.PathLike) -> dict[str, Any]:
    """The state of the newest good checkpoint in ``directory``; warns for every newer one skipped."""
    skipped = []
    for path in sorted(Path(directory).glob("step-*.pt"), reverse=True):
        problem = _problem(path)
        if problem is None:
            try:  # never unpickle arbitrary objects: a checkpoint file must not be able to run code
                state = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 -- a file that will not load is not good; say why and go on
                problem = f"refused by torch.load(weights_only=True): {type(e).__name__}"
            else:
                if skipped:
                    warnings.warn(f"falling back to {path.name}; skipped: {'; '.join(skipped)}", stacklevel=2)
                return state
        skipped.append(f"{path.name}: {problem}")
    raise FileNotFoundError(f"no good checkpoint in {str(directory)!r}: " + ("; ".join(skipped) or "none at all"))


__all__ = ["load_verified", "save_atomic"]
