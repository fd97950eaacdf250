"""A pool of persistent torch.distributed ranks that run code strings, cell by cell.

``launch`` runs one function on fresh ranks and tears them down; a ``RankPool`` keeps N ranks alive so a
learner can poke at them interactively (``workbench.magics`` puts it behind ``%ranks`` / ``%%ranks``)::

    pool = RankPool(2, timeout=30)
    pool.run("x = torch.tensor([rank + 1.0], device=device)")
    pool.run("comm.all_reduce(x); x")          # every rank's last expression: tensor([3.])
    pool.stop()

Each rank execs the code in its own namespace, which persists across runs and starts with ``rank``,
``world_size``, ``device``, ``torch``, ``dist`` and ``comm``. Its stdout/stderr (C++ included: fds 1 and 2
are captured) and the repr of the code's last expression come back per rank as a ``RankResult``.

Ranks start the way ``launch`` starts them (its helpers are reused): forked from a forkserver that has
already imported torch, rendezvous on 127.0.0.1 on a port the OS picked, every process group bounded by
``timeout``, and each rank exits when the caller dies (a watcher thread and ``PR_SET_PDEATHSIG``).

Failure modes, and what the pool does:

* A Python exception on a rank comes back as that rank's traceback; the pool keeps going.
* A rank that dies, or does not answer within the timeout (typically a collective that not every rank
  joined), is reported naming the rank, and the pool is marked *broken*: the ranks' process group may be
  out of step, so further runs refuse until ``restart()``. So does an interrupt (Ctrl-C) while ranks run.
* ``run(code, ranks=[0, 2])`` runs on a subset only. A collective in such code waits for ranks that never
  join it: that is the learner's choice to make (it is how a hang is demonstrated), and the timeout
  reports it.

``stop()`` is idempotent and also runs at interpreter exit, so shutting a kernel down leaves no orphans.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import ctypes
import linecache
import multiprocessing.connection as mp_connection
import os
import signal
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workbench import trace
from workbench.dist import emulation
from workbench.dist.emulation import LinkEmulation, Straggler
from workbench.dist.launch import (
    TIMEOUT_ENV,
    Placement,
    death_error,
    exit_when_parent_dies,
    host_store,
    init_rank_process_group,
    main_not_reimported,
    mp_context,
    rank_device,
    resolve_placement,
    set_rank_env,
    stop_all,
)
from workbench.theory.checks import positive_int, positive_number

#: Seconds a rank may take beyond the collective timeout before the caller calls it hung: the process
#: group's own timeout error (which names the collective) should arrive first.
_ANSWER_GRACE_S = 2.0
_START_GRACE_S = 30.0
_MAX_TEXT = 100_000  # characters kept of one rank's stdout, stderr or repr: a notebook cell is no log file
_PR_SET_PDEATHSIG = 1
_COLLECTIVE_TIMEOUT_MARKERS = ("timed out", "timeout")


class PoolBrokenError(RuntimeError):
    """The pool lost a rank (death or no answer); ``restart()`` it before running more code."""


@dataclass
class RankResult:
    """What one rank sent back for one run. ``value`` is the repr of the code's last expression (None when
    the code does not end in an expression or raised); ``error`` the traceback (None when it succeeded);
    ``lost`` is True when the rank died or did not answer; ``trace`` the collectives it logged."""

    rank: int
    stdout: str = ""
    stderr: str = ""
    value: str | None = None
    error: str | None = None
    elapsed: float = 0.0
    lost: bool = False
    trace: trace.Trace | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class RankStatus:
    """One rank's process: ``rss_bytes`` is its resident memory (None where /proc cannot tell)."""

    rank: int
    pid: int | None
    alive: bool
    device: str
    rss_bytes: int | None


_LIVE_POOLS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_live_pools() -> None:
    """Kernel shutdown: stop every pool still running so no rank outlives the process."""
    for pool in list(_LIVE_POOLS):
        pool.stop()


