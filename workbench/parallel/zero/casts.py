"""Mixed precision around ZeRO stage 3's units: what is cast to the compute dtype, and when.

FSDP2's ``MixedPrecisionPolicy`` (Micikevicius et al. 2018): the fp32 shards stay the masters; the gathered units
compute in ``param_dtype``. Sharded parameters are cast before their all-gather (``fully_sharded.py``); here is
the rest: replicated parameters a low-precision module must see in ``param_dtype`` (``low_precision_slots``,
cast for each forward by ``cast_during_forward``), the forward's floating-point inputs (``cast_floating``) and
the policy's own check (``check_mp_policy``).

Nothing of the package is imported; ``fully_sharded.py`` uses these.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_NORM_LAYERS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)

#: (attribute name, fp32 master) pairs of one module that its forward must see cast.
CastSlots = list[tuple[str, nn.Parameter]]


def low_precision_slots(module: nn.Module, replicated: dict[str, nn.Parameter],
                        param_dtype: torch.dtype) -> dict[nn.Module, CastSlots]:
    """The modules that must see a replicated parameter in ``param_dtype``, each with its (attribute, master) pairs.

    A module's own parameters meet in one op (a Linear's weight and bias; a LayerNorm's kernel wants weight and
    bias in one dtype), so one that mixes replicated fp32 and gathered low-precision parameters gets them all in
    ``param_dtype``. A norm layer whose parameters are all replicated is left in fp32 (see ``FullyShardedModel``).
    A tied parameter is listed under every module that holds it."""
    ids = {id(p) for p in replicated.values()}
    slots: dict[nn.Module, CastSlots] = {}
    for owner in module.modules():
        own = [(name, p) for name, p in owner._parameters.items() if p is not None]
        picked = [(name, p) for name, p in own if id(p) in ids and p.dtype != param_dtype]
        if not picked or (isinstance(owner, _NORM_LAYERS) and all(id(p) in ids for _, p in own)):
            continue
        slots[owner] = picked
    return slots


def cast_during_forward(owner: nn.Module, slots: CastSlots, dtype: torch.dtype) -> None:
    """While ``owner`` runs forward (a recomputation's rerun too), its attributes in ``slots`` are ``dtype``
    copies of the masters; after it (even one that raised) the masters are back, under the same keys and order."""

    def cast(module: nn.Module, args: Any) -> None:
        for name, master in slots:
            module._parameters[name] = master.to(dtype)  # a plain tensor for the forward: autograd reaches master

    def restore(module: nn.Module, args: Any, output: Any) -> None:
        for name, master in slots:
            module._parameters[name] = master

    owner.register_forward_pre_hook(cast)
    owner.register_forward_hook(restore, always_call=True)


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it (through tuples, lists and dicts) cast to ``dtype``."""
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple takes its fields positionally
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value


def check_mp_policy(mp_policy: Any) -> None:
    """Refuse a policy without floating ``param_dtype`` and ``reduce_dtype`` at construction, not mid-forward."""
    if mp_policy is None:
        return
    dtypes = [getattr(mp_policy, name, None) for name in ("param_dtype", "reduce_dtype")]
    if not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes):
        raise ValueError(f"mp_policy must carry floating param_dtype and reduce_dtype (workbench.precision."
                         f"policy(name).sharded()), got {mp_policy!r}")
