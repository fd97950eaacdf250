"""ZeRO stage 3 / FSDP, ``FullyShardedModel``: parameters sharded too, each unit gathered only to be used.

Stage 3 (P_os+g+p, Rajbhandari et al. 2020 §5.3; Zhao et al. 2023, "PyTorch FSDP", VLDB): the model is cut
into units (by default each child of every ``nn.ModuleList``, ``default_units``); each unit's trainable
parameters are flattened, padded and sharded like one flat bucket (``flat.py``), and a rank keeps only its
shard. A unit's parameters are all-gathered just before its forward and freed after it, all-gathered again
just before its backward, and its gradient is reduce-scattered into the shard as soon as the unit's backward
is done: 3Ψ moved per step instead of DDP's 2Ψ (§7.2). The next unit's all-gather is prefetched while the
current one computes. Pair it with ``ZeroOptimizer(model.parameters(), cls, stage=3)`` (``optimizer.py``).

Mixed precision (FSDP2's ``MixedPrecisionPolicy``; Micikevicius et al. 2018): with ``mp_policy`` the fp32 shard
stays the master the optimizer steps; before each gather it is cast to ``param_dtype``, so the all-gather
moves, and the gathered unit holds, half the bytes of fp32 (bf16/fp16). The units then compute in that
dtype without autocast (the parameters already are low precision); gradients come out in ``param_dtype``,
are reduce-scattered in ``reduce_dtype`` and accumulate into the fp32 shard's ``.grad``.

Here: ``FullyShardedModel``, ``default_units``, a unit's flat shard and transient full buffer (``_Unit``) and
the autograd function whose backward is the moment to reduce-scatter (``_Unshard``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from workbench import comm, trace
from workbench.parallel.zero.flat import _ceil_div, _queue_end_of_backward
from workbench.parallel.zero.offload import _offload_copy

if TYPE_CHECKING:  # only the type: a strategy file imports no training-layer module at run time
    from workbench.precision import MixedPrecision


def _record_span(name: str, category: str, t0: float) -> None:
    """A span that hooks open and close (forward/backward of one unit), for the timeline."""
    tracer = trace.current()
    if tracer is not None and tracer.enabled:
        tracer.trace.spans.append(trace.Span(name, category, t0, time.time(), tracer.trace.rank, tracer.step))


class _Unit:
    """One unit of a ``FullyShardedModel``: its trainable params flattened, padded and sharded.

    ``shard`` (an nn.Parameter of ``shard_numel`` elements, registered on the unit's module as
    ``_flat_param``) is all this rank keeps. ``full`` is the gathered flat tensor while the unit is in use;
    its storage is emptied (``resize_(0)``) in between, as FSDP does, so the views autograd saved for
    backward stay valid and are refilled by the backward all-gather.
    """

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter],
                 uses: list[tuple[nn.Module, str, int]], world: int, rank: int, offload_device: Any,
                 mp_policy: MixedPrecision | None = None) -> None:
        self.name, self.module, self.uses = name, module, uses
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        numel = sum(self.numels)
        self.shard_numel = _ceil_div(numel, world)
        self.split_sizes = [*self.numels, world * self.shard_numel - numel]
        self.dtype, self.device = params[0].dtype, params[0].device  # the shard's (the master's) dtype
        # What the gathered unit computes in and what its gradient is reduce-scattered in (None: as produced).
        self.compute_dtype = mp_policy.param_dtype if mp_policy is not None else self.dtype
        self.reduce_dtype = mp_policy.reduce_dtype if mp_policy is not None else None
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
        return sum(self.split_sizes) * self.compute_dtype.itemsize

    def is_gathered(self) -> bool:
        return self.full is not None and self.full.untyped_storage().nbytes() > 0


class _Unshard(torch.autograd.Function):
    """Forward: hand out the all-gathered flat parameter of a unit. Backward: reduce-scatter its gradient.

    Autograd sums the gradients of all the unit's parameter views (one ``split`` backward) into the gradient
    of the flat tensor, so this node runs exactly when the whole unit's backward is done: the moment to
    reduce-scatter, return this rank's shard gradient (autograd accumulates it into ``shard.grad``) and free
    the gathered parameters.
    """

    gathers_parameters = True  # the ledger counts its output as parameters, not activations (trace.py)

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
    ``mp_policy`` (a ``workbench.precision.MixedPrecision``: ``param_dtype``, ``reduce_dtype``): gather and
    compute in ``param_dtype``, reduce-scatter gradients in ``reduce_dtype``, keep the fp32 shards as masters
    (see the module docstring); None: everything in the parameters' own dtype.
    ``offload_params=True`` keeps the shards (and their gradients) on ``offload_device``; each gather copies
    the shard to the compute device first. A unit run twice in one forward is not supported.
    """

    def __init__(self, module: nn.Module, group: Any = None, units: list[nn.Module] | None = None,
                 offload_params: bool = False, prefetch: bool = True,
                 offload_device: str | torch.device = "cpu", mp_policy: MixedPrecision | None = None) -> None:
        super().__init__()
        _check_mp_policy(mp_policy)
        self.mp_policy = mp_policy
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
                         self.rank, offload_device, self.mp_policy)
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
        if unit.reduce_dtype is not None:  # mixed precision: accumulate and reduce in reduce_dtype
            grad_full = grad_full.to(unit.reduce_dtype)
        if self._no_sync:
            unit.acc_grad = grad_full.clone() if unit.acc_grad is None else unit.acc_grad.add_(grad_full)
            return None
        if unit.acc_grad is not None:
            grad_full = grad_full + unit.acc_grad
            unit.acc_grad = None
        shard_grad = torch.empty(unit.shard_numel, dtype=grad_full.dtype, device=grad_full.device)
        comm.reduce_scatter(shard_grad, grad_full.contiguous(), op="avg", group=self.group, tag="grad")
        _record_span(f"backward {unit.name}", "backward", unit.t0)
        shard_grad = shard_grad.to(unit.dtype)  # into the fp32 master's gradient (a no-op without a policy)
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
            unit.full = torch.empty(sum(unit.split_sizes), dtype=unit.compute_dtype, device=unit.device)
            target = unit.full
        else:
            storage = unit.full.untyped_storage()
            storage.resize_(unit.full_bytes)
            target = torch.empty(0, dtype=unit.compute_dtype, device=unit.device).set_(storage, 0, unit.full.shape)
        src = unit.shard.detach()
        if unit.offloaded:
            src = src.to(unit.device, copy=True)  # offload: bring the shard to the compute device
        # Mixed precision: cast the shard before gathering (as FSDP2 does), so the wire carries param_dtype too.
        src = src.to(unit.compute_dtype)
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

    # -- a model also split over other ranks (tensor / sequence parallelism) ---------------------------------

    def _local_segments(self, names: Mapping[str, Any]) -> Iterator[tuple[_Unit, int, int, Any]]:
        """(unit, start, end, value): where in this rank's shard of its unit each named parameter lies."""
        for name, value in names.items():
            if name not in self._where:
                continue
            unit, i = self._where[name]
            start = sum(unit.numels[:i]) - self.rank * unit.shard_numel
            lo, hi = max(start, 0), min(start + unit.numels[i], unit.shard_numel)
            if lo < hi:
                yield unit, lo, hi, value

    def set_norm_shares(self, shares: Mapping[str, float]) -> None:
        """Weight each parameter's squared gradient norm by ``shares[name]`` (original names; default 1) when
        ``ZeroOptimizer.clip_grad_norm_`` sums this rank's shards: a unit flattens tensor-parallel shards
        (share 1) and tensors every tp rank holds whole (share 1/tp) into one shard, so the weights go per
        segment (``_zero_norm_segments`` on the shard)."""
        for unit in self._units:
            unit.shard._zero_norm_segments = []
        for unit, lo, hi, share in self._local_segments({n: float(s) for n, s in shares.items() if s != 1.0}):
            unit.shard._zero_norm_segments.append((lo, hi, share))
        for unit in self._units:
            segments = sorted(unit.shard._zero_norm_segments)
            covered = sum(hi - lo for lo, hi, _ in segments)
            if covered < unit.shard_numel:  # the rest of the shard (and the padding, zero) counts fully
                edges = [0, *[x for lo, hi, _ in segments for x in (lo, hi)], unit.shard_numel]
                segments += [(a, b, 1.0) for a, b in zip(edges[::2], edges[1::2], strict=True) if a < b]
            unit.shard._zero_norm_segments = sorted(segments)

    @torch.no_grad()
    def sum_partial_grads(self, names: Iterable[str], group: Any, tag: str) -> None:
        """Add up over ``group`` the shard-gradient segments of the parameters ``names`` (original names),
        whose gradients are partial sums over it (sequence parallelism: each tp rank saw its own positions).
        Every rank of ``group`` holds the same unit layout, so segment meets segment; one flat all-reduce."""
        segments = [(u, lo, hi) for u, lo, hi, _ in self._local_segments(dict.fromkeys(names))
                    if u.shard.grad is not None]
        if not segments or comm.group_size(group) == 1:
            return
        pieces = [u.shard.grad[lo:hi] for u, lo, hi in segments]
        for piece, summed in zip(pieces, comm.all_reduce_coalesced(pieces, group=group, tag=tag), strict=True):
            piece.copy_(summed)

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


def _check_mp_policy(mp_policy: Any) -> None:
    if mp_policy is None:
        return
    dtypes = [getattr(mp_policy, name, None) for name in ("param_dtype", "reduce_dtype")]
    if not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes):
        raise ValueError(f"mp_policy must carry floating param_dtype and reduce_dtype (workbench.precision."
                         f"policy(name).sharded()), got {mp_policy!r}")


def _check_units(module: nn.Module, units: list[nn.Module]) -> None:
    inside = {id(m) for m in module.modules()}
    for u in units:
        if not isinstance(u, nn.Module) or id(u) not in inside:
            raise ValueError(f"every unit must be a submodule of the wrapped model; got {type(u).__name__} "
                             "that is not (use default_units(model) or children of model)")
        if u is module:
            raise ValueError("the wrapped model itself is the root unit; list only its submodules in units")
