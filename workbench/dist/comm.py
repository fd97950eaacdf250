"""Every collective workbench uses, each logged to the active tracer.

One thin layer over ``torch.distributed``: each function calls the primitive and appends a
``CommEvent`` (op, bytes, dtype, group ranks, start and end time) to ``trace.current()``. Because every
strategy communicates through here, the bytes-per-step table, the communication timeline and the
"ZeRO-3 moves 1.5x DDP's bytes" lesson all come from one measured log.

With no process group (one process) or a group of one rank, the collectives are identities, so
single-process training runs the same code path as data-parallel training.

With emulated links on (``dist.emulation``, ``launch(..., nodes=2, inter_link="ethernet")``), each op also waits
until the end the α-β model gives over the links it crosses, and its event records the link class and the
modelled seconds beside the measured ones. With them off, nothing here changes.

``group=None`` means the default (world) group, as in torch.distributed.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from workbench import trace
from workbench.dist import emulation
from workbench.theory import comm as theory_comm
from workbench.trace import CommEvent

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "product": dist.ReduceOp.PRODUCT}
VALID_REDUCE_OPS = ("sum", "avg", "max", "min", "product")

# torch >= 2.10 renamed the tensor-in/tensor-out collectives; keep working on older releases too.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def group_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def group_ranks(group: Any = None) -> tuple[int, ...]:
    """Global ranks of ``group`` in group-rank order."""
    if not is_distributed():
        return (0,)
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def global_rank(group: Any, group_rank_: int) -> int:
    """The global rank of ``group``'s member number ``group_rank_`` (send/recv take global ranks)."""
    return group_ranks(group)[group_rank_]


def bus_bytes(op: str, nbytes: int, world: int) -> float:
    """Bytes one rank sends for ``op`` (ring accounting, ``theory.comm.bus_bytes``); nothing moves in a group
    of one, nor in a barrier."""
    if world <= 1 or op == "barrier":
        return 0.0
    return theory_comm.bus_bytes(op, nbytes, world)


def check_device(op: str, group: Any, *tensors: torch.Tensor) -> None:
    """Refuse, with the fix, a tensor the group's backend cannot move: NCCL needs CUDA tensors; gloo
    collectives on CUDA tensors crashed the rank when measured (``writev: Bad address``)."""
    if not is_distributed() or group_size(group) == 1:  # a group of one moves nothing
        return
    backend = dist.get_backend(group)
    for t in tensors:
        if backend == "nccl" and t.device.type != "cuda":
            raise ValueError(f"{op}: the NCCL backend needs CUDA tensors, got one on {t.device}; create it on "
                             f"the rank's device (workbench.launch.rank_device() / mesh.device)")
        if backend == "gloo" and t.device.type == "cuda":
            raise ValueError(f"{op}: gloo cannot move CUDA tensors here, got one on {t.device}; launch with "
                             f"device='cuda' (NCCL) or keep the tensor on the CPU")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _record(op: str, t: torch.Tensor, nbytes: int, group: Any, t0: float, async_op: bool = False,
            tag: str = "", peer: int | None = None, emulated: _Emulated | None = None) -> None:
    tracer = trace.current()
    if tracer is None:
        return
    ranks = group_ranks(group)
    world = 2 if op in ("send", "recv") else len(ranks)
    tracer.record_comm(CommEvent(
        op=op, nbytes=int(nbytes), bus_bytes=bus_bytes(op, nbytes, world), dtype=str(t.dtype).replace("torch.", ""),
        shape=tuple(t.shape), group=ranks, t0=t0, t1=time.time(), rank=tracer.trace.rank,
        async_op=async_op, tag=tag, peer=peer, link=emulated.link if emulated else "",
        modelled_s=emulated.modelled if emulated else None))


