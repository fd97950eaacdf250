"""The sharded optimizer, ``ZeroOptimizer``: ZeRO stages 0-2 over flat buckets, and the step of stage 3.

Stage 1 (P_os, Rajbhandari et al. 2020 §5.1): each rank keeps optimizer state for, and updates, only its
1/N shard of every flat bucket (``flat.py``), then the updated shards are all-gathered straight into the
model's parameters, which are views of the buckets. ``step()`` steps one bucket at a time and starts that
bucket's all-gather at once, so it runs while the next bucket is stepped. Stage 2 adds gradient sharding
during backward (``gradients.py``); stage 0 is the unsharded baseline; at stage 3 the parameters are a
``FullyShardedModel``'s shards and ``step()`` only updates them (``fully_sharded.py``). Norm clipping
needs one scalar all-reduce, never a full gradient.

Here: ``ZeroOptimizer``, and how it reads its ``params`` (``_param_groups``, ``_check_stage_matches_params``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch

from workbench import trace
from workbench.dist import comm
from workbench.dist.launch import rank_device
from workbench.parallel.buckets import bucket_params
from workbench.parallel.zero.flat import (
    DEFAULT_BUCKET_MB,
    Bucket,
    all_gather_accepts_own_slice,
    step_chunks,
)
from workbench.parallel.zero.gradients import GradientReduction
from workbench.parallel.zero.offload import master_copies, offload_copy
from workbench.theory.memory import ZERO_STAGES

VALID_STAGES = ZERO_STAGES  # one definition: workbench.theory.memory
#: Param-group keys this optimizer reads itself (not passed to the inner optimizer), for a model that is also
#: split over other ranks (tensor / sequence parallelism; see ``ZeroOptimizer``).
NORM_SHARE = "norm_share"
PARTIAL_GRADS = "partial_grads"
_OWN_KEYS = (NORM_SHARE, PARTIAL_GRADS)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors (Adam moments, momentum), not step counters."""
    return trace.tensor_bytes(t for s in optimizer.state.values() for t in s.values()
                              if torch.is_tensor(t) and t.dim() > 0)


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
    * 3: ``params`` must be the parameters of a ``FullyShardedModel``: its shards, whose backward already
      reduce-scattered the gradients, and its replicated parameters (``replicate=``), whose gradients it
      all-reduced: ``step()`` updates the local shards and steps the replicated parameters whole on every rank
      (the same averaged gradient everywhere, so they stay identical). Clipping counts each replicated
      parameter once (on rank 0 of ``group``), not once per rank.

    Gradient accumulation: either accumulate into the shard (call backward K times; stage 2 reduce-scatters
    every micro-batch and sums into the shard), or wrap the first K−1 backwards in ``no_sync()`` (stage 2
    then keeps the full local gradients and communicates once, on the last). Scale the loss by 1/K as usual.

    ``param_groups`` are the inner optimizer's, so an LR scheduler's ``lr`` reaches the inner ``step``; at
    stages 0-2 their params are the shards cut in pieces of ``STEP_CHUNK_BYTES`` (one state entry per piece).
    ``state_dict()`` is shard-local: each rank saves and loads its own shard's state (same world size and
    rank required). ``offload=True`` keeps optimizer state, and a master copy of the stepped shard, on
    ``offload_device`` (ZeRO-Offload); gradients are copied there, stepped, and the result copied back.

    A model also split over other ranks (tensor parallelism inside, data parallelism over ``group``, as in
    Megatron-LM's distributed optimizer) passes those groups as ``model_parallel_groups`` and, per param
    group (stages 0-2; buckets never mix groups): ``"norm_share"``, the share of each parameter's squared
    gradient norm this rank holds (1 for a tp shard, 1/tp for a tensor every tp rank holds whole), so that
    ``clip_grad_norm_`` adds the shares over ``group`` and then over each model-parallel group into the norm
    of the whole model; and ``"partial_grads": (group, tag)`` for parameters whose gradient is a partial sum
    over that group (sequence parallelism's LayerNorms: each tp rank saw its own positions), added up over it
    once the data-parallel reduction is done (the sum commutes with the average over ``group``).
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer], group: Any = None,
                 stage: int = 1, offload: bool = False, *, reduce_grads: bool = False,
                 bucket_cap_mb: float = DEFAULT_BUCKET_MB, offload_device: str | torch.device = "cpu",
                 model_parallel_groups: tuple[Any, ...] = (), **optimizer_kwargs: Any) -> None:
        if stage not in VALID_STAGES:
            raise ValueError(f"ZeRO stage {stage!r} is not valid; valid stages: {VALID_STAGES}")
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_cls must be a torch.optim.Optimizer class (e.g. torch.optim.AdamW), "
                             f"got {optimizer_cls!r}")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.group, self.stage, self.offload = group, stage, offload
        self.model_parallel_groups = tuple(model_parallel_groups)
        self.reduce_grads = reduce_grads or stage == 2
        self.offload_device = torch.device(offload_device)
        self.comm_device = rank_device()  # where scalars this optimizer communicates are born
        self.world, self.rank = comm.group_size(group), comm.group_rank(group)
        groups = _param_groups(params)
        _check_stage_matches_params(stage, groups)
        _check_own_keys(stage, groups)
        self.buckets: list[Bucket] = []
        parts, part_rank = (1, 0) if stage == 0 else (self.world, self.rank)
        inner_groups = []
        for g in groups:
            if stage == 3:
                tensors = list(g["params"])
            else:
                # reverse registration order, the order backward produces gradients (Li et al. 2020 §3.2.3), so
                # stage 2's first bucket is complete, and reduce-scattered, while backward goes on
                cut = bucket_params(reversed(g["params"]), int(bucket_cap_mb * 2**20))
                new = [Bucket(b, parts, part_rank) for b in cut]
                for b in new:
                    b.norm_share, b.partial_grads = float(g.get(NORM_SHARE, 1.0)), g.get(PARTIAL_GRADS)
                self.buckets += new
                tensors = [b.shard for b in new]
            inner_groups.append({**{k: v for k, v in g.items() if k not in ("params", *_OWN_KEYS)}, "params": tensors})
        self._sharded = [t for g in inner_groups for t in g["params"]]  # what step() updates, on device
        self._masters = master_copies(self._sharded, self.offload_device) if offload else {}
        for b in self.buckets:
            b.chunks = step_chunks(self._masters.get(id(b.shard), b.shard))
        chunks = {id(b.shard): b.chunks for b in self.buckets}
        for g in inner_groups:
            g["params"] = [c for t in g["params"] for c in chunks.get(id(t), [self._masters.get(id(t), t)])]
        self.optimizer = optimizer_cls(inner_groups, **optimizer_kwargs)
        self._gather_in_place = all_gather_accepts_own_slice(group)
        self.defaults = self.optimizer.defaults
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._reduction = GradientReduction(self.buckets, group, stage, self.reduce_grads, self._record_memory)
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
        """This rank's shard of the optimizer state (shard-local: load it on the same rank of the same N), and
        with offload the master copies the inner optimizer steps (they, not the device shards, are the truth)."""
        masters = [self._masters[id(t)] for t in self._sharded if id(t) in self._masters]
        return {"zero_stage": self.stage, "rank": self.rank, "world": self.world,
                "optimizer": self.optimizer.state_dict(), "masters": masters}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        got = (state_dict.get("zero_stage"), state_dict.get("rank"), state_dict.get("world"))
        want = (self.stage, self.rank, self.world)
        if got != want:
            raise ValueError(f"shard-local state dict of (stage, rank, world)={got} cannot be loaded into "
                             f"(stage, rank, world)={want}; save and load on the same layout")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        masters = [self._masters[id(t)] for t in self._sharded if id(t) in self._masters]
        saved = state_dict.get("masters", [])
        if len(saved) != len(masters):
            raise ValueError(f"the state dict holds {len(saved)} master copies, this optimizer has {len(masters)} "
                             f"(offload={self.offload}); save and load with the same offload setting")
        with torch.no_grad():
            for mine, theirs in zip(masters, saved, strict=True):
                mine.copy_(theirs)
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
        self._reduction.synced = False

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
                self._masters_to_device(self._sharded)
        else:
            self._step_buckets()
        self._reduction.synced = False
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
                self._masters_to_device([b.shard])
            if self.stage in (1, 2):
                works.append(self._start_all_gather(b))
        self._wait_all_gathers(works)

    # -- gradients -------------------------------------------------------------------------------------

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate full local gradients without communicating (stage 2); stages
        0/1/3 communicate only at ``step()`` or in the model, so it is a no-op there."""
        return self._reduction.no_sync()

    def finish_gradient_synchronization(self) -> None:
        """Make each bucket's gradient shard final: wait for stage 2's in-flight reduce-scatters, or build
        (stage 0/1) the shard from ``.grad``, reducing it first when ``reduce_grads``. Idempotent per step."""
        self._reduction.finish()

    def _attach_grads(self, bucket: Bucket | None = None) -> None:
        """Give the stepped tensors their gradient: stage 3's shards (``bucket`` ignored), or the pieces of
        ``bucket``'s shard (views of its gradient shard, or of the offloaded master's copy of it);
        ``bucket=None`` at stages 0-2 clears every piece's gradient."""
        if self.stage == 3:
            for t in self._sharded:
                if id(t) in self._masters:
                    master = self._masters[id(t)]
                    master.grad = None if t.grad is None else offload_copy(t.grad, self.offload_device)
            return
        if bucket is None:
            for b in self.buckets:
                for c in b.chunks:
                    c.grad = None
            return
        grad = bucket.shard.grad = bucket.shard_grad
        master = self._masters.get(id(bucket.shard))
        if master is not None:
            grad = master.grad = None if grad is None else offload_copy(grad, self.offload_device)
        pieces = [None] * len(bucket.chunks) if grad is None else grad.split([c.numel() for c in bucket.chunks])
        for c, g in zip(bucket.chunks, pieces, strict=True):
            c.grad = g

    def _owned_grads(self) -> list[tuple[torch.Tensor, float]]:
        """(gradient shard, this rank's share of its squared norm) of everything this rank steps."""
        if self.stage == 3:  # FullyShardedModel.set_norm_shares may have weighted segments of a shard
            out = []
            for t in (t for t in self._sharded if t.grad is not None):
                if getattr(t, "_zero_replicated", False):
                    out.append(self._replicated_grad(t))
                    continue
                segments = getattr(t, "_zero_norm_segments", None) or [(0, t.numel(), 1.0)]
                out += [(t.grad[lo:hi], share) for lo, hi, share in segments]
            return out
        return [(b.shard_grad, b.norm_share) for b in self.buckets if b.shard_grad is not None]

    def _replicated_grad(self, t: torch.Tensor) -> tuple[torch.Tensor, float]:
        """A stage-3 replicated parameter is whole on every rank of ``group``: only rank 0 counts its squared
        norm, so the all-reduce over ``group`` adds it once (times its tp share, ``set_norm_shares``)."""
        return t.grad, (float(getattr(t, "_zero_norm_share", 1.0)) if self.rank == 0 else 0.0)

    @torch.no_grad()
    def unscale_grads_(self, factor: float) -> list[torch.Tensor]:
        """Multiply the gradient shards this rank steps by ``factor`` (a loss scaler's 1/scale) and return them.

        Mixed precision with fp16 (Micikevicius et al. 2018): the shards are the only gradients a stage 2/3
        rank keeps, so they are where unscaling and the inf/NaN check happen; the union of every rank's
        shards is the whole gradient. A shard that is a view of the model's ``.grad`` is scaled out of place,
        as ``clip_grad_norm_`` does, so ``.grad`` stays put."""
        self.finish_gradient_synchronization()
        if self.stage == 3:
            grads = [t.grad for t in self._sharded if t.grad is not None]
            for g in grads:
                g.mul_(factor)
            return grads
        for b in self.buckets:
            if b.shard_grad is not None:
                b.shard_grad = b.shard_grad.mul(factor) if b.shard_grad_is_view else b.shard_grad.mul_(factor)
                b.shard_grad_is_view = False
        return [b.shard_grad for b in self.buckets if b.shard_grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm, computed from the shards with one all-reduce of a scalar.

        Same formula as ``torch.nn.utils.clip_grad_norm_``: scale by min(1, max_norm / (norm + 1e-6)).
        Each rank sums the squares of its own shard (padding is zero), an all-reduce adds the N partial sums,
        so the norm is exact without ever gathering a full gradient. With ``model_parallel_groups`` each
        bucket's squares are weighted by its ``norm_share`` and the sum is all-reduced over those groups too.
        """
        if norm_type not in (2.0, float("inf")):
            raise ValueError(f"norm_type {norm_type!r} is not supported; valid: 2.0 or float('inf')")
        self.finish_gradient_synchronization()
        grads = self._owned_grads()
        sharded = self.stage >= 1 and self.world > 1
        # Offloaded shards' gradients live on the CPU; the partial norm travels on the rank's device.
        none = torch.zeros((), dtype=torch.float64, device=self.comm_device)
        if norm_type == 2.0:
            parts = [share * g.double().pow(2).sum().to(self.comm_device) for g, share in grads]
            op = "sum"
        else:
            parts = [g.abs().max().double().to(self.comm_device) for g, share in grads if share > 0]
            op = "max"
        local = (torch.stack(parts).sum() if op == "sum" else torch.stack(parts).max()) if parts else none
        for group in ((self.group,) if sharded else ()) + self.model_parallel_groups:
            comm.all_reduce(local, op=op, group=group, tag="clip")
        total = local.sqrt() if op == "sum" else local
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if self.stage == 3:
            for t in self._sharded:
                if t.grad is not None:
                    t.grad.mul_(coef.to(device=t.grad.device, dtype=t.grad.dtype))
        for b in self.buckets:
            if b.shard_grad is not None:  # a view of the model's .grad is scaled out of place: .grad stays put
                c = coef.to(device=b.shard_grad.device, dtype=b.shard_grad.dtype)
                b.shard_grad = b.shard_grad.mul(c) if b.shard_grad_is_view else b.shard_grad.mul_(c)
                b.shard_grad_is_view = False
        return total.float()

    # -- parameters --------------------------------------------------------------------------------------

    @torch.no_grad()
    def publish_shards(self) -> None:
        """Make the model's parameters show what the stepped tensors (``param_groups``' params) hold: offloaded
        masters are copied to their device shards and (stages 1-2) every bucket's shard is all-gathered into the
        replicas, as after ``step()``. For code that writes those tensors directly (``workbench.reshard``)."""
        self._masters_to_device(self._sharded)
        if self.stage in (1, 2):
            self._wait_all_gathers([self._start_all_gather(b) for b in self.buckets])

    def _masters_to_device(self, shards: list[torch.Tensor]) -> None:
        """Offload: the (updated) master copies of ``shards`` go back to the device shards; a no-op otherwise."""
        for t in shards:
            if id(t) in self._masters:
                t.copy_(self._masters[id(t)])

    def _start_all_gather(self, b: Bucket) -> tuple[Any, int]:
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


def _check_own_keys(stage: int, groups: list[dict[str, Any]]) -> None:
    if stage == 3 and any(key in g for g in groups for key in _OWN_KEYS):
        raise ValueError(f"param-group keys {_OWN_KEYS} need stages 0-2: a FullyShardedModel's flat shards mix "
                         "parameters of different kinds, so per-group shares cannot apply to them")
    for g in groups:
        share = g.get(NORM_SHARE, 1.0)
        if not (isinstance(share, (int, float)) and 0 <= share <= 1):
            raise ValueError(f"param group {NORM_SHARE!r} must be a number in [0, 1] (this rank's share of the "
                             f"group's squared gradient norm), got {share!r}")
        partial = g.get(PARTIAL_GRADS)
        if partial is not None and not (isinstance(partial, tuple) and len(partial) == 2):
            raise ValueError(f"param group {PARTIAL_GRADS!r} must be (process group, comm tag), got {partial!r}")


def _check_stage_matches_params(stage: int, groups: list[dict[str, Any]]) -> None:
    shards = [getattr(p, "_zero_shard", False) for g in groups for p in g["params"]]
    replicated = [getattr(p, "_zero_replicated", False) for g in groups for p in g["params"]]
    if stage == 3 and not all(s or r for s, r in zip(shards, replicated, strict=True)):
        raise ValueError("stage=3 steps the shards (and replicated parameters) of a FullyShardedModel: wrap the "
                         "model first and pass FullyShardedModel(model).parameters(), or use stage 1 or 2 for plain "
                         "parameters")
    if stage < 3 and any(shards):
        raise ValueError(f"stage={stage} got the flat shards of a FullyShardedModel; use stage=3 for those")
