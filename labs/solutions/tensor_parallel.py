"""Reference solution of lab 07 (``labs/07_tensor_parallel_linear.ipynb``): Megatron's f and g, and a
column-parallel + row-parallel linear pair cut from a full ``nn.Linear`` (Shoeybi et al. 2019, §3, Fig. 3).

    X [b, s, h] ──f──► X·A_rᵀ + a_r [b, s, 4h/tp] ──GeLU──► Y_r ──► Y_r·B_rᵀ [b, s, h] ──g──► Σ_r (…) + b_proj

The library's version, with tags, plans and sequence parallelism, is ``workbench.parallel.tensor``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from workbench import comm
from workbench.labs.tensor_parallel import TensorParallelLinear


class CopyToTensorParallel(torch.autograd.Function):
    """f: identity in forward (X is whole on every rank); all-reduce in backward (each rank's dL/dX flowed
    through its own output features only, a partial sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may share the buffer with a residual
        comm.all_reduce(grad, group=ctx.group, tag="tp")
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce in forward (sum the partial products); identity in backward (dL/dZ is already whole and
    the same on every rank, and d(Σ_r Z_r)/dZ_r = 1)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)  # never reduce an autograd input in place
        comm.all_reduce(out, group=group, tag="tp")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ColumnParallel(TensorParallelLinear):
    """This rank's block of the output features: weight rows [r·out/tp, (r+1)·out/tp) and the same bias block."""

    @staticmethod
    def shard(weight: torch.Tensor, bias: torch.Tensor | None, tp_size: int,
              tp_rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = weight.shape[0] // tp_size
        rows = slice(tp_rank * n, (tp_rank + 1) * n)
        return weight[rows], None if bias is None else bias[rows]  # [out/tp, in], [out/tp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(CopyToTensorParallel.apply(x, self.group), self.weight, self.bias)  # [..., out/tp]


class RowParallel(TensorParallelLinear):
    """This rank's block of the input features: weight columns [r·in/tp, (r+1)·in/tp); the bias stays whole and
    is added once, after the sum."""

    @staticmethod
    def shard(weight: torch.Tensor, bias: torch.Tensor | None, tp_size: int,
              tp_rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = weight.shape[1] // tp_size
        return weight[:, tp_rank * n:(tp_rank + 1) * n], bias  # [out, in/tp], [out]

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        out = ReduceFromTensorParallel.apply(F.linear(y, self.weight), self.group)  # [..., out], summed
        return out if self.bias is None else out + self.bias


__all__ = ["ColumnParallel", "CopyToTensorParallel", "ReduceFromTensorParallel", "RowParallel"]
