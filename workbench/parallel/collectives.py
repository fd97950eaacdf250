"""All-reduce, reduce-scatter and all-gather built from point-to-point messages: ring, tree, hierarchical.

Nothing here calls a torch.distributed collective. Every byte moves through ``comm.isend/irecv/send/recv``
(so the tracer logs each message with its peer, size and a phase tag), plus local tensor arithmetic. That
makes the algorithms of Thakur, Rabenseifner & Gropp 2005 ("Optimization of Collective Communication
Operations in MPICH") and Patarasuk & Yuan 2009 ("Bandwidth optimal all-reduce algorithms for clusters
of workstations") visible, measurable and comparable with gloo's own ``all_reduce``.

Ring all-reduce (Patarasuk & Yuan 2009) over N ranks, tensor of S bytes cut into N chunks:
  reduce-scatter  N-1 steps: send one chunk to the right neighbour, receive one from the left, add it.
                  Afterwards group rank r owns chunk r summed over all ranks.
  all-gather      N-1 steps: pass the finished chunks around the ring, receiving straight into place.
Each rank sends 2(N-1)/N * S bytes whatever N is: the bandwidth-optimal volume.

Why it is fast here: a naive ring waits for a whole chunk, then adds it, so the link idles during every
add (README.md, section "Benchmarks", compares ours with gloo's). We cut each chunk into segments of
``segment_bytes`` and keep messages in flight: while segment k is being added, segment k+1 is still
arriving, and segment k of the next step is sent the moment it is ready (the step s+1 chunk *is* the
chunk just received at step s).
The two phases run as one pipeline of 2(N-1) steps.

Tags: every message carries ``tag="<phase>:<step>:<chunk>"`` (e.g. ``"ring-rs:0:3"``), so a figure can
colour phases and replay the algorithm from the trace alone; ``parse_tag`` splits it back.

Chunks follow ``torch.tensor_split`` of the flattened tensor: sizes differ by at most one element, so
any numel works (chunks of 0 elements send nothing). The combine runs in the tensor's dtype (bf16 adds
in bf16), in ring order, so results match gloo's to that dtype's rounding, not bitwise; but every rank
ends with bitwise the same values, since each chunk is finished once by its owner and then copied.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from workbench.dist import comm
from workbench.dist.launch import group_timeout

#: Segment size of the pipelined ring. Big enough that per-message overhead (~tens of µs on gloo/TCP) is
#: small, small enough that a 64 MiB all-reduce has dozens of messages in flight to overlap with adds.
DEFAULT_SEGMENT_BYTES = 1 << 20

#: Receives posted ahead of the one being processed: enough to keep the link busy during an add.
RECV_WINDOW = 8

VALID_OPS = ("sum", "avg", "max", "min", "product")

_COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "sum": torch.Tensor.add_,
    "avg": torch.Tensor.add_,  # summed on the way, divided once by the chunk's owner
    "product": torch.Tensor.mul_,
    "max": lambda acc, x: torch.maximum(acc, x, out=acc),
    "min": lambda acc, x: torch.minimum(acc, x, out=acc),
}


# ----------------------------------------------------------------------------------------------------
# Public API


def broadcast_module_state(module: torch.nn.Module, group: Any = None) -> None:
    """Overwrite every parameter and buffer (frozen ones too) with group rank 0's copy: how every data-parallel
    strategy (DDP, ZeRO-2, local SGD) makes its replicas start alike.

    Seeded construction usually gives identical replicas already; the broadcast makes it a guarantee
    (different seeds, a rank that loaded another checkpoint, a buffer filled from local data...).
    """
    src = comm.global_rank(group, 0)  # comm.broadcast takes a global rank, as torch.distributed does
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            comm.broadcast(tensor.detach(), src=src, group=group, tag="init")


def ring_all_reduce(tensor: torch.Tensor, group: Any = None, op: str = "sum",
                    segment_bytes: int = DEFAULT_SEGMENT_BYTES, tag: str = "ring") -> torch.Tensor:
    """In-place ring all-reduce (reduce-scatter then all-gather, Patarasuk & Yuan 2009); returns ``tensor``.

    Each rank sends 2(N-1)/N of the tensor's bytes in 2(N-1) steps. ``op`` is one of VALID_OPS ("avg"
    divides by the group size, floating dtypes only). World size 1 is an identity.
    """
    _check_args(tensor, op, segment_bytes)
    world = comm.group_size(group)
    with _flat(tensor) as flat:
        schedule = _rs_schedule(comm.group_rank(group), world) + _ag_schedule(comm.group_rank(group), world)
        _ring(flat, group, schedule, op, segment_bytes, tag)
    return tensor


def ring_reduce_scatter(tensor: torch.Tensor, group: Any = None, op: str = "sum",
                        segment_bytes: int = DEFAULT_SEGMENT_BYTES, tag: str = "ring") -> torch.Tensor:
    """Ring reduce-scatter: this rank's chunk of ``tensor`` (flattened) reduced over the group.

    Chunks are ``tensor.flatten().tensor_split(N)``; group rank r gets chunk r, a new 1-D tensor.
    ``tensor`` itself is left unchanged (the ring accumulates into a copy).
    """
    _check_args(tensor, op, segment_bytes)
    rank, world = comm.group_rank(group), comm.group_size(group)
    flat = tensor.detach().flatten().clone()
    _ring(flat, group, _rs_schedule(rank, world), op, segment_bytes, tag)
    return flat[_bounds(flat.numel(), world)[rank]:_bounds(flat.numel(), world)[rank + 1]]


def ring_all_gather(chunk: torch.Tensor, group: Any = None, numel: int | None = None,
                    segment_bytes: int = DEFAULT_SEGMENT_BYTES, tag: str = "ring") -> torch.Tensor:
    """Ring all-gather: every rank's ``chunk`` concatenated in group-rank order, as a 1-D tensor.

    With ``numel=None`` every rank's chunk must have the same numel and the result has N times as many.
    With ``numel`` the chunks are the ``tensor_split`` pieces of a ``numel``-element tensor (what
    ``ring_reduce_scatter`` returns, uneven when N does not divide numel): the exact inverse.
    """
    _check_args(chunk, "sum", segment_bytes)
    rank, world = comm.group_rank(group), comm.group_size(group)
    numel = chunk.numel() * world if numel is None else numel
    bounds = _bounds(numel, world)
    mine = bounds[rank + 1] - bounds[rank]
    if chunk.numel() != mine:
        raise ValueError(f"ring_all_gather: group rank {rank} holds {chunk.numel()} elements but chunk {rank} of "
                         f"a {numel}-element tensor over {world} ranks has {mine}; pass the numel that was split")
    out = torch.empty(numel, dtype=chunk.dtype, device=chunk.device)
    out[bounds[rank]:bounds[rank + 1]] = chunk.detach().flatten()
    _ring(out, group, _ag_schedule(rank, world), "sum", segment_bytes, tag)
    return out


def tree_all_reduce(tensor: torch.Tensor, group: Any = None, op: str = "sum", tag: str = "tree") -> torch.Tensor:
    """In-place binomial-tree all-reduce: reduce to group rank 0, then broadcast back down the same tree.

    ceil(log2 N) rounds each way, every message the whole tensor (Thakur et al. 2005, §4): fewer
    latencies than the ring's 2(N-1), but S/B per round instead of S/N/B, so it wins only for small S.
    """
    _check_args(tensor, op, DEFAULT_SEGMENT_BYTES)
    rank, world = comm.group_rank(group), comm.group_size(group)
    if world == 1:
        return tensor
    with _flat(tensor) as flat:
        _tree_reduce(flat, group, rank, world, op, tag)
        if rank == 0 and op == "avg":
            flat.div_(world)  # once, at the root: every rank then receives bitwise the same average
        _tree_broadcast(flat, group, rank, world, tag)
    return tensor


def hierarchical_all_reduce(tensor: torch.Tensor, intra_group: Any, inter_group: Any, op: str = "sum",
                            segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> torch.Tensor:
    """In-place two-level all-reduce for ranks laid out as nodes x GPUs-per-node (``hierarchical_groups``).

    1. ring reduce-scatter inside the node (fast link): local rank i owns chunk i summed over the node;
    2. ring all-reduce of that 1/node_size shard across nodes (slow link), one ring per local rank;
    3. ring all-gather inside the node.
    Only S/node_size crosses the slow link per rank: this is how NCCL and Horovod use a cluster's
    NVLink + InfiniBand (Sergeev & Del Balso 2018; Thakur et al. 2005 for the two-level idea).
    """
    _check_args(tensor, op, segment_bytes)
    local, node_size = comm.group_rank(intra_group), comm.group_size(intra_group)
    with _flat(tensor) as flat:
        bounds = _bounds(flat.numel(), node_size)
        _ring(flat, intra_group, _rs_schedule(local, node_size), _sum_like(op), segment_bytes, "hier-intra")
        shard = flat[bounds[local]:bounds[local + 1]]
        ring_all_reduce(shard, inter_group, _sum_like(op), segment_bytes, tag="hier-inter")
        if op == "avg":
            shard.div_(node_size * comm.group_size(inter_group))
        _ring(flat, intra_group, _ag_schedule(local, node_size), "sum", segment_bytes, "hier-intra")
    return tensor


def hierarchical_groups(node_size: int, group: Any = None) -> tuple[Any, Any]:
    """(intra_group, inter_group) of this rank: consecutive blocks of ``node_size`` ranks form a "node".

    With 4 ranks and node_size 2: intra groups {0,1} {2,3}, inter groups {0,2} {1,3}. Must be called on
    every rank of ``group``, in the same order relative to other group creations.
    """
    ranks = comm.group_ranks(group)
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1 or len(ranks) % node_size:
        raise ValueError(f"node_size must be a positive divisor of the group size {len(ranks)}, got {node_size!r}")
    me = ranks.index(dist.get_rank()) if comm.is_distributed() else 0
    node, local = divmod(me, node_size)
    intra = list(ranks[node * node_size:(node + 1) * node_size])
    inter = list(ranks[local::node_size])
    if not comm.is_distributed():
        return None, None
    # Local synchronisation: each rank builds only its own two groups; torch would otherwise give the
    # groups a 30-minute timeout instead of launch's.
    timeout = group_timeout()
    intra_group = dist.new_group(intra, timeout=timeout, use_local_synchronization=True)
    inter_group = dist.new_group(inter, timeout=timeout, use_local_synchronization=True)
    return intra_group, inter_group


def parse_tag(tag: str) -> tuple[str, int, int]:
    """Split a message tag ``"<phase>:<step>:<chunk>"`` into (phase, step, chunk)."""
    phase, step, chunk = tag.rsplit(":", 2)
    return phase, int(step), int(chunk)


def ring_schedule(rank: int, world: int) -> list[tuple[str, int, int]]:
    """The ring all-reduce's plan for group rank ``rank``: per step (phase, chunk sent, chunk received).

    Reduce-scatter step s: send chunk (r-s-1) mod N, receive chunk (r-s-2) mod N and add it, so after
    N-1 steps rank r owns chunk r. All-gather step t: send chunk (r-t) mod N, receive (r-t-1) mod N.
    Each step sends exactly the chunk received the step before, which is what lets the steps pipeline.
    """
    return _rs_schedule(rank, world) + _ag_schedule(rank, world)


# ----------------------------------------------------------------------------------------------------
# The pipelined ring


def _rs_schedule(rank: int, world: int) -> list[tuple[str, int, int]]:
    return [("rs", (rank - s - 1) % world, (rank - s - 2) % world) for s in range(world - 1)]


def _ag_schedule(rank: int, world: int) -> list[tuple[str, int, int]]:
    return [("ag", (rank - t) % world, (rank - t - 1) % world) for t in range(world - 1)]


def _bounds(numel: int, world: int) -> list[int]:
    """Chunk boundaries of ``tensor_split(numel, world)``: the first numel % world chunks get one extra."""
    base, extra = divmod(numel, world)
    return [i * base + min(i, extra) for i in range(world + 1)]


def _segments(start: int, stop: int, seg_elems: int) -> list[tuple[int, int]]:
    """Fixed-size pieces of [start, stop); empty chunks have none (nothing is sent for them)."""
    return [(a, min(a + seg_elems, stop)) for a in range(start, stop, seg_elems)]


def _ring(flat: torch.Tensor, group: Any, schedule: Sequence[tuple[str, int, int]], op: str,
          segment_bytes: int, tag: str, window: int = RECV_WINDOW) -> None:
    """Run a ring schedule on the contiguous 1-D ``flat``, in place, with segments pipelined.

    The receives of all steps form one queue of (step, segment) jobs in the order the left neighbour
    sends them; ``window`` of them are posted ahead, each reduce-scatter job into its own segment-sized
    scratch buffer (a few MiB in all, not a chunk: large fresh buffers cost page faults on every call).
    When job (s, k) is combined, segment k of step s+1 is sent at once: it is the same piece of the same
    chunk, now final for this step. So no link waits for a whole chunk, and the two phases of an
    all-reduce flow into each other without a barrier. Receiving into a chunk this rank sent from
    earlier is safe: the data arriving for it causally depends on that earlier send having been received.
    """
    rank, world = comm.group_rank(group), comm.group_size(group)
    if world == 1 or not schedule:
        return
    bounds = _bounds(flat.numel(), world)
    seg_elems = max(1, segment_bytes // flat.element_size())
    right = comm.global_rank(group, (rank + 1) % world)
    left = comm.global_rank(group, (rank - 1) % world)
    last_rs = max((i for i, (phase, _, _) in enumerate(schedule) if phase == "rs"), default=-1)
    jobs = [(step, a, b) for step, (_, _, chunk) in enumerate(schedule)
            for a, b in _segments(bounds[chunk], bounds[chunk + 1], seg_elems)]
    rs_jobs = sum(1 for step, _, _ in jobs if step <= last_rs)
    scratch = [flat.new_empty(min(seg_elems, bounds[1] - bounds[0])) for _ in range(min(window, rs_jobs))]
    tags = [(_tag(tag, schedule, step, sent=False), _tag(tag, schedule, step, sent=True))
            for step in range(len(schedule))]

    def post_recv(i: int) -> tuple[comm.Work, torch.Tensor]:
        step, a, b = jobs[i]
        # reduce-scatter receives into scratch and combines; all-gather receives straight into place
        buf = scratch[i % len(scratch)][:b - a] if step <= last_rs else flat[a:b]
        return comm.irecv(buf, left, group, tag=tags[step][0]), buf

    # Receives first: gloo moves a message once the receiver has announced its buffer, so announcing
    # ours before sending saves the left neighbour a round trip.
    posted = {i: post_recv(i) for i in range(min(window, len(jobs)))}
    sends = [comm.isend(flat[a:b], right, group, tag=tags[0][1])
             for a, b in _segments(bounds[schedule[0][1]], bounds[schedule[0][1] + 1], seg_elems)]
    for i, (step, a, b) in enumerate(jobs):
        work, buf = posted.pop(i)
        work.wait()
        if step <= last_rs:
            _COMBINE[op](flat[a:b], buf)
            if step == last_rs and op == "avg":
                flat[a:b].div_(world)  # once, by the chunk's owner, so every rank gets bitwise the same
        if i + window < len(jobs):
            posted[i + window] = post_recv(i + window)  # this job's buffer is free again
        if step + 1 < len(schedule):
            sends.append(comm.isend(flat[a:b], right, group, tag=tags[step + 1][1]))
    for work in sends:
        work.wait()


def _tag(prefix: str, schedule: Sequence[tuple[str, int, int]], step: int, sent: bool) -> str:
    """``"<prefix>-<phase>:<step within phase>:<chunk>"``; the chunk is the one sent or received."""
    phase = schedule[step][0]
    first = next(i for i, (p, _, _) in enumerate(schedule) if p == phase)
    chunk = schedule[step][1] if sent else schedule[step][2]
    return f"{prefix}-{phase}:{step - first}:{chunk}"


# ----------------------------------------------------------------------------------------------------
# Binomial tree


def _tree_reduce(flat: torch.Tensor, group: Any, rank: int, world: int, op: str, tag: str) -> None:
    """Round k: ranks with bit k set send their partial sum to rank - 2^k and drop out (Thakur et al. 2005)."""
    scratch = torch.empty_like(flat)
    mask, rnd = 1, 0
    while mask < world:
        if rank & mask:
            comm.send(flat, comm.global_rank(group, rank - mask), group, tag=f"{tag}-reduce:{rnd}:0")
            return
        if rank + mask < world:
            comm.recv(scratch, comm.global_rank(group, rank + mask), group, tag=f"{tag}-reduce:{rnd}:0")
            _COMBINE[op](flat, scratch)
        mask, rnd = mask << 1, rnd + 1


def _tree_broadcast(flat: torch.Tensor, group: Any, rank: int, world: int, tag: str) -> None:
    """The reduce tree run backwards: receive from the parent, then send to children, largest subtree first."""
    rounds = math.ceil(math.log2(world))
    low_bit = rank & -rank if rank else 1 << rounds
    if rank:
        rnd = rounds - low_bit.bit_length()
        comm.recv(flat, comm.global_rank(group, rank - low_bit), group, tag=f"{tag}-bcast:{rnd}:0")
    sends = []
    mask = low_bit >> 1
    while mask:
        if rank + mask < world:
            rnd = rounds - mask.bit_length()
            sends.append(comm.isend(flat, comm.global_rank(group, rank + mask), group, tag=f"{tag}-bcast:{rnd}:0"))
        mask >>= 1
    for work in sends:
        work.wait()


# ----------------------------------------------------------------------------------------------------
# Helpers


class _flat:
    """Context manager: a contiguous 1-D view of ``tensor`` to work on, copied back if it had to be a copy."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.work = tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()

    def __enter__(self) -> torch.Tensor:
        return self.work.view(-1)

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None and self.work.data_ptr() != self.tensor.data_ptr():
            with torch.no_grad():
                self.tensor.copy_(self.work)


def _sum_like(op: str) -> str:
    """The op the inner stages run: "avg" is a sum whose division happens once, at the end."""
    return "sum" if op == "avg" else op


def _check_args(tensor: Any, op: str, segment_bytes: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if op not in VALID_OPS:
        raise ValueError(f"unknown reduce op {op!r}; valid: {', '.join(VALID_OPS)}")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}; use op='sum' and divide")
    if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < 1:
        raise ValueError(f"segment_bytes must be a positive int, got {segment_bytes!r}")


__all__ = [
    "DEFAULT_SEGMENT_BYTES", "VALID_OPS", "hierarchical_all_reduce", "hierarchical_groups", "parse_tag",
    "ring_all_gather", "ring_all_reduce", "ring_reduce_scatter", "ring_schedule", "tree_all_reduce",
]
