"""Bytes moved by local SGD and DiLoCo (``parallel.local_sgd.LocalSGD``), against DDP's gradient all-reduce.

Local SGD (Stich 2019, "Local SGD Converges Fast and Communicates Little", ICLR; Lin et al. 2020, "Don't Use Large
Mini-Batches, Use Local SGD", ICLR) and DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models") let every replica take H = ``local_steps`` optimizer steps on its own gradients with no
communication at all, then all-reduce one pseudo-gradient Δ = θ_global − θ_local per trainable parameter: one
all-reduce of the trainable parameters' element count every H steps. DDP all-reduces the gradients, the same element
count in fp32, every step. So, with S = numel·bytes_per_elem:

    per outer step:  one all-reduce of S                  (``outer_collectives``)
    per inner step:  S / H tensor bytes, 2(N−1)/N · S / H bus bytes   (``bytes_per_step``)
    per token:       the above / tokens per inner step     (``bytes_per_token``)

i.e. 1/H of DDP's bytes per step and per token (H = 1 is exactly DDP's count; DiLoCo's H = 500 is 500 times
fewer). Two forms, as in ``theory.comm`` and ``theory.compression``:

* ``tensor``: the sum of S over the collectives, what ``workbench.comm`` logs (``CommEvent.nbytes``);
* ``bus``: the bytes one rank sends under a ring all-reduce, ``theory.comm.bus_bytes`` (nccl-tests' convention),
  0 at N = 1.

What is *not* reduced: the bytes of one synchronisation. Each outer all-reduce is as large as DDP's per-step one,
so its latency on the critical path is the same; only its frequency falls (DiLoCo's point is that a slow link is
then busy 1/H of the time).

Pure Python; the argument checks ``LocalSGD`` runs before it communicates live here too.
"""

from __future__ import annotations

import math
from typing import Any

from workbench.theory.checks import positive_int
from workbench.theory.comm import bus_bytes

#: The outer optimizers: "avg" (periodic model averaging, θ_g ← mean of the replicas), "sgd" (θ_g ← θ_g − lr·Δ),
#: "nesterov" (SGD with Nesterov momentum on Δ: DiLoCo's outer optimizer).
OUTERS: tuple[str, ...] = ("avg", "sgd", "nesterov")
FP32_BYTES = 4


def check_local_steps(value: Any) -> int:
    """H, the inner steps between two outer steps: an int >= 1 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"local_steps must be an int >= 1 (inner optimizer steps between outer steps), "
                         f"got {value!r}")
    return value


def check_outer(name: Any) -> str:
    """``name`` if it is one of ``OUTERS``, else ValueError listing them."""
    if name not in OUTERS:
        raise ValueError(f"unknown outer optimizer {name!r}; valid: {', '.join(OUTERS)}")
    return name


def check_outer_lr(value: Any) -> float:
    """The outer learning rate: a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"outer_lr must be a finite number > 0, got {value!r}")
    return float(value)


def check_outer_momentum(value: Any) -> float:
    """The outer momentum: a number in [0, 1) (1 would never forget a pseudo-gradient)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"outer_momentum must be a number in [0, 1), got {value!r}")
    return float(value)


def _check_numel(numel: Any) -> int:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an int >= 0 (trainable parameter elements), got {numel!r}")
    return numel


def outer_collectives(numel: int, bytes_per_elem: float = FP32_BYTES) -> list[tuple[str, float]]:
    """The collectives of one outer step, as (op, S): one all-reduce of every trainable parameter's Δ."""
    return [("all_reduce", float(_check_numel(numel)) * bytes_per_elem)]


def bytes_per_step(numel: int, world: int, local_steps: int = 1,
                   bytes_per_elem: float = FP32_BYTES) -> dict[str, float]:
    """Bytes per rank per *inner* step, averaged over the H steps of one outer round.

    "tensor": S / H (the comm log's nbytes summed over H steps, divided by H); "bus": 2(N−1)/N · S / H. At
    ``local_steps=1`` this is DDP's gradient all-reduce (``theory.comm.dp_step_volume(numel, 4, 0, N)["ring_wire"]``
    is the same "bus").
    """
    positive_int("world", world)
    h = check_local_steps(local_steps)
    ops = outer_collectives(numel, bytes_per_elem)
    return {"tensor": sum(s for _, s in ops) / h, "bus": sum(bus_bytes(op, s, world) for op, s in ops) / h}


def bytes_per_token(numel: int, world: int, local_steps: int, tokens_per_step: int,
                    bytes_per_elem: float = FP32_BYTES) -> dict[str, float]:
    """``bytes_per_step`` divided by the global tokens of one inner step (every rank's batch together): H times
    fewer bytes per token than DDP at the same batch."""
    tokens = positive_int("tokens_per_step", tokens_per_step)
    return {k: v / tokens for k, v in bytes_per_step(numel, world, local_steps, bytes_per_elem).items()}


__all__ = ["FP32_BYTES", "OUTERS", "bytes_per_step", "bytes_per_token", "check_local_steps", "check_outer",
           "check_outer_lr", "check_outer_momentum", "outer_collectives"]
