"""Data parallelism four ways: how N replicas stay identical, and how their communication is hidden.

Every rank holds a full replica of the model and runs forward/backward on its own shard of the global
batch. Before the optimizer step the replicas average their gradients; since they started from the same
weights (broadcast from rank 0 at wrap time) and apply the same averaged gradient with the same optimizer,
they stay identical step after step, and training matches one process on the whole global batch.

The four wrappers differ only in *how* the gradients are averaged. Each one is a lesson of Li et al. 2020,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (VLDB), section 3.2:

``NaiveDDP``
    After backward, one all-reduce per parameter. Each collective pays the latency alpha, and a model has
    hundreds of small tensors, so the step time grows with the *number* of tensors.
``FlatDDP``
    After backward, copy every gradient into one flat buffer and all-reduce it once: alpha is paid once
    and the ring runs at full bandwidth (Patarasuk & Yuan 2009), but communication still only starts when
    computation has ended.
``OverlapDDP``
    An asynchronous all-reduce per parameter, launched from autograd's post-accumulate-grad hook as soon as
    that gradient is final, so communication runs while backward computes the earlier layers' gradients.
    Hidden, but alpha is paid per tensor again.
``BucketedDDP``
    Both ideas: gradients are grouped, in reverse registration order (backward produces them roughly in
    that order), into flat buckets of at most ``bucket_mb``; a bucket's async all-reduce starts the moment
    its last gradient is ready. Few collectives, and all but the last bucket hidden under backward.

Common behaviour (what a torch ``DistributedDataParallel`` user expects, with the differences noted):

* ``group=None`` is the world; pass ``mesh.dp_group`` when data parallelism is one axis of a mesh.
* ``.module`` is the wrapped model. ``named_parameters()``, ``parameters()``, ``named_buffers()`` and
  ``state_dict()``/``load_state_dict()`` use the *wrapped module's* names, without torch DDP's
  ``"module."`` prefix, so a checkpoint or an optimizer built from the wrapper matches the bare model.
* Call the wrapper for forward, ``loss.backward()``, then ``finish_gradient_synchronization()`` before
  ``optimizer.step()``. It waits for outstanding async work and leaves the *average* (sum / world) in every
  ``.grad``; calling it twice is harmless. Any torch optimizer works: it only sees ordinary ``.grad``.
* ``no_sync()`` skips communication for the forward/backward passes run inside it, so gradients accumulate
  locally; the first backward of a forward run outside it averages the accumulated sums (as in torch, the
  decision is taken at forward time).
* Frozen parameters (``requires_grad=False``) are broadcast but never reduced. A tied weight (one
  Parameter reached through two modules) is one parameter: autograd sums its two contributions before its
  post-accumulate-grad hook fires, so it is reduced once.
* A parameter that got no gradient in this backward (unused on this rank, or only used inside ``no_sync``)
  still takes part in every collective with zeros or with its accumulated gradient, so all ranks issue the
  same collectives in the same order and nothing hangs. By default it ends with a (possibly zero) averaged
  gradient. With ``find_unused_parameters=True`` one extra tiny all-reduce (tag ``"grad_used"``) of a
  per-parameter "had a gradient" flag tells which parameters no rank used, and their ``.grad`` is left
  ``None`` exactly as in single-process training (torch DDP does the same with that flag).

Every collective goes through ``workbench.comm`` with ``tag="grad"``, so the communication log shows the
difference between the four: per step, naive issues one all-reduce per trainable parameter, flat one,
overlap one per parameter (started during backward), bucketed one per bucket (started during backward).

Gradient compression: every wrapper takes ``compressor=`` (a ``parallel.compression.Compressor`` or its name:
``none``, ``bf16``, ``powersgd``, ``topk``, ``sign``). Each *unit* the wrapper would all-reduce (a gradient for
naive and overlap, the flat buffer for flat, a bucket for bucketed; ``reduction_units()`` lists their shapes) is
handed to the compressor instead, with the shapes of the parameters in it so that PowerSGD treats each matrix on
its own, as torch's PowerSGD hook does within a bucket. The hooked wrappers start it from the autograd hook, as
they start an all-reduce; ``finish_gradient_synchronization`` waits for it (PowerSGD's second round trip runs
there) and closes the compressor's step. ``compressor=None`` (the default) is the plain code path, unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from workbench import trace
from workbench.dist import comm
from workbench.dist.launch import rank_device
from workbench.parallel.buckets import bucket_params
from workbench.parallel.collectives import broadcast_module_state  # noqa: F401  (also public here)
from workbench.parallel.compression import Compressor, Pending, resolve_compressor

DDP_KINDS = ("naive", "flat", "overlap", "bucketed")
_MB = 2**20


class _DataParallel(nn.Module):
    """What all four wrappers share: the broadcast, the names, ``no_sync`` and the sync bookkeeping."""

    def __init__(self, module: nn.Module, group: Any = None, find_unused_parameters: bool = False,
                 compressor: Compressor | str | None = None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ValueError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.group = group
        self.world_size = comm.group_size(group)
        # Buffers are born where the model lives (the rank's device), so the same code runs on gloo CPU
        # ranks and NCCL GPUs.
        self.device = next((t.device for t in module.parameters()), rank_device())
        self.find_unused_parameters = bool(find_unused_parameters)
        self.compressor = resolve_compressor(compressor)  # None: plain all-reduce (parallel/compression.py)
        # module.parameters() yields a tied Parameter once; frozen ones need no gradient sync.
        self._grad_params: list[nn.Parameter] = [p for p in module.parameters() if p.requires_grad]
        self._require_sync = True  # False inside no_sync()
        self._sync_pending = False  # a forward ran outside no_sync: its backward's gradients need averaging
        broadcast_module_state(module, group)

    # -- names: the wrapped module's, without a "module." prefix ------------------------------------

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # -- the training-step protocol ---------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._sync_pending = self._require_sync
        if self._sync_pending:
            self._prepare_for_backward()
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: forward/backward passes run inside accumulate locally, unsynchronised."""
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Wait for (or run) the gradient all-reduces; afterwards every ``.grad`` holds the average.

        Call after ``backward()`` and before ``optimizer.step()``. A no-op inside ``no_sync`` and when
        called again for the same backward.
        """
        if not self._sync_pending:
            return
        self._sync_pending = False
        used = [p.grad is not None for p in self._grad_params]
        self._synchronize()
        if self.find_unused_parameters:
            self._drop_globally_unused(used)
        trace.ledger_set("gradients", trace.tensor_bytes(p.grad for p in self._grad_params if p.grad is not None))

    def synchronize_external_backward(self) -> None:
        """Average gradients produced by backward passes run outside this wrapper's forward (a pipeline
        schedule drives its stage's forward and backward itself). Only the post-backward wrappers (naive,
        flat) support it: hooked ones would have reduced during each of the schedule's backward passes."""
        if isinstance(self, _HookedDDP):
            raise ValueError(f"{type(self).__name__} reduces from autograd hooks during backward; a backward "
                             f"run outside its forward needs NaiveDDP or FlatDDP")
        self._sync_pending = True
        self.finish_gradient_synchronization()

    def reduction_units(self) -> list[list[torch.Size]]:
        """The shapes of the gradients in each unit this wrapper reduces, in the order it reduces them (what a
        compressor sees; ``theory.compression.step_bytes`` takes this list)."""
        return [[p.shape] for p in self._grad_params]

    def _drop_globally_unused(self, used: list[bool]) -> None:
        counts = torch.tensor(used, dtype=torch.float32, device=self.device)
        comm.all_reduce(counts, "sum", group=self.group, tag="grad_used")
        for p, n in zip(self._grad_params, counts.tolist(), strict=True):
            if n == 0:
                p.grad = None

    def _prepare_for_backward(self) -> None:
        """Reset per-backward state (hooked variants)."""

    def _synchronize(self) -> None:
        raise RuntimeError(f"{type(self).__name__} must define _synchronize")  # only subclasses are used

    def _grad_or_zeros(self, p: nn.Parameter) -> torch.Tensor:
        # A parameter without a gradient still joins the collective, with zeros, so ranks stay in step.
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad


