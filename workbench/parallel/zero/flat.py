"""Flat buckets: the one memory layout every ZeRO stage uses, and why it was chosen.

Parameters are laid end to end in *flat buckets* (for stage 3, one bucket per unit: ``sharded_unit.ShardedUnit``),
each padded to a multiple of N; rank r owns the contiguous slice [r·S, (r+1)·S) of every bucket
(S = ⌈bucket/N⌉). Flat contiguous shards make the per-rank bytes exactly ZeRO's Ψ/N (plus at most N−1
padding elements per bucket), and each bucket is one ``reduce_scatter`` and one ``all_gather`` whose input
and output are plain tensors: no per-parameter messages. One flat partition of the whole model (DeepSpeed's
layout) would need a separate reduce per owner for every bucket that straddles a shard boundary; sharding
each bucket keeps every collective a single call, at the cost of the padding. In stages 0-2 the model's
parameters become views into the bucket buffers (DeepSpeed's "contiguous gradients/params"), so the
all-gather writes the updated weights straight into the model and the optimizer steps a view of the owned
slice: no extra copy of the parameters exists.

Which parameters share a bucket is ``workbench.parallel.buckets.bucket_params`` (DDP cuts its buckets the same
way). Here: ``Bucket`` (a stage 0-2 bucket: the flat buffer, the owned shard, the bucket's gradient as one flat
tensor or as this rank's slice), ``step_chunks`` (the cache-sized pieces the inner optimizer steps),
``all_gather_accepts_own_slice`` (whether a shard can be all-gathered without a staging copy), and two helpers
the stages share (``ceil_div``, ``queue_end_of_backward``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workbench.dist import comm

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


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def queue_end_of_backward(callback: Any) -> None:
    """Run ``callback`` once the current backward pass has finished (what torch DDP does too)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class Bucket:
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
        self.shard_numel = ceil_div(self.numel, parts)
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
        # Set from the bucket's param group when the model is also split over other ranks (tensor / sequence
        # parallelism): this rank's share of the bucket's squared gradient norm, and the group (with its comm
        # tag) over which its gradient is a partial sum to be added up once reduced over the data-parallel group.
        self.norm_share = 1.0
        self.partial_grads: tuple[Any, str] | None = None

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


def step_chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` as consecutive leaf views of at most ``STEP_CHUNK_BYTES`` each (see its comment for why)."""
    return list(t.detach().split(max(1, STEP_CHUNK_BYTES // t.element_size())))


def all_gather_accepts_own_slice(group: Any) -> bool:
    """Whether an all-gather on ``group`` may read its input from the output buffer (see the backend list)."""
    if not comm.is_distributed() or comm.group_size(group) == 1:
        return True  # comm.all_gather copies input to output, and copy_ onto itself is a no-op
    backends = str(dist.get_backend(group)).split(",")  # e.g. "gloo" or "cpu:gloo,cuda:nccl"
    return all(b.split(":")[-1].strip() in _IN_PLACE_ALL_GATHER_BACKENDS for b in backends)

