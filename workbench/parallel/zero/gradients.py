"""How a ``ZeroOptimizer``'s gradients become shards: stage 2's reduce-scatter while backward still runs.

Stage 2 (P_os+g, Rajbhandari et al. 2020 §5.2) keeps only this rank's shard of every gradient. A
post-accumulate-grad hook on each parameter marks it ready; once a bucket's last parameter is ready, the
bucket's gradient (one flat tensor, ``flat.Bucket.flat_grad``) is reduce-scattered (averaged) into this
rank's shard, asynchronously, and the full ``.grad`` tensors are freed. Buckets hold parameters in reverse
registration order, the order backward produces their gradients, so the first buckets' communication
overlaps the rest of backward; they are launched strictly in bucket order, so every rank issues the same
collectives in the same order. At the end of backward (an autograd engine callback) a bucket that got no
gradient joins with zeros, so no rank hangs.

Stages 0 and 1 reduce at ``step()`` instead: with ``reduce_grads=True`` stage 1 reduce-scatters (the paper's
stage 1, 2Ψ) and stage 0 all-reduces; without it the gradients arrived averaged from a DDP wrapper and
stage 1 only takes its slice. Stage 3 has nothing to do here: ``FullyShardedModel`` reduce-scatters each
unit's gradient inside autograd.

Here: ``GradientReduction``, the part of a ``ZeroOptimizer`` that owns those hooks and in-flight
reductions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from workbench import trace
from workbench.dist import comm
from workbench.parallel.zero.flat import Bucket, queue_end_of_backward


class GradientReduction:
    """Averages each bucket's gradient over ``group`` into the bucket's ``shard_grad`` (see the module doc).

    ``record_memory`` is called whenever the gradients changed hands (end of backward, ``finish()``), so the
    ledger follows. ``synced`` says the shards are final for this step; the optimizer clears it after
    ``step()`` and ``zero_grad()``.
    """

    def __init__(self, buckets: list[Bucket], group: Any, stage: int, reduce_grads: bool,
                 record_memory: Callable[[], None]) -> None:
        self.buckets, self.group, self.stage, self.reduce_grads = buckets, group, stage, reduce_grads
        self._record_memory = record_memory
        self._bucket_of = {id(p): b for b in buckets for p in b.params}
        self._pending: list[tuple[Bucket, Any, torch.Tensor, torch.Tensor]] = []
        self._next_bucket = 0
        self._callback_queued = False
        self._no_sync = False
        self.synced = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for b in buckets for p in b.params] if stage == 2 else []

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate full local gradients without communicating (stage 2)."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def finish(self) -> None:
        """Make each bucket's gradient shard final: wait for stage 2's in-flight reduce-scatters, or build
        (stage 0/1) the shard from ``.grad``, reducing it first when ``reduce_grads``. Idempotent per step."""
        if self.synced:
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
        self._sum_partial_grads()
        self.synced = True
        self._record_memory()

    def _sum_partial_grads(self) -> None:
        """Add up, over its ``partial_grads`` group, each bucket's gradient shard that holds partial sums
        (sequence parallelism: each tp rank's share of a LayerNorm's gradient). Every rank of that group has
        the same bucket layout, so the same shard slice meets the same slice; one flat all-reduce per group."""
        by_group: dict[tuple[int, str], list[Bucket]] = {}
        for b in self.buckets:
            if b.partial_grads is not None and b.shard_grad is not None:
                by_group.setdefault((id(b.partial_grads[0]), b.partial_grads[1]), []).append(b)
        for buckets in by_group.values():
            group, tag = buckets[0].partial_grads
            summed = comm.all_reduce_coalesced([b.shard_grad for b in buckets], group=group, tag=tag)
            for b, total in zip(buckets, summed, strict=True):
                b.shard_grad, b.shard_grad_is_view = total, False  # a fresh tensor: .grad views stay untouched

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self._no_sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            queue_end_of_backward(self._end_of_backward)
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

    def _launch(self, b: Bucket, free_full_grads: bool) -> None:
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
