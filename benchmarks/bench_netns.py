"""A real shaped link against the emulation (workbench.dist.netns): is the emulation a fantasy? (issue 20)

Row ``netns_vs_emulation``: 4 ranks as 2 nodes x 2 ranks (node-major). Each node's ranks run in a network
namespace of their own; the namespaces are joined by a veth pair with a tbf token bucket on both ends (200 Mbit/s =
25 MB/s each way). The link's α (a ping-pong's half round trip) and effective bandwidth (one 8 MiB message) are
measured, and the emulation is given that link (``inter_link``). Then all-reduce over the 4 ranks and send/recv
from rank 0 (node 0) to rank 2 (node 1), at 256 KiB .. 64 MiB:

* ``reference``: the real shaped link, ms summed over ops and sizes;
* ``ours``: the same ops under the emulation on the loopback (``launch(..., nodes=2, inter_link=...)``), ms summed
  (the model's prediction, ``LinkEmulation.modelled_time``, is in the config beside each);
* ``ratio``: the worst predicted / real over every op and size. Goal: each op within ``netns.agreement_bound``,
  10 % plus 8 ms of waiting for a core relative to its time (+-50 % for the 20 ms all-reduce at 256 KiB, +-10 % at
  64 MiB); ``config.all_within_bound`` says whether it held, ``per_op`` gives each op's figures and bound.

A second row, ``netns_vs_emulation_3_nodes``, does the same on 3 nodes x 1 rank: each node's veth pair runs to a
bridge in a switch namespace, with a token bucket on both ends (node egress, switch port = node ingress), so the
message (rank 0 -> rank 2) and every hop of the all-reduce's ring cross two shaped links and the bridge. Goal: the
same bound for the message; 10 % more for the all-reduce (``netns.STAR_ALL_REDUCE_SLACK`` says why).

Times as bench_topology takes them: barrier, then the op on every rank; the last rank's start to the last rank's
end, median over reps after one warm-up (more reps for small sizes). Needs root, iproute2 and tbf; without them the
row is ``"status": "skipped"`` with the reason (benchmarks/run.py prints it as SKIPPED, not as a failure).

    python benchmarks/bench_netns.py [--quick]
"""

from __future__ import annotations

import sys
from typing import Any

from workbench.dist import netns

DEVICES = ("cpu",)
SIZES = {netns.size_label(n): n for n in (256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)}
QUICK_SIZES = {label: SIZES[label] for label in ("256KiB", "4MiB", "64MiB")}
GOAL = "every op and size within netns.agreement_bound: |predicted/real - 1| <= 10 % + 8 ms / real time"


STAR_GOAL = GOAL + "; all-reduce through the switch: 10 % more (netns.STAR_ALL_REDUCE_SLACK)"
#: (row name, nodes, ranks per node, goal): the pair README's figures are from, and 3 nodes behind the switch
LAYOUTS = (("netns_vs_emulation", 2, 2, GOAL), ("netns_vs_emulation_3_nodes", 3, 1, STAR_GOAL))


def skipped_row(reason: str, name: str = "netns_vs_emulation", goal: str = GOAL) -> dict[str, Any]:
    return {"benchmark": name, "status": "skipped", "reason": reason, "ours": None,
            "reference": None, "ratio": None, "unit": None, "config": {"goal": goal}}


def comparison_row(comparison: netns.Comparison, sizes: dict[str, int], reps: int,
                   name: str = "netns_vs_emulation", goal: str = GOAL) -> dict[str, Any]:
    timings, link = comparison.timings, comparison.link
    return {"benchmark": name,
            "ours": sum(t.emulated_s for t in timings) * 1e3,
            "reference": sum(t.shaped_s for t in timings) * 1e3,
            "ratio": comparison.worst_ratio(),
            "unit": "ms summed over ops and sizes (ours: emulated link, reference: real tbf-shaped veth)",
            "config": {"goal": goal, "world_size": comparison.world_size, "nodes": comparison.nodes,
                       "topology": "one veth pair" if comparison.nodes == 2 else "leaf-to-switch star (bridge)",
                       "tbf": comparison.bucket.describe(),
                       "tbf_switch_port": (netns.TokenBucket.for_switch_port(comparison.bucket.rate).describe()
                                           if comparison.nodes > 2 else None),
                       "measured_link": {"alpha_us": round(link.alpha * 1e6, 1),
                                         "bandwidth_MB_s": round(link.bandwidth / 1e6, 3),
                                         "inter_link": f"{link.bandwidth / 1e9:.6g},{link.alpha * 1e6:.4g}"},
                       "predicted_ms": round(sum(t.predicted_s for t in timings) * 1e3, 2),
                       "worst_emulated_ratio": comparison.worst_emulated_ratio(),
                       "all_within_bound": all(t.within_bound() for t in timings),
                       "sizes": list(sizes), "reps": {label: netns.reps_for(n, reps) for label, n in sizes.items()},
                       "emulated_time": True,
                       "per_op": {f"{t.op}_{t.label}": t.describe() for t in timings}}}


def rows(quick: bool) -> list[dict[str, Any]]:
    sizes, reps = (QUICK_SIZES, 1) if quick else (SIZES, 3)
    out = []
    for name, nodes, per_node, goal in LAYOUTS:
        reason = netns.unavailable_reason(nodes)
        if reason is not None:
            out.append(skipped_row(reason, name, goal))
            continue
        with netns.shaped_link(nodes=nodes) as link:
            comparison = netns.compare(link, sizes, reps=reps, timeout=400, ranks_per_node=per_node)
        out.append(comparison_row(comparison, sizes, reps, name, goal))
    return out


if __name__ == "__main__":
    for row in rows(quick="--quick" in sys.argv):
        if row.get("status") == "skipped":
            print(f"{row['benchmark']}: skipped: {row['reason']}")
            continue
        print(f"{row['benchmark']}: ours {row['ours']:.1f} vs reference {row['reference']:.1f} {row['unit']} "
              f"(ratio {row['ratio']:.3f})")
        for name, value in row["config"].items():
            print(f"  {name}: {value}")
