"""Bounded subprocesses for the benchmarks: nothing a benchmark starts may outlive its time limit.

``run_bounded`` runs a command in its own session (so it and everything it forks share one process group)
and, on timeout, on an interrupt of the caller, or after the command exits, kills that whole group: a rank
or a forked worker stuck in a futex cannot be left behind. ``python harness.py MODULE OUT [--quick]`` is the
child side of ``run.py``: it imports one ``bench_*.py`` in a fresh, single-threaded interpreter (so a
fork-based reference inside it forks from a process without threads), calls ``rows(quick)`` and writes
``{"status": "ok", "rows": [...]}`` or ``{"status": "failed", "reason": ...}`` as JSON to OUT.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Environment variable that tells a benchmark (and ``workbench.launch``) which device to run on.
DEVICE_ENV = "WORKBENCH_DEVICE"
#: Seconds between SIGTERM and SIGKILL: long enough for a rank to remove its shared-memory files.
KILL_GRACE_S = 5.0


@dataclass
class Outcome:
    """How a bounded command ended: ``returncode`` is None when it was killed for running past its limit."""

    returncode: int | None
    elapsed_s: float
    timed_out: bool

    def describe(self, timeout: float) -> str:
        """A one-line reason for a command that did not succeed, e.g. ``timed out after 240 s``."""
        if self.timed_out:
            return f"timed out after {timeout:g} s"
        if self.returncode is not None and self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = str(-self.returncode)
            return f"killed by signal {name}"
        return f"exited with code {self.returncode}"


def _descendants(pid: int) -> list[Any]:
    """Descendants of ``pid`` that psutil can see (those that left the process group included), or []."""
    try:
        import psutil
    except ImportError:  # optional: the process-group kill below covers everything that did not setsid
        return []
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in group ``pgid``."""
    proc_root = Path("/proc")
    if not proc_root.is_dir():  # not Linux: a zombie counts as alive here, so the caller waits the grace out
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for stat in proc_root.glob("[0-9]*/stat"):
        try:
            # after the ")" closing the command name: state, ppid, pgrp, ...
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # it exited while we looked
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def kill_group(pgid: int, also: list[Any] | None = None, leader: subprocess.Popen | None = None) -> None:
    """SIGTERM the process group ``pgid`` (and ``also``, psutil processes), then SIGKILL what is left.

    ``leader`` (the group's leader, if it is our child) is reaped while we wait, so that its zombie does not
    look like a process that ignores SIGTERM.
    """
    extra = also or []

    def signal_all(sig: int) -> bool:
        alive = False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
            alive = True
        for proc in extra:
            with contextlib.suppress(Exception):  # already gone, or a zombie: nothing to do
                proc.send_signal(sig)
        return alive

    if not signal_all(signal.SIGTERM) and not extra:
        return
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline:
        if leader is not None:
            leader.poll()
        if not _group_alive(pgid) and not any(_running(p) for p in extra):
            return
        time.sleep(0.05)
    signal_all(signal.SIGKILL)


def _running(proc: Any) -> bool:
    try:
        return proc.is_running() and proc.status() != "zombie"
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess and friends: it is gone
        return False


def run_bounded(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
                cwd: str | None = None) -> Outcome:
    """Run ``cmd`` for at most ``timeout`` seconds; afterwards nothing it started is left running.

    stdout/stderr are inherited, so a benchmark's progress and tracebacks reach the terminal as they happen.
    """
    t0 = time.monotonic()
    # A new session makes the child the leader of a fresh process group that every rank and forked worker
    # joins; it also keeps the terminal's Ctrl-C away from it, so the finally below is what stops it.
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True)
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        # Also after a clean exit: a straggler (a forkserver, an orphaned rank) must not outlive the command.
        kill_group(proc.pid, also=_descendants(proc.pid) if proc.poll() is None else None, leader=proc)
        proc.wait()
    return Outcome(None if timed_out else proc.returncode, time.monotonic() - t0, timed_out)


def declared_devices(path: Path) -> tuple[str, ...]:
    """The module-level ``DEVICES`` tuple of a bench module, read without importing it (default: cpu only).

    Reading the source keeps the runner from paying torch's import (or a module's import-time failure) just
    to learn that a module is to be skipped.
    """
    import ast

    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError):
        return ("cpu",)  # the child will report the real error
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "DEVICES" for t in node.targets)
                or isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == "DEVICES" and node.value is not None):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return ("cpu",)
            return tuple(value) if isinstance(value, (tuple, list)) else (str(value),)
    return ("cpu",)


def device_and_world(world_size: int) -> tuple[str, int]:
    """Where a multi-rank bench module runs: ``("cpu", world_size)`` gloo ranks, or under ``--device cuda``
    one NCCL rank per visible GPU, at most ``world_size`` (the row records the world it ran)."""
    if os.environ.get(DEVICE_ENV) != "cuda":
        return "cpu", world_size
    import torch

    return "cuda", max(1, min(world_size, torch.cuda.device_count()))


def error_reason(exc: BaseException) -> str:
    """``<ExceptionType>: message`` on one line, as it goes into a failed row's reason."""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


# ----------------------------------------------------------------------------------------------------
# Child side: one bench module in this (fresh) interpreter.


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _device_config(device: str) -> dict[str, Any]:
    config: dict[str, Any] = {"device": device}
    if device == "cuda":
        import torch

        config["device_name"] = torch.cuda.get_device_name()
    return config


def _check_rows(rows: Any) -> list[dict[str, Any]]:
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "benchmark" in r for r in rows):
        raise TypeError(f"rows() must return a list of dicts with a 'benchmark' key, got {type(rows).__name__}")
    return rows


def _die_with_parent() -> None:
    """Linux: ask the kernel to SIGKILL this child when the runner dies, even by SIGKILL (then nobody is left
    to kill our process group, and a hung module would live on). Elsewhere a no-op."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def child_main(argv: list[str] | None = None) -> int:
    """Run one bench module and write its outcome to a JSON file (see the module docstring)."""
    _die_with_parent()
    args = sys.argv[1:] if argv is None else argv
    path, out = Path(args[0]), Path(args[1])
    quick = "--quick" in args[2:]
    device = os.environ.get(DEVICE_ENV, "cpu")
    # A bench module may import its neighbours (e.g. a shared timing helper), as this one is imported.
    sys.path.insert(0, str(path.resolve().parent))
    try:
        rows = _check_rows(_load(path).rows(quick))
        # Asked after the rows are measured: initialising CUDA earlier would make a later fork unsafe.
        extra = _device_config(device)
        for row in rows:
            row.setdefault("status", "ok")
            row["config"] = {**(row.get("config") or {}), **extra}
        result: dict[str, Any] = {"status": "ok", "rows": rows}
    except BaseException as exc:  # noqa: BLE001 - SystemExit/KeyboardInterrupt too: the runner wants a reason
        traceback.print_exc()
        result = {"status": "failed", "reason": error_reason(exc)}
    # default=str: a stray numpy float or Path in a config must not cost the whole module its rows.
    out.write_text(json.dumps(result, default=str))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(child_main())
