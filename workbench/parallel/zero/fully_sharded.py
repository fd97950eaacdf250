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

Which submodules are units (FSDP's auto-wrap policy, Zhao et al. 2023 §3.2.1): ``units=`` lists them, or
``wrap_policy=`` picks them: a set of module types, a minimum parameter count (bottom-up, as FSDP1's
``size_based_auto_wrap_policy``) or a callable ``(name, module) -> bool`` (``units_from_policy``). What no unit
takes is the root unit, gathered for the whole forward: a model that ends up as the root alone saves no
parameter memory while it computes, and the constructor warns.

Replicated parameters (FSDP's ``ignored_params``): ``replicate=`` keeps chosen parameters (norms, usually:
small, and in every unit) whole on every rank, outside the flat shards; their gradients are averaged with one
flat all-reduce after backward, and ``ZeroOptimizer(stage=3)`` steps them fully on every rank.

State dicts under the unwrapped model's names (``state_dict``, ``full_state_dict``, ``load_state_dict``): the
keys are exactly the wrapped model's ``state_dict()`` keys, so a checkpoint reads like a DDP wrapper's.

Here: the runtime, ``FullyShardedModel`` (construction, per-unit gather / free / reduce-scatter, replicated
parameters' all-reduce, no_sync, tensor-parallel norm shares) and the autograd function whose backward is the
moment to reduce-scatter (``_Unshard``). The rest of stage 3 sits beside it, one job per file: unit selection and
replicated parameters in ``units.py``, a unit's flat shard and transient full buffer in ``sharded_unit.py``,
mixed-precision casts in ``casts.py``, state dicts and full parameters by name in ``state_dict.py``.
``default_units``, ``units_from_policy`` and ``VALID_WRAP_POLICIES`` are importable from here as before.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from workbench import trace
from workbench.dist import comm
from workbench.parallel.zero.casts import cast_during_forward, cast_floating, check_mp_policy, low_precision_slots
from workbench.parallel.zero.flat import queue_end_of_backward
from workbench.parallel.zero.offload import offload_copy
from workbench.parallel.zero.sharded_unit import ShardedUnit
from workbench.parallel.zero.state_dict import ShardedStateDict
from workbench.parallel.zero.units import VALID_WRAP_POLICIES as VALID_WRAP_POLICIES
from workbench.parallel.zero.units import check_units, replicated_params, units_from_policy
from workbench.parallel.zero.units import default_units as default_units

if TYPE_CHECKING:  # only the type: a strategy file imports no training-layer module at run time
    from workbench.parallel.precision import MixedPrecision


def _record_span(name: str, category: str, t0: float) -> None:
    """A span that hooks open and close (forward/backward of one unit), for the timeline."""
    tracer = trace.current()
    if tracer is not None and tracer.enabled:
        tracer.trace.spans.append(trace.Span(name, category, t0, time.time(), tracer.trace.rank, tracer.step))


class _Unshard(torch.autograd.Function):
    """Forward: hand out the all-gathered flat parameter of a unit. Backward: reduce-scatter its gradient.

    Autograd sums the gradients of all the unit's parameter views (one ``split`` backward) into the gradient
    of the flat tensor, so this node runs exactly when the whole unit's backward is done: the moment to
    reduce-scatter, return this rank's shard gradient (autograd accumulates it into ``shard.grad``) and free
    the gathered parameters.
    """

    gathers_parameters = True  # the ledger counts its output as parameters, not activations (trace.py)

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, owner: FullyShardedModel, unit: ShardedUnit) -> torch.Tensor:
        ctx.owner, ctx.unit = owner, unit
        return unit.full

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        return ctx.owner._reduce_grad(ctx.unit, grad_full), None, None


class FullyShardedModel(ShardedStateDict, nn.Module):
    """ZeRO stage 3 / FSDP: every rank keeps 1/N of each unit's parameters and gathers a unit only to use it.

    Units: ``units`` lists the submodules sharded as one unit each, or ``wrap_policy`` picks them (a set of
    module types, a minimum parameter count, or a callable ``(name, module) -> bool``: ``units_from_policy``);
    neither: ``default_units`` (each child of every ``nn.ModuleList``). The remaining trainable parameters form
    the root unit. A parameter used by two units (a tied weight such as GPT's wte/lm_head, or one tied across
    two units) goes to the root unit, which is gathered for the whole forward. If that leaves the whole model
    as the root unit (and world > 1), a warning says so: nothing is saved while it computes.

    Per unit and step: all-gather before forward (the next unit's all-gather is prefetched, async, while this
    one computes), free after forward; all-gather again before backward (prefetching the previous unit's);
    after its backward, reduce-scatter (average) the gradient into the shard's ``.grad`` and free everything
    full. That is 3Ψ moved per step against DDP's 2Ψ (ZeRO §7.2.2). The reduce-scatter is synchronous inside
    autograd, so ``finish_gradient_synchronization()`` has nothing left to wait for (kept for a uniform loop).

    ``replicate`` (FSDP's ignored parameters): parameters kept whole, as plain ``nn.Parameter``s, on every
    rank: an iterable of parameters or of their qualified names, or a callable ``(name, param) -> bool``
    (e.g. ``lambda n, p: p.dim() == 1`` for norms and biases). Their gradients are averaged over ``group`` with
    one flat all-reduce once backward ends (after the last backward of a ``no_sync`` accumulation, like the
    shards); ``ZeroOptimizer(stage=3)`` steps them fully on every rank, so they stay bit-identical.

    Names, as a DDP wrapper's (no ``module.`` prefix): ``named_parameters()`` yields each unit's flat shard
    (``<unit>._flat_param``, ``_flat_param`` for the root) and the replicated and frozen parameters under their
    own names: step them all with ``ZeroOptimizer(model.parameters(), cls, stage=3)``. ``state_dict()`` is
    keyed by the wrapped model's ``state_dict()`` keys and is *sharded*: a sharded parameter's value is this
    rank's piece of it, the 1-D slice of the flattened parameter that lies in this rank's shard (possibly
    empty; ``shard_ranges()`` says which elements), and buffers, replicated and frozen parameters are whole.
    ``full_state_dict()`` (every rank calls it) all-gathers the full tensors, which a plain
    ``nn.Module.load_state_dict(strict=True)`` of the unwrapped model accepts; ``load_state_dict`` takes either
    (per key: the parameter's full shape, or this rank's 1-D piece), and loads what ``state_dict`` gave bit-exact.
    ``full_parameters()`` all-gathers the full parameters by their original names (every rank must call it).
    Ranks must start from identical weights (build the model with the same seed everywhere).

    ``mp_policy`` (a ``workbench.precision.MixedPrecision``: ``param_dtype``, ``reduce_dtype``): gather and
    compute in ``param_dtype``, reduce-scatter gradients in ``reduce_dtype``, keep the fp32 shards as masters
    (see the module docstring), and cast floating-point inputs of ``forward`` to ``param_dtype`` unless the policy's
    ``cast_forward_inputs`` is False; None: everything in the parameters' own dtype. Replicated parameters stay fp32
    masters too and are cast to ``param_dtype`` for each forward (the cast is differentiable, so the gradient
    arrives in fp32), except a norm layer whose parameters are all replicated: it keeps its fp32 weights (its
    kernels take low-precision input and reduce in fp32, as mixed precision wants of normalisation: Micikevicius
    et al. 2018, §3.3).
    ``offload_params=True`` keeps the shards (and their gradients) on ``offload_device``; each gather copies
    the shard to the compute device first. A unit run twice in one forward is not supported.
    """

    def __init__(self, module: nn.Module, group: Any = None, units: list[nn.Module] | None = None,
                 offload_params: bool = False, prefetch: bool = True,
                 offload_device: str | torch.device = "cpu", mp_policy: MixedPrecision | None = None, *,
                 wrap_policy: Any = None,
                 replicate: Iterable[nn.Parameter | str] | Callable[[str, nn.Parameter], bool] | None = None
                 ) -> None:
        super().__init__()
        check_mp_policy(mp_policy)
        if units is not None and wrap_policy is not None:
            raise ValueError(f"pass units=[...] or wrap_policy={wrap_policy!r}, not both: units lists the units "
                             "explicitly, wrap_policy picks them")
        self.mp_policy = mp_policy
        self.module = module
        self.group = group
        self.world, self.rank = comm.group_size(group), comm.group_rank(group)
        self.prefetch, self.offload_params = prefetch, offload_params
        self._replicated = replicated_params(module, replicate)
        unit_modules = list(units) if units is not None else units_from_policy(module, wrap_policy,
                                                                                self._replicated.values())
        check_units(module, unit_modules)
        self._names = [name for name, _ in module.named_parameters()]
        self._state_keys = list(module.state_dict().keys())  # before the parameters move into flat shards
        pids = {id(p): name for name, p in module.named_parameters()}
        self._canonical = {alias: pids[id(p)] for alias, p in module.named_parameters(remove_duplicate=False)}
        self._kept = {name: p for name, p in module.named_parameters()
                      if not p.requires_grad or name in self._replicated}  # frozen and replicated: whole
        # before the shards take the sharded parameters out of their modules: a norm's own parameters are read
        casts = low_precision_slots(module, self._replicated, mp_policy.param_dtype) if mp_policy else {}
        self._units, self._where = self._build_units(unit_modules, offload_device if offload_params else None)
        self._unit_of_module = {id(u.module): u for u in self._units}
        for u in self._units:
            if u.module is not module:
                u.module.register_forward_pre_hook(self._make_pre_forward(u))
                u.module.register_forward_hook(self._make_post_forward(u))
        for p in self._replicated.values():
            p._zero_replicated = True
            p.register_post_accumulate_grad_hook(self._on_replicated_grad)
        for owner, slots in casts.items():
            cast_during_forward(owner, slots, mp_policy.param_dtype)
        self._order: list[ShardedUnit] = []
        self._last_order: list[ShardedUnit] = list(self._units)
        self._no_sync = False
        self._callback_queued = False
        self._warn_if_one_unit()
        self._record_memory()

    # -- construction ------------------------------------------------------------------------------------

    def _build_units(self, unit_modules: list[nn.Module], offload_device: Any) -> tuple[list[ShardedUnit], dict]:
        owner: dict[int, nn.Module] = {}
        for u in unit_modules:  # a nested unit is listed after its parent so the innermost wins
            for sub in u.modules():
                owner[id(sub)] = u
        uses: dict[int, list[tuple[nn.Module, str]]] = {}
        params: dict[int, nn.Parameter] = {}
        kept = {id(p) for p in self._kept.values()}
        for m in self.module.modules():
            for local, p in m._parameters.items():
                if p is not None and id(p) not in kept:
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
            unit = ShardedUnit(names.get(id(m), "") or "root", m, [params[pid] for pid in pids], unit_uses, self.world,
                         self.rank, offload_device, self.mp_policy)
            for i, pid in enumerate(pids):
                where[pid] = (unit, i)
            for mod, local, _ in unit_uses:
                del mod._parameters[local]
            m.register_parameter("_flat_param", unit.shard)
            units.append(unit)
        return units, {name: where[pid] for name, pid in name_to_pid.items() if pid in where}

    def _warn_if_one_unit(self) -> None:
        """FSDP's silent trap: with no unit but the root, every rank gathers the whole model for the whole
        forward and backward, so sharding saves nothing while it computes (only between steps)."""
        if self.world > 1 and self._units and all(u.module is self.module for u in self._units):
            warnings.warn(f"FullyShardedModel: no submodule of {type(self.module).__name__} became a unit, so its "
                          f"{sum(self._units[0].numels)} sharded parameters form one root unit, all-gathered for "
                          "the whole forward and backward: no parameter memory is saved during forward. Pick units "
                          "with wrap_policy= a set of module types (e.g. {nn.Linear}), a minimum parameter count "
                          "(e.g. 100_000), or a callable (name, module) -> bool; or pass units=[...]",
                          UserWarning, stacklevel=3)

    # -- forward -----------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._order = []
        for u in self._units:  # a forward whose backward never ran left its (emptied) buffer behind
            if u.work is None and not u.is_gathered():
                u.full = None
        if self.mp_policy is not None and getattr(self.mp_policy, "cast_forward_inputs", True):
            dtype = self.mp_policy.param_dtype
            args, kwargs = cast_floating(args, dtype), cast_floating(kwargs, dtype)
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

    def _make_pre_forward(self, unit: ShardedUnit) -> Any:
        return lambda module, args: self._pre_forward(unit)

    def _make_post_forward(self, unit: ShardedUnit) -> Any:
        return lambda module, args, out: self._post_forward(unit, out)

    def _pre_forward(self, unit: ShardedUnit) -> None:
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

    def _post_forward(self, unit: ShardedUnit, out: Any) -> None:
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

    def _make_pre_backward(self, unit: ShardedUnit) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._pre_backward(unit)
        return hook

    def _pre_backward(self, unit: ShardedUnit) -> None:
        if unit.backward_started:
            return
        unit.backward_started = True
        unit.t0 = time.time()
        if not self._callback_queued:
            self._callback_queued = True
            queue_end_of_backward(self._end_of_backward)
        self._start_gather(unit)
        self._wait(unit)
        if self.prefetch:  # backward visits the root (its hook is on the loss), then units in reverse order
            root = [u for u in self._order if u.module is self.module]
            prev = _after(root + [u for u in self._order[::-1] if u.module is not self.module], unit)
            if prev is not None:
                self._start_gather(prev)

    def _reduce_grad(self, unit: ShardedUnit, grad_full: torch.Tensor) -> torch.Tensor | None:
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
        return offload_copy(shard_grad, unit.shard.device) if unit.offloaded else shard_grad

    def _on_replicated_grad(self, param: nn.Parameter) -> None:
        """A replicated parameter's gradient is final for this backward: reduce all of them once it ends."""
        if not self._callback_queued:
            self._callback_queued = True
            queue_end_of_backward(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        for u in self._units:
            self._wait(u)
            self._free(u)
            u.full = None
        if not self._no_sync:
            self._all_reduce_replicated()
        self._record_memory()

    @torch.no_grad()
    def _all_reduce_replicated(self) -> None:
        """Average the replicated parameters' gradients over the group: one flat all-reduce (as ``FlatDDP``).
        A parameter without a gradient on this rank joins with zeros, so every rank issues the same collective."""
        params = list(self._replicated.values())
        if not params or self.world == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        for grad, avg in zip(grads, comm.all_reduce_coalesced(grads, op="avg", group=self.group, tag="grad"),
                             strict=True):
            grad.copy_(avg)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep each unit's full gradient locally (summed over micro-batches) instead
        of reduce-scattering it, and leave the replicated parameters' gradients unreduced in ``.grad``; the
        first backward outside reduces each sum once."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Nothing to wait for: each unit's reduce-scatter finished inside backward."""

    # -- gather / free -----------------------------------------------------------------------------------

    def _start_gather(self, unit: ShardedUnit) -> None:
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

    def _wait(self, unit: ShardedUnit) -> None:
        if unit.work is not None:
            unit.work.wait()
            unit.work = None

    def _free(self, unit: ShardedUnit) -> None:
        if unit.is_gathered():
            unit.full.untyped_storage().resize_(0)
            trace.ledger_add("gathered_params", -unit.full_bytes)

    # -- a model also split over other ranks (tensor / sequence parallelism) ---------------------------------

    def _local_segments(self, names: Mapping[str, Any]) -> Iterator[tuple[ShardedUnit, int, int, Any]]:
        """(unit, start, end, value): where in this rank's shard of its unit each named parameter lies."""
        for name, value in names.items():
            if name not in self._where:
                continue
            unit, i = self._where[name]
            lo, hi, _ = self._piece(unit, i)
            if lo < hi:
                yield unit, lo, hi, value

    def set_norm_shares(self, shares: Mapping[str, float]) -> None:
        """Weight each parameter's squared gradient norm by ``shares[name]`` (original names; default 1) when
        ``ZeroOptimizer.clip_grad_norm_`` sums this rank's shards: a unit flattens tensor-parallel shards
        (share 1) and tensors every tp rank holds whole (share 1/tp) into one shard, so the weights go per
        segment (``_zero_norm_segments`` on the shard)."""
        for name, p in self._replicated.items():  # whole on every rank: the tensor's share as a tp rank's
            p._zero_norm_share = float(shares.get(name, 1.0))
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
        whose gradients are partial sums over it (sequence parallelism: each tp rank saw its own positions), and
        the whole gradients of those that are replicated. Every rank of ``group`` holds the same unit layout and
        the same replicated parameters, so segment meets segment; one flat all-reduce."""
        names = list(names)
        segments = [(u, lo, hi) for u, lo, hi, _ in self._local_segments(dict.fromkeys(names))
                    if u.shard.grad is not None]
        whole = [self._replicated[n].grad for n in names if n in self._replicated]  # replicated: the whole grad
        pieces = [u.shard.grad[lo:hi] for u, lo, hi in segments] + [g for g in whole if g is not None]
        if not pieces or comm.group_size(group) == 1:
            return
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
        held = list(self._replicated.values())  # whole on every rank, never offloaded
        if not self.offload_params:
            held += [u.shard for u in self._units]
        trace.ledger_set("parameters", trace.tensor_bytes(held))
        trace.ledger_set("gradients", trace.tensor_bytes(t.grad for t in held if t.grad is not None))

    def offloaded_bytes(self) -> dict[str, int]:
        """Bytes of parameter shards and their gradients kept on ``offload_device``."""
        if not self.offload_params:
            return {"parameters": 0, "gradients": 0}
        return {"parameters": trace.tensor_bytes(u.shard for u in self._units),
                "gradients": trace.tensor_bytes(u.shard.grad for u in self._units if u.shard.grad is not None)}


def _after(order: list[ShardedUnit], unit: ShardedUnit) -> ShardedUnit | None:
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
