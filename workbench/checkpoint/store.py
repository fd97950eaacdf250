"""Training-state checkpoints: per-rank shard files, a manifest with checksums, atomic writes, async save.

Layout of a checkpoint directory (one sub-directory per saved step)::

    ckpt/step-000123/rank-00000.pt     # torch.save of rank 0's state (tensors and plain python only)
    ckpt/step-000123/rank-00001.pt
    ckpt/step-000123/manifest.json     # written LAST, by rank 0: step, world size, meta, size + sha256 per shard

Why each piece (the lessons of long runs: jobs die, disks fill, writes tear):

* **Atomic files.** A shard is written to a hidden temp file in the same directory, flushed, ``fsync``-ed,
  then ``os.replace``-d onto its name and the directory is ``fsync``-ed: a crash leaves either the old
  file or the new one, never half of one under the real name (the POSIX rename guarantee; the directory
  fsync makes the rename itself durable).
* **The manifest is the commit record.** A checkpoint is *complete* only when ``manifest.json`` exists and
  every shard matches its recorded size and sha256. Rank 0 writes it after every rank's shard exists (after a
  barrier), so a run killed mid-save leaves a directory without a manifest, which ``latest_good`` skips.
* **Verify before delete.** ``keep`` old checkpoints are removed only after the new one verifies, so there
  is always at least one good checkpoint on disk.
* **No arbitrary unpickling.** ``load`` uses ``torch.load(weights_only=True)``; ``save`` refuses state that
  such a load could not read back (custom objects), before writing anything.
* **Async save** (``AsyncCheckpointer``): the state is copied to CPU in the caller (so training may mutate its
  tensors at once) and written by one background thread; at most one save is in flight. This is the
  snapshot-then-persist split of CheckFreq (Mohan et al., FAST 2021) and of PyTorch DCP's ``async_save``.

How the trainer uses it (one call per rank, every rank)::

    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "rng": rng_state()}
    save(ckpt_dir, step, state, meta={"mesh": [2, 2], "zero_stage": 3}, keep=3)     # or
    ckpt = AsyncCheckpointer(ckpt_dir, keep=3); ckpt.save(step, state, meta=...); ...; ckpt.close()
    # on resume:
    path = latest_good(ckpt_dir); state = load(path, map_location=device); set_rng_state(state["rng"])
    discard_newer(ckpt_dir, state["step"])          # rank 0, before the first new save
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import copy
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workbench.dist.notices import notice

FORMAT = "workbench-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d+)$")
_PLAIN = (str, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)
_HASH_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or unreadable; the message names the path and the problem."""


# -- names -----------------------------------------------------------------------------------------------------

def step_dir(directory: str | os.PathLike, step: int) -> Path:
    """``directory/step-000123``: where step ``step`` is saved."""
    return Path(directory) / f"step-{_check_step(step):06d}"


def shard_name(rank: int) -> str:
    """``rank-00001.pt``: the file name of ``rank``'s shard."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, got {rank!r}")
    return f"rank-{rank:05d}.pt"


def list_steps(directory: str | os.PathLike) -> list[int]:
    """Steps that have a ``step-*`` directory under ``directory`` (complete or not), oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = (_STEP_RE.match(p.name) for p in root.iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return step


def _check_keep(keep: Any) -> int | None:
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be an int >= 1 (how many checkpoints to keep) or None (keep all), got {keep!r}")
    return keep


def _dist_rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The caller's rank and world size: given, or from the process group, or (0, 1) in a single process."""
    up = dist.is_available() and dist.is_initialized()
    rank = (dist.get_rank() if up else 0) if rank is None else rank
    world_size = (dist.get_world_size() if up else 1) if world_size is None else world_size
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    shard_name(rank)  # validates rank
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
    return rank, world_size


def _default_barrier(world_size: int) -> Callable[[], None]:
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        from workbench.dist import comm  # imported here: comm pulls in the trace machinery only when distributed

        return lambda: comm.barrier(tag="checkpoint")
    return lambda: None


# -- checks before writing ----------------------------------------------------------------------------------------

def ensure_writable(directory: str | os.PathLike) -> Path:
    """Create ``directory`` if needed and prove it writable by creating a file in it; ``ValueError`` if not.

    A probe file rather than ``os.access``: access() says yes to root on a read-only mount and knows nothing of
    full disks or quotas; a real create finds out before a long run depends on it.
    """
    root = Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"checkpoint directory {str(root)!r} is not writable ({e.strerror or e}); "
                         "choose a directory you can create files in") from e
    return root