class NaiveDDP(_DataParallel):
    """After backward, all-reduce every gradient separately (one collective, one alpha, per tensor)."""

    def _synchronize(self) -> None:
        with trace.span("all-reduce each gradient", "comm"):
            if self.compressor is not None:
                for i, p in enumerate(self._grad_params):
                    self.compressor.reduce(self._grad_or_zeros(p), self.group, key=i).wait()
                self.compressor.end_step()
                return
            for p in self._grad_params:
                comm.all_reduce(self._grad_or_zeros(p), "avg", group=self.group, tag="grad")


class FlatDDP(_DataParallel):
    """After backward, copy all gradients into one flat buffer and all-reduce it once.

    One collective per step pays alpha once (Li et al. 2020 fig. 2: all-reduce of one big tensor beats
    many small ones), at the price of a copy in and out and a buffer as large as all gradients.
    """

    def __init__(self, module: nn.Module, group: Any = None, find_unused_parameters: bool = False,
                 compressor: Compressor | str | None = None) -> None:
        super().__init__(module, group, find_unused_parameters, compressor)
        dtypes = {p.dtype for p in self._grad_params}
        if len(dtypes) > 1:
            raise ValueError(f"FlatDDP needs one gradient dtype, got {sorted(map(str, dtypes))}; "
                             f"use BucketedDDP, which starts a new bucket at each dtype change")
        dtype = dtypes.pop() if dtypes else torch.float32
        self._flat = torch.zeros(sum(p.numel() for p in self._grad_params), dtype=dtype, device=self.device)
        trace.ledger_set("comm_buffers", trace.tensor_bytes([self._flat]))

    def reduction_units(self) -> list[list[torch.Size]]:
        return [[p.shape for p in self._grad_params]]

    def _synchronize(self) -> None:
        with trace.span("all-reduce flat gradients", "comm"):
            views = self._flat.split([p.numel() for p in self._grad_params])
            for p, view in zip(self._grad_params, views, strict=True):
                view.copy_(self._grad_or_zeros(p).reshape(-1))
            if self.compressor is None:
                comm.all_reduce(self._flat, "avg", group=self.group, tag="grad")
            else:
                self.compressor.reduce(self._flat, self.group, shapes=self.reduction_units()[0], key=0).wait()
                self.compressor.end_step()
            for p, view in zip(self._grad_params, views, strict=True):
                p.grad.copy_(view.view_as(p.grad))


