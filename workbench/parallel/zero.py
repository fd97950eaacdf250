"""ZeRO stages 1-3 and CPU offload: why keep N copies of the optimizer at all?

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC'20).
Plain data parallelism replicates all model states on every rank: 4Ψ bytes of fp32 parameters, 4Ψ of
gradients and 8Ψ of Adam moments. ZeRO partitions them over the N data-parallel ranks:

stage 1 (P_os)      ``ZeroOptimizer(..., stage=1)``: each rank keeps optimizer state for, and updates, only
                    its 1/N shard of the parameters, then the updated shards are all-gathered.
stage 2 (P_os+g)    ``ZeroOptimizer(..., stage=2)``: gradients are reduce-scattered (averaged) bucket by
                    bucket while backward runs, so each rank keeps only its gradient shard.
stage 3 (P_os+g+p)  ``FullyShardedModel`` + ``ZeroOptimizer(..., stage=3)``: parameters are sharded too and
                    each unit's are all-gathered just before its forward and again before its backward
                    (FSDP: Zhao et al. 2023, "PyTorch FSDP", VLDB). 3Ψ moved per step instead of 2Ψ (§7.2).
offload             ZeRO-Offload (Ren et al. 2021): optimizer state (and with ``offload_params`` the stage-3
                    parameter shards) live on ``offload_device`` and are copied to the compute device to be used.

How a layout is chosen, and why. Parameters are laid end to end in *flat buckets* (for stage 3, one bucket
per unit), each padded to a multiple of N; rank r owns the contiguous slice [r·S, (r+1)·S) of every bucket
(S = ⌈bucket/N⌉). Flat contiguous shards make the per-rank bytes exactly ZeRO's Ψ/N (plus at most N−1
padding elements per bucket), and each bucket is one ``reduce_scatter`` and one ``all_gather`` whose input
and output are plain tensors: no per-parameter messages. One flat partition of the whole model (DeepSpeed's
layout) would need a separate reduce per owner for every bucket that straddles a shard boundary; sharding
each bucket keeps every collective a single call, at the cost of the padding. In stages 0-2 the model's
parameters become views into the bucket buffers (DeepSpeed's "contiguous gradients/params"), so the
all-gather writes the updated weights straight into the model and the optimizer steps a view of the owned
slice: no extra copy of the parameters exists.

Memory is recorded in the tracer's ledger (``workbench.trace``): "parameters" (what this rank permanently
holds), "gradients", "optimizer_state" (tensors of the inner optimizer's state, its 0-dim step counters
excluded as bookkeeping), "gathered_params" (stage 3's transient full units; its peak is what matters),
"comm_buffers" (staging buffers of collectives). Frozen parameters are not ZeRO's business: they stay
replicated, are never communicated and are not counted. Offloaded bytes are not device bytes: they are
reported by ``offloaded_bytes()``. Collectives are tagged "grad" (gradient reduction), "param" (parameter
all-gathers), "clip" (the one-scalar norm all-reduce) and "checkpoint" (``full_parameters``), so the bytes
per step and purpose come straight from ``trace.comms``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workbench import comm, trace
from workbench.launch import rank_device

VALID_STAGES = (0, 1, 2, 3)
DEFAULT_BUCKET_MB = 25.0
# The inner optimizer steps each flat shard as pieces of at most this many bytes. An element-wise optimizer
# (torch's single-tensor AdamW/SGD on CPU) makes ~6 passes over each tensor it steps; a piece that fits in
# a core's L2 cache keeps those passes in cache, where a 25 MiB shard would stream from memory every pass
# (measured: AdamW over 5.4 M fp32 elements, one thread, 35 ms as one tensor, 18 ms as 1 MiB pieces).
STEP_CHUNK_BYTES = 1 << 20
# Backends whose all-gather may take as input this rank's own slice of the output: NCCL documents it
# ("in place" when sendbuff == recvbuff + rank * count); gloo gathers into a temporary buffer and copies
# into the output only after every input byte has been read (ProcessGroupGloo::AsyncAllgatherWork).
_IN_PLACE_ALL_GATHER_BACKENDS = frozenset({"gloo", "nccl"})


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _queue_end_of_backward(callback: Any) -> None:
    """Run ``callback`` once the current backward pass has finished (what torch DDP does too)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def _record_span(name: str, category: str, t0: float) -> None:
    """A span that hooks open and close (forward/backward of one unit), for the timeline."""
    tracer = trace.current()
    if tracer is not None and tracer.enabled:
        tracer.trace.spans.append(trace.Span(name, category, t0, time.time(), tracer.trace.rank, tracer.step))


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors (Adam moments, momentum), not step counters."""
    return trace.tensor_bytes(t for s in optimizer.state.values() for t in s.values()
                              if torch.is_tensor(t) and t.dim() > 0)


# ----------------------------------------------------------------------------------------------------
# Flat buckets (stages 0-2)


class _Bucket:
    """Whole parameters laid end to end in one flat buffer of ``parts`` × ``shard_numel`` elements.

    The model's parameters become views of ``flat``; partition rank r owns
    ``flat[r*shard_numel:(r+1)*shard_numel]`` (``shard``, a view the inner optimizer steps in place, as the
    cache-sized pieces ``chunks``).
    Stage 0 uses ``parts=1``: the "shard" is the whole bucket.
    """

    def __init__(self, params: list[nn.Parameter], parts: int, part_rank: int) -> None:
        self.params = params
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.shard_numel = _ceil_div(self.numel, parts)
        self.parts, self.part_rank = parts, part_rank
        first = params[0]
        self.flat = torch.zeros(parts * self.shard_numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, offset, n in zip(params, self.offsets, self.numels, strict=True):
                self.flat[offset:offset + n].copy_(p.detach().reshape(-1))
                p.data = self.flat[offset:offset + n].view_as(p)
        self.shard = self.flat.narrow(0, part_rank * self.shard_numel, self.shard_numel)
        self.shard_grad: torch.Tensor | None = None
        self.shard_grad_is_view = False  # shard_grad aliases the params' .grad (do not modify it in place)
        self.chunks: list[torch.Tensor] = []  # what the inner optimizer steps: pieces of the shard (or master)
        self.ready: set[int] = set()

    def is_ready(self) -> bool:
        return len(self.ready) == len(self.params)

    def flat_grad(self) -> torch.Tensor | None:
        """The bucket's local gradient as one padded flat tensor (zeros where a param has no .grad)."""
        if all(p.grad is None for p in self.params):
            return None
        g = torch.zeros_like(self.flat)
        for p, offset, n in zip(self.params, self.offsets, self.numels, strict=True):
            if p.grad is not None:
                g[offset:offset + n].copy_(p.grad.reshape(-1))
        return g

    def owned_grad(self) -> torch.Tensor | None:
        """This rank's slice of the (already averaged) gradient: a view when the ``.grad`` tensors it spans lie
        end to end in one buffer (a DDP wrapper's gradient bucket, as with ``BucketedDDP``'s
        gradient-as-bucket-view), else copied piece by piece from ``.grad``. ``shard_grad_is_view`` says which."""
        self.shard_grad_is_view = False
        if all(p.grad is None for p in self.params):
            return None
        own_lo = self.part_rank * self.shard_numel
        own_hi = own_lo + self.shard_numel
        view = self._owned_grad_view(own_lo, own_hi)
        if view is not None:
            self.shard_grad_is_view = True
            return view
        out = torch.zeros_like(self.shard)
        for p, offset, n in zip(self.params, self.offsets, self.numels, strict=True):
            lo, hi = max(offset, own_lo), min(offset + n, own_hi)
            if lo < hi and p.grad is not None:
                out[lo - own_lo:hi - own_lo].copy_(p.grad.reshape(-1)[lo - offset:hi - offset])
        return out

    def _owned_grad_view(self, own_lo: int, own_hi: int) -> torch.Tensor | None:
        """A view of [own_lo, own_hi) of the bucket's gradient if the ``.grad`` of every parameter overlapping
        it is contiguous and they sit at the same relative offsets in one storage; None otherwise (or when the
        slice includes padding, which must read as zeros)."""
        if own_hi > self.numel:
            return None
        base, grad0 = None, None
        for p, offset, n in zip(self.params, self.offsets, self.numels, strict=True):
            if offset + n <= own_lo or offset >= own_hi:
                continue
            g = p.grad
            if g is None or not g.is_contiguous() or g.dtype != self.flat.dtype or g.device != self.flat.device:
                return None
            if grad0 is None:
                base, grad0 = g.storage_offset() - offset, g
            elif (g.untyped_storage().data_ptr() != grad0.untyped_storage().data_ptr()
                  or g.storage_offset() - offset != base):
                return None
        if grad0 is None or base + own_lo < 0:
            return None
        return grad0.detach().as_strided((own_hi - own_lo,), (1,), base + own_lo)


