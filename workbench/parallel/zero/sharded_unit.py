"""One unit of ZeRO stage 3 (``FullyShardedModel``): its parameters as one flat, padded, sharded bucket.

The unit is ``flat.py``'s layout applied to one submodule (Rajbhandari et al. 2020 §5.3): its trainable
parameters laid end to end, padded to a multiple of N, and rank r keeps the slice r (``shard``). ``full`` is the
gathered flat tensor while the unit is in use. The runtime that gathers, frees and reduce-scatters it is
``fully_sharded.py``; its state dicts, ``state_dict.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from workbench.parallel.zero.flat import ceil_div
from workbench.parallel.zero.offload import offload_copy

if TYPE_CHECKING:  # only the type: a strategy file imports no training-layer module at run time
    from workbench.parallel.precision import MixedPrecision


class ShardedUnit:
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
        self.shard_numel = ceil_div(numel, world)
        self.split_sizes = [*self.numels, world * self.shard_numel - numel]
        self.dtype, self.device = params[0].dtype, params[0].device  # the shard's (the master's) dtype
        # What the gathered unit computes in and what its gradient is reduce-scattered in (None: as produced).
        self.compute_dtype = mp_policy.param_dtype if mp_policy is not None else self.dtype
        self.reduce_dtype = mp_policy.reduce_dtype if mp_policy is not None else None
        flat = torch.cat([p.detach().reshape(-1) for p in params]
                         + [params[0].new_zeros(self.split_sizes[-1])])
        shard = flat[rank * self.shard_numel:(rank + 1) * self.shard_numel].clone()
        self.offloaded = offload_device is not None
        self.shard = nn.Parameter(offload_copy(shard, torch.device(offload_device)) if self.offloaded else shard)
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
