"""Emulated links: every ``comm`` op takes the time Hockney's α-β model gives over the links it crosses (issue 20).

All ranks of a workbench run share one machine's loopback, so without this a ring that crosses "nodes" costs what
one inside a node costs. With a ``LinkEmulation`` active (``launch(..., nodes=2, inter_link="ethernet")``,
``workbench run --nodes 2``), each op first moves its data for real, then waits until the end the model gives:

* **Which link.** ``Topology.link_of(group)``: a group inside one node pays the intra-node link, a group spanning
  nodes the slowest link it crosses (a ring runs at its slowest hop's pace). A send pays the link between the two
  ranks.
* **How long.** ``Link.collective_time(op, bytes, N)`` (ring all-reduce, reduce-scatter and all-gather, binomial
  broadcast and reduce, pairwise all-to-all, dissemination barrier, one message for send/recv), times
  ``time_scale``.
* **From when.** A collective cannot start before its last member arrives and before each member's link has
  finished the ops it queued earlier: every rank offers ``max(its issue time, its link free time)`` and the
  group's largest is the start (one extra 8-byte all-reduce of those times, issued with the op, so an async op
  still returns at once). A message starts when its sender issues it (or its sender's link frees up); the sender
  tells the receiver the arrival time in an 8-byte message ahead of the data.
* **Until when.** A blocking op returns at ``max(real end, start + modelled)``; an async op's ``Work.wait()``
  returns no earlier than that, so compute between issue and wait still overlaps communication, and ops queued
  on one link run one after another (each rank's link is a queue per link class), as they would on a real NIC.

So the emulation only ever adds waiting: numbers are untouched (a run ends with the same parameters), and where
the real loopback is slower than the modelled link (tiny messages, fast links at ``time_scale`` 1) the real time
shows through. Wall-clock time shown for an emulated run is *emulated* time; notebooks and reports say so.

Clocks: start and arrival times are ``time.time()`` of the ranks' one machine. Across real machines (torchrun on
several hosts) clocks differ; emulating a topology there is refused in ``launch``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from workbench.theory.comm import Link
from workbench.theory.topology import GPU_PEAK_FLOPS, Topology, link_label, parse_link

INTRA, INTER = "intra", "inter"


@dataclass(frozen=True)
class LinkEmulation:
    """A topology whose links every ``comm`` op pays, its modelled seconds multiplied by ``time_scale``.

    ``time_scale`` maps a real cluster onto this machine: with ``time_scale_for("h100-bf16", nproc)`` compute on
    these CPU ranks is that many times slower than on the GPU, so links slowed by as much keep a real cluster's
    compute : communication ratio (the notebooks print the factor).
    """

    topology: Topology
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.topology, Topology):
            raise ValueError(f"topology must be a theory.topology.Topology, got {self.topology!r}")
        scale = self.time_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"time_scale must be a finite number > 0 (modelled seconds are multiplied by it), "
                             f"got {scale!r}")

    @classmethod
    def build(cls, nproc: int, nodes: int = 1, intra_link: str | Link = "nvlink", inter_link: str | Link = "infiniband",
              time_scale: float = 1.0, distribution: str = "block") -> LinkEmulation:
        """From the command line's spellings: link specs as ``parse_link`` reads them (or ``Link`` objects)."""
        return cls(Topology.from_nproc(nproc, nodes, intra=_as_link(intra_link, "intra_link"),
                                       inter=_as_link(inter_link, "inter_link"), distribution=distribution),
                   time_scale)

    def link_class(self, ranks: tuple[int, ...] | list[int]) -> str:
        """``"intra"`` for a group on one node, ``"inter"`` for one spanning nodes."""
        return INTER if self.topology.spans_nodes(list(ranks)) else INTRA

    def modelled_time(self, op: str, nbytes: int, ranks: tuple[int, ...] | list[int]) -> float:
        """Seconds ``op`` on ``nbytes`` takes over the links of ``ranks`` (for send/recv: the two ends)."""
        world = len(ranks)
        if world <= 1:
            return 0.0
        link = self.topology.link_of(list(ranks))
        return self.time_scale * link.collective_time(op, nbytes, world)

    def describe(self) -> str:
        """``2 nodes x 4 ranks, intra nvlink, inter ethernet: 12.5 GB/s, 20 µs (emulated, time scale 1)``."""
        topo = self.topology
        return (f"{topo.describe()}, intra {link_label(topo.intra, detail=True)}, inter "
                f"{link_label(topo.inter, detail=True)} (emulated links, time scale {self.time_scale:g})")


