"""Bytes per data-parallel step under gradient compression, for each scheme of ``parallel.compression``.

A scheme turns each *unit* of gradients (one tensor for naive/overlap DDP, every gradient for flat DDP, a bucket
for bucketed DDP) into one to three collectives. Counted per rank and per step:

``none``      one all-reduce of the unit, S = numel·4 bytes (fp32).
``bf16``      one all-reduce of the unit cast to bf16, S = numel·2 (torch's ``bf16_compress_hook``).
``powersgd``  Vogels et al. 2019 (NeurIPS), rank r: a gradient with ≥ 2 dims is an n×m matrix (n = shape[0],
              m = the rest); it is compressed when r'(n+m) < n·m, r' = min(r, n, m) (torch's ``min_compression_rate``
              of 1), and sends P (n·r' values) and Q (m·r' values), each in one all-reduce per unit. Everything
              else (1-D tensors, matrices too small to gain) goes in one plain all-reduce per unit.
``topk``      per tensor of n elements k = ⌈ratio·n⌉ values (4 bytes) and k int32 indices (4 bytes); one
              all-gather per unit of every rank's values and indices.
``sign``      per tensor of n elements ⌈n/8⌉ bytes of packed signs plus one fp32 scale (4 bytes); one all-gather
              per unit.

Three byte counts (as in ``theory.comm``):

* ``payload``: the bytes this rank contributes to the step's messages (an all-reduce's S, an all-gather's S/N);
  ``compression_ratio`` = uncompressed payload / compressed payload.
* ``logged``: the sum of S as ``workbench.comm`` logs each op (``CommEvent.nbytes``: the all-reduced tensor, the
  full N-rank all-gather output), what the tests compare with the measured log exactly.
* ``bus``: bytes one rank sends under ring algorithms, ``theory.comm.bus_bytes`` (nccl-tests' convention): an
  all-reduce 2(N−1)/N·S, an all-gather (N−1)/N·S = (N−1)·payload.

The lesson the last one carries: all-reduce compressors (bf16, PowerSGD) keep a ring's per-rank traffic flat in N,
but a sparse or 1-bit message cannot be summed on the way (a sum of sparse vectors is denser, of signs is not a
sign), so top-k and sign all-gather and each rank receives N−1 messages: their wire saving over an fp32
all-reduce is ``compression_ratio``·2/N, gone by N = 2·ratio (``wire_ratio``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from workbench.theory.checks import positive_int
from workbench.theory.comm import bus_bytes

COMPRESSIONS: tuple[str, ...] = ("none", "bf16", "powersgd", "topk", "sign")
FP32_BYTES = 4
BF16_BYTES = 2
INDEX_BYTES = 4  # top-k indices travel as int32
SCALE_BYTES = 4  # one fp32 scale per tensor (sign)

Shape = Sequence[int]


def check_scheme(name: str) -> str:
    """``name`` if it is one of ``COMPRESSIONS``, else ValueError listing them."""
    if name not in COMPRESSIONS:
        raise ValueError(f"unknown compression {name!r}; valid: {', '.join(COMPRESSIONS)}")
    return name


def check_rank(rank: object) -> int:
    """PowerSGD's approximation rank: an int >= 1."""
    return positive_int("powersgd_rank", rank)


