"""Mixed precision: fp32 / bf16 / fp16 policies, a dynamic loss scaler, fp32 master weights, a simulated fp8.

The recipe is Micikevicius et al. 2018, "Mixed Precision Training" (arXiv:1710.03740): run the forward and
backward in a 16-bit *compute copy* of the weights, keep an fp32 *master* copy that the optimizer updates
(its state, Adam's m and v, is fp32 too), and, for fp16, multiply the loss by a scale so that small gradients
do not underflow fp16's range. An update of size lr * g is often below half a unit in the last place of a
16-bit weight, so without fp32 masters many updates would round away to nothing.

bf16 needs no loss scaler: it keeps fp32's 8 exponent bits (range about 1e-38 .. 3e38) and gives up mantissa
bits instead, so a gradient that fits in fp32 fits in bf16. fp16 has 5 exponent bits (smallest subnormal
about 6e-8, largest 65504): gradients of a few times 1e-8 flush to zero unless scaled up, and a too-large
scale overflows to inf, which is why the scale is *dynamic* (grow while clean, back off on inf/NaN).

How it slots into training (``workbench.parallel.parallelize`` wires it into every strategy; ``workbench run
--precision {fp32,bf16,fp16} --reduce-dtype ...``):

* ``policy(name, reduce_in_fp32)`` gives a ``PrecisionPolicy``; ``policy.needs_scaler`` says whether to build
  a ``DynamicLossScaler``.
* Replicated and sharded-optimizer strategies (single process, every DDP, ZeRO-1/2, TP, PP): the model's fp32
  parameters *are* the masters; forward runs under ``autocast(policy, device_type)`` (torch's AMP: each
  matmul casts its fp32 weight and input to ``param_dtype``, reductions such as the loss stay fp32), so the
  gradients land in fp32 ``.grad`` and are reduced in fp32, and the optimizer state is fp32.
* ZeRO-3: ``policy.sharded()`` is a ``MixedPrecision`` view like FSDP2's ``MixedPrecisionPolicy``: the
  sharded model keeps its fp32 shard as the master, casts it to ``param_dtype`` and all-gathers that (half
  the bytes gathered and moved), runs the units without autocast, reduce-scatters gradients in
  ``reduce_dtype`` and accumulates into the fp32 shard's gradient.
* fp16: the loss is multiplied by ``scaler.scale_value`` before backward; after the gradient reduction each
  rank unscales the gradients it holds (``p.grad``, or its ZeRO shard), ``found_inf`` agrees over the whole
  mesh, then the step is taken or skipped (``Parallelized.optimizer_step``).
* For a plain model outside ``parallelize`` (teaching the recipe by hand): ``cast_for_compute`` keeps a 16-bit
  compute copy and fp32 masters, and ``MixedPrecisionStep`` runs one step of it.
* The inf check must see every gradient shard: pass the groups whose union is the whole mesh (world, or the
  dp and tp groups of a 2-D mesh: a MAX over each axis in turn is a MAX over the product).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workbench.dist import comm

PRECISIONS = ("fp32", "bf16", "fp16")
_COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MASTER_DTYPE = torch.float32
AMP_TAG = "amp"  # the comm log tag of the scaler's inf/NaN agreement


@dataclass(frozen=True)
class MixedPrecision:
    """The two dtypes a sharded (ZeRO-3) model needs, named as in FSDP2's ``MixedPrecisionPolicy``.

    ``param_dtype``: the dtype the all-gathered full parameter is cast to for forward and backward.
    ``reduce_dtype``: the dtype gradients are reduce-scattered in. The sharded master stays fp32.
    ``cast_forward_inputs``: floating-point tensors passed to the sharded model's forward are cast to
    ``param_dtype`` first (as FSDP2 does), so fp32 features meet low-precision weights in one dtype; integer
    inputs (token ids) are left alone.
    """

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype each kind of tensor is kept in.

    ``param_dtype``: the compute copy's dtype (weights, activations and gradients of forward/backward).
    ``reduce_dtype``: the dtype gradients are summed across ranks in: the compute dtype (half the bytes on
    the wire) or fp32 (no rounding error accumulated over the sum of many ranks).
    Master weights and optimizer state are always fp32 (``master_dtype``).
    """

    name: str
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"unknown precision {self.name!r}; valid: {', '.join(PRECISIONS)}")
        if self.param_dtype != _COMPUTE_DTYPES[self.name]:
            raise ValueError(f"precision {self.name!r} computes in {_COMPUTE_DTYPES[self.name]}, "
                             f"got param_dtype={self.param_dtype}")
        if self.reduce_dtype not in (self.param_dtype, MASTER_DTYPE):
            raise ValueError(f"reduce_dtype must be the compute dtype {self.param_dtype} or {MASTER_DTYPE}, "
                             f"got {self.reduce_dtype}")

    @property
    def master_dtype(self) -> torch.dtype:
        return MASTER_DTYPE

    @property
    def needs_scaler(self) -> bool:
        """Only fp16 needs loss scaling; bf16 has fp32's exponent range (see the module docstring)."""
        return self.name == "fp16"

    def sharded(self) -> MixedPrecision:
        """The FSDP2-style view the ZeRO-3 model takes: gather in ``param_dtype``, reduce in ``reduce_dtype``."""
        return MixedPrecision(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)


