"""Clipping by the global gradient norm of a model that is split over ranks.

``torch.nn.utils.clip_grad_norm_`` needs every gradient in one process. When a model is split, each rank
adds *its share* of each parameter's squared norm — 1 for a shard or a stage's own layer, 1/tp for a
tensor replicated over tp ranks, 0 for a copy counted elsewhere (a pipeline's tied head) — and one all-reduce
of that scalar per group of the split sums the shares into the exact total. Shared by the tensor- and
pipeline-parallel strategies; not a strategy itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from workbench.dist import comm


@torch.no_grad()
def clip_by_shares_(named_grads: Sequence[tuple[str, torch.Tensor]], shares: dict[str, float],
                    groups: Iterable[Any], max_norm: float, device: torch.device) -> torch.Tensor:
    """Scale ``named_grads`` in place so the whole model's gradient norm is at most ``max_norm``; return that
    norm (before clipping) as a 0-dim float64 tensor on ``device``. ``shares[name]`` defaults to 1. Same formula
    as ``clip_grad_norm_``: coefficient min(1, max_norm / (norm + 1e-6)).

    Nothing is read back to the host (no ``float(norm)``, no ``if coef < 1``): the coefficient stays on the
    device and every gradient is multiplied by it, 1.0 included (x * 1.0 == x exactly), so the host can queue
    the optimizer's kernels while the GPU still runs the backward."""
    local = torch.zeros((), dtype=torch.float64, device=device)
    for name, grad in named_grads:
        local += shares.get(name, 1.0) * grad.double().pow(2).sum()
    for group in groups:
        comm.all_reduce(local, group=group, tag="clip")
    total = local.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # float64, as the Python float it replaces
    for _, grad in named_grads:
        grad.mul_(coef.to(grad.dtype))
    return total
