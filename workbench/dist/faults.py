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
  NaN on every rank, and the health check (``--on-spike``) must notice (``workbench.health``).

A fault fires only in the first attempt: a restarted run (``restart_count() > 0``) must get past the step
that failed, as a real run does once the bad node is replaced.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

FAULT_KINDS = ("kill", "raise", "hang", "nan")

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
    plant (it needs the model): True means "poison your weights now"."""
    if spec is None or rank != spec.rank or step != spec.step or restart_count() > 0:
        return False
    if spec.kind == "nan":
        return True
    if spec.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.kind == "raise":
        raise InjectedFault(f"injected fault {spec}: rank {rank} raised before step {step}")
    while True:  # hang: never return; the peers' collective timeout ends the attempt, the launcher kills us
        time.sleep(3600)