def autocast(policy_: PrecisionPolicy, device_type: str) -> AbstractContextManager:
    """``torch.autocast`` to the policy's compute dtype on ``device_type`` ("cpu", "cuda"); fp32: a no-op
    context, so an fp32 run executes exactly the ops it did before mixed precision existed."""
    _check_policy(policy_)
    if policy_.param_dtype == MASTER_DTYPE:
        return nullcontext()
    return torch.autocast(device_type=device_type, dtype=policy_.param_dtype)


def policy(name: str, reduce_in_fp32: bool = True) -> PrecisionPolicy:
    """The policy named ``name`` ("fp32", "bf16", "fp16"); gradients reduced in fp32 unless told otherwise."""
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; valid: {', '.join(PRECISIONS)}")
    if not isinstance(reduce_in_fp32, bool):
        raise ValueError(f"reduce_in_fp32 must be True or False, got {reduce_in_fp32!r}")
    compute = _COMPUTE_DTYPES[name]
    return PrecisionPolicy(name, compute, MASTER_DTYPE if reduce_in_fp32 else compute)


def policy_from_names(precision: str, reduce_dtype: str = "fp32") -> PrecisionPolicy:
    """The policy of ``--precision P --reduce-dtype R``: R is "fp32" or P's own compute dtype name."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    valid = ("fp32",) if precision == "fp32" else ("fp32", precision)
    if reduce_dtype not in valid:
        raise ValueError(f"reduce_dtype={reduce_dtype!r} with precision={precision!r}; valid: {', '.join(valid)} "
                         f"(gradients are reduced in fp32 or in the compute dtype)")
    return policy(precision, reduce_in_fp32=reduce_dtype == "fp32")


# ---------------------------------------------------------------------------------------------------------
# The dynamic loss scaler


class DynamicLossScaler:
    """Scale the loss up so fp16 gradients do not underflow; back off and skip the step when they overflow.

    The schedule is Micikevicius et al. 2018 (and ``torch.amp.GradScaler``'s): start at ``init_scale``;
    after ``growth_interval`` consecutive clean steps multiply the scale by ``growth_factor``; on any
    inf/NaN gradient skip the optimizer step and multiply the scale by ``backoff_factor`` (never below
    ``min_scale``). The inf/NaN verdict is one all-reduce MAX of a flag over the given groups, so every rank
    skips the same steps: a rank that stepped while another skipped would leave the replicas different.

    The scale is a python float (exact powers of two), so scaling and unscaling add no rounding error.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0, max_scale: float = 2.0 ** 24) -> None:
        _check_positive("init_scale", init_scale)
        _check_positive("min_scale", min_scale)
        _check_positive("max_scale", max_scale)
        if not (isinstance(growth_factor, (int, float)) and growth_factor > 1):
            raise ValueError(f"growth_factor must be a number > 1, got {growth_factor!r}")
        if not (isinstance(backoff_factor, (int, float)) and 0 < backoff_factor < 1):
            raise ValueError(f"backoff_factor must be a number in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(f"need min_scale <= init_scale <= max_scale, got {min_scale}, {init_scale}, "
                             f"{max_scale}")
        self.scale_value = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.clean_steps = 0  # consecutive clean steps since the last growth or backoff
        self.skipped_steps = 0
        self.total_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``: call backward on this, not on the loss."""
        return loss * self.scale_value

    def unscale_(self, grads: Iterable[torch.Tensor | None]) -> None:
        """Divide gradients by the scale in place (do it on fp32 master gradients: fp16 ones may underflow)."""
        inv = 1.0 / self.scale_value
        for g in grads:
            if g is not None:
                g.mul_(inv)

    def found_inf(self, grads: Iterable[torch.Tensor | None], groups: Sequence[Any] = (None,),
                  device: torch.device | str | None = None) -> bool:
        """True on every rank if any gradient on any rank of ``groups`` holds an inf or NaN.

        One all-reduce MAX of a 0/1 flag per group (tagged ``"amp"`` in the comm log). ``device``: where the
        flag is born (default: the first gradient's device, else the rank's device).
        """
        grads = [g for g in grads if g is not None]
        if device is None:
            device = grads[0].device if grads else _rank_device()
        # The flag is computed on the device from every gradient and read once below (one sync, as
        # torch.amp.GradScaler makes for a non-fused optimizer), not once per gradient.
        flag = torch.zeros(1, device=device)
        for g in grads:
            flag = torch.maximum(flag, (~torch.isfinite(g)).any().to(device=device, dtype=flag.dtype).reshape(1))
        for group in groups:
            comm.all_reduce(flag, op="max", group=group, tag=AMP_TAG)
        return bool(flag.item() > 0)

    def update(self, found_inf: bool) -> bool:
        """Advance the schedule after a step; True if the step should be taken (no inf/NaN found)."""
        self.total_steps += 1
        if found_inf:
            self.scale_value = max(self.scale_value * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
            return False
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale_value = min(self.scale_value * self.growth_factor, self.max_scale)
            self.clean_steps = 0
        return True

    def state_dict(self) -> dict[str, float | int]:
        """Plain python numbers: ``torch.load(weights_only=True)`` reads them back."""
        return {"scale": self.scale_value, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "min_scale": self.min_scale, "max_scale": self.max_scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise ValueError(f"loss scaler state is missing {missing}; expected keys {sorted(self.state_dict())}")
        fresh = DynamicLossScaler(_number(state, "scale"), _number(state, "growth_factor"),
                                  _number(state, "backoff_factor"), int(_number(state, "growth_interval")),
                                  _number(state, "min_scale"), _number(state, "max_scale"))
        self.__dict__.update(fresh.__dict__)
        self.clean_steps = int(_number(state, "clean_steps"))
        self.skipped_steps = int(_number(state, "skipped_steps"))
        self.total_steps = int(_number(state, "total_steps"))


def _number(state: dict[str, Any], key: str) -> float:
    """A state value as a float; a 0-d tensor (from another saver) is accepted too."""
    value = state[key]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"loss scaler state {key!r} must be a finite number, got {value!r}")
    return float(value)


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _rank_device() -> torch.device:
    from workbench.dist.launch import rank_device  # launch imports much; only needed when no tensor says where

    return rank_device()


# ---------------------------------------------------------------------------------------------------------
# fp32 masters and a compute copy


def cast_for_compute(model: nn.Module, policy_: PrecisionPolicy) -> list[nn.Parameter]:
    """Cast ``model``'s parameters in place to the compute dtype; return their fp32 masters, in
    ``model.parameters()`` order, for the optimizer to update. Masters are born on each parameter's device.

    In fp32 the masters are fresh fp32 copies too, so the same step code runs in every policy.
    """
    _check_policy(policy_)
    masters = []
    for p in model.parameters():
        if p.dtype != MASTER_DTYPE:
            raise ValueError(f"cast_for_compute expects an fp32 model (build it in fp32), found a {p.dtype} "
                             f"parameter of shape {tuple(p.shape)}")
        masters.append(nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
        p.data = p.data.to(policy_.param_dtype)  # same Parameter object: wrappers/hooks keep their handles
    return masters


def copy_grads_to_masters(model: nn.Module, masters: Sequence[nn.Parameter]) -> None:
    """Each master's ``.grad`` = its compute parameter's gradient in fp32 (None stays None)."""
    params = _paired(model, masters)
    for p, m in params:
        m.grad = None if p.grad is None else p.grad.detach().to(MASTER_DTYPE, copy=True)


def copy_masters_to_model(masters: Sequence[nn.Parameter], model: nn.Module) -> None:
    """Round the updated fp32 masters into the compute copy (the only place masters lose precision)."""
    with torch.no_grad():
        for p, m in _paired(model, masters):
            p.copy_(m)


def reduce_grads(grads: Sequence[torch.Tensor | None], policy_: PrecisionPolicy, group: Any = None) -> None:
    """Average gradients over ``group`` in ``policy_.reduce_dtype`` (tagged ``"grad"``), written back in place.

    Reducing in the compute dtype halves the bytes on the wire; fp32 keeps the sum of many ranks exact to
    fp32 rounding (and a scaled fp16 sum cannot overflow fp16 on the way).
    """
    _check_policy(policy_)
    if comm.group_size(group) == 1:
        return
    for g in grads:
        if g is None:
            continue
        wire = g if g.dtype == policy_.reduce_dtype else g.to(policy_.reduce_dtype)
        comm.all_reduce(wire, op="avg", group=group, tag="grad")
        if wire is not g:
            g.copy_(wire)


def param_bytes(model: nn.Module) -> int:
    """Bytes held by ``model``'s (unique) parameters, in whatever dtype they are now."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _paired(model: nn.Module, masters: Sequence[nn.Parameter]) -> list[tuple[nn.Parameter, nn.Parameter]]:
    params = list(model.parameters())
    if len(params) != len(masters):
        raise ValueError(f"{len(masters)} masters for a model with {len(params)} parameters; build them with "
                         f"cast_for_compute(model, policy)")
    return list(zip(params, masters, strict=True))


