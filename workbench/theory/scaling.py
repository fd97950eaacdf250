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


__all__ = ["ALGORITHMS", "ScalingPoint", "allreduce_time", "cluster", "scaling_curve"]