class RankPool:
    """``world_size`` persistent ranks that ``run`` code strings; see the module docstring."""

    def __init__(self, world_size: int, timeout: float = 60.0, device: str | None = None,
                 backend: str | None = None, links: LinkEmulation | None = None,
                 straggler: str | Straggler | None = None) -> None:
        positive_int("world_size", world_size)
        self.placement = resolve_placement(world_size, device, backend)
        if links is not None and links.topology.world != world_size:
            raise ValueError(f"links are for {links.topology.describe()} = {links.topology.world} ranks, but the pool "
                             f"has {world_size}")
        #: Emulated nodes and links every rank's ``comm`` ops pay (``dist.emulation``); None: the real loopback.
        self.links = links
        #: An emulated straggler: its rank's forward, backward and optimizer spans take ``factor`` times as long.
        self.straggler = None if straggler is None else Straggler.parse(straggler, world_size)
        self.world_size = world_size
        self.timeout = positive_number("timeout", timeout, "seconds")
        self.broken: str | None = None
        self.last_results: list[RankResult] = []
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._devices: list[str] = []
        self._store: Any = None
        self._start()

    # -- lifecycle -------------------------------------------------------------------------------------

    def _start(self) -> None:
        ctx = mp_context()
        self._store = host_store(0, self.world_size, self.timeout)
        self.broken = None
        try:
            with main_not_reimported():
                for rank in range(self.world_size):
                    ours, theirs = ctx.Pipe(duplex=True)
                    p = ctx.Process(target=_worker_main, name=f"workbench-pool-rank{rank}", daemon=True,
                                    args=(rank, self.world_size, self._store.port, self.placement, self.timeout,
                                          theirs, os.getpid(), self.links, self.straggler))
                    p.start()
                    theirs.close()
                    self._procs.append(p)
                    self._conns.append(ours)
            _LIVE_POOLS.add(self)
            self._devices = self._await_ready()
        except BaseException:
            self.stop()
            raise

    def _await_ready(self) -> list[str]:
        deadline = time.time() + self.timeout + _START_GRACE_S
        devices: dict[int, str] = {}
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.time())):
                raise RuntimeError(f"rank {rank} did not come up within {self.timeout + _START_GRACE_S:.0f}s")
            try:
                kind, payload = conn.recv()
            except EOFError:
                self._procs[rank].join(1.0)
                code = self._procs[rank].exitcode
                how = death_error(rank, code).message if code is not None else "no exit code yet"
                raise RuntimeError(f"rank {rank} died while starting ({how}); see the kernel's stderr") from None
            if kind != "ready":
                raise RuntimeError(f"rank {rank} failed to start:\n{payload}")
            devices[rank] = payload
        return [devices[r] for r in range(self.world_size)]

    def stop(self) -> None:
        """Ask every rank to exit, then terminate and kill what is left; reap all. Safe to call twice."""
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
        deadline = time.time() + 1.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.time()))
        stop_all(self._procs)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._store = [], [], None
        _LIVE_POOLS.discard(self)

    def restart(self) -> None:
        """Stop the ranks and start ``world_size`` fresh ones (namespaces start empty again)."""
        self.stop()
        self._start()

    @property
    def running(self) -> bool:
        return bool(self._procs)

    def status(self) -> list[RankStatus]:
        """Per rank: pid, whether the process is alive, its device and resident memory."""
        return [RankStatus(rank, p.pid, p.is_alive(), self._devices[rank] if rank < len(self._devices) else "?",
                           _rss_bytes(p.pid) if p.is_alive() else None)
                for rank, p in enumerate(self._procs)]

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- running code ----------------------------------------------------------------------------------

    def run(self, code: str, ranks: Sequence[int] | None = None, timeout: float | None = None) -> list[RankResult]:
        """Exec ``code`` on ``ranks`` (all by default); return one ``RankResult`` per rank, in rank order.

        A rank that dies or does not answer within ``timeout`` (default: the pool's) comes back with
        ``lost=True`` and marks the pool broken. Raises ``PoolBrokenError`` on a broken or stopped pool and
        ``ValueError`` for a rank list that does not fit the pool."""
        if not isinstance(code, str):
            raise ValueError(f"code must be a str, got {type(code).__name__}")
        chosen = self.check_ranks(ranks)
        wait = self.timeout + _ANSWER_GRACE_S if timeout is None else positive_number("timeout", timeout, "seconds")
        if not self.running:
            raise PoolBrokenError("the pool is stopped; start one (RankPool(...) / %ranks start N)")
        if self.broken:
            raise PoolBrokenError(f"the pool is broken ({self.broken}); restart it (pool.restart() / "
                                  f"%ranks restart)")
        for rank in chosen:
            with contextlib.suppress(OSError):  # a rank that died since: its closed pipe reports the death
                self._conns[rank].send(code)
        try:
            results = self._collect(chosen, wait)
        except BaseException:
            # Interrupted (Ctrl-C / the notebook's stop button): the ranks may still be running the code and
            # will answer later, out of step with the next run.
            self.broken = f"interrupted while rank(s) {chosen} were running"
            raise
        self.last_results = [results[r] for r in chosen]
        return self.last_results

    def check_ranks(self, ranks: Sequence[int] | None) -> list[int]:
        """``ranks`` as a sorted list of distinct ranks of this pool, or a ValueError naming what is valid."""
        if ranks is None:
            return list(range(self.world_size))
        ranks = list(ranks)
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.world_size]
        if bad or not ranks:
            raise ValueError(f"ranks must be distinct ints in 0..{self.world_size - 1} (the pool has "
                             f"{self.world_size} ranks), got {ranks!r}")
        return sorted(set(ranks))

    def _collect(self, chosen: list[int], wait: float) -> dict[int, RankResult]:
        deadline = time.time() + wait
        results: dict[int, RankResult] = {}
        pending = {self._conns[r]: r for r in chosen}
        while pending:
            ready = mp_connection.wait(list(pending), timeout=max(0.0, deadline - time.time()))
            if not ready:
                break
            for conn in ready:
                rank = pending.pop(conn)
                results[rank] = self._receive(rank, conn)
        for rank in pending.values():
            results[rank] = RankResult(rank, error=f"rank {rank} did not answer within {wait:.1f}s: it is still "
                                       f"running, most likely waiting in a collective that not every rank joined "
                                       f"(on a subset of ranks or behind an if on rank). The pool is now broken: "
                                       f"restart it.", elapsed=wait, lost=True)
        timed_out = [r for r in chosen if _is_collective_timeout(results[r].error)]
        for r in timed_out:
            results[r].error += (f"\n(a collective waited longer than the pool's timeout={self.timeout}s: "
                                 f"usually a rank never joined it. The pool is now broken: restart it.)\n")
        lost = [r for r in chosen if results[r].lost or r in timed_out]
        if lost:
            self.broken = (f"rank(s) {lost} lost or timed out in a collective; the process group may be out "
                           f"of step")
        return results

    def _receive(self, rank: int, conn: Any) -> RankResult:
        try:
            return conn.recv()
        except (EOFError, OSError):
            p = self._procs[rank]
            p.join(1.0)
            how = death_error(rank, p.exitcode).message if p.exitcode is not None else "its pipe closed"
            return RankResult(rank, error=f"rank {rank} died: {how}", lost=True)