class _Emulated:
    """An op's debt to the emulated links while it is in flight (``dist.emulation``): its link class, modelled
    seconds, and the time it may end, known at once (a send) or from the stamp a peer sends (a collective's
    start, a message's arrival), read when the op is waited for."""

    def __init__(self, clock: emulation.LinkClock, link: str, modelled: float, end: float | None = None,
                 stamp: torch.Tensor | None = None, stamp_work: Any = None, offset: float = 0.0) -> None:
        self.clock, self.link, self.modelled = clock, link, modelled
        self._end, self._stamp, self._stamp_work, self._offset = end, stamp, stamp_work, offset

    def end(self) -> float:
        """The modelled end (waits for the peers' stamp if it has not come yet)."""
        if self._stamp_work is not None:
            self._stamp_work.wait()
            self._stamp_work = None
        if self._end is None:
            self._end = float(self._stamp.item()) + self._offset
        return self._end

    def ready(self) -> bool:
        """Whether the modelled end has passed, without blocking."""
        if self._stamp_work is not None and not self._stamp_work.is_completed():
            return False
        return time.time() >= self.end()

    def settle(self) -> None:
        """Block until the modelled end; the link stays busy until then."""
        end = self.end()
        self.clock.occupy(self.link, end)
        emulation.sleep_until(end)


def _stamp_device(group: Any) -> torch.device:
    """Where a stamp must live for ``group``'s backend: this rank's GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _charge_collective(op: str, nbytes: int, group: Any, t0: float) -> _Emulated | None:
    """Start charging a collective (before the real op is issued, in the same order on every rank): each member
    offers when its link could start; the group's latest offer is when the collective starts."""
    clock = emulation.current()
    if clock is None:  # emulation off: nothing more than this check per op
        return None
    ranks = group_ranks(group)
    if len(ranks) <= 1:
        return None
    link = clock.emulation.link_class(ranks)
    modelled = clock.emulation.modelled_time(op, nbytes, ranks)
    offer = clock.offer(link, t0)
    clock.occupy(link, offer + modelled)  # the next op this rank queues on the link starts after this one
    offered = emulation.stamp(offer, _stamp_device(group))
    work = dist.all_reduce(offered, op=dist.ReduceOp.MAX, group=group, async_op=True)
    return _Emulated(clock, link, modelled, stamp=offered, stamp_work=work, offset=modelled)


def _p2p_link(peer: int, op: str, nbytes: int) -> tuple[emulation.LinkClock, str, float] | None:
    clock = emulation.current()
    if clock is None:
        return None
    ends = (dist.get_rank(), peer)
    return clock, clock.emulation.link_class(ends), clock.emulation.modelled_time(op, nbytes, ends)


def _charge_send(tensor: torch.Tensor, dst: int, group: Any, t0: float) -> _Emulated | None:
    """The message arrives when the sender's link has carried it; the sender tells the receiver when, in a stamp
    sent just ahead of the data (the receiver cannot know when the sender issued it, nor what its link had queued)."""
    priced = _p2p_link(dst, "send", _nbytes(tensor))
    if priced is None:
        return None
    clock, link, modelled = priced
    end = clock.offer(link, t0) + modelled
    clock.occupy(link, end)
    arrival = emulation.stamp(end, _stamp_device(group))
    work = dist.isend(arrival, dst=dst, group=group)
    return _Emulated(clock, link, modelled, end=end, stamp=arrival, stamp_work=work)


def _charge_recv(tensor: torch.Tensor, src: int, group: Any) -> _Emulated | None:
    priced = _p2p_link(src, "recv", _nbytes(tensor))
    if priced is None:
        return None
    clock, link, modelled = priced
    arrival = torch.empty(1, dtype=torch.float64, device=_stamp_device(group))
    work = dist.irecv(arrival, src=src, group=group)
    return _Emulated(clock, link, modelled, stamp=arrival, stamp_work=work)


class Work:
    """Handle of an async op: ``wait()`` blocks, then logs the op with the time it really finished."""

    def __init__(self, work: Any, on_done: Any, emulated: _Emulated | None = None) -> None:
        self._work = work
        self._on_done = on_done
        self._done = False
        self._emulated = emulated

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        if self._emulated is not None:
            self._emulated.settle()  # an emulated link: done no earlier than its modelled end
        self._done = True
        self._on_done()

    @property
    def waited(self) -> bool:
        """True once ``wait()`` returned (finishing on its own does not count: nobody saw the result)."""
        return self._done

    def is_completed(self) -> bool:
        if self._done:
            return True
        real = self._work is not None and self._work.is_completed()
        return real and (self._emulated is None or self._emulated.ready())


