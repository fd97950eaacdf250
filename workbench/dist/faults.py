"""Injected faults and restarts: how a course shows that a long run survives a dead rank.

Large runs lose a worker every few hours (Meta's OPT-175B logbook lists over 100 restarts in two months;
Llama 3's 54-day run saw 419 unexpected interruptions, Dubey et al. 2024 §3.3.4). What saves them is a restart
of every rank from the newest good checkpoint. ``workbench run --inject-fault kind:rank=R:step=S`` plants one
such failure so a learner can watch it happen:

* ``kill``  -- rank R sends itself SIGKILL just before step S (a dead GPU, an OOM-killed process);
* ``raise`` -- rank R raises an exception there (a bug, a bad batch);
* ``hang``  -- rank R stops answering there (a stuck NCCL kernel, a dead link): its peers' next collective
  times out after ``--timeout`` seconds, which is what turns a hang into a failure at all;
* ``nan``   -- rank R's weights turn to NaN there (a bad update, a flipped bit): nothing crashes, the loss goes
  NaN on every rank, and the health check (``--on-spike``) must notice (``workbench.health``);
* ``bitflip`` -- rank R flips one bit of its first parameter right after step S (silent data corruption: a bad
  DRAM cell or a faulty ALU). Nothing crashes and the loss barely moves; only the replicas' fingerprints
  (``--sdc-check-every``) tell that rank R no longer holds what its data-parallel peers hold;
* ``lose`` -- rank R's node goes away for good just before step S (a host pulled from the pool, a reclaimed spot
  instance): the rank exits with ``LOST_RANK_EXIT_CODE`` and no restart of the same world can bring it back. An
  elastic run (``--min-nproc M``) goes on without it on the survivors (``workbench.training.elastic``);
* ``stall`` -- rank R's input pipeline stalls for ``seconds`` (default 2) before step S (a slow shared filesystem, a
  stuck data-loader worker): nothing fails, every peer waits for it in the step's first collective, and only that
  rank's ``data_wait_s`` says where the time went (``workbench.health``'s straggler view).

``rank=R1,R2,...`` strikes several ranks at once (a node holding them goes away: ``lose:rank=2,3:step=S``), and
several specs joined by ``;`` plant several faults (``lose:rank=3:step=4;lose:rank=2:step=8`` shrinks 4 -> 3 -> 2;
the ranks of a later ``lose`` are numbered in the world it strikes, the survivors renumbered from 0).

A fault fires only in the first attempt: a restarted run (``restart_count() > 0``) must get past the step
that failed, as a real run does once the bad node is replaced.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

import torch

FAULT_KINDS = ("kill", "raise", "hang", "nan", "bitflip", "lose", "stall")

#: How long a ``stall`` lasts when its spec names no ``seconds``: long beside a step here (tens of ms), short beside
#: any ``--timeout``.
DEFAULT_STALL_S = 2.0

#: Joins several fault specs in one ``--inject-fault`` value.
SPEC_SEPARATOR = ";"

#: The exit status of a rank a ``lose`` fault removed: sysexits.h's EX_UNAVAILABLE ("a service is unavailable").
#: ``launch`` does not restart the same world after it (the rank would not come back); an elastic run shrinks.
LOST_RANK_EXIT_CODE = 69

#: The bit a ``bitflip`` fault flips, per dtype: the top mantissa bit, so element 0 moves by up to half its magnitude
#: (visible in the weights) but keeps its exponent and stays finite (an exponent bit could make it inf and let the
#: spike check catch it instead, which is not what silent corruption looks like).
_TOP_MANTISSA_BIT = {torch.float32: (torch.int32, 22), torch.float64: (torch.int64, 51),
                     torch.bfloat16: (torch.int16, 6), torch.float16: (torch.int16, 9)}

#: Set in each rank by ``launch(max_restarts=...)``; torchrun's elastic agent sets the second.
RESTART_ENV = ("WORKBENCH_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")

_SPEC = re.compile(r"^(?P<kind>[a-z]+):rank=(?P<ranks>\d+(?:,\d+)*):step=(?P<step>\d+)"
                   r"(?::seconds=(?P<seconds>\d+(?:\.\d*)?))?$")


class InjectedFault(RuntimeError):
    """The exception a ``raise:`` fault raises in its rank."""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    ranks: tuple[int, ...]
    step: int
    seconds: float | None = None  # a stall's length

    @property
    def rank(self) -> int:
        """The first rank it strikes (the only one, unless the spec names several)."""
        return self.ranks[0]

    def strikes(self, rank: int, step: int) -> bool:
        """Whether it fires on ``rank`` before ``step`` (first attempt only, as every fault)."""
        return rank in self.ranks and step == self.step and restart_count() == 0

    def __str__(self) -> str:
        seconds = "" if self.seconds is None else f":seconds={self.seconds:g}"
        return f"{self.kind}:rank={','.join(map(str, self.ranks))}:step={self.step}{seconds}"


def parse_fault(spec: str, nproc: int | None = None, steps: int | None = None) -> FaultSpec:
    """``"kill:rank=1:step=3"`` -> ``FaultSpec``; ``ValueError`` naming what is wrong and what would be valid."""
    match = _SPEC.match(spec.strip()) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(f"fault spec {spec!r} is malformed; expected KIND:rank=R:step=S with KIND in "
                         f"{', '.join(FAULT_KINDS)}, e.g. kill:rank=1:step=3 (rank=R1,R2 strikes several ranks; "
                         f"stall takes :seconds=T; several specs are joined by {SPEC_SEPARATOR!r})")
    kind, step = match["kind"], int(match["step"])
    ranks = tuple(int(r) for r in match["ranks"].split(","))
    if kind not in FAULT_KINDS:
        raise ValueError(f"fault kind {kind!r} in {spec!r} is unknown; valid: {', '.join(FAULT_KINDS)}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"fault spec {spec!r} names a rank twice; name each rank once, e.g. rank=2,3")
    if nproc is not None and max(ranks) >= nproc:
        raise ValueError(f"fault spec {spec!r} names rank {max(ranks)} but the run has ranks 0..{nproc - 1}")
    if steps is not None and step >= steps:
        raise ValueError(f"fault spec {spec!r} names step {step} but the run has steps 0..{steps - 1}")
    seconds = None if match["seconds"] is None else float(match["seconds"])
    if seconds is not None and kind != "stall":
        raise ValueError(f"fault spec {spec!r}: only a stall lasts a number of seconds; drop :seconds={seconds:g}")
    if kind == "stall" and (seconds := DEFAULT_STALL_S if seconds is None else seconds) <= 0:
        raise ValueError(f"fault spec {spec!r}: a stall must last seconds > 0, e.g. stall:rank=1:step=3:seconds=2")
    return FaultSpec(kind, ranks, step, seconds)


def parse_faults(specs: str | None, nproc: int | None = None, steps: int | None = None) -> list[FaultSpec]:
    """Every spec of an ``--inject-fault`` value (``;``-joined), in order of step; ``[]`` for None. Each ``lose``
    shrinks the world it strikes, so a later one's ranks are checked against the world left by the earlier ones,
    and two ``lose`` at one step must be one spec naming both ranks (one node loss, one shrink)."""
    if specs is None:
        return []
    if not isinstance(specs, str) or not specs.strip():
        raise ValueError(f"inject_fault={specs!r} must be a fault spec such as kill:rank=1:step=3")
    faults = sorted((parse_fault(one, None, steps) for one in specs.split(SPEC_SEPARATOR)), key=lambda f: f.step)
    world = nproc
    for fault in faults:
        if world is not None and max(fault.ranks) >= world:
            after = "" if world == nproc else " (the world left after the earlier lose specs, renumbered from 0)"
            raise ValueError(f"fault spec {str(fault)!r} names rank {max(fault.ranks)} but the run has ranks "
                             f"0..{world - 1} by step {fault.step}{after}")
        if fault.kind == "lose" and world is not None:
            world -= len(fault.ranks)
    lose_steps = [f.step for f in faults if f.kind == "lose"]
    if len(set(lose_steps)) != len(lose_steps):
        raise ValueError(f"inject_fault={specs!r} loses ranks twice at one step; name them in one spec "
                         f"(lose:rank=R1,R2:step=S): one node loss, one shrink of the world")
    return faults


def after_shrink(faults: list[FaultSpec], lost_step: int) -> str | None:
    """The ``--inject-fault`` value a shrunk world runs with: the ``lose`` specs still to come. The one that struck
    (at ``lost_step``) has happened, and every other kind fired in the first world only, as on a real cluster."""
    later = [str(f) for f in faults if f.kind == "lose" and f.step > lost_step]
    return SPEC_SEPARATOR.join(later) or None


def restart_count() -> int:
    """How many times this run's ranks have been restarted (0 in the first attempt)."""
    for name in RESTART_ENV:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def maybe_inject(spec: FaultSpec | None, rank: int, step: int) -> bool:
    """Fire ``spec`` if this is one of its ranks and its step, in the first attempt only. A ``nan`` fault is the
    caller's to plant (it needs the model): True means "poison your weights now". A ``bitflip`` never fires here:
    it strikes after its step, not before (``bitflip_due``); a ``stall`` is the data pipeline's (``stall_seconds``)."""
    if spec is None or spec.kind in ("bitflip", "stall") or not spec.strikes(rank, step):
        return False
    if spec.kind == "nan":
        return True
    if spec.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.kind == "lose":
        os._exit(LOST_RANK_EXIT_CODE)  # at once, as a vanished host: no cleanup, no result, no goodbye to peers
    if spec.kind == "raise":
        raise InjectedFault(f"injected fault {spec}: rank {rank} raised before step {step}")
    while True:  # hang: never return; the peers' collective timeout ends the attempt, the launcher kills us
        time.sleep(3600)