def _is_collective_timeout(error: str | None) -> bool:
    if not error:
        return False
    last = error.strip().splitlines()[-1].lower()
    return "error" in last.split(":")[0].lower() and any(m in last for m in _COLLECTIVE_TIMEOUT_MARKERS)


def _rss_bytes(pid: int | None) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# ----------------------------------------------------------------------------------------------------
# Inside a rank process.


def _worker_main(rank: int, world_size: int, port: int, placement: Placement, timeout: float,
                 conn: Any, parent_pid: int, links: LinkEmulation | None = None,
                 straggler: Straggler | None = None) -> None:
    _die_with_parent()
    exit_when_parent_dies(parent_pid)
    set_rank_env(rank, world_size, port)
    os.environ[TIMEOUT_ENV] = str(timeout)
    # Line-buffered streams on fds 1 and 2, which each run points at a capture file.
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    try:
        init_rank_process_group(rank, world_size, port, placement, timeout)
        namespace = _fresh_namespace(rank, world_size)
        conn.send(("ready", str(namespace["device"])))
    except BaseException:  # noqa: BLE001 - a failed start is reported to the caller
        conn.send(("error", traceback.format_exc()))
        os._exit(1)
    with emulation.emulating(links):  # one link clock for the pool's life: queued ops carry across cells
        _serve(rank, world_size, conn, namespace, 1.0 if straggler is None else straggler.slowdown(rank))
    # Skip interpreter teardown: gloo's destructors can block on peers that already left.
    os._exit(0)


