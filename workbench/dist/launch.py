"""Run a function on N real torch.distributed ranks, from a notebook cell, a script or under torchrun.

``launch(fn, world_size)`` starts one process per rank, brings up the process group, calls ``fn`` on
every rank and returns the per-rank return values in rank order, with each rank's trace attached.

How it stays fast, safe and hang-free:

* Ranks are forked from a *forkserver* that has already imported torch, so a launch costs ~0.1 s after
  the first, and a rank never inherits an initialised CUDA context from the notebook kernel (plain fork
  would). ``fn`` travels by value with cloudpickle, so functions defined in a notebook cell or a script's
  ``__main__`` work (plain pickle, as ``mp.spawn`` uses, cannot ship those).
* The rendezvous store is hosted by the caller on 127.0.0.1 on a port the OS picked, so there is no
  free-port race and two launches in a row in one kernel never collide.
* Every process group has ``timeout``: a collective that one rank never joins raises on the ranks that
  did. A rank that raises or dies makes the caller stop all others at once and raise ``RankError``;
  ranks exit on their own if the caller dies. No orphan processes in any of these cases.
* Each rank runs in a process group of its own, so a signal for the whole job (Ctrl-C in a terminal reaches the
  foreground group) reaches the caller alone, which decides: ``workbench.run`` stops the ranks at a step
  boundary on the first SIGTERM/SIGINT and tears them down on the second.
* Each rank's stdout/stderr (C++ included: fds 1 and 2 are redirected) is relayed to the caller's
  ``sys.stdout``/``sys.stderr`` line by line, prefixed ``[rank r]``, so it appears in the notebook cell.

One device per rank. ``resolve_placement`` decides, before anything is spawned, where the ranks run:
CUDA + NCCL when every rank of this node gets a GPU of its own, otherwise gloo on the CPU. NCCL refuses two
ranks on one GPU ("invalid usage") and gloo collectives on CUDA tensors crashed a rank on an H100
(``writev: Bad address``), so with fewer GPUs than ranks the only honest choice is the CPU, said in one
line. Inside a rank ``rank_device()`` is the device every tensor is born on (``cuda:LOCAL_RANK``, made
current, or ``cpu``).
"""

from __future__ import annotations

import codecs
import contextlib
import datetime
import errno
import multiprocessing as mp
import os
import queue as queue_module
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from workbench import trace
from workbench.dist import emulation
from workbench.dist.emulation import LinkEmulation, Straggler, resolve_time_scale
from workbench.dist.faults import LOST_RANK_EXIT_CODE, RESTART_ENV, restart_count
from workbench.dist.notices import say
from workbench.theory.comm import Link

VALID_BACKENDS = ("gloo", "nccl")
VALID_DEVICES = ("auto", "cpu", "cuda")
#: Default for ``launch(device=...)`` and ``workbench run --device`` (e.g. ``cpu`` to keep a GPU free).
DEVICE_ENV = "WORKBENCH_DEVICE"
_RANK_DEVICE_ENV = "WORKBENCH_RANK_DEVICE"
_TERMINATE_GRACE_S = 2.0
_DEATH_DRAIN_S = 0.5
_ROOT_CAUSE_WINDOW_S = 1.0
TIMEOUT_ENV = "WORKBENCH_TIMEOUT"


class RankError(RuntimeError):
    """A rank raised, died or timed out. ``rank``, ``remote_traceback`` and ``exit_code`` tell which/how."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "", exit_code: int | None = None):
        self.rank = rank
        self.message = message
        self.remote_traceback = remote_traceback
        self.exit_code = exit_code
        self.restarts: list[dict[str, Any]] = []  # the restarts made before this, final, failure
        text = f"rank {rank} failed: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


class RankResults(list):
    """The per-rank return values of ``fn`` in rank order; ``.traces`` holds each rank's ``Trace``."""

    def __init__(self, values: list[Any], traces: list[trace.Trace]):
        super().__init__(values)
        self.traces = traces
        self.restarts: list[dict[str, Any]] = []  # one entry per restart launch(max_restarts=...) made


