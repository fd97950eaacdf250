"""Lab 10: an atomic, verified checkpoint writer, checked by killing it and corrupting what it wrote.

A week-long run survives a dead machine only if its last checkpoint is whole. Writes tear (a process killed
mid-write leaves half a file), renames are atomic only within one filesystem, a rename is durable only once
the directory is fsync-ed, disks flip bits, and ``pickle`` runs code. The learner writes

* ``save_atomic(path, state)``: after it returns, ``path`` holds ``torch.save(state)`` durably, and a crash at
  any instant before leaves ``path`` as it was (absent, or the previous complete file), never half of one;
* ``load_verified(directory)``: the state of the newest checkpoint (``step-*.pt``, newest = last by name) that
  is complete and intact, with a ``warnings.warn`` for each newer one skipped; an exception when none is good.

``check(save_atomic, load_verified)`` runs them in subprocesses (``workbench.launch``, one rank):

1. two saves watched: every rename and every ``os.fsync`` is recorded (an audit hook and a wrapper), so the
   checker sees where the temp file lives, whether its bytes were fsync-ed before the rename, and whether the
   directory was fsync-ed after it;
2. the newest checkpoint truncated, then one bit flipped inside a tensor (torch.load still succeeds: only a
   checksum notices), then a checkpoint whose pickle would run code if loaded with ``weights_only=False``
   (it would create a marker file), then nothing good at all;
3. a writer overwriting a checkpoint with a 64 MB state, SIGKILLed the moment bytes appear on disk;
4. a writer SIGKILLed just before the last rename of its save (after the data is written and fsync-ed).

After each, ``load_verified`` must return a state equal (tensors bit for bit) to one that was completely
saved, the newest such, and warn when it skipped one. Each failure is a ``LabCheckFailed`` naming the mistake;
``hint(1)``, ``hint(2)``, ``hint(3)`` say more, tier by tier.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from workbench.labs import LabCheckFailed, show_hint

TIMEOUT = 120.0
MORE = " (more help: hint(1), hint(2), hint(3))"
BIG_MB = 64  # the state a writer is killed while writing

HINTS = {
    1: "Two separate promises. Atomic: the name `path` must only ever point at a complete file, so write the "
       "bytes somewhere else first and make the switch one indivisible operation, one that is guaranteed only "
       "inside one filesystem. Durable: the operating system keeps writes (and renames) in memory; a crash "
       "after your function returned may lose them unless you force them to disk, in the right order. "
       "Verified: a file can be whole-sized and still wrong (a flipped bit, a half-finished save); only a "
       "record of what was written, checked on load, tells. And a checkpoint file is data: loading it must "
       "never run code.",
    2: "save_atomic: tempfile.mkstemp(dir=<the target's directory>) -> write with torch.save into it -> "
       "f.flush() -> os.fsync(f.fileno()) -> os.replace(tmp, path) -> fsync the directory "
       "(os.open(dir, os.O_RDONLY), os.fsync, os.close). Then write a manifest beside it (e.g. path + "
       "'.manifest.json' holding the size and hashlib.sha256 of the file) the same atomic way: it is the commit "
       "record, written last. load_verified: sorted(glob('step-*.pt')) newest first; skip any file whose "
       "manifest is missing, whose size or sha256 differs, or that torch.load(..., weights_only=True) refuses "
       "(catch the exception); warnings.warn naming each skipped one; raise if none is left.",
    3: "def _atomic_write(target, write):\n"
       "    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix='.' + target.name, suffix='.tmp')\n"
       "    with os.fdopen(fd, 'wb') as f:\n"
       "        write(f); f.flush(); os.fsync(f.fileno())\n"
       "    os.replace(tmp, target)\n"
       "    dfd = os.open(target.parent, os.O_RDONLY); os.fsync(dfd); os.close(dfd)\n"
       "def save_atomic(path, state):\n"
       "    path = Path(path); _atomic_write(path, lambda f: torch.save(state, f))\n"
       "    m = {'bytes': path.stat().st_size, 'sha256': sha256_of(path)}\n"
       "    _atomic_write(Path(str(path) + '.manifest.json'), lambda f: f.write(json.dumps(m).encode()))\n"
       "def load_verified(directory):\n"
       "    for p in sorted(Path(directory).glob('step-*.pt'), reverse=True):\n"
       "        # manifest exists, size and sha256 match, then torch.load(p, weights_only=True) in a try\n"
       "        # ... return the state (warnings.warn first if you skipped any), else note why and continue\n"
       "    raise FileNotFoundError(...)",
}


def hint(level: int = 1) -> str:
    """Print (and return) hint ``level`` (1: the promises, 2: the steps in order, 3: nearly the code)."""
    return show_hint(HINTS, level)


# ---------------------------------------------------------------------------------------------------------
# States: a small training state per step, and a large one to be killed while writing.


def make_state(step: int, big: bool = False) -> dict[str, Any]:
    """A training-like state (nested dicts, tensors, plain python) that differs per step; ``big`` adds 64 MB."""
    gen = torch.Generator(device="cpu").manual_seed(step)  # checkpoints are written from CPU copies

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cpu")

    state: dict[str, Any] = {"step": step, "model": {"w": draw(64, 64), "b": draw(64)},
                             "optim": {"lr": 0.01 * step, "exp_avg": [draw(64)]}, "note": f"step {step}"}
    if big:  # many tensors, so the write is many system calls and the kill lands in the middle
        n = BIG_MB * 2 ** 20 // 4 // 16
        state["blob"] = [draw(n) for _ in range(16)]
    return state


def same_state(a: Any, b: Any) -> bool:
    """Equal structure and values, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _name(step: int) -> str:
    return f"step-{step:06d}.pt"