def check_ratio(ratio: object) -> float:
    """Top-k's kept share: a number in (0, 1]."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"topk_ratio must be a number in (0, 1], got {ratio!r}")
    return float(ratio)


def numel(shape: Shape) -> int:
    return math.prod(shape)


def powersgd_plan(shape: Shape, rank: int, min_compression_rate: float = 1.0) -> tuple[int, int, int] | None:
    """(n, m, r') when PowerSGD compresses a gradient of ``shape`` at rank ``rank``, else None (sent as is).

    n = shape[0], m = numel/n (torch's hook views a tensor the same way); r' = min(rank, n, m). Compressed when
    r'(n+m)·min_compression_rate < n·m: at the default 1, whenever P and Q are smaller than the matrix (torch's
    default is 2). A rate of 0 compresses every matrix, full rank included (the tests' exactness check).
    """
    check_rank(rank)
    if len(shape) < 2 or numel(shape) == 0:
        return None
    n = int(shape[0])
    m = numel(shape) // n
    r = min(rank, n, m)
    return (n, m, r) if r * (n + m) * min_compression_rate < n * m else None


def topk_k(n: int, ratio: float) -> int:
    """Elements top-k keeps of a tensor of ``n``: ⌈ratio·n⌉ (at least 1 of a non-empty tensor)."""
    check_ratio(ratio)
    # round(): 0.01 * 300 is 3.0000000000000004 in floats, and nobody means 4 by it
    return max(1, math.ceil(round(ratio * n, 6))) if n else 0


def unit_collectives(scheme: str, shapes: Sequence[Shape], world: int, *, powersgd_rank: int = 4,
                     topk_ratio: float = 0.01, min_compression_rate: float = 1.0) -> list[tuple[str, int]]:
    """The collectives one unit of fp32 gradients costs, as (op, S) with S what the comm log records."""
    check_scheme(scheme)
    positive_int("world", world)
    total = sum(numel(s) for s in shapes)
    if scheme == "none":
        return [("all_reduce", total * FP32_BYTES)]
    if scheme == "bf16":
        return [("all_reduce", total * BF16_BYTES)]
    if scheme == "topk":
        k = sum(topk_k(numel(s), topk_ratio) for s in shapes)
        return [("all_gather", world * k * (FP32_BYTES + INDEX_BYTES))]
    if scheme == "sign":
        packed = sum(math.ceil(numel(s) / 8) + SCALE_BYTES for s in shapes)
        return [("all_gather", world * packed)]
    plans = [powersgd_plan(s, powersgd_rank, min_compression_rate) for s in shapes]
    plain = sum(numel(s) for s, plan in zip(shapes, plans, strict=True) if plan is None)
    p_values = sum(n * r for n, _, r in filter(None, plans))
    q_values = sum(m * r for _, m, r in filter(None, plans))
    out = [("all_reduce", plain * FP32_BYTES)] if plain else []
    return out + ([("all_reduce", p_values * FP32_BYTES), ("all_reduce", q_values * FP32_BYTES)] if p_values else [])


def step_collectives(scheme: str, units: Sequence[Sequence[Shape]], world: int,
                     **options: float) -> list[tuple[str, int]]:
    """Every collective of one compressed step over ``units`` (each a list of gradient shapes), in unit order.

    ``options``: ``powersgd_rank``, ``topk_ratio``, ``min_compression_rate`` (as ``unit_collectives``). Steps
    inside the compressor's warm-up are ``"none"`` steps."""
    return [c for unit in units for c in unit_collectives(scheme, unit, world, **options)]


def per_tensor_units(shapes: Sequence[Shape]) -> list[list[Shape]]:
    """One unit per gradient: how naive and overlap DDP hand gradients to a compressor."""
    return [[s] for s in shapes]


def _payload(op: str, nbytes: int, world: int) -> float:
    return nbytes / world if op == "all_gather" else nbytes


def step_bytes(scheme: str, units: Sequence[Sequence[Shape]], world: int, **options: float) -> dict[str, float]:
    """Bytes of one compressed step per rank: ``payload``, ``logged``, ``bus`` (module docstring), the same
    three for plain fp32 all-reduce (``uncompressed``, ``uncompressed_bus``), ``compression_ratio`` (payload),
    ``wire_ratio`` (bus; 0 bytes move at N = 1, where it is reported as the payload ratio) and ``collectives``."""
    ops = step_collectives(scheme, units, world, **options)
    plain = step_collectives("none", units, world)
    out: dict[str, float] = {
        "payload": sum(_payload(op, s, world) for op, s in ops),
        "logged": sum(s for _, s in ops),
        "bus": sum(bus_bytes(op, s, world) for op, s in ops),
        "uncompressed": sum(s for _, s in plain),
        "uncompressed_bus": sum(bus_bytes(op, s, world) for op, s in plain),
        "collectives": len(ops),
    }
    out["compression_ratio"] = out["uncompressed"] / out["payload"] if out["payload"] else math.inf
    out["wire_ratio"] = (out["uncompressed_bus"] / out["bus"]) if world > 1 and out["bus"] else out["compression_ratio"]
    return out


__all__ = ["COMPRESSIONS", "check_ratio", "check_rank", "check_scheme", "per_tensor_units", "powersgd_plan",
           "step_bytes", "step_collectives", "topk_k", "unit_collectives"]