def _bucket_params(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Group params, in reverse registration order (the order backward produces their gradients, Li et al.
    2020 §3.2.3), into lists of at most ``cap_bytes`` (a larger param gets a bucket of its own) that share
    dtype and device, so each list can be one flat tensor."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        fits = buckets and size + nbytes <= cap_bytes
        same_kind = buckets and (buckets[-1][0].dtype, buckets[-1][0].device) == (p.dtype, p.device)
        if fits and same_kind:
            buckets[-1].append(p)
            size += nbytes
        else:
            buckets.append([p])
            size = nbytes
    return buckets


def _param_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Normalise ``params`` (tensors or param-group dicts, any iterable) to groups of unique trainable
    parameters; a tied parameter listed twice is kept once."""
    items = list(params)
    if not items:
        raise ValueError("ZeroOptimizer got an empty parameter list; pass model.parameters()")
    groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
    seen: set[int] = set()
    for g in groups:
        if "params" not in g:
            raise ValueError(f"a param group needs a 'params' key, got keys {sorted(g)}")
        tensors = [g["params"]] if torch.is_tensor(g["params"]) else list(g["params"])
        unique = []
        for p in tensors:
            if not torch.is_tensor(p):
                raise ValueError(f"params must be tensors or param-group dicts, got {type(p).__name__}")
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        g["params"] = unique
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("ZeroOptimizer: no parameter requires grad; nothing to optimise")
    return groups


# ----------------------------------------------------------------------------------------------------
# The sharded optimizer (stages 0-3)


class ZeroOptimizer(torch.optim.Optimizer):
    """Wrap any ``torch.optim`` optimizer so each data-parallel rank keeps state for 1/N of the parameters.

    ``params``: any iterable of parameters or param-group dicts (frozen ones are ignored).
    ``optimizer_cls`` and ``**optimizer_kwargs``: the inner optimizer (e.g. ``torch.optim.AdamW, lr=1e-3``).

    Stages (Rajbhandari et al. 2020 §5):

    * 0: nothing sharded (plain data parallelism's memory; the baseline the others are measured against).
    * 1: optimizer state sharded. Gradients must arrive *averaged*, from a DDP wrapper, as with torch's
      ``ZeroRedundancyOptimizer`` (then DDP's all-reduce 2Ψ + our all-gather Ψ = 3Ψ per step). With
      ``reduce_grads=True`` ``step()`` reduce-scatters the local gradients itself instead, which is the
      paper's stage 1 (2Ψ, §7.2.1). Stage 0 with ``reduce_grads=True`` all-reduces them (2Ψ).
    * 2: gradients sharded too. Post-accumulate-grad hooks reduce-scatter (average) each bucket into this
      rank's gradient shard as soon as its last gradient is final, in reverse order while backward still
      runs, and free the full ``.grad``. Use *without* a DDP wrapper.
    * 3: ``params`` must be the shards of a ``FullyShardedModel``, whose backward already reduce-scattered
      the gradients: ``step()`` only updates the local shards.

    Gradient accumulation: either accumulate into the shard (call backward K times; stage 2 reduce-scatters
    every micro-batch and sums into the shard), or wrap the first K−1 backwards in ``no_sync()`` (stage 2
    then keeps the full local gradients and communicates once, on the last). Scale the loss by 1/K as usual.

    ``param_groups`` are the inner optimizer's, so an LR scheduler's ``lr`` reaches the inner ``step``; at
    stages 0-2 their params are the shards cut in pieces of ``STEP_CHUNK_BYTES`` (one state entry per piece).
    ``state_dict()`` is shard-local: each rank saves and loads its own shard's state (same world size and
    rank required). ``offload=True`` keeps optimizer state, and a master copy of the stepped shard, on
    ``offload_device`` (ZeRO-Offload); gradients are copied there, stepped, and the result copied back.
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer], group: Any = None,
                 stage: int = 1, offload: bool = False, *, reduce_grads: bool = False,
                 bucket_cap_mb: float = DEFAULT_BUCKET_MB, offload_device: str | torch.device = "cpu",
                 **optimizer_kwargs: Any) -> None:
        if stage not in VALID_STAGES:
            raise ValueError(f"ZeRO stage {stage!r} is not valid; valid stages: {VALID_STAGES}")
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_cls must be a torch.optim.Optimizer class (e.g. torch.optim.AdamW), "
                             f"got {optimizer_cls!r}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.group, self.stage, self.offload = group, stage, offload
        self.reduce_grads = reduce_grads or stage == 2
        self.offload_device = torch.device(offload_device)
        self.comm_device = rank_device()  # where scalars this optimizer communicates are born
        self.world, self.rank = comm.group_size(group), comm.group_rank(group)
        groups = _param_groups(params)
        _check_stage_matches_params(stage, groups)
        self.buckets: list[_Bucket] = []
        parts, part_rank = (1, 0) if stage == 0 else (self.world, self.rank)
        inner_groups = []
        for g in groups:
            if stage == 3:
                tensors = list(g["params"])
            else:
                new = [_Bucket(b, parts, part_rank) for b in _bucket_params(g["params"], int(bucket_cap_mb * 2**20))]
                self.buckets += new
                tensors = [b.shard for b in new]
            inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": tensors})
        self._sharded = [t for g in inner_groups for t in g["params"]]  # what step() updates, on device
        self._masters = self._make_masters()
        for b in self.buckets:
            b.chunks = _step_chunks(self._masters.get(id(b.shard), b.shard))
        chunks = {id(b.shard): b.chunks for b in self.buckets}
        for g in inner_groups:
            g["params"] = [c for t in g["params"] for c in chunks.get(id(t), [self._masters.get(id(t), t)])]
        self.optimizer = optimizer_cls(inner_groups, **optimizer_kwargs)
        self._gather_in_place = _all_gather_accepts_own_slice(group)
        self.defaults = self.optimizer.defaults
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._pending: list[tuple[_Bucket, Any, torch.Tensor, torch.Tensor]] = []
        self._next_bucket = 0
        self._callback_queued = False
        self._no_sync = False
        self._synced = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for b in self.buckets for p in b.params] if stage == 2 else []
        self._record_memory()

    # -- torch.optim.Optimizer surface ---------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def __repr__(self) -> str:
        return (f"ZeroOptimizer(stage={self.stage}, rank {self.rank}/{self.world}, offload={self.offload}, "
                f"inner={type(self.optimizer).__name__}, buckets={len(self.buckets)})")

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (shard-local: load it on the same rank of the same N)."""
        return {"zero_stage": self.stage, "rank": self.rank, "world": self.world,
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        got = (state_dict.get("zero_stage"), state_dict.get("rank"), state_dict.get("world"))
        want = (self.stage, self.rank, self.world)
        if got != want:
            raise ValueError(f"shard-local state dict of (stage, rank, world)={got} cannot be loaded into "
                             f"(stage, rank, world)={want}; save and load on the same layout")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._record_memory()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError("ZeroOptimizer partitions its parameters at construction; pass every param group "
                         "to the constructor instead of add_param_group")

    def zero_grad(self, set_to_none: bool = True) -> None:
        tensors = [*self._sharded, *self._masters.values()]
        tensors += [t for b in self.buckets for t in (*b.params, *b.chunks)]
        for t in tensors:
            if t.grad is not None:
                if set_to_none:
                    t.grad = None
                else:
                    t.grad.zero_()
        for b in self.buckets:
            if set_to_none:
                b.shard_grad = None
            elif b.shard_grad is not None:
                b.shard_grad.zero_()
            b.shard_grad_is_view = b.shard_grad_is_view and b.shard_grad is not None
        self._synced = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Update this rank's shard, then (stages 1-2) all-gather the updated shards into every replica."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.finish_gradient_synchronization()
        if self.stage == 3:
            self._attach_grads()
            with trace.span("optimizer step (shard)", "optimizer"):
                self.optimizer.step()
                for t in self._sharded:
                    if id(t) in self._masters:
                        t.copy_(self._masters[id(t)])  # offload: the updated master goes back to the device
        else:
            self._step_buckets()
        self._synced = False
        self._record_memory()
        return loss

    def _step_buckets(self) -> None:
        """Stages 0-2: step the shard bucket by bucket and start each bucket's all-gather as soon as its shard
        is updated, so it runs while the next bucket is being stepped (the overlap DeepSpeed's ZeRO-1/2 get by
        gathering partitions as they finish). The inner optimizer steps one bucket per call: torch optimizers
        skip parameters whose ``.grad`` is None, so only the bucket whose pieces have gradients attached moves,
        and each piece's state (Adam's step counter included) advances once per ``step()``."""
        self._attach_grads(None)
        works = []
        for b in self.buckets:
            with trace.span("optimizer step (shard)", "optimizer"):
                self._attach_grads(b)
                self.optimizer.step()
                for c in b.chunks:
                    c.grad = None
                if id(b.shard) in self._masters:
                    b.shard.copy_(self._masters[id(b.shard)])  # offload: the updated master back to the device
            if self.stage in (1, 2):
                works.append(self._start_all_gather(b))
        self._wait_all_gathers(works)

    # -- gradients -------------------------------------------------------------------------------------

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate full local gradients without communicating (stage 2); stages
        0/1/3 communicate only at ``step()`` or in the model, so it is a no-op there."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Make each bucket's gradient shard final: wait for stage 2's in-flight reduce-scatters, or build
        (stage 0/1) the shard from ``.grad``, reducing it first when ``reduce_grads``. Idempotent per step."""
        if self._synced:
            return
        if self.stage in (0, 1):
            for b in self.buckets:
                if self.reduce_grads:
                    self._launch(b, free_full_grads=False)
                else:
                    b.shard_grad = b.owned_grad() if self.stage == 1 else b.flat_grad()
        elif self.stage == 2:
            self._launch_remaining()
        self._wait_pending()
        self._synced = True
        self._record_memory()

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self._no_sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            _queue_end_of_backward(self._end_of_backward)
        self._bucket_of[id(p)].ready.add(id(p))
        # Launch strictly in bucket order, so every rank issues the same collectives in the same order.
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].is_ready():
            self._launch(self.buckets[self._next_bucket], free_full_grads=True)
            self._next_bucket += 1

    def _end_of_backward(self) -> None:
        self._launch_remaining()
        self._wait_pending()
        self._callback_queued = False
        self._record_memory()

    def _launch_remaining(self) -> None:
        """Buckets whose parameters got no gradient in this backward still join, with zeros (no hangs)."""
        if self._next_bucket == 0 and not self._callback_queued:
            return  # no backward ran since the last step: nothing to reduce
        while self._next_bucket < len(self.buckets):
            self._launch(self.buckets[self._next_bucket], free_full_grads=True)
            self._next_bucket += 1
        self._next_bucket = 0
        for b in self.buckets:
            b.ready.clear()

    def _launch(self, b: _Bucket, free_full_grads: bool) -> None:
        """Start the average of bucket ``b``'s gradient: reduce-scatter into the shard (all-reduce at stage 0)."""
        flat = b.flat_grad()
        if flat is None:
            flat = torch.zeros_like(b.flat)
        if free_full_grads:
            for p in b.params:
                p.grad = None  # stage 2: the full gradient is gone; only the shard remains
        if b.parts == 1:
            out = flat
            work = comm.all_reduce(flat, op="avg", group=self.group, async_op=True, tag="grad")
        else:
            out = torch.empty_like(b.shard)
            work = comm.reduce_scatter(out, flat, op="avg", group=self.group, async_op=True, tag="grad")
        trace.ledger_add("comm_buffers", trace.tensor_bytes([flat]))
        self._pending.append((b, work, out, flat))

    def _wait_pending(self) -> None:
        for b, work, out, flat in self._pending:
            work.wait()
            b.shard_grad = out if b.shard_grad is None else b.shard_grad.add_(out)
            trace.ledger_add("comm_buffers", -trace.tensor_bytes([flat]))
        self._pending = []

    def _attach_grads(self, bucket: _Bucket | None = None) -> None:
        """Give the stepped tensors their gradient: stage 3's shards (``bucket`` ignored), or the pieces of
        ``bucket``'s shard (views of its gradient shard, or of the offloaded master's copy of it);
        ``bucket=None`` at stages 0-2 clears every piece's gradient."""
        if self.stage == 3:
            for t in self._sharded:
                if id(t) in self._masters:
                    master = self._masters[id(t)]
                    master.grad = None if t.grad is None else _offload_copy(t.grad, self.offload_device)
            return
        if bucket is None:
            for b in self.buckets:
                for c in b.chunks:
                    c.grad = None
            return
        grad = bucket.shard.grad = bucket.shard_grad
        master = self._masters.get(id(bucket.shard))
        if master is not None:
            grad = master.grad = None if grad is None else _offload_copy(grad, self.offload_device)
        pieces = [None] * len(bucket.chunks) if grad is None else grad.split([c.numel() for c in bucket.chunks])
        for c, g in zip(bucket.chunks, pieces, strict=True):
            c.grad = g

    def _owned_grads(self) -> list[torch.Tensor]:
        if self.stage == 3:
            return [t.grad for t in self._sharded if t.grad is not None]
        return [b.shard_grad for b in self.buckets if b.shard_grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm, computed from the shards with one all-reduce of a scalar.

        Same formula as ``torch.nn.utils.clip_grad_norm_``: scale by min(1, max_norm / (norm + 1e-6)).
        Each rank sums the squares of its own shard (padding is zero), an all-reduce adds the N partial sums,
        so the norm is exact without ever gathering a full gradient.
        """
        if norm_type not in (2.0, float("inf")):
            raise ValueError(f"norm_type {norm_type!r} is not supported; valid: 2.0 or float('inf')")
        self.finish_gradient_synchronization()
        grads = self._owned_grads()
        sharded = self.stage >= 1 and self.world > 1
        # Offloaded shards' gradients live on the CPU; the partial norm travels on the rank's device.
        none = torch.zeros((), dtype=torch.float64, device=self.comm_device)
        if norm_type == 2.0:
            local = torch.stack([g.double().pow(2).sum().to(self.comm_device) for g in grads]).sum() if grads else none
            if sharded:
                comm.all_reduce(local, op="sum", group=self.group, tag="clip")
            total = local.sqrt()
        else:
            local = torch.stack([g.abs().max().double().to(self.comm_device) for g in grads]).max() if grads else none
            if sharded:
                comm.all_reduce(local, op="max", group=self.group, tag="clip")
            total = local
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if self.stage == 3:
            for g in grads:
                g.mul_(coef.to(device=g.device, dtype=g.dtype))
        for b in self.buckets:
            if b.shard_grad is not None:  # a view of the model's .grad is scaled out of place: .grad stays put
                c = coef.to(device=b.shard_grad.device, dtype=b.shard_grad.dtype)
                b.shard_grad = b.shard_grad.mul(c) if b.shard_grad_is_view else b.shard_grad.mul_(c)
                b.shard_grad_is_view = False
        return total.float()

    # -- parameters --------------------------------------------------------------------------------------

    def _all_gather_params(self) -> None:
        """Every rank sends its updated slice; the all-gather writes them straight into the model's params."""
        self._wait_all_gathers([self._start_all_gather(b) for b in self.buckets])

    def _start_all_gather(self, b: _Bucket) -> tuple[Any, int]:
        """Launch the async all-gather of bucket ``b``'s updated shard into ``b.flat`` (the model's params).

        The input is this rank's own slice of the output. Where the backend allows that (NCCL, gloo) it is sent
        as it is; elsewhere it is sent from a copy, whose bytes are returned so the ledger can count them."""
        send = b.shard.detach() if self._gather_in_place else b.shard.detach().clone()
        nbytes = 0 if self._gather_in_place else trace.tensor_bytes([send])
        trace.ledger_add("comm_buffers", nbytes)
        return comm.all_gather(b.flat, send, group=self.group, async_op=True, tag="param"), nbytes

    @staticmethod
    def _wait_all_gathers(works: list[tuple[Any, int]]) -> None:
        for work, nbytes in works:
            work.wait()
            trace.ledger_add("comm_buffers", -nbytes)

    def _make_masters(self) -> dict[int, torch.Tensor]:
        """Offload: an fp32 master copy of each stepped shard on ``offload_device`` (ZeRO-Offload). Shards
        that already live there (``FullyShardedModel(offload_params=True)``) are stepped in place."""
        if not self.offload:
            return {}
        return {id(t): _offload_copy(t.detach(), self.offload_device) for t in self._sharded
                if not getattr(t, "_zero_offloaded", False)}

    # -- memory ------------------------------------------------------------------------------------------

    def _record_memory(self) -> None:
        state = _state_bytes(self.optimizer)
        trace.ledger_set("optimizer_state", 0 if self.offload else state)
        if self.stage == 3:
            return  # FullyShardedModel records parameters and gradients
        trace.ledger_set("parameters", trace.tensor_bytes(b.flat for b in self.buckets))
        if self.stage == 2:
            grads = [b.shard_grad for b in self.buckets if b.shard_grad is not None]
        else:
            grads = [p.grad for b in self.buckets for p in b.params if p.grad is not None]
        trace.ledger_set("gradients", trace.tensor_bytes(grads))

    def offloaded_bytes(self) -> dict[str, int]:
        """Bytes this rank keeps on ``offload_device`` instead of the compute device, by category."""
        if not self.offload:
            return {"optimizer_state": 0, "master_weights": 0}
        return {"optimizer_state": _state_bytes(self.optimizer),
                "master_weights": trace.tensor_bytes(self._masters.values())}

    def shard_numel(self) -> int:
        """Elements of parameters this rank steps (its shard, padding included)."""
        return sum(t.numel() for t in self._sharded)


def _offload_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``t`` on the offload device. Host memory that backs a GPU is pinned (page-locked), so the
    PCIe copies run by DMA at full speed instead of through a pageable bounce buffer (ZeRO-Offload, Ren et
    al. 2021, section 4). The copy is blocking: the CPU optimizer reads it right away."""
    pin = t.is_cuda and device.type == "cpu"
    out = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
    return out.copy_(t)


def _step_chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` as consecutive leaf views of at most ``STEP_CHUNK_BYTES`` each (see its comment for why)."""
    return list(t.detach().split(max(1, STEP_CHUNK_BYTES // t.element_size())))


def _all_gather_accepts_own_slice(group: Any) -> bool:
    """Whether an all-gather on ``group`` may read its input from the output buffer (see the backend list)."""
    if not comm.is_distributed() or comm.group_size(group) == 1:
        return True  # comm.all_gather copies input to output, and copy_ onto itself is a no-op
    backends = str(dist.get_backend(group)).split(",")  # e.g. "gloo" or "cpu:gloo,cuda:nccl"
    return all(b.split(":")[-1].strip() in _IN_PLACE_ALL_GATHER_BACKENDS for b in backends)


def _check_stage_matches_params(stage: int, groups: list[dict[str, Any]]) -> None:
    shards = [getattr(p, "_zero_shard", False) for g in groups for p in g["params"]]
    if stage == 3 and not all(shards):
        raise ValueError("stage=3 steps the shards of a FullyShardedModel: wrap the model first and pass "
                         "FullyShardedModel(model).parameters(), or use stage 1 or 2 for plain parameters")
    if stage < 3 and any(shards):
        raise ValueError(f"stage={stage} got the flat shards of a FullyShardedModel; use stage=3 for those")


# ----------------------------------------------------------------------------------------------------
# Stage 3: fully sharded parameters


class _Unit:
    """One unit of a ``FullyShardedModel``: its trainable params flattened, padded and sharded.

    ``shard`` (an nn.Parameter of ``shard_numel`` elements, registered on the unit's module as
    ``_flat_param``) is all this rank keeps. ``full`` is the gathered flat tensor while the unit is in use;
    its storage is emptied (``resize_(0)``) in between, as FSDP does, so the views autograd saved for
    backward stay valid and are refilled by the backward all-gather.
    """

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter],
                 uses: list[tuple[nn.Module, str, int]], world: int, rank: int, offload_device: Any) -> None:
        self.name, self.module, self.uses = name, module, uses
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        numel = sum(self.numels)
        self.shard_numel = _ceil_div(numel, world)
        self.split_sizes = [*self.numels, world * self.shard_numel - numel]
        self.dtype, self.device = params[0].dtype, params[0].device
        flat = torch.cat([p.detach().reshape(-1) for p in params]
                         + [params[0].new_zeros(self.split_sizes[-1])])
        shard = flat[rank * self.shard_numel:(rank + 1) * self.shard_numel].clone()
        self.offloaded = offload_device is not None
        self.shard = nn.Parameter(_offload_copy(shard, torch.device(offload_device)) if self.offloaded else shard)
        self.shard._zero_shard = True
        self.shard._zero_offloaded = self.offloaded
        self.full: torch.Tensor | None = None
        self.work: Any = None
        self.acc_grad: torch.Tensor | None = None  # no_sync: summed full gradients of earlier micro-batches
        self.backward_started = False
        self.t0 = 0.0  # when this unit's forward / backward started (for its span)

    @property
    def full_bytes(self) -> int:
        return sum(self.split_sizes) * self.shard.element_size()

    def is_gathered(self) -> bool:
        return self.full is not None and self.full.untyped_storage().nbytes() > 0


class _Unshard(torch.autograd.Function):
    """Forward: hand out the all-gathered flat parameter of a unit. Backward: reduce-scatter its gradient.

    Autograd sums the gradients of all the unit's parameter views (one ``split`` backward) into the gradient
    of the flat tensor, so this node runs exactly when the whole unit's backward is done: the moment to
    reduce-scatter, return this rank's shard gradient (autograd accumulates it into ``shard.grad``) and free
    the gathered parameters.
    """

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, owner: FullyShardedModel, unit: _Unit) -> torch.Tensor:
        ctx.owner, ctx.unit = owner, unit
        return unit.full

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        return ctx.owner._reduce_grad(ctx.unit, grad_full), None, None


def default_units(module: nn.Module) -> list[nn.Module]:
    """FSDP's usual wrapping: each child of every ``nn.ModuleList`` (GPT blocks, ToyMLP layers)."""
    return [child for m in module.modules() if isinstance(m, nn.ModuleList) for child in m]


class FullyShardedModel(nn.Module):
    """ZeRO stage 3 / FSDP: every rank keeps 1/N of each unit's parameters and gathers a unit only to use it.

    ``units``: the submodules sharded as one unit each (default ``default_units``); the remaining trainable
    parameters form the root unit. A parameter used by two units (a tied weight such as GPT's wte/lm_head,
    or one tied across two units) goes to the root unit, which is gathered for the whole forward.

    Per unit and step: all-gather before forward (the next unit's all-gather is prefetched, async, while this
    one computes), free after forward; all-gather again before backward (prefetching the previous unit's);
    after its backward, reduce-scatter (average) the gradient into the shard's ``.grad`` and free everything
    full. That is 3Ψ moved per step against DDP's 2Ψ (ZeRO §7.2.2). The reduce-scatter is synchronous inside
    autograd, so ``finish_gradient_synchronization()`` has nothing left to wait for (kept for a uniform loop).

    ``named_parameters()`` yields the flat shards (``<unit>._flat_param``; frozen parameters stay replicated
    and are yielded as they are): step them with ``ZeroOptimizer(model.parameters(), cls, stage=3)``.
    ``full_parameters()`` all-gathers the full tensors by their original names (every rank must call it).
    Ranks must start from identical weights (build the model with the same seed everywhere).
    ``offload_params=True`` keeps the shards (and their gradients) on ``offload_device``; each gather copies
    the shard to the compute device first. A unit run twice in one forward is not supported.
    """

    def __init__(self, module: nn.Module, group: Any = None, units: list[nn.Module] | None = None,
                 offload_params: bool = False, prefetch: bool = True,
                 offload_device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.world, self.rank = comm.group_size(group), comm.group_rank(group)
        self.prefetch, self.offload_params = prefetch, offload_params
        unit_modules = default_units(module) if units is None else list(units)
        _check_units(module, unit_modules)
        self._names = [name for name, _ in module.named_parameters()]
        self._frozen = {name: p for name, p in module.named_parameters() if not p.requires_grad}
        self._units, self._where = self._build_units(unit_modules, offload_device if offload_params else None)
        self._unit_of_module = {id(u.module): u for u in self._units}
        for u in self._units:
            if u.module is not module:
                u.module.register_forward_pre_hook(self._make_pre_forward(u))
                u.module.register_forward_hook(self._make_post_forward(u))
        self._order: list[_Unit] = []
        self._last_order: list[_Unit] = list(self._units)
        self._no_sync = False
        self._callback_queued = False
        self._record_memory()

    # -- construction ------------------------------------------------------------------------------------

    def _build_units(self, unit_modules: list[nn.Module], offload_device: Any) -> tuple[list[_Unit], dict]:
        owner: dict[int, nn.Module] = {}
        for u in unit_modules:  # a nested unit is listed after its parent so the innermost wins
            for sub in u.modules():
                owner[id(sub)] = u
        uses: dict[int, list[tuple[nn.Module, str]]] = {}
        params: dict[int, nn.Parameter] = {}
        for m in self.module.modules():
            for local, p in m._parameters.items():
                if p is not None and p.requires_grad:
                    uses.setdefault(id(p), []).append((m, local))
                    params[id(p)] = p
        assigned: dict[int, list[int]] = {}
        for pid, places in uses.items():
            owners = {id(owner.get(id(m), self.module)) for m, _ in places}
            home = owner.get(id(places[0][0]), self.module) if len(owners) == 1 else self.module
            assigned.setdefault(id(home), []).append(pid)
        name_to_pid = {name: id(p) for name, p in self.module.named_parameters()}
        units, where = [], {}
        modules = [self.module, *unit_modules]
        names = {id(m): n for n, m in self.module.named_modules(remove_duplicate=False)}
        for m in modules:
            pids = assigned.get(id(m), [])
            if not pids:
                continue
            unit_uses = [(mod, local, i) for i, pid in enumerate(pids) for mod, local in uses[pid]]
            unit = _Unit(names.get(id(m), "") or "root", m, [params[pid] for pid in pids], unit_uses, self.world,
                         self.rank, offload_device)
            for i, pid in enumerate(pids):
                where[pid] = (unit, i)
            for mod, local, _ in unit_uses:
                del mod._parameters[local]
            m.register_parameter("_flat_param", unit.shard)
            units.append(unit)
        return units, {name: where[pid] for name, pid in name_to_pid.items() if pid in where}

    # -- forward -----------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._order = []
        for u in self._units:  # a forward whose backward never ran left its (emptied) buffer behind
            if u.work is None and not u.is_gathered():
                u.full = None
        root = self._unit_of_module.get(id(self.module))
        if root is not None:
            self._pre_forward(root)
        out = self.module(*args, **kwargs)
        if root is not None:
            self._post_forward(root, out)
        for u in self._units:  # a prefetched unit this forward never used
            if u not in self._order:
                self._wait(u)
                self._free(u)
        self._last_order = list(self._order)
        return out

    def _make_pre_forward(self, unit: _Unit) -> Any:
        return lambda module, args: self._pre_forward(unit)

    def _make_post_forward(self, unit: _Unit) -> Any:
        return lambda module, args, out: self._post_forward(unit, out)

    def _pre_forward(self, unit: _Unit) -> None:
        self._order.append(unit)
        unit.t0 = time.time()
        self._start_gather(unit)
        self._wait(unit)
        full = _Unshard.apply(unit.shard, self, unit)
        pieces = torch.split(full, unit.split_sizes)
        for mod, local, i in unit.uses:
            setattr(mod, local, pieces[i].view(unit.shapes[i]))
        if self.prefetch:
            nxt = _after(self._last_order, unit)
            if nxt is not None and nxt not in self._order:
                self._start_gather(nxt)

    def _post_forward(self, unit: _Unit, out: Any) -> None:
        _record_span(f"forward {unit.name}", "forward", unit.t0)
        self._free(unit)
        tensors = [t for t in _tensors(out) if t.requires_grad]
        if not tensors:
            unit.full = None
            return
        unit.backward_started = False
        for t in tensors:
            t.register_hook(self._make_pre_backward(unit))

    # -- backward ----------------------------------------------------------------------------------------

    def _make_pre_backward(self, unit: _Unit) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._pre_backward(unit)
        return hook

    def _pre_backward(self, unit: _Unit) -> None:
        if unit.backward_started:
            return
        unit.backward_started = True
        unit.t0 = time.time()
        if not self._callback_queued:
            self._callback_queued = True
            _queue_end_of_backward(self._end_of_backward)
        self._start_gather(unit)
        self._wait(unit)
        if self.prefetch:  # backward visits the root (its hook is on the loss), then units in reverse order
            root = [u for u in self._order if u.module is self.module]
            prev = _after(root + [u for u in self._order[::-1] if u.module is not self.module], unit)
            if prev is not None:
                self._start_gather(prev)

    def _reduce_grad(self, unit: _Unit, grad_full: torch.Tensor) -> torch.Tensor | None:
        """The unit's backward is done: average its gradient into this rank's shard, free the full unit."""
        self._wait(unit)
        self._free(unit)
        unit.full = None
        if self._no_sync:
            unit.acc_grad = grad_full.clone() if unit.acc_grad is None else unit.acc_grad.add_(grad_full)
            return None
        if unit.acc_grad is not None:
            grad_full = grad_full + unit.acc_grad
            unit.acc_grad = None
        shard_grad = torch.empty(unit.shard_numel, dtype=grad_full.dtype, device=grad_full.device)
        comm.reduce_scatter(shard_grad, grad_full.contiguous(), op="avg", group=self.group, tag="grad")
        _record_span(f"backward {unit.name}", "backward", unit.t0)
        return _offload_copy(shard_grad, unit.shard.device) if unit.offloaded else shard_grad

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        for u in self._units:
            self._wait(u)
            self._free(u)
            u.full = None
        self._record_memory()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep each unit's full gradient locally (summed over micro-batches) instead
        of reduce-scattering it; the first backward outside reduce-scatters the sum once."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Nothing to wait for: each unit's reduce-scatter finished inside backward."""

    # -- gather / free -----------------------------------------------------------------------------------

    def _start_gather(self, unit: _Unit) -> None:
        """Launch the async all-gather of ``unit`` into its flat buffer, unless gathered or in flight.

        After forward, ``unit.full`` keeps its (emptied) storage, which autograd's saved views share: the
        backward gather refills that same storage through an alias with its own version counter, so autograd
        does not mistake the refill for an in-place change of a saved tensor.
        """
        if unit.work is not None or unit.is_gathered():
            return
        if unit.full is None:
            unit.full = torch.empty(sum(unit.split_sizes), dtype=unit.dtype, device=unit.device)
            target = unit.full
        else:
            storage = unit.full.untyped_storage()
            storage.resize_(unit.full_bytes)
            target = torch.empty(0, dtype=unit.dtype, device=unit.device).set_(storage, 0, unit.full.shape)
        src = unit.shard.detach()
        if unit.offloaded:
            src = src.to(unit.device, copy=True)  # offload: bring the shard to the compute device
        trace.ledger_add("gathered_params", unit.full_bytes)
        unit.work = comm.all_gather(target, src, group=self.group, async_op=True, tag="param")

    def _wait(self, unit: _Unit) -> None:
        if unit.work is not None:
            unit.work.wait()
            unit.work = None

    def _free(self, unit: _Unit) -> None:
        if unit.is_gathered():
            unit.full.untyped_storage().resize_(0)
            trace.ledger_add("gathered_params", -unit.full_bytes)

    # -- inspection --------------------------------------------------------------------------------------

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The full, unsharded parameters by their original names (an all-gather: call it on every rank)."""
        gathered = {}
        for u in self._units:
            out = torch.empty(sum(u.split_sizes), dtype=u.dtype, device=u.device)
            comm.all_gather(out, u.shard.detach().to(u.device), group=self.group, tag="checkpoint")
            gathered[id(u)] = torch.split(out, u.split_sizes)
        result = {}
        for name in self._names:
            if name in self._where:
                unit, i = self._where[name]
                result[name] = gathered[id(unit)][i].view(unit.shapes[i]).clone()
            else:
                result[name] = self._frozen[name].detach().clone()
        return result

    @property
    def units(self) -> list[str]:
        """Unit names in construction order (root first)."""
        return [u.name for u in self._units]

    def unit_numels(self) -> dict[str, int]:
        """Full (unpadded) element count of each unit."""
        return {u.name: sum(u.numels) for u in self._units}

    def _record_memory(self) -> None:
        shards = [u.shard for u in self._units]
        grads = [u.shard.grad for u in self._units if u.shard.grad is not None]
        trace.ledger_set("parameters", 0 if self.offload_params else trace.tensor_bytes(shards))
        trace.ledger_set("gradients", 0 if self.offload_params else trace.tensor_bytes(grads))

    def offloaded_bytes(self) -> dict[str, int]:
        """Bytes of parameter shards and their gradients kept on ``offload_device``."""
        if not self.offload_params:
            return {"parameters": 0, "gradients": 0}
        return {"parameters": trace.tensor_bytes(u.shard for u in self._units),
                "gradients": trace.tensor_bytes(u.shard.grad for u in self._units if u.shard.grad is not None)}


def _after(order: list[_Unit], unit: _Unit) -> _Unit | None:
    for i, u in enumerate(order[:-1]):
        if u is unit:
            return order[i + 1]
    return None


def _tensors(out: Any) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


def _check_units(module: nn.Module, units: list[nn.Module]) -> None:
    inside = {id(m) for m in module.modules()}
    for u in units:
        if not isinstance(u, nn.Module) or id(u) not in inside:
            raise ValueError(f"every unit must be a submodule of the wrapped model; got {type(u).__name__} "
                             "that is not (use default_units(model) or children of model)")
        if u is module:
            raise ValueError("the wrapped model itself is the root unit; list only its submodules in units")


__all__ = ["DEFAULT_BUCKET_MB", "VALID_STAGES", "FullyShardedModel", "ZeroOptimizer", "default_units"]
