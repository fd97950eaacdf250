"""Tensor parallelism's pieces: the tp group, Megatron's f and g, the column/row/vocab-parallel layers.

Part of the tensor-parallel strategy (``workbench.parallel.tensor``; the package docstring has the overview).
Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", §3. For the MLP Z = GeLU(X A) B, split A by *columns* and B by *rows*:

    X [b, s, h] ──f──► X A_i [b, s, 4h/tp] ──GeLU──► Y_i ──► Y_i B_i [b, s, h] ──g──► Σ_i Y_i B_i = Z

GeLU acts on each column alone, so no communication is needed between the two matmuls; the partial
products are summed once, by g. Attention is split the same way: q, k, v column-parallel (whole heads, H/tp
per rank; softmax is per head, so again no communication inside), the output projection row-parallel.

f and g are conjugate (§3, Fig. 3): f is the identity in forward and an all-reduce in backward (each rank
computes dL/dX through its own columns only: a partial sum), g an all-reduce in forward and the identity in
backward. Per block and step that is 2 all-reduces in forward and 2 in backward, each of b·s·h elements
(``workbench.theory.comm.tp_block_collectives``); tagged ``"tp"`` in the comm log.

The vocab-parallel embedding (Megatron §3, "input embedding"): rank i owns vocabulary rows
[i·V/tp, (i+1)·V/tp), looks up only the tokens it owns and g sums the rows (tag ``"tp_vocab"``). The head is a
``ColumnParallelLinear`` over the vocabulary (``plan.py`` ties it to the embedding's shard); its loss is in
``loss.py``.

Each layer is cut from the full, seeded layer (``ColumnParallelLinear.from_linear``...), so tp=N starts
exactly where tp=1 does. ``tp_shard_dims`` on each layer says which parameters are shards and along which
dim; ``shards.py`` reads it to gather them. Sequence parallelism (``sequence.py``) subclasses these layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workbench.dist import comm
from workbench.dist.mesh import Mesh

TP_TAG = "tp"  # f and g inside the transformer blocks
VOCAB_TAG = "tp_vocab"  # g after the vocab-parallel embedding, f before the vocab-parallel head


# ---------------------------------------------------------------------------------------------------------
# The tp group: a process group plus this rank's place in it.


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group, its size and this rank's index in it."""

    group: Any
    size: int
    rank: int


def tp_group_of(mesh_or_group: Any) -> TPGroup:
    """A ``Mesh`` (its tp axis), a process group (``None`` = the world) or a ``TPGroup``, as a ``TPGroup``.

    A mesh built without torch.distributed (planning a layout) still knows its tp size and index, which is
    what the divisibility checks and the slicing need."""
    if isinstance(mesh_or_group, TPGroup):
        return mesh_or_group
    if isinstance(mesh_or_group, Mesh):
        return TPGroup(mesh_or_group.tp_group, mesh_or_group.tp_size, mesh_or_group.tp_rank)
    return TPGroup(mesh_or_group, comm.group_size(mesh_or_group), comm.group_rank(mesh_or_group))


def divisors(n: int) -> list[int]:
    """The sizes that divide ``n``: what an error message offers as valid tp values."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _owned_range(size: int, tp: TPGroup, what: str) -> slice:
    """This rank's contiguous 1/tp of ``size`` rows, or a ValueError naming the sizes that would work."""
    if size % tp.size:
        raise ValueError(f"tensor parallel: {what}={size} is not divisible by tp={tp.size}; "
                         f"valid tp values: {', '.join(map(str, divisors(size)))}")
    local = size // tp.size
    return slice(tp.rank * local, (tp.rank + 1) * local)


# ---------------------------------------------------------------------------------------------------------
# Megatron's f and g (§3, Fig. 3).


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's f: identity in forward, all-reduce of the gradient in backward.

    Sits where a replicated activation X [b, s, h] enters column-parallel layers. Each rank's dL/dX [b, s, h]
    only flows through its own columns, a partial sum; the all-reduce makes it the full gradient, so the
    LayerNorm and residual stream before it see exactly what one process would."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, tag: str) -> torch.Tensor:
        ctx.group, ctx.tag = group, tag
        return x.view_as(x)  # a new autograd node over the same data: nothing moves in forward

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # Reduce a copy: autograd may hand the same gradient buffer to other branches (e.g. the residual).
        grad = grad.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(grad, group=ctx.group, tag=ctx.tag)
        return grad, None, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's g: all-reduce in forward, identity in backward.

    Sums the partial outputs Y_i B_i [b, s, h] of a row-parallel layer (or the masked lookups of a
    vocab-parallel embedding). The sum's gradient with respect to each term is the incoming gradient
    itself, already the same on every rank, so backward moves nothing."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, tag: str) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)  # never all-reduce an autograd input in place
        comm.all_reduce(out, group=group, tag=tag)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def copy_to_tp_region(x: torch.Tensor, group: Any, tag: str = TP_TAG) -> torch.Tensor:
    """f(x): identity forward, all-reduce backward over ``group``."""
    return CopyToTensorParallelRegion.apply(x, group, tag)


def reduce_from_tp_region(x: torch.Tensor, group: Any, tag: str = TP_TAG) -> torch.Tensor:
    """g(x): all-reduce forward over ``group``, identity backward."""
    return ReduceFromTensorParallelRegion.apply(x, group, tag)


# ---------------------------------------------------------------------------------------------------------
# The split layers. ``tp_shard_dims`` says which parameters are shards and along which dim (the rest are
# replicated); ``full_parameters`` reads it to gather.