def _finish(op: str, work: Any, async_op: bool, record: Any, after: Any = None,
            emulated: _Emulated | None = None) -> Work | None:
    """Wait now (sync) or hand back a Work that logs on wait (async). ``after`` runs once the data is in."""

    def on_done() -> None:
        if after is not None:
            after()
        record()

    handle = Work(work, on_done, emulated)
    if async_op:
        return handle
    handle.wait()
    return None


def _reduce_op(op: str) -> Any:
    if op not in VALID_REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; valid: {', '.join(VALID_REDUCE_OPS)}")
    return _REDUCE_OPS.get(op, dist.ReduceOp.SUM)


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Any = None, async_op: bool = False,
               tag: str = "") -> Work | None:
    """In-place all-reduce. ``op="avg"`` is a sum followed by a division (gloo has no AVG everywhere)."""
    reduce_op = _reduce_op(op)
    check_device("all_reduce", group, tensor)
    t0 = time.time()
    world = group_size(group)
    after = (lambda: tensor.div_(world)) if op == "avg" and world > 1 else None
    emulated = _charge_collective("all_reduce", _nbytes(tensor), group, t0) if world > 1 else None
    work = dist.all_reduce(tensor, op=reduce_op, group=group, async_op=True) if world > 1 else None
    return _finish("all_reduce", work, async_op,
                   lambda: _record("all_reduce", tensor, _nbytes(tensor), group, t0, async_op, tag, emulated=emulated),
                   after, emulated)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: str = "sum", group: Any = None,
                         tag: str = "") -> list[torch.Tensor]:
    """All-reduce several tensors as one flat message (one collective, one log entry) and return the results,
    views of one new buffer shaped like the inputs; the inputs are left as they are (copy or rebind them)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, op=op, group=group, tag=tag)
    return [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str = "sum", group: Any = None,
                   async_op: bool = False, tag: str = "") -> Work | None:
    """``output`` (shape input/N along dim 0) receives this rank's reduced chunk of ``input``."""
    reduce_op = _reduce_op(op)
    world = group_size(group)
    if input.shape[0] != output.shape[0] * world:
        raise ValueError(f"reduce_scatter: input dim 0 ({input.shape[0]}) must be world ({world}) x "
                         f"output dim 0 ({output.shape[0]})")
    check_device("reduce_scatter", group, output, input)
    t0 = time.time()
    emulated = None
    if world == 1:
        output.copy_(input)
        work = None
    else:
        emulated = _charge_collective("reduce_scatter", _nbytes(input), group, t0)
        work = _reduce_scatter_single(output, input, op=reduce_op, group=group, async_op=True)
    after = (lambda: output.div_(world)) if op == "avg" and world > 1 else None
    return _finish("reduce_scatter", work, async_op,
                   lambda: _record("reduce_scatter", input, _nbytes(input), group, t0, async_op, tag,
                                   emulated=emulated), after, emulated)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False,
               tag: str = "") -> Work | None:
    """``output`` (N x input along dim 0) receives every rank's ``input`` in group-rank order."""
    world = group_size(group)
    if output.shape[0] != input.shape[0] * world:
        raise ValueError(f"all_gather: output dim 0 ({output.shape[0]}) must be world ({world}) x "
                         f"input dim 0 ({input.shape[0]})")
    check_device("all_gather", group, output, input)
    t0 = time.time()
    emulated = None
    if world == 1:
        output.copy_(input)
        work = None
    else:
        emulated = _charge_collective("all_gather", _nbytes(output), group, t0)
        work = _all_gather_single(output, input, group=group, async_op=True)
    return _finish("all_gather", work, async_op,
                   lambda: _record("all_gather", output, _nbytes(output), group, t0, async_op, tag,
                                   emulated=emulated), None, emulated)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None, async_op: bool = False,
              tag: str = "") -> Work | None:
    """Broadcast from ``src``, a *global* rank as in torch.distributed."""
    check_device("broadcast", group, tensor)
    t0 = time.time()
    several = group_size(group) > 1
    emulated = _charge_collective("broadcast", _nbytes(tensor), group, t0) if several else None
    work = dist.broadcast(tensor, src=src, group=group, async_op=True) if several else None
    return _finish("broadcast", work, async_op,
                   lambda: _record("broadcast", tensor, _nbytes(tensor), group, t0, async_op, tag, emulated=emulated),
                   None, emulated)


