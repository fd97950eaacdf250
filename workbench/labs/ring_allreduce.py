"""Checker for lab 02: a ring all-reduce written by the learner from send/recv.

``check(fn)`` runs ``fn(tensor, group)`` on 2 and then 3 real ranks with sizes the world size does not
divide, compares every rank's tensor with the true sum, and reads the communication trace to make sure
the answer used only point-to-point messages and sent what a ring sends: 2(N-1)/N of the tensor per rank
(Patarasuk & Yuan 2009). A wrong answer raises ``LabCheckFailed`` whose message names the likely mistake;
``hint(1)``, ``hint(2)``, ``hint(3)`` say more, tier by tier (the lab's stub states only the contract).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workbench.labs import LabCheckFailed, show_hint

#: (world size, tensor sizes): uneven on purpose, so chunk bookkeeping matters.
CASES = ((2, (11, 1001)), (3, (10, 1000)))
POINT_TO_POINT = ("send", "recv")
MORE = " (more help: hint(1), hint(2), hint(3))"

HINTS = {
    1: "Read the byte budget as a design: 2(N-1)/N x S is 2(N-1) messages of S/N bytes, so cut the tensor into N "
       "chunks and send one chunk per step. Think in two phases of N-1 steps each. First make the sum of every "
       "chunk complete on exactly one rank: a chunk that travels once around the ring, each rank adding its own "
       "values as it passes, has picked up everyone's contribution after N-1 hops. Then pass the finished "
       "chunks around the ring so every rank ends with all of them.",
    2: "Phase 1 (reduce-scatter), N-1 steps: every rank sends one chunk to its right neighbour and receives one "
       "from its left neighbour into a scratch buffer (torch.empty_like), then ADDS it into its own copy of that "
       "chunk. Stagger the chunks by rank so that no two ranks send the same chunk in a step, and send next the "
       "chunk you have just added into: that is how a partial sum keeps moving. Phase 2 (all-gather), N-1 steps: "
       "the same movement, but what arrives is already complete, so receive it straight into place, no add. "
       "tensor.view(-1).tensor_split(N) gives N views into tensor (sizes differ by at most one element), so "
       "writing into a chunk writes into tensor. Post comm.isend and comm.irecv before waiting on either: if "
       "every rank blocks in send first, nobody is receiving.",
    3: "chunks = tensor.view(-1).tensor_split(N); right/left = comm.global_rank(group, (r +/- 1) % N)\n"
       "reduce-scatter, for s in range(N - 1):\n"
       "    buf = torch.empty_like(chunks[(r - s - 1) % N])\n"
       "    h = comm.isend(chunks[(r - s) % N], right, group); comm.irecv(buf, left, group).wait(); h.wait()\n"
       "    chunks[(r - s - 1) % N].add_(buf)\n"
       "now rank r holds the finished sum of chunk (r + 1) % N. all-gather, for s in range(N - 1):\n"
       "    h = comm.isend(chunks[(r + 1 - s) % N], right, group)\n"
       "    comm.irecv(chunks[(r - s) % N], left, group).wait(); h.wait()   # received in place: a copy, no add\n"
       "return tensor",
}


def hint(level: int = 1) -> str:
    """Print (and return) hint ``level``: 1 the idea, 2 the two phases and their pitfalls, 3 nearly the code."""
    return show_hint(HINTS, level)


def case_input(rank: int, numel: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Rank ``rank``'s input on ``device``: small random integers in float32, so every sum is exact and
    distinctive (drawn on the CPU's generator, the same on every machine)."""
    g = torch.Generator(device="cpu").manual_seed(7919 * rank + numel)
    return torch.randint(-50, 51, (numel,), generator=g, device="cpu").to(device=device, dtype=torch.float32)


