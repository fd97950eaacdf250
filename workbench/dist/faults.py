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
  elastic run (``--min-nproc M``) goes on without it on the survivors (``workbench.training.elastic``).

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

FAULT_KINDS = ("kill", "raise", "hang", "nan", "bitflip", "lose")

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

_SPEC = re.compile(r"^(?P<kind>[a-z]+):rank=(?P<rank>\d+):step=(?P<step>\d+)$")


class InjectedFault(RuntimeError):
    """The exception a ``raise:`` fault raises in its rank."""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    rank: int
    step: int

    def __str__(self) -> str:
        return f"{self.kind}:rank={self.rank}:step={self.step}"


def parse_fault(spec: str, nproc: int | None = None, steps: int | None = None) -> FaultSpec:
    """``"kill:rank=1:step=3"`` -> ``FaultSpec``; ``ValueError`` naming what is wrong and what would be valid."""
    match = _SPEC.match(spec.strip()) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(f"fault spec {spec!r} is malformed; expected KIND:rank=R:step=S with KIND in "
                         f"{', '.join(FAULT_KINDS)}, e.g. kill:rank=1:step=3")
    kind, rank, step = match["kind"], int(match["rank"]), int(match["step"])
    if kind not in FAULT_KINDS:
        raise ValueError(f"fault kind {kind!r} in {spec!r} is unknown; valid: {', '.join(FAULT_KINDS)}")
    if nproc is not None and rank >= nproc:
        raise ValueError(f"fault spec {spec!r} names rank {rank} but the run has ranks 0..{nproc - 1}")
    if steps is not None and step >= steps:
        raise ValueError(f"fault spec {spec!r} names step {step} but the run has steps 0..{steps - 1}")
    return FaultSpec(kind, rank, step)


def restart_count() -> int:
    """How many times this run's ranks have been restarted (0 in the first attempt)."""
    for name in RESTART_ENV:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def maybe_inject(spec: FaultSpec | None, rank: int, step: int) -> bool:
    """Fire ``spec`` if this is its rank and step, in the first attempt only. A ``nan`` fault is the caller's to
    plant (it needs the model): True means "poison your weights now". A ``bitflip`` never fires here: it strikes
    after its step, not before (``bitflip_due``)."""
    if spec is None or spec.kind == "bitflip" or rank != spec.rank or step != spec.step or restart_count() > 0:
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


def bitflip_due(spec: FaultSpec | None, rank: int, step: int) -> bool:
    """Whether a ``bitflip`` fault strikes this rank right after ``step`` (first attempt only, like every fault)."""
    return (spec is not None and spec.kind == "bitflip" and rank == spec.rank and step == spec.step
            and restart_count() == 0)


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