class _HookedDDP(_DataParallel):
    """Gradients grouped into *units* reduced asynchronously from autograd hooks, strictly in unit order.

    Collectives are matched by their position in each rank's sequence (gloo and NCCL alike), so every rank
    must issue them in the same order. Autograd's order can differ between ranks (a parameter unused on one
    rank never fires its hook), so units are launched in a fixed order: unit i goes out once all its
    gradients are ready *and* units 0..i-1 have gone out (Li et al. 2020 section 3.2.3 does the same).
    Units still waiting at ``finish_gradient_synchronization`` are launched there.
    """

    def __init__(self, module: nn.Module, group: Any = None, find_unused_parameters: bool = False,
                 compressor: Compressor | str | None = None) -> None:
        super().__init__(module, group, find_unused_parameters, compressor)
        self._units: list[list[nn.Parameter]] = self._build_units()
        self._unit_of = {id(p): i for i, unit in enumerate(self._units) for p in unit}
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                              for p in self._grad_params]
        self._prepare_for_backward()

    def _build_units(self) -> list[list[nn.Parameter]]:
        raise RuntimeError("subclasses define _build_units")

    def _prepare_for_backward(self) -> None:
        self._ready: set[int] = set()
        self._missing = [len(unit) for unit in self._units]
        self._next_unit = 0
        self._handles: list[comm.Work | Pending] = []

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        # Fires once per backward per parameter, after autograd has summed all of its contributions.
        if not self._sync_pending or id(param) in self._ready:
            return  # inside no_sync (or a second backward): keep accumulating locally
        self._ready.add(id(param))
        self._stage(param)
        self._missing[self._unit_of[id(param)]] -= 1
        while self._next_unit < len(self._units) and self._missing[self._next_unit] == 0:
            self._launch(self._next_unit)

    def _launch(self, i: int) -> None:
        if self.compressor is None:
            self._handles.append(comm.all_reduce(self._unit_tensor(i), "avg", group=self.group, async_op=True,
                                                 tag="grad"))
        else:  # the unit's parameter shapes, so PowerSGD compresses each matrix on its own
            self._handles.append(self.compressor.reduce(self._unit_tensor(i), self.group,
                                                        shapes=[p.shape for p in self._units[i]], key=i))
        self._next_unit = i + 1

    def reduction_units(self) -> list[list[torch.Size]]:
        return [[p.shape for p in unit] for unit in self._units]

    def _synchronize(self) -> None:
        with trace.span("wait for gradient all-reduce", "wait"):
            for i in range(self._next_unit, len(self._units)):
                for p in self._units[i]:
                    if id(p) not in self._ready:
                        self._stage_unready(p)
                self._launch(i)
            for handle in self._handles:
                handle.wait()
            self._handles = []
            if self.compressor is not None:
                self.compressor.end_step()
            self._unstage()

    # What differs between per-parameter and per-bucket reduction.
    def _stage(self, p: nn.Parameter) -> None:
        """Called when ``p.grad`` is final for this backward."""

    def _stage_unready(self, p: nn.Parameter) -> None:
        """Called at finish for a parameter whose hook did not fire in this backward."""

    def _unit_tensor(self, i: int) -> torch.Tensor:
        raise RuntimeError("subclasses define _unit_tensor")

    def _unstage(self) -> None:
        """Called once every all-reduce has finished."""