def _on_rank(fn: Callable[..., Any], sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    """Run the learner's function once per size on this rank; return tensors and this call's messages."""
    from workbench import trace
    from workbench.dist import comm
    from workbench.dist.launch import rank_device

    out = []
    for numel in sizes:
        tensor = case_input(comm.group_rank(), numel, rank_device())
        start = len(trace.current().trace.comms)
        returned = fn(tensor, None)
        events = trace.current().trace.comms[start:]
        out.append({"result": tensor.cpu().clone(),
                    "returned": returned.detach().cpu().clone() if isinstance(returned, torch.Tensor) else None,
                    "ops": [(e.op, e.nbytes, e.tag) for e in events]})
    return out


def check(fn: Callable[..., Any], timeout: float = 20.0) -> None:
    """Check ``fn(tensor, group)``, an in-place SUM ring all-reduce; print a success message or raise
    ``LabCheckFailed`` naming the mistake (and pointing at the hints)."""
    try:
        _check(fn, timeout)
    except LabCheckFailed as error:
        raise LabCheckFailed(f"{error}{MORE}") from None


def _check(fn: Callable[..., Any], timeout: float) -> None:
    if not callable(fn):
        raise LabCheckFailed(f"pass your function itself, e.g. check(ring_all_reduce), not {type(fn).__name__}")
    for world, sizes in CASES:
        per_rank = _launch(fn, world, sizes, timeout)
        for index, numel in enumerate(sizes):
            runs = [rank_runs[index] for rank_runs in per_rank]
            _check_ops(runs, world, numel)
            _check_values(runs, world, numel)
            _check_bytes(runs, world, numel)
    print("Correct: your ring all-reduce matches the true sum on 2 and 3 ranks with uneven sizes, uses only "
          "point-to-point messages, and each rank sends 2(N-1)/N of the tensor, the bandwidth-optimal volume.")


def _launch(fn: Callable[..., Any], world: int, sizes: tuple[int, ...], timeout: float) -> list:
    from workbench import RankError
    from workbench.dist.launch import launch

    try:
        return list(launch(_on_rank, world, fn, sizes, timeout=timeout))
    except RankError as error:
        raise LabCheckFailed(_explain_rank_error(error, world, timeout)) from None


def _explain_rank_error(error: Exception, world: int, timeout: float) -> str:
    text = str(error)
    if "NotImplementedError" in text:
        detail = text.split("NotImplementedError:", 1)[1].splitlines()[0].strip()
        return f"your function is still the stub (NotImplementedError: {detail}). Replace its body with your ring."
    # launch names a timed-out rank as the root cause ahead of its peers' "connection closed" echoes.
    if "timed out" in text.lower() or "timeout" in text.lower():
        return (f"on {world} ranks your function did not finish within {timeout:g} s: a deadlock. Most likely "
                "every rank called a blocking comm.send first, so each waits for a receive nobody has posted. "
                "Use comm.isend/comm.irecv and wait on both, or order sends by rank parity (even ranks send "
                "then receive, odd ranks receive then send).")
    first = text.splitlines()[0]
    return f"your function raised on {world} ranks: {first}\n(full traceback below)\n{text}"


def _check_ops(runs: list[dict], world: int, numel: int) -> None:
    used = sorted({op for run in runs for op, _, _ in run["ops"] if op not in POINT_TO_POINT})
    if used:
        raise LabCheckFailed(f"your function called comm.{'/'.join(used)}; this lab builds the all-reduce itself. "
                             "Use send/recv only: comm.isend, comm.irecv (or comm.send, comm.recv).")


def _check_values(runs: list[dict], world: int, numel: int) -> None:
    inputs = [case_input(r, numel) for r in range(world)]
    want = torch.stack(inputs).sum(0)
    # Bit for bit on any CPU, although the ring adds in another order than this sum: every input is a small
    # integer in float32 (case_input), so every partial sum is an integer far below 2^24, exact in any order.
    for rank, run in enumerate(runs):
        got = run["result"]
        if torch.equal(got, want):
            continue
        returned = run["returned"]
        if returned is not None and returned.shape == want.shape and torch.equal(returned.view(-1), want):
            raise LabCheckFailed("your function returns the right sum but leaves the tensor it was given unchanged: "
                                 "the all-reduce must be in place (write into tensor's chunks, or "
                                 "tensor.copy_(result)).")
        raise LabCheckFailed(f"on {world} ranks, numel={numel}, rank {rank}: {_diagnose(got, want, inputs, rank)}")


def _diagnose(got: torch.Tensor, want: torch.Tensor, inputs: list[torch.Tensor], rank: int) -> str:
    """Name the mistake from which wrong values the tensor holds."""
    world = len(inputs)
    wrong = ~torch.isclose(got, want)
    first = int(wrong.nonzero()[0]) if wrong.any() else 0
    detail = f"{int(wrong.sum())} of {want.numel()} values are wrong (first at index {first}: got " \
             f"{got[first].item():g}, want {want[first].item():g})"
    own = torch.isclose(got, inputs[rank])
    if own.all():
        return ("nothing was reduced: the tensor still holds this rank's own input. In the reduce-scatter, "
                "add each received chunk into yours (chunk.add_(received)).")
    if torch.isclose(got, want / world).all():
        return (f"the values are the sum divided by {world}: you averaged instead of summed. "
                "This lab asks for op=sum; do not divide by the world size.")
    n_times_one = torch.stack([torch.isclose(got, world * x) for x in inputs]).any(0) & wrong
    if n_times_one.any():
        return (f"{detail}; some positions hold {world} x one rank's value, i.e. a chunk was added to itself. "
                "Chunk indices are off: add each received buffer into the chunk with the SAME index as the one "
                "your left neighbour sent at that step (not into the chunk you sent), and send that chunk next.")
    if (got.numel() > 1 and wrong.all() and torch.isclose(got, want * (got[0] / want[0])).all()
            and want[0] != 0):
        return f"the values are the true sum scaled by {(got[0] / want[0]).item():g}; do not rescale."
    partial = _matches_partial_sum(got, inputs) & wrong
    if (own | partial)[wrong].all():
        return (f"{detail}; those positions hold only some ranks' values (a partial sum or the rank's own input). "
                "Either the reduce-scatter ran fewer than N-1 steps or the all-gather did not pass every finished "
                "chunk around: it needs N-1 steps too, copying (not adding) the received chunk into place.")
    if torch.isclose(got, want + inputs[rank]).any() or torch.isclose(got, 2 * want).any():
        return (f"{detail}; some values were added twice. In the all-gather phase the received chunk is "
                "already complete: copy it into place, do not add it.")
    return f"{detail}. Check the chunk each step sends and receives, on paper, for N = {world}."


def _matches_partial_sum(got: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Where ``got`` equals the sum over some strict subset (of at least two) of the ranks' inputs."""
    world = len(inputs)
    hit = torch.zeros_like(got, dtype=torch.bool)
    for mask in range(1, (1 << world) - 1):
        if bin(mask).count("1") >= 2:
            hit |= torch.isclose(got, sum(inputs[r] for r in range(world) if mask >> r & 1))
    return hit


def _check_bytes(runs: list[dict], world: int, numel: int) -> None:
    size = numel * 4
    ring = 2 * (world - 1) / world * size
    chunk = -(-numel // world) * 4  # the largest chunk, in bytes
    slack = 2 * world * 4  # uneven chunks: a few elements either way
    for rank, run in enumerate(runs):
        sends = [nbytes for op, nbytes, _ in run["ops"] if op == "send"]
        if sends and max(sends) >= size:
            raise LabCheckFailed(
                f"the sum is right, but on {world} ranks rank {rank} sent {len(sends)} messages of up to "
                f"{max(sends)} bytes for a {size}-byte tensor: you sent the whole tensor each step. Send one chunk "
                f"(about S/N = {size / world:.0f} bytes) per step; a ring all-reduce sends 2(N-1)/N x S = {ring:.0f} "
                "bytes per rank in all.")
        if sum(sends) > ring + slack or (sends and max(sends) > chunk):
            raise LabCheckFailed(f"the sum is right, but rank {rank} sent {sum(sends)} bytes in messages of up to "
                                 f"{max(sends)} bytes, where a ring sends one chunk (<= {chunk} bytes) per step, "
                                 f"{ring:.0f} bytes (2(N-1)/N x S) in all: some step sends more than one chunk.")


__all__ = ["CASES", "HINTS", "case_input", "check", "hint"]
