"""Emulated links (workbench.dist.emulation): do measured times follow the α-β model, and does the hierarchy pay?

Two rows, both on 4 ranks placed as 2 emulated nodes x 2 ranks (node-major), all times **emulated**:

* ``emulated_link_accuracy``: gloo's all-reduce over the whole cluster and one 2-rank message across the nodes,
  at 256 KiB .. 64 MiB, on a slow inter-node link (0.1 GB/s, 5 ms) so that the modelled time dwarfs the real
  loopback. ``ours`` is the measured time, ``reference`` the modelled one (``Link.collective_time``), ``ratio`` the
  worst measured / modelled over every op and size (goal: within 10 %, 0.9 .. 1.1).
* ``hierarchical_vs_ring_10x_link``: our hierarchical all-reduce (intra-node reduce-scatter, inter-node all-reduce
  of the shard, intra-node all-gather) against our flat ring, both built from the same emulated sends, with the
  inter-node link 10x slower than the intra-node one. ``ratio`` = hierarchical / ring (goal <= 0.7); theory's
  prediction (``hierarchical_allreduce_time`` / ``ring_allreduce_time``) is in the config.

Each rep: barrier, then the op on every rank; its time runs from the last rank's start to the last rank's end
(``time.time()``, one clock for all ranks of this machine), so a rank that left the barrier early does not count
its wait for the others as link time. Medians over reps after one warm-up rep.

    python benchmarks/bench_topology.py [--quick]
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from workbench import launch
from workbench.dist import comm
from workbench.dist.emulation import op_seconds, timed
from workbench.parallel.collectives import hierarchical_all_reduce, hierarchical_groups, ring_all_reduce
from workbench.theory.comm import hierarchical_allreduce_time, ring_allreduce_time
from workbench.theory.topology import parse_link

WORLD_SIZE, NODES = 4, 2
DEVICES = ("cpu",)
# 100 MB/s, 5 ms: slow enough that every size's modelled time (34 ms .. 1 s) is well above this machine's floor: the
# ~1 ms it takes 4 ranks on 2 shared cores to wake from their sleeps and return (reported as overhead_ms).
ACCURACY_INTER = "0.1,5000"
ACCURACY_SIZES = {"256KiB": 256 << 10, "4MiB": 4 << 20, "64MiB": 64 << 20}
HIER_INTRA, HIER_INTER = "1,100", "0.1,1000"  # the inter-node link is 10x slower, as Ethernet is to NVLink-ish
HIER_BYTES = 16 << 20




def _time_ops(sizes: dict[str, int], reps: int) -> dict[str, dict[str, list]]:
    """Per size: this rank's (start, end) of the all-reduce and of the 0 -> 2 message (None on ranks 1 and 3)."""
    rank, out = dist.get_rank(), {}
    for label, nbytes in sizes.items():
        x = torch.ones(nbytes // 4)
        times: dict[str, list] = {"all_reduce": [], "send": [], "modelled_all_reduce": [], "modelled_send": []}
        message = {0: lambda x=x: comm.send(x, 2), 2: lambda x=x: comm.recv(x, 0)}.get(rank)
        for rep in range(reps + 1):
            comm.barrier()
            reduced = timed(lambda x=x: comm.all_reduce(x))
            modelled = comm_last_modelled()
            comm.barrier()
            sent = timed(message) if message else None
            if rep:  # the first rep warms up gloo's pairs and buffers
                times["all_reduce"].append(reduced)
                times["modelled_all_reduce"].append(modelled)
                times["send"].append(sent)
                times["modelled_send"].append(comm_last_modelled() if message else 0.0)
        out[label] = times
    return out


def comm_last_modelled() -> float:
    """The modelled seconds of this rank's newest logged op (all ranks trace inside ``launch``)."""
    from workbench import trace

    return trace.current().trace.comms[-1].modelled_s or 0.0


def accuracy_row(quick: bool) -> dict[str, Any]:
    reps = 2 if quick else 5
    per_rank = list(launch(_time_ops, WORLD_SIZE, ACCURACY_SIZES, reps, nodes=NODES, intra_link="nvlink",
                           inter_link=ACCURACY_INTER, timeout=300))
    detail, worst = {}, 1.0
    measured_total = modelled_total = 0.0
    for label in ACCURACY_SIZES:
        for op in ("all_reduce", "send"):
            measured = op_seconds([r[label][op] for r in per_rank])
            modelled = max(r[label][f"modelled_{op}"][0] for r in per_rank)
            detail[f"{op}_{label}"] = {"measured_ms": round(measured * 1e3, 2), "modelled_ms": round(modelled * 1e3, 2),
                                       "overhead_ms": round((measured - modelled) * 1e3, 2),
                                       "ratio": round(measured / modelled, 3)}
            worst = max(worst, measured / modelled, key=lambda r: abs(r - 1))
            measured_total += measured
            modelled_total += modelled
    return {"benchmark": "emulated_link_accuracy", "ours": measured_total * 1e3, "reference": modelled_total * 1e3,
            "ratio": worst, "unit": "ms emulated (sum over ops and sizes)",
            "config": {"goal": "worst measured/modelled within 0.9..1.1", "world_size": WORLD_SIZE, "nodes": NODES,
                       "inter_link": ACCURACY_INTER, "reps": reps, "emulated_time": True, "per_op": detail}}


def _hierarchy(nbytes: int, reps: int) -> dict[str, list[tuple[float, float]]]:
    intra, inter = hierarchical_groups(WORLD_SIZE // NODES)
    x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    ops = {"hierarchical": lambda t: hierarchical_all_reduce(t, intra, inter), "ring": lambda t: ring_all_reduce(t)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ops}
    work = x.clone()
    for rep in range(reps + 1):
        for name, op in ops.items():
            work.copy_(x)
            comm.barrier()
            span = timed(lambda op=op: op(work))
            if rep:
                times[name].append(span)
    return times


def hierarchy_row(quick: bool) -> dict[str, Any]:
    reps = 2 if quick else 5
    per_rank = list(launch(_hierarchy, WORLD_SIZE, HIER_BYTES, reps, nodes=NODES, intra_link=HIER_INTRA,
                           inter_link=HIER_INTER, timeout=300))
    hier, ring = (op_seconds([r[name] for r in per_rank]) for name in ("hierarchical", "ring"))
    fast, slow = parse_link(HIER_INTRA), parse_link(HIER_INTER)
    per_node = WORLD_SIZE // NODES
    predicted = (hierarchical_allreduce_time(HIER_BYTES, per_node, NODES, fast.alpha, fast.bandwidth, slow.alpha,
                                             slow.bandwidth)
                 / ring_allreduce_time(HIER_BYTES, WORLD_SIZE, slow.alpha, slow.bandwidth))
    return {"benchmark": "hierarchical_vs_ring_10x_link", "ours": hier * 1e3, "reference": ring * 1e3,
            "ratio": hier / ring, "unit": "ms emulated (hierarchical vs flat ring, lower is better)",
            "config": {"goal": "ratio <= 0.7", "predicted_ratio": round(predicted, 3), "bytes": HIER_BYTES,
                       "world_size": WORLD_SIZE, "nodes": NODES, "intra_link": HIER_INTRA, "inter_link": HIER_INTER,
                       "reps": reps, "emulated_time": True, "reference_impl": "workbench ring_all_reduce (flat)"}}


def rows(quick: bool) -> list[dict[str, Any]]:
    return [accuracy_row(quick), hierarchy_row(quick)]


if __name__ == "__main__":
    for row in rows(quick="--quick" in sys.argv):
        print(f"{row['benchmark']}: ours {row['ours']:.1f} vs reference {row['reference']:.1f} {row['unit']} "
              f"(ratio {row['ratio']:.3f}) {row['config']}")
