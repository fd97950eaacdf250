"""Reference solution of lab 06 (``labs/06_selective_checkpoint_policy.ipynb``): a selective-checkpoint policy
that saves the matmuls' outputs and recomputes the pointwise rest, and the budgeted plan that recomputes the fewest
FLOPs. Kept beside the labs, outside the ``workbench`` package."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from workbench.labs.checkpoint_policy import Op

aten = torch.ops.aten
MATMULS = (aten.mm, aten.addmm, aten.bmm)


def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep what costs FLOPs to redo (matmuls, the attention kernel); recompute what costs only memory traffic."""
    keep = op.overloadpacket in MATMULS or "scaled_dot_product" in str(op)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def plan(ops: list[Op], budget: int) -> set[int]:
    """The ops to save within ``budget`` bytes that leave the fewest FLOPs to recompute: a 0/1 knapsack over the
    few ops with FLOPs (an op without FLOPs costs nothing to recompute), small enough to try every subset."""
    items = [op for op in ops if op.flops > 0]
    subsets = (s for n in range(len(items) + 1) for s in itertools.combinations(items, n))
    fits = [s for s in subsets if sum(op.new_bytes for op in s) <= budget]
    return {op.index for op in max(fits, key=lambda s: sum(op.flops for op in s))}
