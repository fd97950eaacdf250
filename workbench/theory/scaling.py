"""Scaling efficiency of data parallelism over a cluster's links, in the α-β model (issue 20, "Scaling efficiency").

Each step a data-parallel rank computes for ``compute_s`` seconds and all-reduces its gradients (S bytes). What is
not hidden behind the backward (``1 - overlap`` of the all-reduce) adds to the step:

    step(N) = compute(N) + (1 - overlap) · allreduce(S, N)        efficiency(N) = compute(N) / step(N)

* **Strong scaling** keeps the global batch: compute(N) = compute(1) / N, so the all-reduce, which does not shrink
  with N, takes a growing share. Efficiency = T(1) / (N · T(N)), the usual definition.
* **Weak scaling** keeps the per-rank batch: compute(N) = compute(1); only the all-reduce grows (its latency term
  2(N−1)·α, and the step from NVLink to the inter-node link once the ranks leave one node).

The all-reduce runs over a cluster of ``ranks_per_node``-rank nodes: inside one node a ring on the intra-node link;
across nodes either one flat ring, as slow as its slowest hop (``Topology.link_of``), or the hierarchical algorithm
(``comm.hierarchical_allreduce_time``: only S / ranks_per_node crosses nodes). Pure Python, floor 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workbench.theory.checks import positive_int
from workbench.theory.comm import Link, hierarchical_allreduce_time
from workbench.theory.topology import Topology

ALGORITHMS = ("ring", "hierarchical")


@dataclass(frozen=True)
class ScalingPoint:
    """One world size: per-rank compute, the gradient all-reduce, the exposed part of it, the step, efficiency."""

    world: int
    nodes: int
    compute_s: float
    allreduce_s: float
    exposed_s: float
    step_s: float
    efficiency: float


def cluster(world: int, ranks_per_node: int, intra: Link, inter: Link) -> Topology:
    """``world`` ranks on nodes of ``ranks_per_node`` (one partly filled node below that), node-major."""
    positive_int("world", world)
    positive_int("ranks_per_node", ranks_per_node)
    if world > ranks_per_node and world % ranks_per_node:
        raise ValueError(f"world={world} ranks do not fill nodes of {ranks_per_node}: use a multiple of "
                         f"{ranks_per_node} (or at most {ranks_per_node} ranks on one node)")
    per_node = min(world, ranks_per_node)
    return Topology(nodes=world // per_node, ranks_per_node=per_node, intra=intra, inter=inter)


def allreduce_time(nbytes: float, topology: Topology, algorithm: str = "ring") -> float:
    """Seconds to all-reduce ``nbytes`` over every rank of ``topology``: one flat ring at its slowest hop's pace,
    or ``hierarchical`` (ring reduce-scatter in each node, ring all-reduce of the shard across, all-gather)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    world = topology.world
    if world == 1:
        return 0.0
    if algorithm == "ring" or topology.nodes == 1:
        return topology.link_of(list(range(world))).ring_allreduce(nbytes, world)
    intra, inter = topology.intra, topology.inter
    return hierarchical_allreduce_time(nbytes, topology.ranks_per_node, topology.nodes, intra.alpha, intra.bandwidth,
                                       inter.alpha, inter.bandwidth)


def scaling_curve(compute_1_s: float, grad_bytes: float, worlds: list[int], ranks_per_node: int, intra: Link,
                  inter: Link, mode: str = "weak", overlap: float = 0.0,
                  algorithm: str = "ring") -> list[ScalingPoint]:
    """Efficiency at each world size of ``worlds`` (``mode`` "strong" or "weak"), for one rank's step of
    ``compute_1_s`` seconds on one device and ``grad_bytes`` of gradients all-reduced per step, ``overlap`` of the
    all-reduce hidden behind compute (0: none, bucketed DDP hides part of it)."""
    if mode not in ("strong", "weak"):
        raise ValueError(f"mode={mode!r}; valid: strong (fixed global batch), weak (fixed per-rank batch)")
    if not (math.isfinite(compute_1_s) and compute_1_s > 0):
        raise ValueError(f"compute_1_s must be a finite number of seconds > 0, got {compute_1_s!r}")
    if not (math.isfinite(grad_bytes) and grad_bytes >= 0):
        raise ValueError(f"grad_bytes must be a finite number >= 0, got {grad_bytes!r}")
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1] (the share of the all-reduce hidden behind compute), "
                         f"got {overlap!r}")
    points = []
    for world in worlds:
        topology = cluster(world, ranks_per_node, intra, inter)
        compute = compute_1_s / world if mode == "strong" else compute_1_s
        reduce_s = allreduce_time(grad_bytes, topology, algorithm)
        exposed = (1 - overlap) * reduce_s
        step = compute + exposed
        points.append(ScalingPoint(world, topology.nodes, compute, reduce_s, exposed, step, compute / step))
    return points


#: All-reduce algorithms ``cluster_allreduce_time`` prices: ``ALGORITHMS`` and the binomial tree.
CLUSTER_ALGORITHMS = ("ring", "tree", "hierarchical")


