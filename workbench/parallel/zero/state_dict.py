"""ZeRO stage 3's state dicts and parameters under the unwrapped model's names (``FullyShardedModel``'s).

A checkpoint of a ``FullyShardedModel`` reads like a DDP wrapper's: the keys are exactly the wrapped model's
``state_dict()`` keys. ``state_dict()`` is sharded (each sharded parameter's value is this rank's piece of it, no
communication), ``full_state_dict()`` and ``full_parameters()`` all-gather whole tensors (every rank calls them),
and ``load_state_dict`` takes either. ZeRO stage 3 (Rajbhandari et al. 2020 §5.3) keeps only 1/N of each unit's
flat bucket per rank, so each name maps to a range of one unit's shard (``_piece``).

``ShardedStateDict`` is the part of ``FullyShardedModel`` (``fully_sharded.py``) that does this, as a mixin: it
reads the layout the runtime builds (the attributes annotated below) and changes none of it but the shards' values.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from workbench.dist import comm
from workbench.parallel.zero.sharded_unit import ShardedUnit


class ShardedStateDict:
    """Names, state dicts and full parameters of a ``FullyShardedModel`` (mixed in before ``nn.Module``)."""

    # Set by FullyShardedModel.__init__: the wrapped model, the group, this rank's place in it, the units, where
    # each sharded parameter (first name) lies, the frozen and replicated parameters kept whole, every alias's
    # first name, and the wrapped model's state_dict keys.
    module: nn.Module
    group: Any
    rank: int
    world: int
    _units: list[ShardedUnit]
    _where: dict[str, tuple[ShardedUnit, int]]
    _names: list[str]
    _kept: dict[str, nn.Parameter]
    _canonical: dict[str, str]
    _state_keys: list[str]

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
                result[name] = self._kept[name].detach().clone()
        return result

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The shards (``<unit>._flat_param``) and the replicated and frozen parameters under their own names,
        without a ``module.`` prefix (as the DDP wrappers)."""
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def shard_ranges(self) -> dict[str, tuple[int, int]]:
        """For each sharded parameter (every name, tied ones too): the range [lo, hi) of its flattened elements
        this rank holds, i.e. what its ``state_dict()`` value is (empty when lo == hi)."""
        out = {}
        for key, name in self._canonical.items():
            if name in self._where:
                unit, i = self._where[name]
                lo, hi, start = self._piece(unit, i)
                out[key] = (lo - start, hi - start)
        return out

    def _piece(self, unit: ShardedUnit, i: int) -> tuple[int, int, int]:
        """Where parameter ``i`` of ``unit`` meets this rank's shard: [lo, hi) in the shard, and ``start``, the
        parameter's first element relative to the shard (so its elements [lo - start, hi - start))."""
        start = sum(unit.numels[:i]) - self.rank * unit.shard_numel
        lo = min(max(start, 0), unit.shard_numel)
        return lo, max(lo, min(start + unit.numels[i], unit.shard_numel)), start

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """The sharded state dict under the wrapped model's keys (see the class docstring): no communication.
        Sharded parameters' values are views of this rank's shard (as ``nn.Module.state_dict`` gives views)."""
        if args:
            raise ValueError("FullyShardedModel.state_dict takes keyword arguments only (destination, prefix, "
                             f"keep_vars), got {len(args)} positional")
        inner = self.module.state_dict(keep_vars=keep_vars)
        out = OrderedDict() if destination is None else destination
        for key in self._state_keys:
            name = self._canonical.get(key)
            if name in self._where:
                unit, i = self._where[name]
                lo, hi, _ = self._piece(unit, i)
                out[prefix + key] = unit.shard.detach()[lo:hi]
            else:
                out[prefix + key] = inner[key]
        return out

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unwrapped model's full state dict, every parameter gathered whole (an all-gather per unit: every
        rank must call it); ``nn.Module.load_state_dict(strict=True)`` of the unwrapped model accepts it."""
        full = self.full_parameters()
        inner = self.module.state_dict()
        return OrderedDict((key, full[self._canonical[key]] if key in self._canonical else inner[key].detach().clone())
                           for key in self._state_keys)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:
        """Load ``state_dict()``'s sharded layout (bit-exact) or a full state dict of the unwrapped model: per key,
        a value of the parameter's full shape is cut to this rank's piece, a 1-D value of this rank's piece's
        length is that piece. A state dict of the older ``<unit>._flat_param`` layout loads as it is. No
        communication. ``strict``: missing or unexpected keys are a ValueError naming them."""
        if assign:
            raise ValueError("FullyShardedModel.load_state_dict copies into its shards; assign=True is not supported")
        if any(k.endswith("._flat_param") for k in state_dict):
            return super().load_state_dict(state_dict, strict=strict)  # the flat-shard layout of earlier versions
        expected = set(self._state_keys)
        missing = [k for k in self._state_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if strict and (missing or unexpected):
            raise ValueError(f"state dict does not match the wrapped model: missing keys {missing[:5]}, unexpected "
                             f"keys {unexpected[:5]}; expected the unwrapped model's keys, e.g. {self._state_keys[:3]}")
        rest = {}
        with torch.no_grad():
            for key, value in state_dict.items():
                name = self._canonical.get(key)
                if name in self._where:
                    self._load_piece(key, *self._where[name], value)
                elif key in expected:
                    rest[key] = value
        self.module.load_state_dict(rest, strict=False)  # buffers, replicated and frozen parameters
        return _IncompatibleKeys(missing, unexpected)

    def _load_piece(self, key: str, unit: ShardedUnit, i: int, value: torch.Tensor) -> None:
        lo, hi, start = self._piece(unit, i)
        if not torch.is_tensor(value):
            raise ValueError(f"state dict value for {key!r} is {type(value).__name__}, not a tensor")
        if tuple(value.shape) == tuple(unit.shapes[i]):
            value = value.reshape(-1)[lo - start:hi - start]
        elif value.dim() != 1 or value.numel() != hi - lo:
            raise ValueError(f"state dict value for {key!r} has shape {tuple(value.shape)}; expected the full "
                             f"parameter {tuple(unit.shapes[i])} or this rank's piece of it, 1-D of {hi - lo} "
                             f"elements (rank {self.rank} of {self.world})")
        unit.shard.detach()[lo:hi].copy_(value)