def check_state(state: Any, where: str = "state") -> None:
    """``ValueError`` naming the first value in ``state`` that ``torch.load(weights_only=True)`` could not read."""
    if isinstance(state, torch.Tensor) or isinstance(state, _PLAIN):
        return
    if isinstance(state, Mapping):
        for k, v in state.items():
            if not isinstance(k, (str, int)):
                raise ValueError(f"{where} has a key {k!r} of type {type(k).__name__}; keys must be str or int")
            check_state(v, f"{where}[{k!r}]")
        return
    if isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            check_state(v, f"{where}[{i}]")
        return
    raise ValueError(f"{where} is a {type(state).__module__}.{type(state).__qualname__}; a checkpoint holds only "
                     "tensors and plain python (dict, list, tuple, str, int, float, bool, None) so that it loads "
                     "with torch.load(weights_only=True); convert it (e.g. dataclasses.asdict) first")


# -- atomic writes ------------------------------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (POSIX: the directory entry lives in the directory's own data)."""
    with contextlib.suppress(OSError):  # some filesystems/platforms cannot open a directory; nothing to do there
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(target: Path, write: Callable[[Any], None]) -> Path:
    """Write ``target`` via a temp file in the same directory: write, flush, fsync, os.replace, fsync dir."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(target.parent)
    return target


def write_atomic(path: str | os.PathLike, state: Any) -> Path:
    """``torch.save(state)`` to ``path`` atomically (temp file, fsync, rename, fsync the directory)."""
    check_state(state)
    return _atomic_write(Path(path), lambda f: torch.save(state, f))


def save_shard(directory: str | os.PathLike, step: int, rank: int, state: Mapping[str, Any]) -> Path:
    """Atomically write ``rank``'s shard of step ``step``; returns its path. No manifest: see ``save``."""
    folder = step_dir(directory, step)
    folder.mkdir(parents=True, exist_ok=True)
    return write_atomic(folder / shard_name(rank), state)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: str | os.PathLike, step: int, world_size: int,
                   meta: Mapping[str, Any] | None = None) -> Path:
    """Rank 0's commit: hash every rank's shard and atomically write ``manifest.json``.

    ``CheckpointError`` if a shard is missing (a rank has not finished: call this after the barrier).
    """
    folder = step_dir(directory, step)
    missing = [shard_name(r) for r in range(world_size) if not (folder / shard_name(r)).is_file()]
    if missing:
        raise CheckpointError(f"cannot write the manifest of {folder}: shard(s) {missing} do not exist yet "
                              "(every rank must have saved its shard before rank 0 writes the manifest)")
    shards = []
    for r in range(world_size):
        p = folder / shard_name(r)
        shards.append({"rank": r, "file": p.name, "bytes": p.stat().st_size, "sha256": _sha256(p)})
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "world_size": world_size,
                "created_unix": time.time(), "meta": dict(meta or {}), "shards": shards}
    text = json.dumps(manifest, indent=1).encode()
    return _atomic_write(folder / MANIFEST, lambda f: f.write(text))