def _parameter(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=like.requires_grad)


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i^T + b_i: this rank's out/tp output features (rows of nn.Linear's [out, in] weight).

    Input X [..., in] replicated; output [..., out/tp], this rank's slice (left split for a row-parallel
    layer to consume, or for attention to read as H/tp whole heads). With ``copy_input`` the layer applies
    f itself; layers that share one input (q, k, v) leave it to their parent so backward all-reduces once."""

    tp_shard_dims = {"weight": 0, "bias": 0}

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tp: TPGroup, copy_input: bool = True,
                 tag: str = TP_TAG) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias  # [out/tp, in], [out/tp]
        self.tp, self.copy_input, self.tag = tp, copy_input, tag

    @classmethod
    def from_linear(cls, linear: nn.Linear, mesh_or_group: Any, copy_input: bool = True,
                    tag: str = TP_TAG) -> ColumnParallelLinear:
        """Cut this rank's rows out of a full (seeded) ``nn.Linear``, on the linear's device."""
        tp = tp_group_of(mesh_or_group)
        rows = _owned_range(linear.out_features, tp, "out_features")
        weight = _parameter(linear.weight.detach()[rows].clone(), linear.weight)
        bias = None if linear.bias is None else _parameter(linear.bias.detach()[rows].clone(), linear.bias)
        return cls(weight, bias, tp, copy_input, tag)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp_region(x, self.tp.group, self.tag)
        return F.linear(x, self.weight, self.bias)  # [..., out/tp]

    def extra_repr(self) -> str:
        out_local, in_features = self.weight.shape
        return (f"in={in_features}, out={out_local}x{self.tp.size} (this rank: {out_local}), "
                f"bias={self.bias is not None}, copy_input={self.copy_input}")


class RowParallelLinear(nn.Module):
    """Z = g(Σ_i Y_i B_i^T) + b: this rank's in/tp input features (columns of nn.Linear's weight).

    Input Y_i [..., in/tp], this rank's slice (a column-parallel layer's output); output [..., out]
    replicated. The bias is replicated and added once, after g, not tp times."""

    tp_shard_dims = {"weight": 1}

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tp: TPGroup, tag: str = TP_TAG) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias  # [out, in/tp], [out]
        self.tp, self.tag = tp, tag

    @classmethod
    def from_linear(cls, linear: nn.Linear, mesh_or_group: Any, tag: str = TP_TAG) -> RowParallelLinear:
        """Cut this rank's input columns out of a full (seeded) ``nn.Linear``; the bias is copied whole."""
        tp = tp_group_of(mesh_or_group)
        cols = _owned_range(linear.in_features, tp, "in_features")
        weight = _parameter(linear.weight.detach()[:, cols].clone(), linear.weight)
        bias = None if linear.bias is None else _parameter(linear.bias.detach().clone(), linear.bias)
        return cls(weight, bias, tp, tag)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.reduce(F.linear(x, self.weight))  # [..., out]
        return out if self.bias is None else out + self.bias

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """g: sum the ranks' partial products (sequence parallelism overrides this with a reduce-scatter)."""
        return reduce_from_tp_region(partial, self.tp.group, self.tag)

    def extra_repr(self) -> str:
        out_features, in_local = self.weight.shape
        return f"in={in_local}x{self.tp.size} (this rank: {in_local}), out={out_features}, bias={self.bias is not None}"


class VocabParallelEmbedding(nn.Module):
    """Rank i owns rows [i·V/tp, (i+1)·V/tp) of the [V, d] table; a token's row comes from its owner.

    Each rank looks up the tokens it owns and writes zeros for the rest; g sums over ranks, and since
    exactly one rank owns each token the sum is the full lookup [b, s, d]. In backward each rank's
    rows get gradient only from the tokens it owns (the masked positions contribute zeros)."""

    tp_shard_dims = {"weight": 0}

    def __init__(self, weight: nn.Parameter, vocab_start: int, tp: TPGroup, tag: str = VOCAB_TAG) -> None:
        super().__init__()
        self.weight = weight  # [V/tp, d]
        self.vocab_start, self.tp, self.tag = vocab_start, tp, tag

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, mesh_or_group: Any,
                       tag: str = VOCAB_TAG) -> VocabParallelEmbedding:
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("VocabParallelEmbedding: padding_idx and max_norm are not supported")
        tp = tp_group_of(mesh_or_group)
        rows = _owned_range(embedding.num_embeddings, tp, "vocab_size")
        weight = _parameter(embedding.weight.detach()[rows].clone(), embedding.weight)
        return cls(weight, rows.start, tp, tag)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start  # [b, s]; in [0, V/tp) exactly where this rank owns the token
        owned = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.masked_fill(~owned, 0), self.weight)  # [b, s, d], row 0 as a placeholder
        return self.reduce(rows.masked_fill(~owned.unsqueeze(-1), 0.0))

    def reduce(self, rows: torch.Tensor) -> torch.Tensor:
        """g: sum the ranks' masked lookups (sequence parallelism overrides this with a reduce-scatter)."""
        return reduce_from_tp_region(rows, self.tp.group, self.tag)

    def extra_repr(self) -> str:
        rows, dim = self.weight.shape
        return f"vocab={rows}x{self.tp.size} (this rank: [{self.vocab_start}, {self.vocab_start + rows})), dim={dim}"


__all__ = [
    "TP_TAG", "VOCAB_TAG", "ColumnParallelLinear", "CopyToTensorParallelRegion", "ReduceFromTensorParallelRegion",
    "RowParallelLinear", "TPGroup", "VocabParallelEmbedding", "copy_to_tp_region", "divisors", "reduce_from_tp_region",
    "tp_group_of",
]
