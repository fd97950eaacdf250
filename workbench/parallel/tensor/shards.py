"""A tensor-parallel model's shards back to full tensors, and its gradient norm.

Part of the tensor-parallel strategy (``workbench.parallel.tensor``). Parameters keep their names and hold
this rank's shard (``tp_shard_dims`` on each layer of ``layers.py`` says along which dim);
``full_parameters``/``full_gradients`` gather them (tag ``"tp_gather"``) into the unsplit tensors one process
would hold. ``norm_weights`` and ``clip_grad_norm_`` clip by the unsplit model's gradient norm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workbench.dist import comm
from workbench.parallel.grad_norm import clip_by_shares_
from workbench.parallel.tensor.layers import TPGroup, tp_group_of

GATHER_TAG = "tp_gather"  # gathering shards into full tensors (checks, checkpoints): not part of a step


# ---------------------------------------------------------------------------------------------------------
# Shards back to full tensors.


def _shard_dim(model: nn.Module, name: str) -> int | None:
    module_name, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(module_name), "tp_shard_dims", {}).get(leaf)


def _gather(shard: torch.Tensor, dim: int | None, tp: TPGroup) -> torch.Tensor:
    """The full tensor from every rank's ``shard`` along ``dim`` (None: replicated, a copy of this one)."""
    if dim is None or tp.size == 1:
        return shard.detach().clone()
    moved = shard.detach().movedim(dim, 0).contiguous()  # comm.all_gather concatenates along dim 0
    out = moved.new_empty((tp.size * moved.shape[0], *moved.shape[1:]))
    comm.all_gather(out, moved, group=tp.group, tag=GATHER_TAG)
    return out.movedim(0, dim).contiguous()


def full_parameters(model: nn.Module, mesh_or_group: Any) -> dict[str, torch.Tensor]:
    """{name: the unsplit parameter}, the same names and shapes as the model before ``apply_plan``."""
    return gather_full(model, dict(model.named_parameters()), mesh_or_group)


def gather_full(model: nn.Module, local: dict[str, torch.Tensor], mesh_or_group: Any) -> dict[str, torch.Tensor]:
    """{name: unsplit tensor} from this rank's tensors ``local`` of the split ``model``'s parameters, keyed by
    their names (e.g. what a data-parallel wrapper that re-homes the parameters gathered back by name)."""
    tp = tp_group_of(mesh_or_group)
    return {name: _gather(t, _shard_dim(model, name), tp) for name, t in local.items()}


def full_gradients(model: nn.Module, mesh_or_group: Any) -> dict[str, torch.Tensor | None]:
    """{name: the unsplit gradient} (None where this parameter has none: the same on every tp rank)."""
    tp = tp_group_of(mesh_or_group)
    return {name: None if p.grad is None else _gather(p.grad, _shard_dim(model, name), tp)
            for name, p in model.named_parameters()}


def norm_weights(model: nn.Module, mesh_or_group: Any) -> dict[str, float]:
    """{name: the share of its squared gradient norm this rank contributes}: 1 for a shard (the tp ranks'
    squares add up to the whole), 1/tp for a replicated parameter (every tp rank holds all of it)."""
    tp = tp_group_of(mesh_or_group)
    return {name: 1.0 if _shard_dim(model, name) is not None else 1.0 / tp.size
            for name, _ in model.named_parameters()}


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, mesh_or_group: Any) -> torch.Tensor:
    """Clip by the global gradient norm of the *unsplit* model, as one process would; return that norm (a 0-dim tensor).

    A sharded parameter's squared norm is spread over the tp ranks (sum them); a replicated one is whole on
    every rank (count it once). So each rank adds its shards' squares and 1/tp of the replicated ones, and one
    all-reduce of a scalar over tp gives the exact total. Same formula as ``torch.nn.utils.clip_grad_norm_``.
    """
    tp = tp_group_of(mesh_or_group)
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    device = named[0][1].device if named else torch.device("cpu")
    return clip_by_shares_(named, norm_weights(model, tp), (tp.group,), max_norm, device)


__all__ = ["GATHER_TAG", "clip_grad_norm_", "full_gradients", "full_parameters", "gather_full", "norm_weights"]