def _check_policy(policy_: Any) -> None:
    if not isinstance(policy_, PrecisionPolicy):
        raise ValueError(f"expected a PrecisionPolicy (workbench.precision.policy(name)), got {policy_!r}")


@dataclass(frozen=True)
class StepResult:
    loss: float
    skipped: bool
    scale: float  # the loss scale the step used (1.0 without a scaler)


class MixedPrecisionStep:
    """One training step of a plain (unwrapped) model in ``policy_`` with fp32 masters.

    ``optimizer_factory(masters)`` builds the optimizer on the fp32 masters, so its state is fp32 too.
    ``dp_group``: gradients are averaged over it in ``policy_.reduce_dtype`` (None: the world; one process:
    a no-op). ``reduce_gradients=False`` when something else reduces them already (a DDP wrapper's hooks).
    ``check_groups``: the groups whose union holds every gradient, for the scaler's inf agreement.
    """

    def __init__(self, model: nn.Module, policy_: PrecisionPolicy,
                 optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 scaler: DynamicLossScaler | None = None, dp_group: Any = None,
                 check_groups: Sequence[Any] = (None,), reduce_gradients: bool = True) -> None:
        _check_policy(policy_)
        if policy_.needs_scaler and scaler is None:
            raise ValueError(f"precision {policy_.name!r} needs a DynamicLossScaler: fp16 gradients underflow "
                             f"without loss scaling and overflow would go unnoticed")
        self.model, self.policy, self.scaler = model, policy_, scaler
        self.dp_group, self.check_groups = dp_group, tuple(check_groups)
        self.reduce_gradients = reduce_gradients
        self.masters = cast_for_compute(model, policy_)
        self.optimizer = optimizer_factory(self.masters)

    def step(self, loss_fn: Callable[[nn.Module], torch.Tensor]) -> StepResult:
        """Forward+backward ``loss_fn(model)`` in the compute dtype, then update the fp32 masters."""
        self.model.zero_grad(set_to_none=True)
        loss = loss_fn(self.model)
        scale = self.scaler.scale_value if self.scaler is not None else 1.0
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        copy_grads_to_masters(self.model, self.masters)
        grads = [m.grad for m in self.masters]
        if self.reduce_gradients:
            reduce_grads(grads, self.policy, self.dp_group)
        if self.scaler is not None:
            self.scaler.unscale_(grads)
            if not self.scaler.update(self.scaler.found_inf(grads, self.check_groups)):
                self.optimizer.zero_grad(set_to_none=True)
                return StepResult(float(loss.detach()), True, scale)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        copy_masters_to_model(self.masters, self.model)
        return StepResult(float(loss.detach()), False, scale)