def reduce(tensor: torch.Tensor, dst: int = 0, op: str = "sum", group: Any = None, async_op: bool = False,
           tag: str = "") -> Work | None:
    """Reduce to ``dst`` (a global rank); other ranks' tensors are left unspecified."""
    reduce_op = _reduce_op(op)
    world = group_size(group)
    check_device("reduce", group, tensor)
    t0 = time.time()
    emulated = _charge_collective("reduce", _nbytes(tensor), group, t0) if world > 1 else None
    work = dist.reduce(tensor, dst=dst, op=reduce_op, group=group, async_op=True) if world > 1 else None
    is_dst = not is_distributed() or dist.get_rank() == dst
    after = (lambda: tensor.div_(world)) if op == "avg" and world > 1 and is_dst else None
    return _finish("reduce", work, async_op,
                   lambda: _record("reduce", tensor, _nbytes(tensor), group, t0, async_op, tag, emulated=emulated),
                   after, emulated)


def _split_sizes(op: str, name: str, sizes: list[int] | None, rows: int, world: int) -> list[int] | None:
    """Check a variable all-to-all's split sizes (rows of dim 0 per group rank): one per rank, summing to ``rows``."""
    if sizes is None:
        return None
    sizes = [int(n) for n in sizes]
    if len(sizes) != world or min(sizes, default=0) < 0 or sum(sizes) != rows:
        raise ValueError(f"{op}: {name} must be {world} non-negative row counts (one per group rank) summing to "
                         f"dim 0 ({rows}), got {sizes}")
    return sizes


def _sent_bytes(input: torch.Tensor, input_splits: list[int] | None, world: int, me: int) -> float:
    """Bytes this rank sends to the others: every chunk but its own (equal chunks: (N-1)/N of the buffer)."""
    if world <= 1:
        return 0.0
    if input_splits is None:
        return bus_bytes("all_to_all", _nbytes(input), world)
    row = _nbytes(input) // input.shape[0] if input.shape[0] else 0
    return float(row * (sum(input_splits) - input_splits[me]))


def _record_all_to_all(input: torch.Tensor, sent: float, group: Any, t0: float, async_op: bool, tag: str,
                       emulated: _Emulated | None) -> None:
    """``_record`` with the bytes really sent as ``bus_bytes``: with variable splits they are not (N-1)/N of S."""
    tracer = trace.current()
    if tracer is None:
        return
    tracer.record_comm(CommEvent(
        op="all_to_all", nbytes=_nbytes(input), bus_bytes=sent, dtype=str(input.dtype).replace("torch.", ""),
        shape=tuple(input.shape), group=group_ranks(group), t0=t0, t1=time.time(), rank=tracer.trace.rank,
        async_op=async_op, tag=tag, link=emulated.link if emulated else "",
        modelled_s=emulated.modelled if emulated else None))


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False,
               tag: str = "", *, output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None) -> Work | None:
    """Chunk i of ``input`` goes to group rank i; chunk j of ``output`` comes from group rank j.

    Chunks are equal (dim 0 / N) unless split sizes are given, as in ``dist.all_to_all_single``: ``input_split_sizes``
    [i] rows of dim 0 go to rank i, ``output_split_sizes[j]`` rows arrive from rank j (what rank j sends here; the
    counts are exchanged beforehand, e.g. by an equal-split all-to-all). The log's ``bus_bytes`` are the bytes this
    rank sends to the others, and the emulated link is charged for them (an S-byte buffer whose (N-1)/N leave)."""
    world = group_size(group)
    input_splits = _split_sizes("all_to_all", "input_split_sizes", input_split_sizes, input.shape[0], world)
    output_splits = _split_sizes("all_to_all", "output_split_sizes", output_split_sizes, output.shape[0], world)
    check_device("all_to_all", group, output, input)
    t0 = time.time()
    sent = _sent_bytes(input, input_splits, world, group_rank(group))
    emulated = None
    if world == 1:
        output.copy_(input)
        work = None
    else:
        # The α-β model prices an S-byte all-to-all whose (N-1)/N leave: the S that sends exactly ``sent``.
        emulated = _charge_collective("all_to_all", round(sent * world / (world - 1)), group, t0)
        work = dist.all_to_all_single(output, input, output_split_sizes=output_splits,
                                      input_split_sizes=input_splits, group=group, async_op=True)
    return _finish("all_to_all", work, async_op,
                   lambda: _record_all_to_all(input, sent, group, t0, async_op, tag, emulated), None, emulated)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: str = "") -> None:
    """Blocking send to global rank ``dst``."""
    _send(tensor, dst, group, tag, async_op=False).wait()


