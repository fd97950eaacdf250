"""Scaling on an emulated 2-node cluster (issue 20, "Scaling efficiency" and "Hierarchical collectives"):
measured strong and weak data-parallel efficiency at 1, 2, 4 and 8 ranks, and the message size above which the
hierarchical all-reduce beats the tree (and the flat ring), each beside the α-β model. All times are **emulated**.

The cluster: nodes of ``RANKS_PER_NODE`` = 4 ranks, filled first (1, 2 and 4 ranks on one node, 8 on two), the
``nvlink`` preset inside a node and ``ethernet`` between nodes, both slowed by ``TIME_SCALE`` (every modelled time
x 400: NVLink 2 ms and 1.1 GB/s, Ethernet 8 ms and 31 MB/s), so that the presets' ratios are kept and every
modelled message stays above what the loopback really costs on a small shared CPU. 400 is a chosen number, not a
GPU's measured factor (``time_scale_for("h100-bf16", 8)`` is larger still).

Rows:

* ``strong_scaling_2x4_emulated`` / ``weak_scaling_2x4_emulated``: a data-parallel step of each rank = real compute
  (``torch.mm`` blocks, one thread per rank; strong: ``STRONG_BLOCKS / N`` blocks, weak: ``WEAK_BLOCKS``) then one
  gloo all-reduce of ``GRAD_BYTES`` through ``comm`` (charged by the emulation). 8 ranks share 2 cores, so a rank's
  compute at N = 8 is up to 4x its compute alone, and T(1) / (N·T(N)) would count that contention as a cost of
  scaling. Efficiency is therefore measured as ``efficiency_from_wait(ideal compute, wait)``: the ideal compute is
  the compute measured at N = 1 (divided by N for strong scaling), the wait is the time the step did not compute,
  taken on the rank that arrived last at the all-reduce (the smallest step − compute of the step), which waited
  for the link alone and not for peers slowed by the shared cores. ``ours`` = measured efficiency at N = 8,
  ``reference`` = ``theory.scaling.scaling_curve`` for the same links, time scale and measured compute; the config
  holds every N, and the raw t(1)/(N·t(N)) the 2 cores give.
* ``hierarchical_crossover_2x4_emulated``: ring, tree and hierarchical all-reduce (``workbench.parallel.
  collectives``, all from the same emulated sends) on 8 ranks as 2 x 4, over ``SWEEP_SIZES`` (``--quick``: 5 of
  them); ``ours`` = the measured size above which hierarchical beats the tree (``theory.scaling.crossover``),
  ``reference`` = the α-β prediction (``theory.scaling.predicted_crossover``). In the model the hierarchy beats a
  flat ring at every size (its predicted crossover is 0); the measured hierarchical / ring ratio at each size is in
  the config.

Timing as in ``bench_topology``: each rep starts after a barrier, its time runs from the last rank's start to the
last rank's end (``op_seconds``); medians over reps after one warm-up.

    python benchmarks/bench_scaling.py [--quick]
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from workbench import launch
from workbench.dist import comm
from workbench.dist.emulation import op_seconds, timed
from workbench.parallel.collectives import (
    hierarchical_all_reduce,
    hierarchical_groups,
    ring_all_reduce,
    tree_all_reduce,
)
from workbench.theory.comm import Link
from workbench.theory.scaling import (
    cluster,
    cluster_allreduce_time,
    crossover,
    efficiency_from_wait,
    ideal_compute,
    predicted_crossover,
    scaling_curve,
)
from workbench.theory.topology import parse_link

DEVICES = ("cpu",)
RANKS_PER_NODE, WORLDS = 4, (1, 2, 4, 8)
INTRA, INTER, TIME_SCALE = "nvlink", "ethernet", 400.0
GRAD_BYTES = 256 << 10  # fp32 gradients all-reduced per step: 256 KiB, 127 ms over 2 nodes x 4 at this time scale
DIM = 384  # one compute block: (DIM x DIM) @ (DIM x DIM), ~113 MFLOP
STRONG_BLOCKS, WEAK_BLOCKS = 192, 48  # strong: the global batch's blocks, divided among N; weak: blocks per rank
SWEEP_SIZES = [8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 2 << 20]
QUICK_SWEEP_SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20]
ALGORITHMS = ("ring", "tree", "hierarchical")


def scaled_links(intra: str = INTRA, inter: str = INTER, time_scale: float = TIME_SCALE) -> tuple[Link, Link]:
    """The two links as the emulation charges them: every modelled time x ``time_scale`` is α x scale and B / scale
    (α + S/B is affine in both, so theory priced on these links equals the emulation's charge)."""
    return tuple(Link(link.alpha * time_scale, link.bandwidth / time_scale, name=f"{link.name} x{time_scale:g}")
                 for link in (parse_link(intra), parse_link(inter)))


def nodes_for(world: int, ranks_per_node: int = RANKS_PER_NODE) -> int:
    """Nodes a world fills, nodes first (``theory.scaling.cluster``)."""
    return cluster(world, ranks_per_node, *scaled_links()).nodes


def _dp_steps(strong_blocks: int, weak_blocks: int, grad_bytes: int, steps: int) -> dict[str, list[tuple]]:
    """Per mode, this rank's (compute s, step s) of each step after a warm-up: compute blocks, then the all-reduce."""
    torch.set_num_threads(1)  # one thread per rank at every N: launch would give a lone rank both cores
    world, cpu = dist.get_world_size(), torch.device("cpu")
    a, w = torch.randn(DIM, DIM, device=cpu), torch.randn(DIM, DIM, device=cpu)
    out_buf, grad = torch.empty(DIM, DIM, device=cpu), torch.zeros(grad_bytes // 4, device=cpu)
    blocks = {"strong": strong_blocks // world, "weak": weak_blocks}
    spans: dict[str, list[tuple]] = {mode: [] for mode in blocks}
    for step in range(steps + 1):  # step 0 warms up gloo's pairs and the allocator
        for mode, n in blocks.items():
            t0 = time.perf_counter()
            for _ in range(n):
                torch.mm(a, w, out=out_buf)
            t1 = time.perf_counter()
            if world > 1:
                comm.all_reduce(grad)
            if step:
                spans[mode].append((t1 - t0, time.perf_counter() - t0))
    return spans


def exposed_wait(per_rank: list[list[tuple[float, float]]]) -> float:
    """The communication a step exposed: per step, the smallest step − compute over the ranks (the rank that
    arrived last at the all-reduce waited for the link only), median over steps."""
    steps = zip(*per_rank, strict=True)
    return statistics.median(min(step - compute for compute, step in ranks) for ranks in steps)


def median_of(per_rank: list[list[tuple[float, float]]], index: int, reduce: Any = max) -> float:
    """Median over steps of ``reduce`` over ranks of field ``index`` (0: compute, 1: step)."""
    return statistics.median(reduce(r[index] for r in ranks) for ranks in zip(*per_rank, strict=True))


def summarise(measured: dict[int, list[list[tuple[float, float]]]], mode: str, grad_bytes: int,
              ranks_per_node: int, intra: Link, inter: Link) -> list[dict[str, float]]:
    """One dict per world from every rank's (compute, step) spans of ``mode``: measured efficiency (ideal compute
    against the exposed wait), theory's for the same compute and links, and the raw t(1)/(N·t(N)) or t(1)/t(N)."""
    worlds = sorted(measured)
    if worlds[0] != 1:
        raise ValueError(f"the worlds must start at 1 (the compute alone), got {worlds}")
    compute_1 = median_of(measured[1], 0)
    step_1 = median_of(measured[1], 1)
    theory = scaling_curve(compute_1, grad_bytes, worlds, ranks_per_node, intra, inter, mode=mode)
    points = []
    for world, point in zip(worlds, theory, strict=True):
        ideal = ideal_compute(compute_1, world, mode)
        wait = exposed_wait(measured[world]) if world > 1 else 0.0
        step = median_of(measured[world], 1)
        raw = step_1 / (world * step) if mode == "strong" else step_1 / step
        points.append({"world": world, "nodes": point.nodes, "ideal_compute_ms": ideal * 1e3,
                       "compute_ms": median_of(measured[world], 0, statistics.median) * 1e3,
                       "wait_ms": wait * 1e3, "allreduce_theory_ms": point.allreduce_s * 1e3,
                       "measured": efficiency_from_wait(ideal, wait), "theory": point.efficiency,
                       "raw_t1_over_tN": raw})
    return points


def scaling_rows(quick: bool) -> list[dict[str, Any]]:
    steps = 3 if quick else 8
    intra, inter = scaled_links()
    spans = {world: list(launch(_dp_steps, world, STRONG_BLOCKS, WEAK_BLOCKS, GRAD_BYTES, steps,
                                nodes=nodes_for(world), intra_link=INTRA, inter_link=INTER, time_scale=TIME_SCALE,
                                timeout=300))
             for world in WORLDS}
    rows = []
    for mode in ("strong", "weak"):
        points = summarise({w: [r[mode] for r in spans[w]] for w in WORLDS}, mode, GRAD_BYTES, RANKS_PER_NODE,
                           intra, inter)
        last = points[-1]
        rows.append({"benchmark": f"{mode}_scaling_2x4_emulated", "ours": last["measured"],
                     "reference": last["theory"], "ratio": last["measured"] / last["theory"],
                     "unit": f"{mode}-scaling efficiency at {last['world']} ranks (emulated time; higher is better)",
                     "config": {"emulated_time": True, "ranks_per_node": RANKS_PER_NODE, "intra_link": INTRA,
                                "inter_link": INTER, "time_scale": TIME_SCALE, "grad_bytes": GRAD_BYTES,
                                "blocks": STRONG_BLOCKS if mode == "strong" else WEAK_BLOCKS,
                                "block": f"{DIM}x{DIM} @ {DIM}x{DIM} fp32, one thread per rank", "steps": steps,
                                "efficiency": "ideal compute / (ideal compute + wait of the last rank to arrive)",
                                "per_world": [{k: round(v, 3) for k, v in p.items()} for p in points]}})
    return rows


def _sweep(sizes: list[int], reps: int, node_size: int) -> dict[str, dict[int, list[tuple[float, float]]]]:
    torch.set_num_threads(1)
    intra_group, inter_group = hierarchical_groups(node_size)
    ops = {"ring": ring_all_reduce, "tree": tree_all_reduce,
           "hierarchical": lambda t: hierarchical_all_reduce(t, intra_group, inter_group)}
    spans: dict[str, dict[int, list[tuple[float, float]]]] = {name: {} for name in ops}
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, device=torch.device("cpu"))
        for rep in range(reps + 1):  # rep 0 warms up
            for name, op in ops.items():
                comm.barrier()
                span = timed(lambda op=op, x=x: op(x))
                if rep:
                    spans[name].setdefault(nbytes, []).append(span)
    return spans


def crossover_row(quick: bool) -> dict[str, Any]:
    reps, sizes = (3, QUICK_SWEEP_SIZES) if quick else (5, SWEEP_SIZES)
    world = 2 * RANKS_PER_NODE
    per_rank = list(launch(_sweep, world, sizes, reps, RANKS_PER_NODE, nodes=2, intra_link=INTRA,
                           inter_link=INTER, time_scale=TIME_SCALE, timeout=300))
    measured = {name: [op_seconds([r[name][s] for r in per_rank]) for s in sizes] for name in ALGORITHMS}
    intra, inter = scaled_links()
    topology = cluster(world, RANKS_PER_NODE, intra, inter)
    model = {name: [cluster_allreduce_time(s, topology, name) for s in sizes] for name in ALGORITHMS}
    found = {f"{a}_beats_{b}": {"measured_bytes": crossover(sizes, measured[a], measured[b]),
                                "predicted_bytes": predicted_crossover(topology, a, b)}
             for a, b in (("hierarchical", "tree"), ("hierarchical", "ring"), ("ring", "tree"))}
    ours, ref = found["hierarchical_beats_tree"]["measured_bytes"], found["hierarchical_beats_tree"]["predicted_bytes"]
    return {"benchmark": "hierarchical_crossover_2x4_emulated", "ours": ours, "reference": ref,
            "ratio": None if ours is None or not ref else ours / ref,
            "unit": "bytes above which hierarchical beats the tree (emulated time)",
            "config": {"emulated_time": True, "world_size": world, "nodes": 2, "intra_link": INTRA,
                       "inter_link": INTER, "time_scale": TIME_SCALE, "reps": reps, "sizes": sizes,
                       "crossovers": found,
                       "measured_ms": {k: [round(t * 1e3, 1) for t in v] for k, v in measured.items()},
                       "model_ms": {k: [round(t * 1e3, 1) for t in v] for k, v in model.items()},
                       "hierarchical_over_ring": [round(h / r, 3) for h, r in
                                                  zip(measured["hierarchical"], measured["ring"], strict=True)]}}


def rows(quick: bool) -> list[dict[str, Any]]:
    return [*scaling_rows(quick), crossover_row(quick)]


if __name__ == "__main__":
    for row in rows(quick="--quick" in sys.argv):
        print(f"{row['benchmark']}: ours {row['ours']} vs reference {row['reference']} {row['unit']} "
              f"(ratio {row['ratio']}) {row['config']}")