# ---------------------------------------------------------------------------------------------------------
# Simulated fp8 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433)

FP8_FORWARD = torch.float8_e4m3fn  # 4 exponent bits: more precision, max 448, for weights and activations
FP8_BACKWARD = torch.float8_e5m2   # 5 exponent bits: more range, max 57344, for gradients


def fp8_scale(t: torch.Tensor, dtype: torch.dtype) -> float:
    """Per-tensor scale mapping ``t``'s largest magnitude onto ``dtype``'s largest finite value."""
    amax = float(t.detach().abs().max()) if t.numel() else 0.0
    return torch.finfo(dtype).max / amax if amax > 0 and math.isfinite(amax) else 1.0


def fp8_round_trip(t: torch.Tensor, dtype: torch.dtype = FP8_FORWARD, scaled: bool = True) -> torch.Tensor:
    """``t`` quantised to ``dtype`` and back to ``t``'s dtype: what an fp8 matmul actually sees.

    With ``scaled`` the tensor is multiplied by ``fp8_scale`` first and divided after, so its values use the
    format's whole range; without, values below the smallest subnormal (2**-9 in e4m3, 2**-16 in e5m2)
    become 0.
    """
    if dtype not in (FP8_FORWARD, FP8_BACKWARD):
        raise ValueError(f"fp8 dtype must be {FP8_FORWARD} or {FP8_BACKWARD}, got {dtype}")
    s = fp8_scale(t, dtype) if scaled else 1.0
    limit = torch.finfo(dtype).max  # clamp first: e4m3fn has no inf, an out-of-range cast is NaN
    q = (t.detach().float() * s).clamp(-limit, limit).to(dtype)
    return (q.float() / s).to(t.dtype)