class OverlapDDP(_HookedDDP):
    """An async all-reduce of each gradient, in place, as soon as autograd has produced it."""

    def _build_units(self) -> list[list[nn.Parameter]]:
        return [[p] for p in reversed(self._grad_params)]  # reverse registration: backward's usual order

    def _stage_unready(self, p: nn.Parameter) -> None:
        self._grad_or_zeros(p)

    def _unit_tensor(self, i: int) -> torch.Tensor:
        return self._units[i][0].grad


class BucketedDDP(_HookedDDP):
    """Gradients in flat buckets of <= ``bucket_mb`` MiB, each all-reduced asynchronously once complete.

    Buckets follow *reverse* registration order because backward produces gradients roughly last layer
    first (Li et al. 2020 section 3.2.3); the first bucket fills early and its all-reduce overlaps the rest
    of backward. Small buckets start communicating sooner but pay alpha more often; 25 MiB is torch's
    default. Sweep ``bucket_mb`` in notebook 03 to see both ends.

    ``bucket_mb=None``: one bucket holding every gradient (one per dtype if the model mixes dtypes), so its one
    all-reduce starts once backward has produced the last gradient: ``FlatDDP``'s single collective, without
    its copies (the gradients are views of the bucket), and with nothing left to overlap.

    ``gradient_as_bucket_view=True`` (the default here) makes each ``.grad`` a view into its bucket: the
    all-reduce result *is* the gradient, with no copy out and no second gradient-sized buffer, and the next
    backward accumulates straight into the bucket. It needs ``.grad`` to stay that tensor: zero gradients
    with ``optimizer.zero_grad(set_to_none=False)``. With ``set_to_none=True`` autograd allocates fresh
    gradients, which the hook copies into the bucket (correct, one copy per gradient, as with
    ``gradient_as_bucket_view=False``, which also copies the result back out).
    """

    def __init__(self, module: nn.Module, group: Any = None, bucket_mb: float | None = 25.0,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = True,
                 compressor: Compressor | str | None = None) -> None:
        if bucket_mb is not None and (not isinstance(bucket_mb, (int, float)) or isinstance(bucket_mb, bool)
                                      or bucket_mb <= 0):
            raise ValueError(f"bucket_mb must be a positive number of MiB, or None for one bucket, got {bucket_mb!r}")
        self.bucket_mb = None if bucket_mb is None else float(bucket_mb)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        super().__init__(module, group, find_unused_parameters, compressor)
        self._bucket_buffers = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                                for b in self._units]
        self._slot: dict[int, torch.Tensor] = {}
        for bucket, buffer in zip(self._units, self._bucket_buffers, strict=True):
            for p, view in zip(bucket, buffer.split([p.numel() for p in bucket]), strict=True):
                self._slot[id(p)] = view.view_as(p)
        # The ledger counts each byte once: as views, the buckets *are* the gradients.
        bucket_bytes = trace.tensor_bytes(self._bucket_buffers)
        trace.ledger_set("comm_buffers", 0 if self.gradient_as_bucket_view else bucket_bytes)

    @property
    def num_buckets(self) -> int:
        return len(self._units)

    def bucket_sizes_bytes(self) -> list[int]:
        return [trace.tensor_bytes([b]) for b in self._bucket_buffers]

    def bucket_param_names(self) -> list[list[str]]:
        """Each bucket's parameter names, in bucket order (bucket 0 holds the last layers)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [[names[id(p)] for p in bucket] for bucket in self._units]

    def _build_units(self) -> list[list[nn.Parameter]]:
        # Reverse registration order: backward produces the last layers' gradients first (Li et al. 2020 §3.2.3).
        cap = float("inf") if self.bucket_mb is None else int(self.bucket_mb * _MB)
        return bucket_params(reversed(self._grad_params), cap)

    def _stage(self, p: nn.Parameter) -> None:
        slot = self._slot[id(p)]
        if p.grad.data_ptr() != slot.data_ptr():  # not (or no longer) a view of the bucket: copy in
            slot.copy_(p.grad)
            if self.gradient_as_bucket_view:
                p.grad = slot

    def _stage_unready(self, p: nn.Parameter) -> None:
        if p.grad is None:
            self._slot[id(p)].zero_()  # the bucket may still hold last step's values
            if self.gradient_as_bucket_view:
                p.grad = self._slot[id(p)]
        else:
            self._stage(p)  # gradient accumulated earlier (e.g. inside no_sync) but not in this backward

    def _unit_tensor(self, i: int) -> torch.Tensor:
        return self._bucket_buffers[i]

    def _unstage(self) -> None:
        if self.gradient_as_bucket_view:
            return
        for p in self._grad_params:
            if p.grad is None:
                p.grad = self._slot[id(p)].clone()
            else:
                p.grad.copy_(self._slot[id(p)])


def make_ddp(module: nn.Module, kind: str, group: Any = None, bucket_mb: float | None = 25.0,
             compressor: Compressor | str | None = None, **kwargs: Any) -> _DataParallel:
    """Wrap ``module`` in the data-parallel wrapper named ``kind`` (one of ``DDP_KINDS``); ``bucket_mb`` is
    ``BucketedDDP``'s (None: one bucket for every gradient) and is ignored by the other kinds. ``compressor``: None
    (plain all-reduce), a name in ``parallel.compression.COMPRESSIONS`` or a ``Compressor`` (one per wrapper)."""
    if kind == "naive":
        return NaiveDDP(module, group, compressor=compressor, **kwargs)
    if kind == "flat":
        return FlatDDP(module, group, compressor=compressor, **kwargs)
    if kind == "overlap":
        return OverlapDDP(module, group, compressor=compressor, **kwargs)
    if kind == "bucketed":
        return BucketedDDP(module, group, bucket_mb=bucket_mb, compressor=compressor, **kwargs)
    raise ValueError(f"unknown DDP kind {kind!r}; valid: {', '.join(DDP_KINDS)}")