def _as_link(spec: str | Link, name: str) -> Link:
    if isinstance(spec, Link):
        return spec
    try:
        return parse_link(spec)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


STRAGGLER_HELP = "rank=R:factor=F, e.g. rank=1:factor=2 (rank R's compute takes F times as long, F >= 1)"


@dataclass(frozen=True)
class Straggler:
    """One rank whose computation is ``factor`` times slower (a thermally throttled GPU, a noisy neighbour):
    every forward, backward and optimizer span of ``rank`` lasts ``factor`` times as long (``trace.Tracer.slowdown``).
    Synchronous training then waits for it at every collective, which is the lesson."""

    rank: int
    factor: float

    @classmethod
    def parse(cls, spec: str | Straggler, nproc: int) -> Straggler:
        """``rank=R:factor=F`` for a run of ``nproc`` ranks; ``ValueError`` naming the value otherwise."""
        if isinstance(spec, Straggler):
            straggler = spec
        else:
            fields = dict(part.split("=", 1) for part in str(spec).split(":") if "=" in part)
            if set(fields) != {"rank", "factor"} or len(str(spec).split(":")) != 2:
                raise ValueError(f"straggler {spec!r}: expected {STRAGGLER_HELP}")
            try:
                straggler = cls(int(fields["rank"]), float(fields["factor"]))
            except ValueError:
                raise ValueError(f"straggler {spec!r}: expected {STRAGGLER_HELP}") from None
        if not 0 <= straggler.rank < nproc:
            raise ValueError(f"straggler rank {straggler.rank} does not exist: the run has ranks 0..{nproc - 1}")
        if not (math.isfinite(straggler.factor) and straggler.factor >= 1):
            raise ValueError(f"straggler factor must be a finite number >= 1 (how many times slower rank "
                             f"{straggler.rank} computes), got {straggler.factor!r}")
        return straggler

    def slowdown(self, rank: int) -> float:
        """The factor for ``rank``: ``factor`` for the straggler, 1 for everyone else."""
        return self.factor if rank == self.rank else 1.0


class LinkClock:
    """This rank's links while an emulation is active: when each link class is next free."""

    def __init__(self, emulation: LinkEmulation) -> None:
        self.emulation = emulation
        self._free_at: dict[str, float] = {}

    def offer(self, link: str, t0: float) -> float:
        """The earliest this rank can start an op on ``link``: after ``t0`` and after what it queued earlier."""
        return max(t0, self._free_at.get(link, 0.0))

    def occupy(self, link: str, end: float) -> None:
        """``link`` is busy until ``end`` (the modelled end of the op just charged)."""
        self._free_at[link] = max(self._free_at.get(link, 0.0), end)


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.time()`` reaches ``deadline`` (no-op when it has)."""
    remaining = deadline - time.time()
    while remaining > 0:
        time.sleep(remaining)
        remaining = deadline - time.time()


class _Active:
    """This process's link clock, if an emulation is on. A process-local slot, like ``trace._Active``."""

    clock: LinkClock | None = None


def current() -> LinkClock | None:
    """The active link clock of this rank, or None when links are not emulated."""
    return _Active.clock


@contextmanager
def emulating(emulation: LinkEmulation | None) -> Iterator[LinkClock | None]:
    """Charge every ``comm`` op of this process for ``emulation``'s links during the block (None: do nothing)."""
    previous = _Active.clock
    _Active.clock = LinkClock(emulation) if emulation is not None else None
    try:
        yield _Active.clock
    finally:
        _Active.clock = previous


