"""Checker for lab 12: a hierarchical all-reduce designed by the learner, graded on an emulated 2-node cluster.

``check(fn)`` runs ``fn(tensor, intra_group, inter_group)`` on 4 ranks placed as 2 emulated nodes of 2 ranks
(``launch(..., nodes=2)``: the inter-node link is 20x slower than the intra-node one), with sizes the node size
divides, and checks three things from the run itself:

* **the sum**: every rank's tensor holds the elementwise sum of all inputs, in place (small integers in float32,
  so every order of addition is exact);
* **the slow link's bytes**: from the trace, the bytes each rank sent over the inter-node link (events whose ``link``
  is ``"inter"``) are at most what the design needs, 2(n−1)/n · S / node_size for n nodes (only a 1/node_size
  shard crosses; Sergeev & Del Balso 2018, Thakur et al. 2005), not the 2(N−1)/N · S of a flat ring;
* **the time**: emulated, the learner's all-reduce of 1 MiB takes at most 0.7x what ``comm.all_reduce`` (one flat
  ring over all ranks, as slow as its slowest hop) takes on the same cluster.

A wrong answer raises ``LabCheckFailed`` naming the likely mistake; ``hint(1..3)`` say more, tier by tier.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workbench.dist.emulation import op_seconds, timed
from workbench.labs import LabCheckFailed, show_hint
from workbench.labs.ring_allreduce import case_input  # lab 02's inputs: small integers, exact sums in any order

WORLD, NODE_SIZE = 4, 2
# 100 MB/s, 100 µs inside a node; 5 MB/s, 1 ms across: 20x slower. Slow enough that the modelled times (5 ms inside
# a node, 0.1-0.3 s across for 1 MiB) stay above what gloo really takes on 4 ranks sharing 2 busy cores (~5 ms).
INTRA_LINK, INTER_LINK = "0.1,100", "0.005,1000"
SIZES = (10, 1000)  # elements: multiples of the node size, small enough to stay quick
TIMED_NUMEL = 1 << 18  # 1 MiB of float32 for the time check
TIME_GOAL = 0.7
MORE = " (more help: hint(1), hint(2), hint(3))"

HINTS = {
    1: "The slow link is the bottleneck, so decide first how many bytes must cross it. Every node must learn the "
       "other nodes' contribution, but not from every one of its ranks: if the ranks of a node first combine "
       "their tensors among themselves and split the result so that each rank owns a different 1/node_size "
       "piece, then each rank only needs to exchange its own piece with its counterparts on the other nodes. "
       "Then the ranks of a node share their finished pieces again.",
    2: "Three phases, each a collective on one of the two groups you are given. 1) inside the node (intra_group): "
       "reduce-scatter, so local rank i holds chunk i summed over the node (comm.reduce_scatter takes an output "
       "of numel/node_size and the whole flat tensor). 2) across nodes (inter_group: the ranks with the same local "
       "index on every node): all-reduce that chunk, now summed over the whole cluster. 3) inside the node again: "
       "all-gather the chunks back into the whole tensor, in place. Only phase 2 uses the slow link, with 1/node_size "
       "of the bytes.",
    3: "flat = tensor.view(-1); k = comm.group_size(intra_group)\n"
       "mine = torch.empty(flat.numel() // k, dtype=flat.dtype, device=flat.device)\n"
       "comm.reduce_scatter(mine, flat, group=intra_group)          # phase 1, fast link\n"
       "comm.all_reduce(mine, group=inter_group)                     # phase 2, slow link, 1/k of the bytes\n"
       "comm.all_gather(flat, mine, group=intra_group)               # phase 3, fast link, writes into tensor\n"
       "return tensor",
}


def hint(level: int = 1) -> str:
    """Print (and return) hint ``level``: 1 the idea, 2 the three phases, 3 nearly the code."""
    return show_hint(HINTS, level)


def _groups() -> tuple[Any, Any]:
    """(intra_group, inter_group) of this rank: its node's ranks, and the ranks with its local index elsewhere."""
    from workbench.parallel.collectives import hierarchical_groups

    return hierarchical_groups(NODE_SIZE)