def recv(tensor: torch.Tensor, src: int, group: Any = None, tag: str = "") -> None:
    """Blocking receive from global rank ``src`` into ``tensor``."""
    _recv(tensor, src, group, tag, async_op=False).wait()


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: str = "") -> Work:
    """Send to global rank ``dst``; ``wait()`` the handle before reusing ``tensor``."""
    return _send(tensor, dst, group, tag, async_op=True)


def irecv(tensor: torch.Tensor, src: int, group: Any = None, tag: str = "") -> Work:
    """Receive from global rank ``src`` into ``tensor``; its data is there once ``wait()`` returns."""
    return _recv(tensor, src, group, tag, async_op=True)


def recv_any(tensor: torch.Tensor, group: Any = None, tag: str = "") -> int:
    """Blocking receive from whichever rank's message arrives first; returns the sender's global rank. What an
    asynchronous server needs (a gloo irecv never reports completion until waited, so it cannot be polled). Gloo
    only (NCCL has no any-source receive), and not on an emulated cluster, which prices each message by its two
    ends and so must know the sender before the message arrives."""
    check_device("recv", group, tensor)
    if emulation.current() is not None:
        raise RuntimeError("recv_any: an emulated cluster prices each message by its sender and receiver, and an "
                           "any-source receive learns its sender only on arrival; run without --nodes")
    if dist.get_backend(group) != "gloo":
        raise RuntimeError(f"recv_any needs gloo (an any-source receive); this group runs {dist.get_backend(group)}")
    t0 = time.time()
    src = dist.recv(tensor, src=None, group=group)
    _record("recv", tensor, _nbytes(tensor), group, t0, False, tag, src, None)
    return src


def _send(tensor: torch.Tensor, dst: int, group: Any, tag: str, async_op: bool) -> Work:
    check_device("isend" if async_op else "send", group, tensor)
    t0 = time.time()
    emulated = _charge_send(tensor, dst, group, t0)
    work = dist.isend(tensor, dst=dst, group=group)
    return Work(work, lambda: _record("send", tensor, _nbytes(tensor), group, t0, async_op, tag, dst, emulated),
                emulated)


def _recv(tensor: torch.Tensor, src: int, group: Any, tag: str, async_op: bool) -> Work:
    check_device("irecv" if async_op else "recv", group, tensor)
    t0 = time.time()
    emulated = _charge_recv(tensor, src, group)
    work = dist.irecv(tensor, src=src, group=group)
    return Work(work, lambda: _record("recv", tensor, _nbytes(tensor), group, t0, async_op, tag, src, emulated),
                emulated)


def barrier(group: Any = None, tag: str = "") -> None:
    t0 = time.time()
    emulated = None
    if group_size(group) > 1:
        emulated = _charge_collective("barrier", 0, group, t0)
        dist.barrier(group=group)
        if emulated is not None:
            emulated.settle()
    _record("barrier", torch.empty(0, device="cpu"), 0, group, t0, tag=tag, emulated=emulated)  # a record, not data


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (pickled; for small metadata, not tensors on a hot path)."""
    if group_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