def stall_seconds(spec: FaultSpec | None, rank: int, step: int) -> float:
    """How long this rank's input pipeline stalls before ``step`` (0: no stall here)."""
    if spec is None or spec.kind != "stall" or not spec.strikes(rank, step):
        return 0.0
    return float(spec.seconds if spec.seconds is not None else DEFAULT_STALL_S)


def bitflip_due(spec: FaultSpec | None, rank: int, step: int) -> bool:
    """Whether a ``bitflip`` fault strikes this rank right after ``step`` (first attempt only, like every fault)."""
    return spec is not None and spec.kind == "bitflip" and spec.strikes(rank, step)


def flip_bit(tensor: torch.Tensor) -> tuple[float, float]:
    """Flip the top mantissa bit of ``tensor``'s element 0 in place; returns (value before, value after).
    Deterministic (same element, same bit), so a test knows which tensor on which rank went bad."""
    if tensor.dtype not in _TOP_MANTISSA_BIT:
        raise ValueError(f"bitflip needs a floating-point tensor of {sorted(map(str, _TOP_MANTISSA_BIT))}, "
                         f"got {tensor.dtype}")
    int_dtype, bit = _TOP_MANTISSA_BIT[tensor.dtype]
    with torch.no_grad():
        flat = tensor.detach().view(-1)  # a view of the parameter's storage: the flip lands in the weight itself
        before = float(flat[0])
        flat[:1].view(int_dtype).bitwise_xor_(1 << bit)
        return before, float(flat[0])