def tree_allreduce_cluster_time(nbytes: float, topology: Topology) -> float:
    """A binomial-tree all-reduce (reduce up, broadcast down, whole tensor per hop) over ``topology``, each level on
    its own link: level k joins ranks 2^k apart, so with block placement the lowest log2(ranks_per_node) levels stay
    inside a node and the rest cross (``Topology.link_of`` of the pair 0, 2^k). ``theory.comm.tree_allreduce_time``
    prices every level on one link; on one link the two agree."""
    levels = math.ceil(math.log2(topology.world)) if topology.world > 1 else 0
    return 2 * sum(topology.link_of([0, 2 ** k]).message_time(nbytes) for k in range(levels))


def cluster_allreduce_time(nbytes: float, topology: Topology, algorithm: str = "ring") -> float:
    """``allreduce_time`` for ``ring`` and ``hierarchical``, ``tree_allreduce_cluster_time`` for ``tree``."""
    if algorithm == "tree":
        return tree_allreduce_cluster_time(nbytes, topology)
    if algorithm not in CLUSTER_ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}; valid: {', '.join(CLUSTER_ALGORITHMS)}")
    return allreduce_time(nbytes, topology, algorithm)


def crossover(sizes: list[float], first: list[float], second: list[float]) -> float | None:
    """The size above which ``first`` is faster than ``second``, from times measured (or modelled) at ``sizes``
    (ascending): the start of the longest run of sizes at the top of the range where ``first`` is faster, placed by
    linear interpolation of ``first - second`` between that size and the one below (both are α-β lines in S, so
    their difference is linear too). ``sizes[0]`` if ``first`` is faster at every size (the crossover is at or below
    the range), None if it is not faster at the largest (no crossover in range). Noise that flips the sign in the
    middle of the range is resolved towards the large sizes, where the answer is meant to hold."""
    if not (len(sizes) == len(first) == len(second) >= 1):
        raise ValueError(f"sizes, first and second must have one entry per size, got {len(sizes)}, {len(first)}, "
                         f"{len(second)}")
    if any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
        raise ValueError(f"sizes must be strictly ascending, got {sizes!r}")
    diff = [a - b for a, b in zip(first, second, strict=True)]
    if diff[-1] >= 0:
        return None
    k = len(diff) - 1
    while k > 0 and diff[k - 1] < 0:
        k -= 1
    if k == 0:
        return float(sizes[0])
    d0, d1 = diff[k - 1], diff[k]  # d0 >= 0 > d1
    return sizes[k - 1] + (sizes[k] - sizes[k - 1]) * d0 / (d0 - d1)


def predicted_crossover(topology: Topology, first: str, second: str) -> float | None:
    """The size in bytes above which all-reduce algorithm ``first`` is faster than ``second`` on ``topology`` in the
    α-β model (``cluster_allreduce_time``): every algorithm's time is affine in S, a + b·S, so the two cross at most
    once, at S* = (a1 − a2) / (b2 − b1). 0.0 if ``first`` is never slower; None if it is never faster above any size
    (it may still be faster *below* one: ask the other way round)."""
    at_zero = [cluster_allreduce_time(0.0, topology, a) for a in (first, second)]
    per_byte = [(cluster_allreduce_time(2.0 ** 30, topology, a) - t0) / 2.0 ** 30
                for a, t0 in zip((first, second), at_zero, strict=True)]
    d0, slope = at_zero[0] - at_zero[1], per_byte[0] - per_byte[1]
    if abs(slope) <= 1e-9 * max(per_byte):  # equal bandwidth terms (a hierarchy over one link), up to rounding
        slope = 0.0
    if abs(d0) <= 1e-9 * max(at_zero):  # equal latency terms (a hierarchy of 2 x 2 against the tree), up to rounding
        d0 = 0.0
    if slope > 0 or (slope == 0 and d0 >= 0):
        return None
    if d0 <= 0:
        return 0.0
    return d0 / -slope


def ideal_compute(compute_1_s: float, world: int, mode: str) -> float:
    """A rank's compute per step at ``world`` ranks on a cluster with a device per rank: ``compute_1_s / world``
    under strong scaling (the global batch is divided), ``compute_1_s`` under weak scaling."""
    if mode not in ("strong", "weak"):
        raise ValueError(f"mode={mode!r}; valid: strong (fixed global batch), weak (fixed per-rank batch)")
    positive_int("world", world)
    return compute_1_s / world if mode == "strong" else compute_1_s


def efficiency_from_wait(compute_s: float, wait_s: float) -> float:
    """Scaling efficiency from a rank's compute and the time it did not compute: compute / (compute + wait).

    With ``compute_s = ideal_compute(t_compute(1), N, "strong")`` this is strong scaling's T(1) / (N·T(N)) for a
    step T(N) = T(1)/N + wait, where the wait is what communication (and peers) cost: the quantity to measure on a
    machine whose N ranks share cores, which would otherwise count their contention as a cost of scaling."""
    if not (math.isfinite(compute_s) and compute_s > 0):
        raise ValueError(f"compute_s must be a finite number of seconds > 0, got {compute_s!r}")
    if not (math.isfinite(wait_s) and wait_s >= 0):
        raise ValueError(f"wait_s must be a finite number of seconds >= 0, got {wait_s!r}")
    return compute_s / (compute_s + wait_s)


__all__ = ["ALGORITHMS", "CLUSTER_ALGORITHMS", "ScalingPoint", "allreduce_time", "cluster", "cluster_allreduce_time",
           "crossover", "efficiency_from_wait", "ideal_compute", "predicted_crossover", "scaling_curve",
           "tree_allreduce_cluster_time"]