def _check_meta(meta: Mapping[str, Any] | None) -> None:
    try:
        json.dumps(dict(meta or {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be JSON-serialisable (it goes into {MANIFEST}): {e}") from e


# -- verify, find, prune ------------------------------------------------------------------------------------------

def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed manifest of the checkpoint at ``path`` (a ``step-*`` directory); ``CheckpointError`` if absent."""
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete (the save did not finish)") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is unreadable: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{file} has format_version {manifest.get('format_version')!r}; "
                              f"this workbench reads version {FORMAT_VERSION}")
    return manifest


def _shard_problem(folder: Path, entry: Mapping[str, Any], hash_it: bool = True) -> str | None:
    p = folder / str(entry.get("file", "?"))
    if not p.is_file():
        return f"{p.name} is missing"
    size = p.stat().st_size
    if size != entry.get("bytes"):
        kind = "truncated" if isinstance(entry.get("bytes"), int) and size < entry["bytes"] else "wrong size"
        return f"{p.name} is {kind}: {size} bytes, the manifest says {entry.get('bytes')}"
    if hash_it and _sha256(p) != entry.get("sha256"):
        return f"{p.name} has a checksum mismatch (sha256 differs from the manifest): the file is corrupt"
    return None


def verify(path: str | os.PathLike) -> list[str]:
    """Problems with the checkpoint at ``path`` (a ``step-*`` directory); ``[]`` means complete and intact."""
    folder = Path(path)
    if not folder.is_dir():
        return [f"{folder} does not exist"]
    try:
        manifest = read_manifest(folder)
    except CheckpointError as e:
        return [str(e)]
    shards = manifest.get("shards") or []
    problems = []
    if sorted(s.get("rank") for s in shards) != list(range(manifest.get("world_size", -1))):
        problems.append(f"manifest lists ranks {[s.get('rank') for s in shards]} for world_size "
                        f"{manifest.get('world_size')}")
    problems += [p for s in shards if (p := _shard_problem(folder, s))]
    return problems


def latest_good(directory: str | os.PathLike) -> Path:
    """The newest ``step-*`` checkpoint under ``directory`` that verifies.

    Newer ones that do not verify are skipped with a ``notice`` (a ``UserWarning`` shown as one ``workbench:``
    line) naming each and what was wrong;
    ``CheckpointError`` naming the directory and every problem if none verifies (or there are none).
    """
    root = Path(directory)
    steps = list_steps(root)
    if not steps:
        raise CheckpointError(f"no checkpoints in {str(root)!r} (no step-* directories)")
    skipped: list[str] = []
    for step in reversed(steps):
        folder = step_dir(root, step)
        problems = verify(folder)
        if not problems:
            if skipped:
                notice(f"falling back to checkpoint {folder.name}: newer checkpoint(s) did not verify: "
                       + "; ".join(skipped))
            return folder
        skipped.append(f"{folder.name}: " + ", ".join(problems))
    raise CheckpointError(f"no good checkpoint in {str(root)!r}; every one failed verification:\n  "
                          + "\n  ".join(skipped))


def _remove(folder: Path) -> None:
    """Delete a checkpoint, manifest first: a half-deleted one is never mistaken for a complete one."""
    with contextlib.suppress(FileNotFoundError):
        (folder / MANIFEST).unlink()
    shutil.rmtree(folder, ignore_errors=True)


def prune(directory: str | os.PathLike, keep: int, newest: int) -> list[Path]:
    """Delete ``step-*`` directories older than the ``keep`` newest at or below step ``newest``; return them.

    Call only after step ``newest`` verified. Steps above ``newest`` (left by a run that later resumed from an
    earlier checkpoint) are not older, so they are left alone (``discard_newer`` removes those on resume).
    """
    _check_keep(keep)
    older = [s for s in list_steps(directory) if s <= newest]
    doomed = [step_dir(directory, s) for s in older[:-keep]]
    for folder in doomed:
        _remove(folder)
    return doomed


def discard_newer(directory: str | os.PathLike, step: int) -> list[Path]:
    """On resume from step ``step``: delete ``step-*`` directories above it (left by the run that died); return them.

    Their steps will be saved again; removing them first means a later save can never mix a shard the dead run
    left behind into a new manifest, and ``latest_good`` stops warning about them.
    """
    _check_step(step)
    doomed = [step_dir(directory, s) for s in list_steps(directory) if s > step]
    for folder in doomed:
        _remove(folder)
    return doomed


# -- save and load ------------------------------------------------------------------------------------------------

def save(directory: str | os.PathLike, step: int, state: Mapping[str, Any], *, meta: Mapping[str, Any] | None = None,
         rank: int | None = None, world_size: int | None = None, keep: int | None = None,
         barrier: Callable[[], None] | None = None) -> Path:
    """Save this rank's ``state`` as step ``step``; every rank calls it. Returns the ``step-*`` directory.

    Each rank writes its shard atomically; after ``barrier`` (default: ``comm.barrier`` when a process group of
    more than one rank is up, else nothing) rank 0 writes the manifest, verifies the checkpoint and only then
    prunes to the newest ``keep``; a second ``barrier`` means no rank returns before the checkpoint is complete.
    ``rank``/``world_size`` default to the process group's (0/1 in a single process). ``meta`` (JSON: mesh shape,
    ZeRO stage, which shard each rank holds, run config) goes into the manifest. ``ValueError`` for bad input
    (unwritable directory, ``keep`` < 1, state that ``weights_only`` could not load) before anything is written.
    """
    rank, world_size = _dist_rank_world(rank, world_size)
    _check_step(step)
    _check_keep(keep)
    _check_meta(meta)
    check_state(state)
    ensure_writable(directory)
    barrier = barrier or _default_barrier(world_size)
    if rank == 0:  # a re-save of this step must not look complete under the old manifest while half-written
        with contextlib.suppress(FileNotFoundError):
            (step_dir(directory, step) / MANIFEST).unlink()
    barrier()
    save_shard(directory, step, rank, state)
    barrier()
    if rank == 0:
        _commit(directory, step, world_size, meta, keep)
    barrier()
    return step_dir(directory, step)


def _commit(directory: str | os.PathLike, step: int, world_size: int, meta: Mapping[str, Any] | None,
            keep: int | None) -> None:
    """Rank 0: manifest, verify (reading the files back), then and only then prune."""
    write_manifest(directory, step, world_size, meta)
    problems = verify(step_dir(directory, step))
    if problems:
        raise CheckpointError(f"checkpoint {step_dir(directory, step)} did not verify after writing "
                              f"({'; '.join(problems)}); older checkpoints were kept")
    if keep is not None:
        prune(directory, keep, step)


def load(path: str | os.PathLike, rank: int | None = None, *, map_location: str | torch.device = "cpu",
         check: bool = True) -> dict[str, Any]:
    """``rank``'s state from the checkpoint at ``path`` (a ``step-*`` directory, e.g. from ``latest_good``).

    ``torch.load(weights_only=True)``: tensors and plain python only, never arbitrary objects. With ``check``
    the manifest must exist and this shard must match its size and sha256. ``map_location`` is where tensors
    land (pass the rank's device). ``CheckpointError`` for a missing, corrupt or refused shard.
    """
    folder = Path(path)
    rank = (dist.get_rank() if dist.is_available() and dist.is_initialized() else 0) if rank is None else rank
    file = folder / shard_name(rank)
    if check:
        manifest = read_manifest(folder)
        entry = next((s for s in manifest.get("shards", []) if s.get("rank") == rank), None)
        if entry is None:
            raise CheckpointError(f"{folder / MANIFEST} has no shard for rank {rank} "
                                  f"(saved with world_size {manifest.get('world_size')})")
        if problem := _shard_problem(folder, entry):
            raise CheckpointError(f"cannot load {file}: {problem}")
    if not file.is_file():
        raise CheckpointError(f"cannot load {file}: the file does not exist")
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"refused to load {file}: it holds objects other than tensors and plain python, and "
                              f"checkpoints are loaded with weights_only=True so that a file can never run code "
                              f"({str(e).splitlines()[0]})") from e
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"cannot load {file}: {e}") from e


# -- a full state dict for a plain model -----------------------------------------------------------------------------

def export_full_state_dict(model: torch.nn.Module, full_params: Mapping[str, torch.Tensor],
                           path: str | os.PathLike) -> Path:
    """Write ``model.state_dict()`` with its parameters replaced by ``full_params`` (gathered from any strategy's
    shards, by the unwrapped model's names), atomically, as a file that ``torch.load(weights_only=True)`` reads and
    a plain ``model.load_state_dict`` accepts: what leaves the training cluster for evaluation or serving.

    ``model`` is an unwrapped instance of the trained architecture (its values are overwritten in a copy of its
    state dict, never in place); a missing or misshapen parameter is a ``ValueError`` naming it."""
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    names = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(names) - set(full_params) - {n for n in names if _tied_to(names, n, full_params)})
    if missing:
        raise ValueError(f"full parameters lack {missing[:5]}{'...' if len(missing) > 5 else ''}; "
                         f"expected the unwrapped model's names, e.g. {sorted(names)[:3]}")
    for name, param in names.items():
        source = full_params.get(name)
        if source is None:
            source = full_params[_tied_to(names, name, full_params)]
        if tuple(source.shape) != tuple(param.shape):
            raise ValueError(f"parameter {name!r} has shape {tuple(source.shape)}, the model expects "
                             f"{tuple(param.shape)}")
        state[name] = source.detach().to("cpu", dtype=param.dtype, copy=True)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, state)


def _tied_to(names: Mapping[str, torch.nn.Parameter], name: str, full: Mapping[str, Any]) -> str | None:
    """The name under which ``full`` holds a parameter tied to ``name`` (the same tensor, e.g. the LM head)."""
    return next((other for other, p in names.items() if p is names[name] and other in full), None)


# -- async save ---------------------------------------------------------------------------------------------------

def snapshot_to_cpu(state: Any, staging: Any = None) -> Any:
    """A copy of ``state`` whose tensors are fresh CPU tensors (containers rebuilt, plain values shared).

    Copies even CPU tensors, so the caller may go on mutating its own in place (optimizer.step) while the
    copy is written; a copy also drops any larger storage a view points into, which torch.save would write whole.

    ``staging``: an earlier snapshot nobody reads any more; wherever it has a CPU tensor of the same shape and
    dtype at the same place, the copy goes into that tensor instead of new memory (DCP's cached staging, as
    ``async_save`` does with ``cache_staged_state_dict``): no allocation and no first-touch page faults, so
    the training loop's stall is one memcpy of the state.
    """
    if isinstance(state, torch.Tensor):
        reusable = (isinstance(staging, torch.Tensor) and staging.device.type == "cpu" and staging.shape == state.shape
                    and staging.dtype == state.dtype and staging.is_contiguous())
        return staging.copy_(state.detach()) if reusable else state.detach().to("cpu", copy=True)
    if isinstance(state, Mapping):
        old = staging if isinstance(staging, Mapping) else {}
        out = {k: snapshot_to_cpu(v, old.get(k)) for k, v in state.items()}
        if isinstance(state, collections.OrderedDict):  # a state_dict: keep its type and version _metadata
            out = collections.OrderedDict(out)
            if hasattr(state, "_metadata"):
                out._metadata = copy.deepcopy(state._metadata)
        return out
    if isinstance(state, (list, tuple)):
        old = staging if isinstance(staging, (list, tuple)) and len(staging) == len(state) else [None] * len(state)
        copied = [snapshot_to_cpu(v, o) for v, o in zip(state, old, strict=True)]
        return copied if isinstance(state, list) else tuple(copied)
    return state


class AsyncCheckpointer:
    """Save checkpoints in one background thread while training goes on; at most one save in flight.

    ``save(step, state)`` first waits for the previous save to finish (re-raising its error, if any), then
    snapshots ``state`` to CPU in the caller and hands the copy to the writer thread, and returns: the training
    loop stalls only for the previous save's remainder plus the copy. With ``reuse_staging`` (the default) each
    snapshot after the first copies into the previous one's CPU tensors (same structure, shapes and dtypes),
    which the writer has finished with by then: the memory is allocated and touched once, not at every save
    (it stays allocated, one state's worth, until the checkpointer is dropped). ``wait()`` blocks until the save
    in flight is done and returns its directory; ``close()`` waits and stops the thread (also on ``with`` exit).

    Coordination without collectives: the writer thread must not call a collective (it would interleave with
    the training loop's own collectives on the same process group), so by default rank 0's thread waits for
    every rank's shard *file* to appear (each is renamed into place atomically, so existing means complete)
    before writing the manifest. This needs the directory to be shared by all ranks (one node, or a shared
    filesystem), as any checkpoint directory must be. ``shard_timeout`` bounds that wait.
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int | None = None, rank: int | None = None,
                 world_size: int | None = None, shard_timeout: float = 300.0, reuse_staging: bool = True) -> None:
        self.rank, self.world_size = _dist_rank_world(rank, world_size)
        self.keep = _check_keep(keep)
        if not isinstance(shard_timeout, (int, float)) or shard_timeout <= 0:
            raise ValueError(f"shard_timeout must be a number of seconds > 0, got {shard_timeout!r}")
        self.shard_timeout = float(shard_timeout)
        self.directory = ensure_writable(directory)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="checkpoint-writer")
        self._inflight: concurrent.futures.Future | None = None
        self.reuse_staging = bool(reuse_staging)
        self._staging: Any = None  # the last snapshot: its CPU tensors are reused by the next one

    def save(self, step: int, state: Mapping[str, Any], *, meta: Mapping[str, Any] | None = None) -> None:
        """Snapshot ``state`` and start writing it as step ``step``; returns once the snapshot is taken."""
        _check_step(step)
        _check_meta(meta)
        check_state(state)
        self.wait()  # one in flight: the previous save finishes (or raises) before the next snapshot is taken
        if self._pool is None:
            raise RuntimeError("this AsyncCheckpointer is closed; create a new one")
        # The previous snapshot is written (wait() above), so its CPU tensors are free: copy into them.
        self._staging = snapshot_to_cpu(state, self._staging if self.reuse_staging else None)
        self._inflight = self._pool.submit(self._write, step, self._staging, dict(meta or {}))

    @property
    def in_flight(self) -> bool:
        """True while a save is being written."""
        return self._inflight is not None and not self._inflight.done()

    def wait(self) -> Path | None:
        """Block until the save in flight is written; its ``step-*`` directory (None if there was none).

        An error raised in the writer thread is raised here (and so by the next ``save``/``close``).
        """
        future, self._inflight = self._inflight, None
        return None if future is None else future.result()

    def close(self) -> None:
        """Wait for the save in flight, then stop the writer thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, step: int, snapshot: dict[str, Any], meta: dict[str, Any]) -> Path:
        if self.rank == 0:
            with contextlib.suppress(FileNotFoundError):
                (step_dir(self.directory, step) / MANIFEST).unlink()
        save_shard(self.directory, step, self.rank, snapshot)
        if self.rank == 0:
            self._wait_for_shards(step)
            _commit(self.directory, step, self.world_size, meta, self.keep)
        return step_dir(self.directory, step)

    def _wait_for_shards(self, step: int) -> None:
        folder = step_dir(self.directory, step)
        deadline = time.monotonic() + self.shard_timeout
        while missing := [r for r in range(self.world_size) if not (folder / shard_name(r)).is_file()]:
            if time.monotonic() > deadline:
                raise CheckpointError(f"step {step}: rank(s) {missing} did not write their shard into {folder} "
                                      f"within {self.shard_timeout:.0f} s; no manifest written")
            time.sleep(0.01)


# -- RNG state ----------------------------------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """Python ``random``, torch CPU and (when CUDA is in use) every CUDA device's RNG state, as plain values and
    CPU byte tensors, so they load with ``weights_only=True``. Restore with ``set_rng_state``."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {"python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # "in use": never initialise CUDA just for this
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``rng_state`` captured, so the same random numbers follow (``ValueError`` if malformed)."""
    if not isinstance(state, Mapping) or "python" not in state or "torch" not in state:
        got = f"keys {list(state)}" if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"set_rng_state needs the dict rng_state() returned (keys 'python', 'torch' and "
                         f"optionally 'cuda'), got {got}")
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    torch.set_rng_state(state["torch"].cpu())  # the CPU generator takes a CPU byte tensor whatever map_location did
    cuda = state.get("cuda")
    if cuda:
        if torch.cuda.is_available():
            for i, s in enumerate(cuda[:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s.cpu(), i)
        else:
            notice("the checkpoint holds CUDA RNG state but CUDA is not available here; "
                   "CUDA random numbers will differ from the saved run")