class _FP8Linear(torch.autograd.Function):
    """y = x w^T with x, w in e4m3 (forward) and the output gradient in e5m2 (backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, scaled: bool) -> torch.Tensor:
        xq, wq = fp8_round_trip(x, FP8_FORWARD, scaled), fp8_round_trip(w, FP8_FORWARD, scaled)
        ctx.save_for_backward(xq, wq)
        ctx.scaled = scaled
        return xq @ wq.t()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        xq, wq = ctx.saved_tensors
        gq = fp8_round_trip(grad_out, FP8_BACKWARD, ctx.scaled)
        grad_w = gq.reshape(-1, gq.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])
        return gq @ wq, grad_w, None


def fp8_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               scaled: bool = True) -> torch.Tensor:
    """A linear layer through simulated fp8: ``x [..., in]``, ``w [out, in]`` -> ``[..., out]``.

    The matmul itself runs in ``x``'s dtype on fp8-rounded values (CPUs have no fp8 matmul); the rounding,
    the range and the per-tensor scaling are fp8's. ``scaled=False`` shows what happens without scaling.
    """
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"fp8_linear needs x [..., in] and w [out, in], got {tuple(x.shape)} and {tuple(w.shape)}")
    y = _FP8Linear.apply(x, w, scaled)
    return y if bias is None else y + bias
