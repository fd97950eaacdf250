"""Lab 10 checker: the stub and each classic mistake of a checkpoint writer/loader get their pointed message; the
solution passes (it is watched, corrupted and SIGKILLed mid-write by the checker).

The reference solution lives beside the lab notebooks (labs/solutions/), not in the workbench package."""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from workbench.labs import LabCheckFailed
from workbench.labs.atomic_checkpoint import check, make_state, same_state

LABS = Path(__file__).resolve().parent.parent / "labs"
if str(LABS) not in sys.path:
    sys.path.insert(0, str(LABS))

from solutions import atomic_checkpoint as solution  # noqa: E402
from solutions.atomic_checkpoint import load_verified, save_atomic  # noqa: E402

# -- planted writers -----------------------------------------------------------------------------------------


def _record(path: Path) -> None:
    """The solution's manifest, for writers that get the data part wrong."""
    manifest = {"file": path.name, "bytes": path.stat().st_size, "sha256": solution._sha256(path)}
    solution._atomic_write(path.with_name(path.name + solution.MANIFEST_SUFFIX),
                           lambda f: f.write(json.dumps(manifest).encode()))


def save_stub(path, state):
    raise NotImplementedError("save_atomic: write, make durable, switch the name atomically")


def save_in_place(path, state):
    path = Path(path)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    _record(path)


def save_rename_before_fsync(path, state):
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.replace(tmp, path)
        os.fsync(f.fileno())  # too late: the name already points at bytes that may not be on disk
    solution._fsync_dir(path.parent)
    _record(path)


def save_never_fsyncs(path, state):
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        torch.save(state, f)
    os.replace(tmp, path)
    solution._fsync_dir(path.parent)
    _record(path)


