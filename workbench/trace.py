"""Per-rank traces: named spans, a communication log and a memory ledger.

Everything recorded here is a plain dataclass of numbers and strings, so a trace pickles across the
process boundary, serialises to JSON for ``summary.json`` and is drawn by ``workbench.viz`` without
touching torch.distributed.

Each rank process has at most one *active* tracer (set by ``launch`` for the duration of the user's
function). ``comm`` and the parallel wrappers record into ``current()``; with no active tracer, recording
is a no-op, so library code never has to check. Timestamps are ``time.time()`` seconds, comparable across
the ranks of one machine (and, with synchronised clocks, of a cluster).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

#: Categories of the memory ledger, in the order figures stack them.
MEMORY_CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "master_weights",
    "activations",
    "comm_buffers",
    "gathered_params",
)

#: Categories of spans; viz colours them consistently.
SPAN_CATEGORIES = ("forward", "backward", "optimizer", "comm", "wait", "idle", "data", "other")
#: The span categories that are this rank's own computation: what an emulated straggler slows down.
COMPUTE_CATEGORIES = ("forward", "backward", "optimizer")


@dataclass
class Span:
    """A named interval of work on one rank (forward, backward, optimizer step, waiting...)."""

    name: str
    category: str
    t0: float
    t1: float
    rank: int
    step: int | None = None


@dataclass
class CommEvent:
    """One collective or point-to-point operation as seen by one rank.

    ``nbytes`` is the logical size of the full tensor the op works on (the unsharded tensor for
    reduce-scatter / all-gather), ``bus_bytes`` what this rank sends under the ring algorithm
    (nccl-tests' "bus bandwidth" accounting), so sum(bus_bytes)/time is comparable across ops.
    For async ops ``t1`` is when ``wait()`` returned.

    With emulated links (``dist.emulation``), ``link`` is the link class the op crossed (``"intra"`` inside a node,
    ``"inter"`` across nodes) and ``modelled_s`` the seconds the α-β model charged it; ``t1 - t0`` is then
    emulated time. Without emulation both stay empty.
    """

    op: str
    nbytes: int
    bus_bytes: float
    dtype: str
    shape: tuple[int, ...]
    group: tuple[int, ...]
    t0: float
    t1: float
    rank: int
    async_op: bool = False
    tag: str = ""
    step: int | None = None
    peer: int | None = None
    link: str = ""
    modelled_s: float | None = None


@dataclass
class MemoryLedger:
    """Bytes per category on this rank: the current value and the peak seen.

    On CPU there is no allocator counter, so code that owns memory (a wrapper allocating a flat gradient
    buffer, an optimizer creating state, saved-tensor hooks) reports it here. Peaks are tracked per
    category and for the total at the moment of each update.
    """

    current: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    peak_total: int = 0

    def set(self, category: str, nbytes: int) -> None:
        _check_category(category)
        self.current[category] = int(nbytes)
        self.peak[category] = max(self.peak.get(category, 0), int(nbytes))
        self.peak_total = max(self.peak_total, self.total())

    def add(self, category: str, delta: int) -> None:
        self.set(category, self.current.get(category, 0) + int(delta))

    def total(self) -> int:
        return sum(self.current.values())

    def reset_peaks(self) -> None:
        self.peak = dict(self.current)
        self.peak_total = self.total()


def _check_category(category: str) -> None:
    if category not in MEMORY_CATEGORIES:
        raise ValueError(f"unknown memory category {category!r}; valid: {', '.join(MEMORY_CATEGORIES)}")


@dataclass
class DeviceMemory:
    """The CUDA caching allocator's own count, taken at the moment the ledger is complete (after the
    optimizer step, before ``zero_grad``), to check the ledger's categories against real bytes.

    ``allocated`` is ``torch.cuda.memory_allocated`` then, beside ``ledger_total`` (the ledger's sum then);
    ``peak_allocated`` is ``max_memory_allocated`` over the run, beside the ledger's ``ledger_peak``. The
    allocator counts more than the ledger's categories and less than ``nvidia-smi`` shows (the CUDA context and
    the allocator's cached free blocks are not "allocated"). What it holds beyond the ledger at that moment is
    named, each measured:

    * ``cublas_workspaces``: cuBLAS's scratch memory, one workspace per (handle, stream) that ran a matmul,
      allocated through torch's caching allocator at the first matmul and kept for the process's life. The
      forward's thread and autograd's backward thread each have a handle, so a training step holds two (on an
      H100 with torch 2.11, 32 MiB each: 65 MiB against the tiny GPT's 1.8 MiB of model states). Measured as
      what ``torch._C._cuda_clearCublasWorkspaces()`` gives back (cuBLAS allocates them again at the next
      matmul, from the allocator's cache); None where torch lacks that call.
    * ``batch``: the step's input and target tensors, still referenced at the record point.

    ``unexplained`` is what is left (the step's loss and grad-norm scalars, each block's rounding to 512 bytes):
    small, and a large figure there is a leak or an uncounted category.

    ``utilization`` is ``torch.cuda.utilization``: the percent of time one or more kernels ran over the
    driver's last sample period (1/6 s to 1 s, as ``nvidia-smi`` shows it), taken at the same moment; a
    busy-ness figure, not FLOP efficiency (a GPU running one small kernel all the time reads 100 %). None where
    it cannot be asked: it needs the ``pynvml`` (nvidia-ml-py) or, on ROCm, ``amdsmi`` package.
    """

    device: str
    allocated: int
    peak_allocated: int
    reserved: int
    ledger_total: int
    ledger_peak: int
    utilization: float | None = None
    cublas_workspaces: int | None = None
    batch: int = 0

    @property
    def unexplained(self) -> int:
        """Allocated bytes that neither the ledger nor a named category above accounts for."""
        return self.allocated - self.ledger_total - (self.cublas_workspaces or 0) - self.batch


@dataclass
class Trace:
    """Everything one rank recorded. Plain data: pickles and turns into JSON via ``to_dict``."""

    rank: int
    world_size: int
    spans: list[Span] = field(default_factory=list)
    comms: list[CommEvent] = field(default_factory=list)
    memory: MemoryLedger = field(default_factory=MemoryLedger)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    device_memory: DeviceMemory | None = None  # only on CUDA, where an allocator can be asked

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        return cls(
            rank=d["rank"],
            world_size=d["world_size"],
            spans=[Span(**s) for s in d.get("spans", [])],
            comms=[CommEvent(**{**c, "shape": tuple(c["shape"]), "group": tuple(c["group"])})
                   for c in d.get("comms", [])],
            memory=MemoryLedger(**d.get("memory", {})),
            device_memory=DeviceMemory(**d["device_memory"]) if d.get("device_memory") else None,
            metrics=list(d.get("metrics", [])),
        )

    def comm_bytes(self, op: str | None = None, step: int | None = None, tag: str | None = None) -> int:
        """Sum of logical bytes of the matching communication events."""
        return sum(e.nbytes for e in self._select(op, step, tag))

    def bus_bytes(self, op: str | None = None, step: int | None = None, tag: str | None = None) -> float:
        return sum(e.bus_bytes for e in self._select(op, step, tag))

    def _select(self, op: str | None, step: int | None, tag: str | None) -> Iterator[CommEvent]:
        for e in self.comms:
            if (op is None or e.op == op) and (step is None or e.step == step) and (tag is None or e.tag == tag):
                yield e


class Tracer:
    """Records into a ``Trace``. Use ``span`` as a context manager; ``comm`` records collectives."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.trace = Trace(rank=rank, world_size=world_size)
        self.step: int | None = None
        self.enabled = True
        #: Whether this step measures memory (saved-activation hooks, the ledger's record, the allocator and
        #: NVML): the trainer turns it off on untraced steps after the first, whose Python hooks and NVML query
        #: would cost host time every step for figures that do not change from step to step.
        self.probe_memory = True
        #: Bytes per collective op since the last ``take_comm_totals``, counted even while ``enabled`` is off
        #: (two dict updates per op): what a live dashboard streams every step without a full trace.
        self.comm_totals: dict[str, int] = {}
        #: An emulated straggler (``launch(..., straggler="rank=R:factor=F")``): this rank's compute spans
        #: (``COMPUTE_CATEGORIES``) last this many times as long, the extra spent asleep inside the span. 1: as is.
        self.slowdown = 1.0
        self._compute_depth = 0
        #: Seconds in outermost compute spans since the last ``take_compute_s``, counted even while ``enabled`` is
        #: off: a rank's own work in a step, the rest of which is waiting (for data, for peers).
        self.compute_s = 0.0

    @property
    def memory(self) -> MemoryLedger:
        return self.trace.memory

    @contextmanager
    def span(self, name: str, category: str = "other") -> Iterator[None]:
        t0 = time.time()
        slowed = self.slowdown != 1.0 and category in COMPUTE_CATEGORIES and self._compute_depth == 0
        self._compute_depth += category in COMPUTE_CATEGORIES
        try:
            yield
        finally:
            self._compute_depth -= category in COMPUTE_CATEGORIES
            if slowed:  # the outermost compute span only, so nested spans are not slowed twice
                time.sleep((self.slowdown - 1.0) * (time.time() - t0))
            if category in COMPUTE_CATEGORIES and self._compute_depth == 0:
                self.compute_s += time.time() - t0
            if self.enabled:
                self.trace.spans.append(Span(name, category, t0, time.time(), self.trace.rank, self.step))

    def record_comm(self, event: CommEvent) -> None:
        self.comm_totals[event.op] = self.comm_totals.get(event.op, 0) + event.nbytes
        if self.enabled:
            event.step = self.step if event.step is None else event.step
            self.trace.comms.append(event)

    def take_compute_s(self) -> float:
        """Compute seconds since the last call (and reset)."""
        seconds, self.compute_s = self.compute_s, 0.0
        return seconds

    def take_comm_totals(self) -> dict[str, int]:
        """Bytes per op counted since the last call, and start counting afresh."""
        totals, self.comm_totals = self.comm_totals, {}
        return totals

    def record_metrics(self, metrics: dict[str, Any]) -> None:
        self.trace.metrics.append(dict(metrics))

    @contextmanager
    def activations(self) -> Iterator[None]:
        """Count bytes autograd saves for backward (saved-tensor hooks) into the ledger's ``activations``.

        Tensors are de-duplicated by storage, and a parameter is not an activation, nor is a view of one
        (``Linear`` saves ``weight.t()``): those bytes already sit under ``parameters``. Autograd frees
        saved tensors as backward consumes them, which no hook reports, so the ledger holds this forward's
        total (its peak) until the caller calls ``release_activations`` after backward.
        """
        import torch

        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            if is_parameter_bytes(t):
                return t
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                self.memory.add("activations", t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def release_activations(self) -> None:
        self.memory.set("activations", 0)


def is_parameter_bytes(t: Any) -> bool:
    """A parameter, a view of one, or a copy of one made to compute with: bytes of the model, not activations.

    Copies: autocast's cast of a weight to the compute dtype (``_to_copy`` of a leaf parameter), and the full
    parameters an autograd Function gathers from shards when it says so (``gathers_parameters = True`` on the
    Function, as ZeRO-3's unshard does)."""
    import torch

    base = t._base if t._base is not None else t
    if isinstance(base, torch.nn.Parameter):  # not any leaf that requires grad: a pipeline stage's received input
        return True
    node = base.grad_fn
    if node is None:
        return False
    if getattr(getattr(node, "_forward_cls", None), "gathers_parameters", False):
        return True
    return type(node).__name__ == "ToCopyBackward0" and _only_parameters_feed(node)


def _only_parameters_feed(node: Any) -> bool:
    """True when every input of the autograd ``node`` is a parameter (an AccumulateGrad whose leaf is one)."""
    import torch

    inputs = [fn for fn, _ in node.next_functions if fn is not None]
    return bool(inputs) and all(isinstance(getattr(fn, "variable", None), torch.nn.Parameter) for fn in inputs)


class _Active:
    """The tracer of this process, if any. A process-local slot, not a process group."""

    tracer: Tracer | None = None


def current() -> Tracer | None:
    """The active tracer of this process, or None when nothing is being traced."""
    return _Active.tracer


@contextmanager
def tracing(tracer: Tracer | None = None, rank: int = 0, world_size: int = 1) -> Iterator[Tracer]:
    """Make ``tracer`` (a new one by default) the active tracer for the duration of the block."""
    previous = _Active.tracer
    _Active.tracer = tracer if tracer is not None else Tracer(rank, world_size)
    try:
        yield _Active.tracer
    finally:
        _Active.tracer = previous


@contextmanager
def untraced() -> Iterator[None]:
    """No active tracer for the duration of the block (what a run without tracing pays: nothing is recorded)."""
    previous = _Active.tracer
    _Active.tracer = None
    try:
        yield
    finally:
        _Active.tracer = previous


@contextmanager
def span(name: str, category: str = "other") -> Iterator[None]:
    """Record a span on the active tracer; a no-op when nothing is being traced."""
    tracer = current()
    if tracer is None:
        yield
        return
    with tracer.span(name, category):
        yield


def set_step(step: int | None) -> None:
    tracer = current()
    if tracer is not None:
        tracer.step = step


def tensor_bytes(tensors: Any) -> int:
    """Bytes held by an iterable of tensors (duck-typed: anything with numel and element_size)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def ledger_set(category: str, nbytes: int) -> None:
    tracer = current()
    if tracer is not None:
        tracer.memory.set(category, nbytes)


def record_device_memory(device: Any, batch_bytes: int = 0) -> None:
    """On a CUDA device, store the allocator's figures beside the ledger's (see ``DeviceMemory``);
    ``batch_bytes``: the step's inputs and targets, alive at this moment."""
    tracer = current()
    if tracer is None or getattr(device, "type", str(device)) != "cuda":
        return
    import torch

    ledger = tracer.memory
    allocated = torch.cuda.memory_allocated(device)
    tracer.trace.device_memory = DeviceMemory(
        device=str(device), allocated=allocated,
        peak_allocated=torch.cuda.max_memory_allocated(device), reserved=torch.cuda.memory_reserved(device),
        ledger_total=ledger.total(), ledger_peak=ledger.peak_total, utilization=device_utilization(device),
        cublas_workspaces=cublas_workspace_bytes(device), batch=int(batch_bytes))


def cublas_workspace_bytes(device: Any) -> int | None:
    """The bytes cuBLAS's workspaces hold on ``device``, measured by handing them back to the caching allocator
    (``torch._C._cuda_clearCublasWorkspaces``; no sync, and the next matmul takes a workspace again from the
    allocator's cache); None where this torch has no such call."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return None
    with torch.cuda.device(device):
        before = torch.cuda.memory_allocated(device)
        clear()
        return max(0, before - torch.cuda.memory_allocated(device))


class _Utilization:
    """Whether ``torch.cuda.utilization`` failed once in this process: it is asked after every step, and a
    missing pynvml would otherwise cost a failed import each time."""

    unavailable = False


def device_utilization(device: Any) -> float | None:
    """``torch.cuda.utilization(device)`` in percent, or None where it cannot be asked (no pynvml/amdsmi, no
    NVML driver, not a CUDA device); after one failure, None without asking again."""
    if _Utilization.unavailable:
        return None
    import torch

    try:
        return float(torch.cuda.utilization(device))
    except Exception:  # noqa: BLE001 - ModuleNotFoundError (no pynvml), pynvml.NVMLError, RuntimeError: all "unknown"
        _Utilization.unavailable = True
        return None


def ledger_add(category: str, delta: int) -> None:
    tracer = current()
    if tracer is not None:
        tracer.memory.add(category, delta)