def _die_with_parent() -> None:
    """SIGKILL this rank when its parent (the forkserver, which exits with the caller) dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _fresh_namespace(rank: int, world_size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from workbench.dist import comm

    return {"__name__": "__rank__", "rank": rank, "world_size": world_size, "torch": torch, "dist": dist,
            "comm": comm, "device": rank_device()}


def _serve(rank: int, world_size: int, conn: Any, namespace: dict[str, Any], slowdown: float = 1.0) -> None:
    cell = 0
    while True:
        try:
            code = conn.recv()
        except KeyboardInterrupt:  # a notebook interrupt reaches the ranks too: keep serving
            continue
        except EOFError:
            return
        if code is None:
            return
        cell += 1
        conn.send(_run_one(rank, world_size, code, namespace, f"<rank {rank}, cell {cell}>", slowdown))


def _run_one(rank: int, world_size: int, code: str, namespace: dict[str, Any], filename: str,
             slowdown: float = 1.0) -> RankResult:
    result = RankResult(rank)
    t0 = time.perf_counter()
    with _captured_fds() as captured, trace.tracing(rank=rank, world_size=world_size) as tracer:
        tracer.slowdown = slowdown  # an emulated straggler's compute spans (trace.span) take this many times as long
        try:
            result.value = _exec_cell(code, namespace, filename)
        except BaseException as exc:  # noqa: BLE001 - the learner's exception is the result
            result.error = _cell_traceback(exc)
    result.elapsed = time.perf_counter() - t0
    result.stdout, result.stderr = captured
    result.trace = tracer.trace
    return result


def _exec_cell(code: str, namespace: dict[str, Any], filename: str) -> str | None:
    """Exec ``code``; when its last statement is an expression, eval that and return its repr."""
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    tree = ast.parse(code, filename=filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - running the learner's cell is the point
    if last is None:
        return None
    value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)  # noqa: S307
    return None if value is None else _clip(repr(value))


def _cell_traceback(exc: BaseException) -> str:
    """The traceback from the learner's code down, without the pool's own frames."""
    tb = exc.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<rank "):
        tb = tb.tb_next
    return _clip("".join(traceback.format_exception(type(exc), exc, tb)))


@contextlib.contextmanager
def _captured_fds() -> Any:
    """Point fds 1 and 2 at temporary files for the block; yields a list filled with (stdout, stderr)."""
    captured: list[str] = []
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield captured
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            captured.extend(_read_back(f) for f in (out, err))


def _read_back(f: Any) -> str:
    f.seek(0)
    return _clip(f.read(_MAX_TEXT + 1).decode("utf-8", errors="replace"))


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + f"\n... [clipped at {_MAX_TEXT} characters]"