def save_temp_elsewhere(path, state):
    path = Path(path)
    fd, tmp = tempfile.mkstemp()  # the system's temp folder: maybe another filesystem
    with os.fdopen(fd, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    solution._fsync_dir(path.parent)
    _record(path)


def _replace_without_dir_fsync(target: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)  # and no fsync of the directory, for the data or for the manifest


def save_no_dir_fsync(path, state):
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    _replace_without_dir_fsync(path, buffer.getvalue())
    manifest = {"file": path.name, "bytes": path.stat().st_size, "sha256": solution._sha256(path)}
    _replace_without_dir_fsync(path.with_name(path.name + solution.MANIFEST_SUFFIX), json.dumps(manifest).encode())


def save_without_record(path, state):
    """Atomic and durable, but no checksum: only the data file."""
    solution._atomic_write(Path(path), lambda f: torch.save(state, f))


def save_state_inside_record(path, state):
    """The manifest and the data in one file: torch.load(path) no longer gives the state back."""
    solution._atomic_write(Path(path), lambda f: torch.save({"sha256": "?", "state": state}, f))


# -- planted loaders -----------------------------------------------------------------------------------------


def load_stub(directory):
    raise NotImplementedError("load_verified: newest first")


def _newest_first(directory):
    return sorted(Path(directory).glob("step-*.pt"), reverse=True)


def load_without_checksum(directory):
    """Tries torch.load newest first, falls back on an exception, warns: but a flipped bit loads fine."""
    skipped = []
    for path in _newest_first(directory):
        try:
            state = torch.load(path, weights_only=True)
        except Exception as e:  # noqa: BLE001
            skipped.append(f"{path.name}: {e}")
            continue
        if skipped:
            warnings.warn("; ".join(skipped), stacklevel=2)
        return state
    raise FileNotFoundError(directory)


def load_unsafe(directory):
    """Verifies checksums, then unpickles anything."""
    skipped = []
    for path in _newest_first(directory):
        problem = solution._problem(path)
        if problem is None:
            try:
                state = torch.load(path, weights_only=False)
            except Exception as e:  # noqa: BLE001
                problem = str(e)
            else:
                if skipped:
                    warnings.warn("; ".join(skipped), stacklevel=2)
                return state
        skipped.append(f"{path.name}: {problem}")
    raise FileNotFoundError(directory)


def load_silently(directory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_verified(directory)


def load_raises_on_bad(directory):
    """Verifies only the newest and gives up if it is bad."""
    path = _newest_first(directory)[0]
    problem = solution._problem(path)
    if problem:
        raise RuntimeError(f"{path.name}: {problem}")
    return torch.load(path, weights_only=True)


def load_none_when_nothing(directory):
    try:
        return load_verified(directory)
    except FileNotFoundError:
        return None


def load_oldest(directory):
    for path in sorted(Path(directory).glob("step-*.pt")):
        if solution._problem(path) is None:
            return torch.load(path, weights_only=True)
    raise FileNotFoundError(directory)


def load_ignores_missing_record(directory):
    """Treats a data file without its manifest as good (it could not verify it, so it trusts it)."""
    skipped = []
    for path in _newest_first(directory):
        problem = solution._problem(path)
        if problem is None or problem.startswith("no manifest"):
            try:
                state = torch.load(path, weights_only=True)
            except Exception as e:  # noqa: BLE001
                problem = str(e)
            else:
                if skipped:
                    warnings.warn("; ".join(skipped), stacklevel=2)
                return state
        skipped.append(f"{path.name}: {problem}")
    raise FileNotFoundError(directory)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("save, load, message", [
    (save_stub, load_verified, r"^your functions are still the stub: save_atomic"),
    (save_atomic, load_stub, r"^your functions are still the stub: load_verified"),
    (save_in_place, load_verified, r"save_atomic writes in place: nothing was renamed onto step-000002.pt"),
    (save_rename_before_fsync, load_verified, r"save_atomic renames before it fsyncs"),
    (save_never_fsyncs, load_verified, r"the temp file is never fsync-ed"),
    (save_temp_elsewhere, load_verified, r"the temp file was written in .*, not in the checkpoint's folder: a "
                                         r"rename is atomic only within one filesystem"),
    (save_no_dir_fsync, load_verified, r"the directory is never fsync-ed after the rename"),
    (save_state_inside_record, load_verified, r"torch.load\(path, weights_only=True\) did not give the state back"),
    (save_without_record, load_without_checksum, r"one flipped bit inside step-000003.pt passed: .* checksum"),
    (save_atomic, load_without_checksum, r"one flipped bit inside step-000003.pt passed"),
    (save_atomic, load_unsafe, r"loading step-000004.pt RAN CODE: .* weights_only=True"),
    (save_atomic, load_silently, r"the newest checkpoint truncated to half: load_verified fell back to "
                                 r"step-000002.pt silently: warnings.warn"),
    (save_atomic, load_raises_on_bad, r"the newest checkpoint truncated to half: load_verified raised"),
    (save_atomic, load_none_when_nothing, r"with no good checkpoint at all load_verified returned NoneType: raise"),
    (save_atomic, load_oldest, r"load_verified returned the OLDEST checkpoint"),
    (save_atomic, load_ignores_missing_record, r"killed just before its last rename \(its commit\), yet "
                                               r"load_verified returned step 2"),
], ids=lambda v: v.__name__ if callable(v) else None)
def test_each_mistake_gets_its_pointed_message(save, load, message):
    with pytest.raises(LabCheckFailed, match=message) as info:
        check(save, load)
    assert str(info.value).endswith("(more help: hint(1), hint(2), hint(3))")


@pytest.mark.timeout(300)
def test_solution_passes(capsys):
    check(save_atomic, load_verified)
    out = capsys.readouterr().out
    assert out.startswith("✓ save_atomic wrote a temp file beside the checkpoint") and "SIGKILLed mid-write" in out


def test_solution_round_trips_and_falls_back_in_one_process(tmp_path):
    """The reference itself, without the checker: a truncated newest file is skipped with a warning."""
    for step in (1, 2):
        save_atomic(tmp_path / f"step-{step:06d}.pt", make_state(step))
    assert same_state(load_verified(tmp_path), make_state(2))
    newest = tmp_path / "step-000002.pt"
    newest.write_bytes(newest.read_bytes()[:50])
    with pytest.warns(UserWarning, match="step-000002.pt: truncated"):
        assert same_state(load_verified(tmp_path), make_state(1))


def test_check_wants_functions():
    with pytest.raises(LabCheckFailed, match="your load_verified function"):
        check(save_atomic, "load_verified")