def _on_rank(fn: Callable[..., Any], sizes: tuple[int, ...], timed_numel: int, reps: int) -> dict[str, Any]:
    """Run the learner's function on each size and time it against comm.all_reduce, on this rank."""
    from workbench import trace
    from workbench.dist import comm
    from workbench.dist.launch import rank_device

    intra, inter = _groups()
    runs = []
    for numel in sizes:
        tensor = case_input(comm.group_rank(), numel, rank_device())
        start = len(trace.current().trace.comms)
        returned = fn(tensor, intra, inter)
        events = trace.current().trace.comms[start:]
        runs.append({"result": tensor.cpu().clone(),
                     "returned": returned.detach().cpu().clone() if isinstance(returned, torch.Tensor) else None,
                     "inter_bytes": sum(e.bus_bytes for e in events if e.link == "inter"),
                     "ops": sorted({f"{e.op} ({e.link or 'no link'})" for e in events})})
    return {"runs": runs, "times": _timed(fn, intra, inter, timed_numel, reps)}


def _timed(fn: Callable[..., Any], intra: Any, inter: Any, numel: int, reps: int) -> dict[str, list]:
    """(start, end) of each rep of the learner's all-reduce and of comm.all_reduce, alternating."""
    from workbench.dist import comm
    from workbench.dist.launch import rank_device

    spans: dict[str, list] = {"yours": [], "flat": []}
    x = torch.ones(numel, device=rank_device())
    for _ in range(reps):
        for name in spans:
            comm.barrier()
            spans[name].append(timed(lambda name=name: fn(x, intra, inter) if name == "yours" else comm.all_reduce(x)))
    return spans


def check(fn: Callable[..., Any], timeout: float = 60.0) -> None:
    """Check ``fn(tensor, intra_group, inter_group)``, an in-place SUM hierarchical all-reduce; print a success
    message or raise ``LabCheckFailed`` naming the mistake."""
    try:
        _check(fn, timeout)
    except LabCheckFailed as error:
        raise LabCheckFailed(f"{error}{MORE}") from None


def _check(fn: Callable[..., Any], timeout: float) -> None:
    if not callable(fn):
        raise LabCheckFailed(f"pass your function itself, e.g. check(hierarchical_all_reduce), not "
                             f"{type(fn).__name__}")
    per_rank = _launch(fn, timeout)
    for index, numel in enumerate(SIZES):
        runs = [r["runs"][index] for r in per_rank]
        _check_values(runs, numel)
        _check_inter_bytes(runs, numel)
    yours, flat = (op_seconds([r["times"][name] for r in per_rank]) for name in ("yours", "flat"))
    ratio = yours / flat
    if ratio > TIME_GOAL:
        raise LabCheckFailed(f"the sum is right and the slow link carried no more than it must, but your all-reduce "
                             f"of 1 MiB took {yours * 1e3:.0f} ms (emulated) against {flat * 1e3:.0f} ms for the flat "
                             f"ring, a ratio of {ratio:.2f} > {TIME_GOAL}: extra messages or waits are costing you. "
                             "Use one collective per phase, on the right group.")
    print(f"Correct: every rank holds the sum; only a 1/{NODE_SIZE} shard crossed the slow link; on the emulated "
          f"2-node cluster your all-reduce took {yours * 1e3:.0f} ms against {flat * 1e3:.0f} ms for one flat ring "
          f"({ratio:.2f}x).")


def _launch(fn: Callable[..., Any], timeout: float) -> list:
    from workbench import RankError
    from workbench.dist.launch import launch

    try:
        return list(launch(_on_rank, WORLD, fn, SIZES, TIMED_NUMEL, 3, timeout=timeout, nodes=WORLD // NODE_SIZE,
                           intra_link=INTRA_LINK, inter_link=INTER_LINK))
    except RankError as error:
        raise LabCheckFailed(_explain_rank_error(error, timeout)) from None