def timed(op: Callable[[], Any]) -> tuple[float, float]:
    """``op()``'s (start, end) in ``time.time()``: one clock for every rank of this machine, so spans of different
    ranks can be compared (``op_seconds``)."""
    start = time.time()
    op()
    return start, time.time()


def op_seconds(per_rank: list[list[tuple[float, float] | None]]) -> float:
    """How long a collective took, from every rank's (start, end) per rep (None on a rank that took no part): the
    median over reps of the last rank's end minus the last rank's start, so a rank that left the barrier early does
    not count its wait for the others as link time."""
    taking_part = [spans for spans in per_rank if spans and spans[0] is not None]
    reps = len(taking_part[0])
    return statistics.median(max(s[i][1] for s in taking_part) - max(s[i][0] for s in taking_part)
                             for i in range(reps))


def stamp(value: float, device: torch.device) -> torch.Tensor:
    """A time as the one float64 element the emulation sends beside an op."""
    return torch.tensor([value], dtype=torch.float64, device=device)


def matmul_rate(seconds: float = 0.3, n: int = 512) -> float:
    """This process's measured float32 matmul rate, FLOP/s: repeated ``n`` x ``n`` products for ``seconds``."""
    cpu = torch.device("cpu")  # the machine's rate: what the ranks here compute with
    a, b = torch.randn(n, n, device=cpu), torch.randn(n, n, device=cpu)
    torch.mm(a, b)  # warm-up: first call pays allocation and kernel selection
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        done += 1
    return done * 2 * n ** 3 / (time.perf_counter() - start)


def time_scale_for(gpu: str, nproc: int, rate: float | None = None) -> float:
    """How many times slower one of ``nproc`` CPU ranks computes than ``gpu`` (a ``GPU_PEAK_FLOPS`` name): the
    machine's matmul rate (measured unless given) shared by its ranks, against the GPU's dense peak. Links slowed
    by this factor keep that GPU cluster's compute : communication ratio."""
    if gpu not in GPU_PEAK_FLOPS:
        raise ValueError(f"unknown GPU {gpu!r} for a time scale; valid: {', '.join(GPU_PEAK_FLOPS)} or a number")
    per_rank = (matmul_rate() if rate is None else rate) / max(1, nproc)
    return GPU_PEAK_FLOPS[gpu] / per_rank


def check_time_scale(value: Any) -> None:
    """``ValueError`` unless ``value`` is None, a number > 0 or a ``GPU_PEAK_FLOPS`` name (nothing measured)."""
    if value is None:
        return
    if isinstance(value, str) and not _is_number(value):
        if value.strip().lower() not in GPU_PEAK_FLOPS:
            raise ValueError(f"time_scale {value!r}: expected a number > 0 or a GPU name "
                             f"({', '.join(GPU_PEAK_FLOPS)})")
        return
    number = float(value) if isinstance(value, str) else value
    if isinstance(number, bool) or not isinstance(number, int | float) or not (math.isfinite(number) and number > 0):
        raise ValueError(f"time_scale must be a finite number > 0 or a GPU name ({', '.join(GPU_PEAK_FLOPS)}), "
                         f"got {value!r}")


def resolve_time_scale(value: Any, nproc: int) -> float:
    """A time scale as configured: a number (> 0), or a GPU name measured against this machine."""
    if isinstance(value, str):
        try:
            return float(value) if _is_number(value) else time_scale_for(value.strip().lower(), nproc)
        except ValueError as error:
            raise ValueError(f"time_scale {value!r}: {error}") from None
    return value


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


__all__ = [
    "INTER", "INTRA", "STRAGGLER_HELP", "LinkClock", "Straggler", "LinkEmulation", "check_time_scale", "current", "op_seconds", "timed", "emulating", "matmul_rate",
    "resolve_time_scale", "sleep_until", "stamp", "time_scale_for",
]