def _sha(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


# ---------------------------------------------------------------------------------------------------------
# Watching a save: renames (audit events fire before the call) and fsyncs (a wrapper resolving the fd's path).


class _Watch:
    events: list[tuple[str, ...]] | None = None
    kill_at_rename: tuple[str, int] | None = None  # (folder, n): SIGKILL this process at the n-th rename into it
    renames_seen = 0
    hooked = False


def _audit(event: str, args: tuple) -> None:
    if event != "os.rename" or _Watch.events is None:
        return
    src, dst = (os.path.realpath(os.fsdecode(a)) if isinstance(a, (str, bytes, os.PathLike)) else str(a)
                for a in args[:2])
    _Watch.events.append(("rename", src, dst))
    if _Watch.kill_at_rename and os.path.dirname(dst) == _Watch.kill_at_rename[0]:
        _Watch.renames_seen += 1
        if _Watch.renames_seen == _Watch.kill_at_rename[1]:
            os.kill(os.getpid(), signal.SIGKILL)  # the planted crash: data written, the rename not yet done


def _fd_path(fd: Any) -> str:
    number = fd if isinstance(fd, int) else fd.fileno()
    try:
        return os.path.realpath(os.readlink(f"/proc/self/fd/{number}"))
    except OSError:
        return f"<fd {number}>"


@contextlib.contextmanager
def _watched() -> Any:
    """Record renames and fsyncs made inside the block (this process only; audit hooks cannot be removed, so
    the hook is installed once and switched by ``_Watch.events``)."""
    if not _Watch.hooked:
        sys.addaudithook(_audit)
        _Watch.hooked = True
    real_fsync, real_fdatasync = os.fsync, getattr(os, "fdatasync", None)
    events: list[tuple[str, ...]] = []

    def fsync(fd: Any) -> None:
        events.append(("fsync", _fd_path(fd)))
        return real_fsync(fd)

    def fdatasync(fd: Any) -> None:
        events.append(("fsync", _fd_path(fd)))
        return real_fdatasync(fd)

    os.fsync, _Watch.events = fsync, events
    if real_fdatasync is not None:
        os.fdatasync = fdatasync
    try:
        yield events
    finally:
        os.fsync, _Watch.events = real_fsync, None
        if real_fdatasync is not None:
            os.fdatasync = real_fdatasync


# ---------------------------------------------------------------------------------------------------------
# The marker a malicious pickle would create: torch.load(weights_only=False) calls _touch, weights_only=True
# refuses the global.


def _touch(path: str) -> None:
    Path(path).write_text("a checkpoint file ran code while being loaded\n")


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (_touch, (self.marker,))


@contextlib.contextmanager
def _save_injects(marker: str) -> Any:
    """While inside, torch.save adds a ``_Payload`` to the state, so the learner's own save (and its checksum)
    writes a file whose unpickling runs code."""
    real = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        return real({**obj, "payload": _Payload(marker)}, f, *args, **kwargs)

    torch.save = save
    try:
        yield
    finally:
        torch.save = real


# ---------------------------------------------------------------------------------------------------------
# What runs in the subprocesses.


def _outcome(load_verified: Any, folder: Path) -> dict[str, Any]:
    """What load_verified(folder) did: returned (the state) or raised (the error), and its warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            state = load_verified(str(folder))
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 -- recorded: raising is right when nothing is good
            return {"raised": f"{type(e).__name__}: {e}", "warnings": [str(w.message) for w in caught]}
    return {"state": state, "warnings": [str(w.message) for w in caught]}


def _flip_a_bit_in(path: Path, tensor: torch.Tensor) -> bool:
    """Flip one bit inside ``tensor``'s stored bytes in the file (the size stays; torch.load still succeeds)."""
    data = bytearray(path.read_bytes())
    raw = tensor.contiguous().numpy().tobytes()
    at = data.find(raw[256:320])
    if at < 0:
        return False
    data[at + 17] ^= 0x04
    path.write_bytes(bytes(data))
    return True


def _stage_basic(save_atomic: Any, load_verified: Any, root: Path) -> dict[str, Any]:
    folder = root / "basic"
    folder.mkdir()
    watched = []
    for step in (1, 2):
        with _watched() as events:
            save_atomic(str(folder / _name(step)), make_state(step))
        watched.append(events)
    direct = None
    with contextlib.suppress(Exception):
        direct = torch.load(folder / _name(2), weights_only=True)
    return {"folder": os.path.realpath(folder), "events": watched, "direct": direct,
            "load": _outcome(load_verified, folder)}


def _stage_corrupt(save_atomic: Any, load_verified: Any, root: Path) -> dict[str, Any]:
    folder = root / "corrupt"
    folder.mkdir()
    for step in (1, 2, 3):
        save_atomic(str(folder / _name(step)), make_state(step))
    newest = folder / _name(3)
    good = newest.read_bytes()
    out: dict[str, Any] = {}
    newest.write_bytes(good[: len(good) // 2])
    out["truncated"] = _outcome(load_verified, folder)
    newest.write_bytes(good)
    out["flipped_found"] = _flip_a_bit_in(newest, make_state(3)["model"]["w"])
    out["flipped"] = _outcome(load_verified, folder)
    newest.write_bytes(good)
    marker = root / "PWNED"
    with _save_injects(str(marker)):
        save_atomic(str(folder / _name(4)), make_state(4))
    out["pickle"] = _outcome(load_verified, folder)
    out["pickle_ran_code"] = marker.exists()
    lonely = root / "lonely"
    lonely.mkdir()
    save_atomic(str(lonely / _name(1)), make_state(1))
    (lonely / _name(1)).write_bytes((lonely / _name(1)).read_bytes()[:100])
    out["none_good"] = _outcome(load_verified, lonely)
    return out


def _prepare_kills(save_atomic: Any, root: Path) -> dict[str, Any]:
    """Folders the killed writers will work in, each holding complete checkpoints written beforehand."""
    torn, crash = root / "torn", root / "crash"
    torn.mkdir()
    crash.mkdir()
    save_atomic(str(torn / _name(1)), make_state(1))
    save_atomic(str(torn / _name(2)), make_state(2))
    save_atomic(str(crash / _name(1)), make_state(1))
    return {"torn_old_sha": _sha(torn / _name(2))}


def _stage(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except NotImplementedError as e:
        return {"error": f"NotImplementedError: {e}", "stub": True}
    except Exception as e:  # noqa: BLE001 -- reported to the caller, which explains it
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def _run_checks(save_atomic: Any, load_verified: Any, root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    base = Path(root)
    out = {"basic": _stage(_stage_basic, save_atomic, load_verified, base)}
    if "error" in out["basic"]:
        return out
    out["corrupt"] = _stage(_stage_corrupt, save_atomic, load_verified, base)
    out["prepare"] = _stage(_prepare_kills, save_atomic, base)
    return out


def _kill_mid_write(save_atomic: Any, root: str) -> str:
    """Overwrite step 2 with a 64 MB state; SIGKILL this process as soon as new bytes appear in the folder."""
    folder = Path(root) / "torn"
    before = {e.name: (e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(folder)}

    def watch() -> None:
        while True:
            for e in os.scandir(folder):
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat()
                    if st.st_size > 0 and before.get(e.name) != (st.st_size, st.st_mtime_ns):
                        os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.0002)

    state = make_state(2, big=True)
    threading.Thread(target=watch, daemon=True).start()
    save_atomic(str(folder / _name(2)), state)
    return "finished"  # the save outran the watcher: the checker then wants the complete new file


def _kill_at_last_rename(save_atomic: Any, root: str, renames: int) -> str:
    folder = Path(root) / "crash"
    _Watch.kill_at_rename, _Watch.renames_seen = (os.path.realpath(folder), renames), 0
    with _watched():
        save_atomic(str(folder / _name(2)), make_state(2))
    return "finished"


def _load_after(load_verified: Any, root: str, name: str) -> dict[str, Any]:
    return _outcome(load_verified, Path(root) / name)


# ---------------------------------------------------------------------------------------------------------
# Explaining what went wrong.


def _which(state: Any, candidates: dict[str, dict[str, Any]]) -> str | None:
    return next((name for name, s in candidates.items() if same_state(state, s)), None)


def _explain_error(where: str, stage: dict[str, Any]) -> LabCheckFailed:
    if stage.get("stub"):
        detail = stage["error"].partition(":")[2].strip()
        return LabCheckFailed("your functions are still the stub" + (f": {detail}" if detail else "") + MORE)
    last = stage.get("traceback", "").strip().splitlines()
    at = next((line.strip() for line in reversed(last) if line.strip().startswith("File ")), "")
    return LabCheckFailed(f"{where} raised {stage['error']}" + (f"\n  at {at}" if at else "") + MORE)


def _check_writes(basic: dict[str, Any]) -> int:
    """The structure of one save: temp in the same folder, fsync before rename, directory fsync after it.
    Returns how many renames a save makes into the folder (the last one is its commit)."""
    folder, events = basic["folder"], basic["events"][1]
    target = os.path.join(folder, _name(2))
    if not same_state(basic["direct"], make_state(2)):
        raise LabCheckFailed(f"after save_atomic(path, state) returned, torch.load(path, weights_only=True) did not "
                             f"give the state back: {_name(2)} must hold exactly what torch.save(state) writes "
                             "(keep the manifest in a file of its own)" + MORE)
    renames = [e for e in events if e[0] == "rename"]
    onto = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == target]
    if not onto:
        raise LabCheckFailed(f"save_atomic writes in place: nothing was renamed onto {_name(2)}, so a crash "
                             "mid-write leaves a torn file under the real name. Write a temp file, then "
                             "os.replace it onto the name" + MORE)
    i = onto[-1]
    src = events[i][1]
    if os.path.dirname(src) != folder:
        raise LabCheckFailed(f"the temp file was written in {os.path.dirname(src)}, not in the checkpoint's "
                             "folder: a rename is atomic only within one filesystem (across two, os.replace "
                             "fails and shutil.move copies, non-atomically). Create it in the same directory "
                             "(tempfile.mkstemp(dir=...))" + MORE)
    synced_before = any(e == ("fsync", src) for e in events[:i])
    synced_after = any(e[0] == "fsync" and e[1] in (src, target) for e in events[i + 1:])
    if not synced_before:
        if synced_after:
            raise LabCheckFailed("save_atomic renames before it fsyncs: after a power cut the name may point at "
                                 "a file whose bytes never reached the disk. Flush and os.fsync the temp file, "
                                 "THEN rename" + MORE)
        raise LabCheckFailed("the temp file is never fsync-ed: the rename can reach the disk before the bytes "
                             "do. f.flush(); os.fsync(f.fileno()) before the rename" + MORE)
    dir_synced = [j for j, e in enumerate(events) if e == ("fsync", folder)]
    if not any(j > i for j in dir_synced):
        raise LabCheckFailed("the directory is never fsync-ed after the rename: the rename lives in the "
                             "directory's own data and may be lost in a crash (the old file comes back). "
                             "os.open(folder, os.O_RDONLY), os.fsync, os.close after os.replace" + MORE)
    return sum(os.path.dirname(e[2]) == folder for e in renames)


def _check_outcome(what: str, got: dict[str, Any], want: str, states: dict[str, dict[str, Any]],
                   skipped: str | None) -> None:
    """``got`` must return states[want], warning iff ``skipped`` (a reason a newer one is not good)."""
    if "raised" in got:
        raise LabCheckFailed(f"{what}: load_verified raised ({got['raised']}) although {want} is good: a "
                             "checkpoint that fails to verify or to load is skipped (with a warning), not fatal"
                             + MORE)
    name = _which(got["state"], states)
    if name != want:
        shown = name or "a state that was never completely saved"
        raise LabCheckFailed(f"{what}: load_verified returned {shown}, want {want}" + MORE)
    if skipped and not got["warnings"]:
        raise LabCheckFailed(f"{what}: load_verified fell back to {want} silently: warnings.warn naming the "
                             f"checkpoint it skipped and why ({skipped}), or nobody learns the newest is broken"
                             + MORE)


def _check_load(basic: dict[str, Any]) -> None:
    states = {_name(s): make_state(s) for s in (1, 2)}
    got = basic["load"]
    if "raised" in got:
        raise LabCheckFailed(f"load_verified raised {got['raised']} on a folder of two good checkpoints" + MORE)
    name = _which(got["state"], states)
    if name == _name(1):
        raise LabCheckFailed("load_verified returned the OLDEST checkpoint: the newest good one is the last by "
                             "name (step-000002.pt after step-000001.pt)" + MORE)
    if name is None:
        raise LabCheckFailed("load_verified returned something other than the saved state (it must return "
                             "exactly what was passed to save_atomic: the same keys, tensors bit for bit)" + MORE)
    if got["warnings"]:
        raise LabCheckFailed(f"load_verified warned although nothing was wrong: {got['warnings'][0]}" + MORE)


def _check_corruption(out: dict[str, Any]) -> None:
    states = {_name(s): make_state(s) for s in (1, 2, 3)}
    _check_outcome("the newest checkpoint truncated to half", out["truncated"], _name(2), states, "truncated")
    flipped = out["flipped"]
    if "state" in flipped and _which(flipped["state"], states) is None:
        raise LabCheckFailed("one flipped bit inside step-000003.pt passed: load_verified returned its corrupt "
                             "tensor. torch.load cannot notice (the size is right, the zip is readable); only a "
                             "checksum can: record the sha256 of the file when saving, compare it when loading"
                             + MORE)
    _check_outcome("one bit flipped in the newest checkpoint", flipped, _name(2), states, "checksum mismatch")
    if out["pickle_ran_code"]:
        raise LabCheckFailed("loading step-000004.pt RAN CODE: its pickle calls a function, and load_verified "
                             "let it (torch.load(..., weights_only=False)). Load with weights_only=True: "
                             "tensors and plain python only; a file it refuses is not a good checkpoint" + MORE)
    _check_outcome("a checkpoint whose pickle runs code", out["pickle"], _name(3), states,
                   "refused by weights_only=True")
    none = out["none_good"]
    if "raised" not in none:
        raise LabCheckFailed(f"with no good checkpoint at all load_verified returned {type(none['state']).__name__}"
                             ": raise instead (a caller that gets None or an empty state would start from "
                             "scratch, or crash later, far from the cause)" + MORE)


def _check_torn(root: Path, old_sha: str | None, finished: bool, loaded: dict[str, Any]) -> None:
    path = root / "torn" / _name(2)
    sha = _sha(path)
    whole_new = False
    if sha != old_sha:
        with contextlib.suppress(Exception):
            whole_new = same_state(torch.load(path, weights_only=True), make_state(2, big=True))
        if not whole_new:
            raise LabCheckFailed(f"a writer killed mid-write left {_name(2)} torn (neither the old complete file nor "
                                 "the new one): the name must switch in one rename, after the bytes are written"
                                 + MORE)
    # The kill may land anywhere in the save, even between its data and its manifest, so any checkpoint that was
    # completely saved is an acceptable answer; a torn, corrupt or missing one is not.
    states = {"the old step-000002.pt": make_state(2), "the new step-000002.pt": make_state(2, big=True),
              _name(1): make_state(1)}
    what = "after a writer was killed mid-write" + ("" if not finished else " (it finished first)")
    if "raised" in loaded:
        raise LabCheckFailed(f"{what}: load_verified raised ({loaded['raised']}) although complete checkpoints "
                             "are there: skip what is broken (a leftover temp file, a torn one), with a warning"
                             + MORE)
    if _which(loaded["state"], states) is None:
        raise LabCheckFailed(f"{what}: load_verified returned a state that was never completely saved" + MORE)


def _check_crash(loaded: dict[str, Any], renames: int) -> None:
    states = {_name(1): make_state(1), _name(2): make_state(2)}
    if "state" in loaded and _which(loaded["state"], states) == _name(2) and renames > 1:
        raise LabCheckFailed("the writer of step-000002.pt was killed just before its last rename (its commit), "
                             "yet load_verified returned step 2: a checkpoint whose manifest (checksum record) "
                             "is missing did not finish saving and must be skipped" + MORE)
    _check_outcome("after a writer was killed just before its last rename", loaded, _name(1), states,
                   "incomplete save")


def _ship_by_value(*objects: Any) -> None:
    import cloudpickle

    for obj in objects:
        module = sys.modules.get(getattr(obj, "__module__", ""))
        if module is not None and module.__name__ != "__main__" and not module.__name__.startswith("workbench"):
            cloudpickle.register_pickle_by_value(module)


def _killed(fn: Any, *args: Any) -> bool:
    """Run ``fn`` in one subprocess that is expected to SIGKILL itself; True if it died, False if it finished."""
    from workbench.dist.launch import RankError, launch

    try:
        launch(fn, 1, *args, device="cpu", timeout=TIMEOUT)
    except RankError as e:
        if e.exit_code == -signal.SIGKILL:
            return True
        raise LabCheckFailed(f"your save_atomic raised in the writer that was to be killed:\n{e}" + MORE) from None
    return False


def check(save_atomic: Any, load_verified: Any) -> None:
    """Watch, corrupt, kill; raise ``LabCheckFailed`` naming the mistake, or print what held."""
    from workbench.dist.launch import RankError, launch

    for name, fn in (("save_atomic", save_atomic), ("load_verified", load_verified)):
        if not callable(fn):
            raise LabCheckFailed(f"check() wants your {name} function, got {fn!r}")
    _ship_by_value(save_atomic, load_verified)
    root = Path(tempfile.mkdtemp(prefix="lab10-"))
    try:
        try:
            [out] = launch(_run_checks, 1, save_atomic, load_verified, str(root), device="cpu", timeout=TIMEOUT)
        except RankError as e:
            raise LabCheckFailed(f"your code failed in the checker's subprocess:\n{e}" + MORE) from None
        for stage in ("basic", "corrupt", "prepare"):
            if "error" in out.get(stage, {}):
                raise _explain_error({"basic": "saving or loading two checkpoints",
                                      "corrupt": "saving or loading around corrupted files",
                                      "prepare": "save_atomic"}[stage], out[stage])
        renames = _check_writes(out["basic"])
        _check_load(out["basic"])
        _check_corruption(out["corrupt"])
        finished = not _killed(_kill_mid_write, save_atomic, str(root))
        [torn] = launch(_load_after, 1, load_verified, str(root), "torn", device="cpu", timeout=TIMEOUT)
        _check_torn(root, out["prepare"]["torn_old_sha"], finished, torn)
        if not _killed(_kill_at_last_rename, save_atomic, str(root), renames):
            raise LabCheckFailed("the writer meant to be killed at its last rename finished: save_atomic made fewer "
                                 "renames than in the first saves (it should do the same thing every time)" + MORE)
        [crash] = launch(_load_after, 1, load_verified, str(root), "crash", device="cpu", timeout=TIMEOUT)
        _check_crash(crash, renames)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("✓ save_atomic wrote a temp file beside the checkpoint, fsync-ed it, renamed it onto the name and "
          "fsync-ed the directory; load_verified skipped (and warned about) a truncated file, a flipped bit and "
          "a file whose pickle would run code, raised when nothing was good, and returned a complete state after "
          f"a writer was SIGKILLed mid-write ({BIG_MB} MB{', it finished first' if finished else ''}) and just "
          "before its last rename.")


__all__ = ["BIG_MB", "HINTS", "check", "hint", "make_state", "same_state"]