@dataclass(frozen=True)
class Placement:
    """Where the ranks of a launch run: ``backend`` (gloo/nccl), ``device`` (cpu/cuda) and, when ``auto``
    could not use the GPUs it saw, ``note``: the one line that says why."""

    backend: str
    device: str
    note: str = ""

    def describe(self, world_size: int) -> str:
        where = "one GPU each" if self.device == "cuda" else "the CPU"
        text = f"{world_size} rank(s), {self.backend} on {where}"
        return f"{text} ({self.note})" if self.note else text


def visible_gpus() -> int:
    """CUDA devices this process can use (0 on a CPU build or a machine without a GPU)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_placement(world_size: int, device: str | None = None, backend: str | None = None,
                      gpus: int | None = None, nccl_available: bool | None = None) -> Placement:
    """Pick backend and device for ``world_size`` ranks on this node, or raise ``ValueError`` naming the fix.

    ``device``: ``auto`` (default; ``$WORKBENCH_DEVICE`` overrides the default), ``cpu`` or ``cuda``.
    ``auto`` is CUDA + NCCL when at least one GPU per rank is visible, else gloo on the CPU with a note.
    ``gpus``/``nccl_available`` default to what this machine has (tests pass them to play other machines).
    Under torchrun the ranks of *this node* (``LOCAL_WORLD_SIZE``) are what must each get a GPU.
    """
    if backend in (None, "auto"):
        backend = None
    elif backend not in VALID_BACKENDS:
        raise ValueError(f"backend must be one of {VALID_BACKENDS} (or auto), got {backend!r}")
    if device is None:  # the environment sets a default device; an explicit backend chooses its own
        device = "auto" if backend else os.environ.get(DEVICE_ENV) or "auto"
    if device not in VALID_DEVICES:
        raise ValueError(f"device must be one of {VALID_DEVICES}, got {device!r}")
    gpus = visible_gpus() if gpus is None else gpus
    nccl = (dist.is_nccl_available() if nccl_available is None else nccl_available) and gpus > 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun() else world_size
    if backend == "gloo" or device == "cpu":
        if backend == "gloo" and device == "cuda":
            raise ValueError("backend='gloo' with device='cuda': gloo collectives on CUDA tensors crashed the "
                             "rank when measured (writev: Bad address); use backend='nccl' or device='cpu'")
        if backend == "nccl":
            raise ValueError("backend='nccl' needs CUDA tensors, but device='cpu'; use backend='gloo' with "
                             "device='cpu', or device='cuda'")
        return Placement("gloo", "cpu")
    if device == "cuda" or backend == "nccl":
        _require_gpus(local, gpus, nccl, asked=f"device='{device}'" if backend is None else "backend='nccl'")
        return Placement("nccl", "cuda")
    if nccl and gpus >= local:
        return Placement("nccl", "cuda")
    if gpus > 0:
        why = (f"{local} ranks but {gpus} GPU(s) visible and NCCL needs one GPU per rank" if nccl
               else "this torch has no NCCL")
        return Placement("gloo", "cpu", f"running gloo on the CPU: {why}")
    return Placement("gloo", "cpu")


def _require_gpus(ranks: int, gpus: int, nccl: bool, asked: str) -> None:
    if gpus == 0:
        build = f"torch {torch.__version__} has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"{asked} but no CUDA device is available ({build}); use device='cpu' (gloo) or "
                         f"device='auto', which falls back to the CPU")
    if not nccl:
        raise ValueError(f"{asked} needs NCCL, which this torch build lacks; use device='cpu' (gloo)")
    if gpus < ranks:
        raise ValueError(f"{asked} needs one GPU per rank: {ranks} ranks but {gpus} GPU(s) visible (NCCL "
                         f"refuses two ranks on one GPU; gloo cannot move CUDA tensors); use {gpus} rank(s) "
                         f"or less, or device='cpu' (gloo on the CPU)")


def usable_cores() -> int:
    """Cores this process may run on (a container's CPU set or taskset may allow fewer than the machine has)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_backend(world_size: int = 1) -> str:
    """The backend ``launch`` picks for ``world_size`` ranks: NCCL with one GPU per rank, else gloo."""
    return resolve_placement(world_size).backend


def rank_device() -> torch.device:
    """The device this rank creates its tensors on: ``cuda:LOCAL_RANK`` under NCCL, else the CPU.

    Outside ``launch`` (one process, a test, a notebook cell) it is the CPU."""
    if os.environ.get(_RANK_DEVICE_ENV) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: What torchrun sets in each process; ``under_torchrun`` reads the env:// four, and a child without any of them (and
#: without ``TORCHELASTIC_*``) launches ranks of its own.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                      "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME")


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another launcher setting the env:// vars)."""
    return all(k in os.environ for k in TORCHRUN_VARIABLES[:4])


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
           device: str | None = None, timeout: float = 60.0, port: int = 0,
           on_report: Callable[[int, Any], None] | None = None, max_restarts: int = 0,
           on_restart: Callable[[int, RankError], None] | None = None, nodes: int | None = None,
           intra_link: str | Link = "nvlink", inter_link: str | Link = "infiniband", time_scale: float | str = 1.0,
           distribution: str = "block", straggler: str | Straggler | None = None, **kwargs: Any) -> RankResults:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks; return their results in rank order.

    ``device`` (``auto``/``cpu``/``cuda``) and ``backend`` choose where ranks run (``resolve_placement``);
    inside ``fn``, ``rank_device()`` is this rank's device. ``timeout`` (seconds) bounds every collective.
    ``port`` is the rendezvous port on 127.0.0.1 (0: the OS picks a free one). ``on_report(rank, obj)`` is
    called in the caller for each ``workbench.launch.report(obj)`` a rank makes while running.
    ``max_restarts``: after a rank fails (raises, dies, or a collective times out), stop every rank and start
    them all again, up to this many times (torchelastic's rule: restart the whole group, never one rank); in a
    restarted rank ``workbench.faults.restart_count()`` says which attempt it is, so ``fn`` can resume from its
    newest checkpoint. ``on_restart(attempt, error)`` is called before each restart; the result's ``restarts``
    lists them. Under torchrun, its own ``--max-restarts`` does this and ``max_restarts`` is ignored.
    ``nodes`` (default None: no emulation) groups the ranks into that many emulated nodes, node-major, joined by
    ``intra_link`` inside a node and ``inter_link`` between nodes (presets ``nvlink``, ``pcie``, ``infiniband``,
    ``ethernet``, or ``"GBPS,US"``): every ``comm`` op then takes the α-β model's time over the links it crosses,
    multiplied by ``time_scale`` (a number, or a GPU name such as ``"h100-bf16"`` to keep that cluster's compute :
    communication ratio on this CPU); see ``workbench.dist.emulation``. ``distribution="cyclic"`` deals the ranks to
    the nodes round-robin instead of node-major (Slurm's ``--distribution``). ``straggler="rank=R:factor=F"`` makes rank
    R's forward, backward and optimizer spans last F times as long.
    ``backend``, ``device``, ``timeout``, ``port``, ``on_report``, ``max_restarts``, ``on_restart``, ``nodes``,
    ``intra_link``, ``inter_link``, ``time_scale``, ``distribution`` and ``straggler`` are launch's own keywords; all
    other keywords go to ``fn``.

    Raises ``RankError`` (a RuntimeError) naming the rank when a rank raises, dies or a collective times
    out; ``ValueError`` for bad arguments, before any process is started.
    """
    placement = _validate(fn, world_size, backend, device, timeout, port)
    emulated = Emulated(link_emulation(world_size, nodes, intra_link, inter_link, time_scale, distribution),
                        None if straggler is None else Straggler.parse(straggler, world_size))
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0 (how often to restart all ranks after a failure), "
                         f"got {max_restarts!r}")
    if placement.note and os.environ.get("LOCAL_RANK", "0") == "0":  # once per node, not once per rank
        say(placement.note)
    if under_torchrun():
        return _run_under_torchrun(fn, world_size, placement, timeout, on_report, args, kwargs, emulated)
    restarts: list[dict[str, Any]] = []
    for attempt in range(max_restarts + 1):
        try:
            results = _spawn_and_run(fn, world_size, placement, timeout, port, on_report, args, kwargs, attempt,
                                     emulated)
        except RankError as error:
            error.restarts = restarts
            if attempt == max_restarts or error.exit_code == LOST_RANK_EXIT_CODE:  # a lost rank would not come back
                raise
            restarts.append({"attempt": attempt + 1, "rank": error.rank,
                             "reason": error.message.splitlines()[0][:300], "time": time.time()})
            say(f"rank {error.rank} failed ({restarts[-1]['reason']}); restarting all {world_size} rank(s), "
                f"restart {attempt + 1} of {max_restarts}")
            if on_restart is not None:
                on_restart(attempt + 1, error)
            continue
        results.restarts = restarts
        return results
    raise AssertionError("unreachable: the last attempt returns or raises")


class _Reporter:
    """Where ``report`` sends to in this process: the caller's queue in a spawned rank, or a callback."""

    send: Callable[[Any], None] | None = None


def report(obj: Any) -> None:
    """Send a small picklable object to the caller's ``on_report`` (a no-op when nobody listens)."""
    if _Reporter.send is not None:
        _Reporter.send(obj)


@dataclass(frozen=True)
class Emulated:
    """What a launch emulates in every rank: links (``LinkEmulation``) and a straggler; both None: nothing."""

    links: LinkEmulation | None = None
    straggler: Straggler | None = None

    @contextlib.contextmanager
    def applied(self, rank: int, world_size: int) -> Any:
        """This rank's tracer, with the straggler's slowdown and the emulated links in force for the block."""
        with trace.tracing(rank=rank, world_size=world_size) as tracer, emulation.emulating(self.links):
            if self.straggler is not None:
                tracer.slowdown = self.straggler.slowdown(rank)
            yield tracer


def link_emulation(world_size: int, nodes: int | None, intra_link: str | Link = "nvlink",
                   inter_link: str | Link = "infiniband", time_scale: float | str = 1.0,
                   distribution: str = "block") -> LinkEmulation | None:
    """The emulated topology ``launch`` was asked for (None when ``nodes`` is None), checked before any rank
    starts; a GPU-named time scale is measured here, once, not in every rank."""
    if nodes is None:
        return None
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be a positive int (emulated nodes the ranks are spread over), got {nodes!r}")
    return LinkEmulation.build(world_size, nodes, intra_link, inter_link, resolve_time_scale(time_scale, world_size),
                               distribution)


def _validate(fn: Any, world_size: Any, backend: str | None, device: str | None, timeout: Any,
              port: Any) -> Placement:
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535 (0 lets the OS pick), got {port!r}")
    return resolve_placement(world_size, device, backend)


# ----------------------------------------------------------------------------------------------------
# torchrun: this process is one rank; run fn for it and share results so every rank returns the list.


def _run_under_torchrun(fn: Callable[..., Any], world_size: int, placement: Placement, timeout: float,
                        on_report: Callable[[int, Any], None] | None, args: tuple, kwargs: dict,
                        emulated: Emulated | None = None) -> RankResults:
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise ValueError(f"world_size={world_size} but torchrun started WORLD_SIZE={env_world} ranks; "
                         f"pass world_size={env_world} or change --nproc-per-node")
    emulated = emulated or Emulated()
    if emulated.links is not None and int(os.environ.get("LOCAL_WORLD_SIZE", env_world)) != env_world:
        # Emulation compares the ranks' time.time(); clocks of different machines do not agree closely enough.
        raise ValueError("emulated nodes need every rank on this machine, but torchrun spread them over several; "
                         "drop nodes= (the real links are already there) or run torchrun with --nnodes 1")
    rank = int(os.environ["RANK"])
    _Reporter.send = (lambda obj: on_report(rank, obj)) if on_report is not None else None
    _bind_device(placement.device, int(os.environ.get("LOCAL_RANK", 0)))
    os.environ[TIMEOUT_ENV] = str(timeout)
    owns_group = not dist.is_initialized()
    if owns_group:
        _init_torchrun_group(placement.backend, timeout)
    try:
        with emulated.applied(rank, world_size) as tracer:
            result = fn(*args, **kwargs)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (result, tracer.trace))
        return RankResults([r for r, _ in gathered], [t for _, t in gathered])
    finally:
        _Reporter.send = None
        if owns_group:
            dist.destroy_process_group()


def _init_torchrun_group(backend: str, timeout: float) -> None:
    """``env://`` rendezvous, with this attempt's keys under their own prefix: after a restart torchrun's store
    still holds the previous attempt's keys, and a rank reading the dead rank 0's gloo address from them fails
    with "Connection refused" before the new rank 0 has overwritten it (seen on a loaded machine)."""
    td = datetime.timedelta(seconds=timeout)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=td))
    store = dist.PrefixStore(f"workbench/attempt-{restart_count()}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=td)


# ----------------------------------------------------------------------------------------------------
# Notebook / script: spawn the ranks ourselves.


def mp_context() -> Any:
    """The multiprocessing context ranks start from (``launch`` and ``rank_pool``): a forkserver."""
    ctx = mp.get_context("forkserver")
    # Preloading makes each rank a fork of a process that has already paid torch's import (~1 s).
    ctx.set_forkserver_preload(["torch", "torch.distributed", "cloudpickle", "workbench.launch"])
    return ctx


def _spawn_and_run(fn: Callable[..., Any], world_size: int, placement: Placement, timeout: float, port: int,
                   on_report: Callable[[int, Any], None] | None, args: tuple, kwargs: dict,
                   attempt: int = 0, emulated: Emulated | None = None) -> RankResults:
    ctx = mp_context()
    payload = cloudpickle.dumps((fn, args, kwargs))
    store = host_store(port, world_size, timeout)
    messages = ctx.Queue()
    procs = []
    try:
        with main_not_reimported():
            for rank in range(world_size):
                p = ctx.Process(target=_rank_main, name=f"workbench-rank{rank}", daemon=True,
                                args=(rank, world_size, store.port, placement, timeout, payload, messages,
                                      os.getpid(), on_report is not None, attempt, emulated))
                p.start()
                procs.append(p)
        return _supervise(procs, messages, timeout, on_report)
    finally:
        stop_all(procs)
        messages.close()
        messages.join_thread()
        del store


@contextlib.contextmanager
def main_not_reimported() -> Any:
    """Ranks get ``fn`` by value (cloudpickle) and never need the caller's ``__main__``, but multiprocessing
    re-imports it by path in each child: that fails for a script read from stdin (``python - <<EOF``, path
    ``<stdin>``). Hide a path that is not a file while the ranks start."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or os.path.exists(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def host_store(port: int, world_size: int, timeout: float) -> Any:
    """The rendezvous store, hosted here; a port already taken is a clear ValueError, not a C++ trace."""
    try:
        return dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        text = str(exc)
        if port and ("EADDRINUSE" in text or "in use" in text or f"code: -{errno.EADDRINUSE}" in text):
            raise ValueError(f"rendezvous port {port} on 127.0.0.1 is already in use (another run or server "
                             f"holds it); pass port=0 (--port 0) to let the OS pick a free one") from None
        raise


def _supervise(procs: list[Any], messages: Any, timeout: float,
               on_report: Callable[[int, Any], None] | None = None) -> RankResults:
    """Relay output, collect results; on the first failure stop everyone and raise."""
    world_size = len(procs)
    results: dict[int, tuple[Any, trace.Trace]] = {}
    errors: list[RankError] = []
    dead_since: dict[int, float] = {}
    while len(results) < world_size and not errors:
        _handle(_next_message(messages), results, errors, on_report)
        _check_deaths(procs, results, errors, dead_since)
    if errors:
        # One failure causes others (peers see "connection closed", waiting ranks time out): listen a
        # moment longer so the root cause and the rank that never joined can be told apart.
        _collect_for(_ROOT_CAUSE_WINDOW_S, procs, messages, results, errors, dead_since)
        stop_all(procs)
        _drain(messages, results, errors)
        raise _explain(errors, results, world_size, timeout)
    _drain(messages, results, errors, on_report)
    ordered = [results[r] for r in range(world_size)]
    return RankResults([value for value, _ in ordered], [t for _, t in ordered])


def _check_deaths(procs: list[Any], results: dict, errors: list, dead_since: dict) -> None:
    """A rank whose process ended without reporting died (signal, os._exit...)."""
    now = time.time()
    reported = {e.rank for e in errors}
    for rank, p in enumerate(procs):
        if rank in results or rank in reported or p.exitcode is None:
            continue
        # Its last messages may still be in the queue: give them a moment before calling it a death.
        dead_since.setdefault(rank, now)
        if now - dead_since[rank] > _DEATH_DRAIN_S:
            errors.append(death_error(rank, p.exitcode))


def _collect_for(seconds: float, procs: list[Any], messages: Any, results: dict, errors: list,
                 dead_since: dict) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and len(results) + len({e.rank for e in errors}) < len(procs):
        _handle(_next_message(messages), results, errors)
        _check_deaths(procs, results, errors, dead_since)


def _next_message(messages: Any, wait: float = 0.05) -> tuple | None:
    try:
        return messages.get(timeout=wait)
    except queue_module.Empty:
        return None


def _handle(msg: tuple | None, results: dict, errors: list,
            on_report: Callable[[int, Any], None] | None = None) -> None:
    if msg is None:
        return
    kind, rank = msg[0], msg[1]
    if kind == "out":
        stream = sys.stdout if msg[2] == "stdout" else sys.stderr
        stream.write(msg[3])
        stream.flush()
    elif kind == "report":
        if on_report is not None:
            on_report(rank, msg[2])
    elif kind == "ok":
        results[rank] = cloudpickle.loads(msg[2])
    elif kind == "error":
        errors.append(RankError(rank, msg[2], msg[3]))


def _drain(messages: Any, results: dict, errors: list,
           on_report: Callable[[int, Any], None] | None = None) -> None:
    while (msg := _next_message(messages, wait=0.01)) is not None:
        _handle(msg, results, errors, on_report)


def death_error(rank: int, exit_code: int) -> RankError:
    if exit_code < 0:
        try:
            how = f"was killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            how = f"was killed by signal {-exit_code}"
    elif exit_code == LOST_RANK_EXIT_CODE:
        how = (f"was lost for good (exit code {exit_code}: its node is gone); an elastic run (--min-nproc) goes on "
               f"without it")
    else:
        how = f"exited with code {exit_code} without returning a result"
    return RankError(rank, f"process {how}", exit_code=exit_code)


_TIMEOUT_MARKERS = ("timed out", "timeout")
_PEER_GONE_MARKERS = ("connection closed", "connection reset", "read error", "broken pipe")


def _root_cause_order(error: RankError) -> tuple[int, int]:
    """Errors a rank raised itself first, then deaths, then timeouts, then a closed connection: a rank that
    timed out closes its links, so its peers' "connection closed" is the echo, not the cause."""
    text = error.message.lower()
    if error.exit_code is not None:
        return (1, error.rank)
    if any(marker in text for marker in _TIMEOUT_MARKERS):
        return (2, error.rank)
    if any(marker in text for marker in _PEER_GONE_MARKERS):
        return (3, error.rank)
    return (0, error.rank)


def _explain(errors: list[RankError], results: dict, world_size: int, timeout: float) -> RankError:
    """The root-cause error, with what a learner needs: who else failed, what a timeout usually means."""
    errors = sorted(errors, key=_root_cause_order)
    first, others = errors[0], errors[1:]
    notes = []
    if "timed out" in first.message.lower():
        failed = {e.rank for e in errors}
        silent = [r for r in range(world_size) if r not in results and r not in failed]
        notes.append(f"a collective waited longer than timeout={timeout}s: usually a rank never joined it"
                     + (f" (ranks that were still busy elsewhere: {silent})" if silent else ""))
    if others:
        notes.append("also failed: " + "; ".join(f"rank {e.rank} ({e.message.splitlines()[0][:100]})"
                                                 for e in others))
    if not notes:
        return first
    return RankError(first.rank, first.message + "\n" + "\n".join(notes), first.remote_traceback,
                     first.exit_code)


def stop_all(procs: list[Any]) -> None:
    """SIGTERM every live rank, then SIGKILL what is still there after a grace period; reap all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.time() + _TERMINATE_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


# ----------------------------------------------------------------------------------------------------
# Inside a rank process.


def _rank_main(rank: int, world_size: int, port: int, placement: Placement, timeout: float, payload: bytes,
               messages: Any, parent_pid: int, listens: bool, attempt: int = 0,
               emulated: Emulated | None = None) -> None:
    pumps = _redirect_output(rank, messages)
    _Reporter.send = (lambda obj: messages.put(("report", rank, obj))) if listens else None
    exit_when_parent_dies(parent_pid)
    # Out of the caller's process group: a rank that got Ctrl-C's SIGINT itself would die mid-step (or mid-write
    # of a checkpoint) while the caller asks all ranks to stop together after it (workbench.run's preemption).
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    set_rank_env(rank, world_size, port)
    os.environ[TIMEOUT_ENV] = str(timeout)
    os.environ[RESTART_ENV[0]] = str(attempt)
    ok = False
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        init_rank_process_group(rank, world_size, port, placement, timeout)
        with (emulated or Emulated()).applied(rank, world_size) as tracer:
            result = fn(*args, **kwargs)
        messages.put(("ok", rank, cloudpickle.dumps((result, tracer.trace))))
        ok = True
    except BaseException as exc:  # noqa: BLE001 - everything a rank raises is reported to the caller
        messages.put(("error", rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        _restore_output(pumps)
        messages.close()
        messages.join_thread()
    if ok and dist.is_initialized():
        dist.destroy_process_group()
    # Skip interpreter teardown: after a failure, gloo's destructors can block on dead peers.
    os._exit(0 if ok else 1)


def group_timeout() -> datetime.timedelta:
    """The collective timeout ``launch`` gave this rank; sub-groups (``Mesh``) must use it too, since
    torch gives a new group 30 minutes by default, whatever the world group has."""
    return datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, 60.0)))


def set_rank_env(rank: int, world_size: int, port: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})


def _bind_device(device: str, local_rank: int) -> None:
    """Make ``cuda:local_rank`` current (so NCCL and every ``rank_device()`` tensor use it) or stay on CPU."""
    os.environ[_RANK_DEVICE_ENV] = device
    if device == "cuda":
        torch.cuda.set_device(local_rank)


def init_rank_process_group(rank: int, world_size: int, port: int, placement: Placement, timeout: float) -> None:
    td = datetime.timedelta(seconds=timeout)
    _bind_device(placement.device, rank)  # spawned ranks all live on this node: local rank = rank
    if placement.device == "cpu":
        # N ranks share the machine's cores: one rank per core-share avoids oversubscription.
        torch.set_num_threads(max(1, usable_cores() // world_size))
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=td)
    dist.init_process_group(placement.backend, store=store, rank=rank, world_size=world_size, timeout=td)


def _redirect_output(rank: int, messages: Any) -> list[threading.Thread]:
    """Point fds 1 and 2 at pipes whose lines are relayed to the caller, prefixed with the rank."""
    pumps = []
    for fd, name in ((1, "stdout"), (2, "stderr")):
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)
        os.close(write_end)
        pump = threading.Thread(target=_pump, args=(read_end, name, rank, messages), daemon=True)
        pump.start()
        pumps.append(pump)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    return pumps


def _pump(read_end: int, name: str, rank: int, messages: Any) -> None:
    prefix = f"[rank {rank}] "
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    while chunk := os.read(read_end, 65536):
        pending += decoder.decode(chunk)
        *lines, pending = pending.split("\n")
        if lines:
            messages.put(("out", rank, name, "".join(prefix + line + "\n" for line in lines)))
    os.close(read_end)
    if pending:
        messages.put(("out", rank, name, prefix + pending + "\n"))


def _restore_output(pumps: list[threading.Thread]) -> None:
    """Flush, close the pipes' write ends (fds 1, 2 -> /dev/null) and wait for the relays to finish."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    for pump in pumps:
        pump.join(5.0)


def exit_when_parent_dies(parent_pid: int) -> None:
    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