def _explain_rank_error(error: Exception, timeout: float) -> str:
    text = str(error)
    if "NotImplementedError" in text:
        detail = text.split("NotImplementedError:", 1)[1].splitlines()[0].strip()
        return f"your function is still the stub (NotImplementedError: {detail}). Replace its body with your design."
    if "timed out" in text.lower() or "timeout" in text.lower():
        return (f"your function did not finish within {timeout:g} s on {WORLD} ranks: a deadlock. Every rank must "
                "call the same collectives on the same groups in the same order.")
    if "must be world" in text:
        return ("comm.reduce_scatter / comm.all_gather refused the shapes: the whole tensor is node_size x the "
                "shard along dim 0, so pass the flat tensor (tensor.view(-1)) and a shard of numel / node_size.\n"
                f"{text}")
    return f"your function raised on {WORLD} ranks: {text.splitlines()[0]}\n(full traceback below)\n{text}"


def _check_values(runs: list[dict], numel: int) -> None:
    inputs = [case_input(r, numel) for r in range(WORLD)]
    want = torch.stack(inputs).sum(0)  # exact: small integers in float32, any order of addition
    node_sums = [torch.stack(inputs[n * NODE_SIZE:(n + 1) * NODE_SIZE]).sum(0) for n in range(WORLD // NODE_SIZE)]
    for rank, run in enumerate(runs):
        got = run["result"]
        if torch.equal(got, want):
            continue
        returned = run["returned"]
        if returned is not None and returned.numel() == numel and torch.equal(returned.view(-1), want):
            raise LabCheckFailed("your function returns the right sum but leaves the tensor it was given unchanged: "
                                 "it must work in place (all-gather into tensor.view(-1), or tensor.copy_(...)).")
        raise LabCheckFailed(f"numel={numel}, rank {rank}: {_diagnose(got, want, inputs, node_sums, rank)}")


def _diagnose(got: torch.Tensor, want: torch.Tensor, inputs: list[torch.Tensor], node_sums: list[torch.Tensor],
              rank: int) -> str:
    node, local = divmod(rank, NODE_SIZE)
    if torch.equal(got, inputs[rank]):
        return "nothing was reduced: the tensor still holds this rank's own input."
    if torch.equal(got, node_sums[node]):
        return ("the tensor holds the sum over this rank's node only: the other nodes' contribution never arrived. "
                "The middle phase must all-reduce across nodes, on inter_group.")
    if torch.allclose(got, want / WORLD):
        return f"the values are the sum divided by {WORLD}: you averaged; this lab asks for the sum."
    shard = want.numel() // NODE_SIZE
    mine = slice(local * shard, (local + 1) * shard)
    if torch.equal(got[mine], want[mine]):
        return (f"only this rank's 1/{NODE_SIZE} of the tensor (elements {mine.start}..{mine.stop - 1}) holds the sum: "
                "the last phase must all-gather the finished shards inside the node, into the whole tensor.")
    wrong = int((got != want).sum())
    return (f"{wrong} of {want.numel()} values are wrong (first: got {got[(got != want).nonzero()[0]].item():g}). "
            "Check each phase's group and which part of the tensor it works on.")


def _check_inter_bytes(runs: list[dict], numel: int) -> None:
    nodes = WORLD // NODE_SIZE
    budget = 2 * (nodes - 1) / nodes * numel * 4 / NODE_SIZE
    flat_ring = 2 * (WORLD - 1) / WORLD * numel * 4
    for rank, run in enumerate(runs):
        sent = run["inter_bytes"]
        if sent > budget * 1.01:
            what = ("as much as a flat ring over every rank" if sent >= flat_ring * 0.99
                    else f"{sent / budget:.1f}x the {budget:.0f} bytes it needs")
            raise LabCheckFailed(
                f"the sum is right, but rank {rank} sent {sent:.0f} bytes over the slow inter-node link, {what}. "
                f"Only a 1/{NODE_SIZE} shard needs to cross: reduce inside the node first, so that each rank carries "
                f"one shard across (ops seen: {', '.join(run['ops'])}).")


__all__ = ["HINTS", "case_input", "check", "hint"]
