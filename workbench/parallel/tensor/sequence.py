"""Sequence parallelism: tensor parallelism with the replicated regions sharded along the sequence.

Part of the tensor-parallel strategy (``workbench.parallel.tensor``): the same plan as TP, realised by
``SequenceParallelStyles``. Its old path ``workbench.parallel.sequence`` is an alias of this module.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.2.2, Fig. 5.
Tensor parallelism (``layers.py`` and ``plan.py`` beside this file) splits attention and the MLP, but
between them (LayerNorms, dropout, residual adds) every tp rank holds the whole activation [b, s, h] and does
the same work. Those ops act on each position alone, so they can run on a slice of the sequence instead: rank
i keeps positions [i·s/t, (i+1)·s/t), an activation [b, s/t, h]. The column region then needs the whole
sequence back, and the row region's partial sums need only this rank's positions, so TP's f/g pair becomes
the paper's g/ḡ pair:

    X_s [b, s/t, h] ─LN─► ─g─► [b, s, h] ─column─► … ─row─► partial [b, s, h] ─ḡ─► [b, s/t, h] ─+ X_s─►
                      (all-gather; backward       (reduce-scatter; backward
                       reduce-scatter)             all-gather)

Note the names: the SP paper's g (all-gather at a region's entry) replaces Megatron-LM's f, and its ḡ
(reduce-scatter at the exit) replaces Megatron-LM's g (the all-reduce). An all-reduce *is* a reduce-scatter
followed by an all-gather, so g and ḡ move the same bytes as the all-reduces they replace
(``workbench.theory.comm.sp_block_collectives``); what changes is that every activation outside the split
layers is stored at 1/t the size: per layer sbh(10 + 24/t + ...) becomes sbh·34/t (+ ...) in the paper's
2-byte units (``workbench.theory.memory.gpt_block_activation_bytes`` for this GPT, in fp32).

**The column layers store the shard, not the gathered input.** A column layer needs its whole input X
[b, s, h] for dL/dW = dYᵀX. Keeping the gathered X would leave the linear inputs at full size, and the
paper's 34/t counts them split; Megatron-LM therefore saves X_s [b, s/t, h] and all-gathers it again in
backward (``LinearWithSequenceGather``, after Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``).
That is one extra all-gather per region per step, the price of the memory; it is tagged like the others
and counted by theory. The layers of one region (q, k and v) share one gather in forward and one in
backward (``SequenceGatherRegion``).

**Ends of the model.** The vocab-parallel embedding reduce-scatters its masked lookups (ḡ: each rank gets
the summed rows of its positions); the position embedding ("sequence" style on an nn.Embedding) returns
only this rank's positions; the final LayerNorm runs on the shard; the vocab-parallel head gathers the
sequence back (g, as a column layer does) so that the vocab-parallel loss sees every token, unchanged.

**Partial gradients.** A parameter used on a slice of the sequence (the LayerNorms, the row layers' biases,
now added after ḡ, and the position embedding) gets on each rank the gradient of its own positions only.
``all_reduce_sequence_parallel_grads`` sums them over tp in one flat all-reduce (tag ``"sp_grads"``): an
explicit step after backward, which the composer runs in ``finish_grad_sync`` (Megatron-LM does the same
in ``finalize_model_grads``; a grad hook would all-reduce each parameter on every micro-batch). Parameters
so marked carry ``p.sequence_parallel = True`` (Megatron's attribute).

The sequence length must be divisible by tp: checked on the config before anything is split and on each
batch before any collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workbench.dist import comm
from workbench.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    divisors,
    tp_group_of,
)
from workbench.parallel.tensor.plan import TensorParallelStyles, apply_tensor_parallel, check_tensor_parallel_sizes

SP_TAG = "sp"  # g, ḡ and the backward re-gathers inside the transformer blocks
SP_VOCAB_TAG = "sp_vocab"  # ḡ after the vocab-parallel embedding, g (and its re-gather) before the head
SP_GRAD_TAG = "sp_grads"  # summing the sequence-parallel parameters' partial gradients over tp
SEQ_DIM = 1  # the GPT's activations are [b, s, h] (Megatron's are [s, b, h], sequence first)


def _local_length(length: int, world: int) -> int:
    """s/t positions per rank, or a ValueError naming the sizes (raised before any collective)."""
    if length % world:
        raise ValueError(f"sequence parallel: sequence length {length} is not divisible by tp={world} (each rank "
                         f"keeps length/tp positions); use a multiple of {world}, or tp in "
                         f"{', '.join(map(str, divisors(length)))}")
    return length // world


# ---------------------------------------------------------------------------------------------------------
# Collectives along the sequence. comm's all-gather and reduce-scatter work on dim 0, so the sequence dim
# is moved there and back (a copy each way; Megatron's [s, b, h] layout avoids it).


def all_gather_along_sequence(x: torch.Tensor, group: Any, tag: str, dim: int = SEQ_DIM) -> torch.Tensor:
    """[b, s/t, h] on each rank -> [b, s, h]: every rank's positions, in group-rank order."""
    chunk = x.movedim(dim, 0).contiguous()  # [s/t, b, h]
    out = chunk.new_empty((comm.group_size(group) * chunk.shape[0], *chunk.shape[1:]))  # [s, b, h]
    comm.all_gather(out, chunk, group=group, tag=tag)
    return out.movedim(0, dim).contiguous()  # [b, s, h]


def reduce_scatter_along_sequence(x: torch.Tensor, group: Any, tag: str, dim: int = SEQ_DIM) -> torch.Tensor:
    """[b, s, h] partial sums on each rank -> [b, s/t, h]: the sum over ranks of this rank's positions."""
    full = x.movedim(dim, 0).contiguous()  # [s, b, h]
    out = full.new_empty((_local_length(full.shape[0], comm.group_size(group)), *full.shape[1:]))  # [s/t, b, h]
    comm.reduce_scatter(out, full, group=group, tag=tag)
    return out.movedim(0, dim).contiguous()  # [b, s/t, h]


# ---------------------------------------------------------------------------------------------------------
# The paper's g and ḡ (§4.2.2, Fig. 5).


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """The SP paper's g: all-gather along the sequence in forward, reduce-scatter in backward.

    Forward X_s [b, s/t, h] -> X [b, s, h], the input of a column region. Backward: each rank's dL/dX
    [b, s, h] flowed through its own output columns only (a partial sum, as under TP's f); the
    reduce-scatter sums the partials over tp and keeps this rank's positions, dL/dX_s [b, s/t, h]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, tag: str) -> torch.Tensor:
        ctx.group, ctx.tag = group, tag
        return all_gather_along_sequence(x, group, tag)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return reduce_scatter_along_sequence(grad, ctx.group, ctx.tag), None, None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """The SP paper's ḡ: reduce-scatter along the sequence in forward, all-gather in backward.

    Forward: a row-parallel layer's partial products Y_i B_i [b, s, h] -> Z_s [b, s/t, h], the sum over
    ranks of this rank's positions. Backward: Z_s depends on every rank's partial product, so each partial
    gets the whole dL/dZ [b, s, h], all-gathered from the ranks' dL/dZ_s [b, s/t, h]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, tag: str) -> torch.Tensor:
        ctx.group, ctx.tag = group, tag
        return reduce_scatter_along_sequence(x, group, tag)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_along_sequence(grad, ctx.group, ctx.tag), None, None


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Any, tag: str = SP_TAG) -> torch.Tensor:
    """g(x): [b, s/t, h] -> [b, s, h] (all-gather); backward reduce-scatter, over ``group``."""
    return GatherFromSequenceParallelRegion.apply(x, group, tag)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Any, tag: str = SP_TAG) -> torch.Tensor:
    """ḡ(x): [b, s, h] partial -> [b, s/t, h] summed (reduce-scatter); backward all-gather, over ``group``."""
    return ReduceScatterToSequenceParallelRegion.apply(x, group, tag)


# ---------------------------------------------------------------------------------------------------------
# Column layers that store the shard (Megatron-LM's sequence-parallel linear).


class LinearWithSequenceGather(torch.autograd.Function):
    """Y = X Wᵀ + b on the gathered X [b, s, in], saving this rank's X_s [b, s/t, in] instead of X.

    Takes X (g's output, for the autograd edge and the matmul) and X_s (to save). Backward: dL/dX = dY W
    [b, s, in] is returned whole (autograd sums q, k and v, then g's backward reduce-scatters once);
    dL/dW = dYᵀ X [out/t, in] needs all of X, so the region all-gathers X_s again, once for its layers."""

    @staticmethod
    def forward(ctx: Any, total: torch.Tensor, shard: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, region: SequenceGatherRegion) -> torch.Tensor:
        ctx.save_for_backward(shard, weight)  # [b, s/t, in], the parameter (not an activation)
        ctx.region, ctx.has_bias = region, bias is not None
        ctx.shared = ctx.needs_input_grad[0]  # g's backward will run and end the region's shared re-gather
        return F.linear(total, weight, bias)  # [b, s, out/t]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shard, weight = ctx.saved_tensors
        total = ctx.region.regathered(shard, ctx.shared)  # [b, s, in]
        # Under autocast the forward's matmul ran in the compute dtype and so does this backward (autocast does not
        # reach a custom backward); autograd casts each returned gradient back to its input's dtype. No-op in fp32.
        total, weight = total.to(grad.dtype), weight.to(grad.dtype)
        grad_2d = grad.reshape(-1, grad.shape[-1])  # [b·s, out/t]
        grad_weight = grad_2d.t() @ total.reshape(-1, total.shape[-1])  # [out/t, in]
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        return grad @ weight, None, grad_weight, grad_bias, None  # dL/dX [b, s, in]: a partial sum over tp


class SequenceGatherRegion:
    """One g shared by the column layers that read one input (q, k, v; or fc; or, alone, the head).

    The region module's forward pre-hook ``open`` and forward hook ``close`` bracket its forward: the first
    layer gathers X_s, the others reuse that X, and X is dropped at ``close`` (no layer stored it). In
    backward the first layer re-gathers X_s; the copy is dropped once dL/dX is complete, i.e. when g's
    backward is about to run (a hook on X)."""

    def __init__(self, group: Any, tag: str = SP_TAG) -> None:
        self.group, self.tag = group, tag
        self._open = False
        self._forward: tuple[torch.Tensor, torch.Tensor] | None = None  # (X_s, X) during the region's forward
        self._backward: tuple[tuple, torch.Tensor] | None = None  # (X_s's address and shape, X) in backward

    def open(self, module: nn.Module, args: tuple) -> None:
        self._open = True

    def close(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._open, self._forward = False, None

    def gathered(self, shard: torch.Tensor) -> torch.Tensor:
        """g(X_s) = X [b, s, in], gathered once per region forward."""
        if self._forward is not None and self._forward[0] is shard:
            return self._forward[1]
        total = gather_from_sequence_parallel_region(shard, self.group, self.tag)
        if total.requires_grad:
            total.register_hook(self._drop_regathered)
        if self._open:
            self._forward = (shard, total)
        return total

    def regathered(self, shard: torch.Tensor, shared: bool = True) -> torch.Tensor:
        """X [b, s, in] again in backward, from the saved X_s; once for all the region's layers when
        ``shared`` (g's backward follows and drops the copy; without it nothing would, so no caching)."""
        if not shared:
            return all_gather_along_sequence(shard.detach(), self.group, self.tag)
        key = (shard.data_ptr(), tuple(shard.shape))
        if self._backward is None or self._backward[0] != key:
            self._backward = (key, all_gather_along_sequence(shard.detach(), self.group, self.tag))
        return self._backward[1]

    def _drop_regathered(self, grad: torch.Tensor) -> None:
        self._backward = None


class SequenceParallelColumnLinear(ColumnParallelLinear):
    """A column-parallel linear whose input is this rank's positions X_s [b, s/t, in]: g gathers X (shared
    with the region's other layers), the output is [b, s, out/t] as under TP, and only X_s is stored."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tp: TPGroup, region: SequenceGatherRegion,
                 tag: str = SP_TAG) -> None:
        super().__init__(weight, bias, tp, copy_input=False, tag=tag)
        self.region = region

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LinearWithSequenceGather.apply(self.region.gathered(x), x, self.weight, self.bias, self.region)


class SequenceParallelRowLinear(RowParallelLinear):
    """A row-parallel linear ending in ḡ: output [b, s/t, out], this rank's positions; the bias is added to
    them, so its gradient is partial (``sequence_parallel``)."""

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_to_sequence_parallel_region(partial, self.tp.group, self.tag)


class SequenceParallelVocabEmbedding(VocabParallelEmbedding):
    """The vocab-parallel embedding ending in ḡ: [b, s, d] masked lookups -> [b, s/t, d] summed rows."""

    def reduce(self, rows: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_to_sequence_parallel_region(rows, self.tp.group, self.tag)


# ---------------------------------------------------------------------------------------------------------
# The same plan, SP's styles.


def _mark_sequence_parallel(*params: nn.Parameter | None) -> None:
    for p in params:
        if p is not None:
            p.sequence_parallel = True  # Megatron-LM's attribute: partial gradient, summed over tp


def _own_positions(tp: TPGroup) -> Any:
    """A forward hook cutting a position embedding's [s, h] output to this rank's rows [s/t, h]."""

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        local = _local_length(out.shape[0], tp.size)
        return out.narrow(0, tp.rank * local, local)

    return hook


class SequenceParallelStyles(TensorParallelStyles):
    """``apply_plan``'s styles for TP + SP: "copy_input" is g's region, "column" stores the shard, "row" and
    "vocab_embedding" end in ḡ, "vocab_head" gathers alone, "sequence" runs on this rank's positions."""

    def copy_input(self, module: nn.Module) -> SequenceGatherRegion:
        region = SequenceGatherRegion(self.tp.group, SP_TAG)
        module.register_forward_pre_hook(region.open)
        module.register_forward_hook(region.close)
        return region

    def _column(self, linear: nn.Linear, region: SequenceGatherRegion, tag: str) -> nn.Module:
        cut = ColumnParallelLinear.from_linear(linear, self.tp, copy_input=False, tag=tag)
        return SequenceParallelColumnLinear(cut.weight, cut.bias, self.tp, region, tag)

    def column(self, linear: nn.Linear, region: Any) -> nn.Module:
        return self._column(linear, region or SequenceGatherRegion(self.tp.group, SP_TAG), SP_TAG)

    def vocab_head(self, linear: nn.Linear, region: Any) -> nn.Module:
        return self._column(linear, region or SequenceGatherRegion(self.tp.group, SP_VOCAB_TAG), SP_VOCAB_TAG)

    def row(self, linear: nn.Linear, region: Any) -> nn.Module:
        layer = SequenceParallelRowLinear.from_linear(linear, self.tp, tag=SP_TAG)
        _mark_sequence_parallel(layer.bias)
        return layer

    def vocab_embedding(self, embedding: nn.Embedding, region: Any) -> nn.Module:
        return SequenceParallelVocabEmbedding.from_embedding(embedding, self.tp, tag=SP_VOCAB_TAG)

    def sequence(self, module: nn.Module, region: Any) -> nn.Module:
        """LayerNorm: acts on each position alone, so it runs on the shard as it is. A position embedding
        (nn.Embedding of arange(s)) returns this rank's rows. Either way its gradient is partial."""
        _mark_sequence_parallel(*module.parameters())
        if isinstance(module, nn.Embedding):
            module.register_forward_hook(_own_positions(self.tp))
        return module


def check_sequence_parallel_sizes(cfg: Any, tp: int) -> None:
    """Raise ValueError unless ``tp`` divides the GPT's seq_len (then its heads, MLP and vocabulary, as TP).

    Pure arithmetic on the config: call it before spawning ranks as well."""
    if cfg.seq_len % tp:
        valid = ", ".join(map(str, divisors(cfg.seq_len)))
        raise ValueError(f"sequence parallel tp={tp} must divide the GPT's seq_len={cfg.seq_len} (each rank keeps "
                         f"seq_len/tp positions); valid tp values for this seq_len: {valid}")
    check_tensor_parallel_sizes(cfg, tp)


def apply_sequence_parallel(model: nn.Module, mesh_or_group: Any) -> nn.Module:
    """Make the tiny GPT tensor- and sequence-parallel over the tp axis of ``mesh_or_group``; return it.

    ``plan.gpt_plan`` realised by ``SequenceParallelStyles``, and the vocab-parallel loss as under TP. After
    each backward, call ``all_reduce_sequence_parallel_grads`` (the composer's ``finish_grad_sync`` does).
    Sizes that tp does not divide raise ValueError before anything is changed or communicated."""
    tp = tp_group_of(mesh_or_group)
    check_sequence_parallel_sizes(model.cfg, tp.size)
    return apply_tensor_parallel(model, tp, styles=SequenceParallelStyles)


def sequence_parallel_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter used on a slice of the sequence (partial gradients)."""
    return [(n, p) for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)]


@torch.no_grad()
def all_reduce_sequence_parallel_grads(model: nn.Module, mesh_or_group: Any) -> None:
    """Sum the partial gradients of the sequence-parallel parameters over tp, in one flat all-reduce.

    Each rank's gradient covers its own positions; the sum is what one process computes on the whole
    sequence. Commutes with data parallelism's averaging over dp, so it may run before or after it."""
    tp = tp_group_of(mesh_or_group)
    grads = [p.grad for _, p in sequence_parallel_parameters(model) if p.grad is not None]
    if not grads or tp.size == 1:
        return
    for g, summed in zip(grads, comm.all_reduce_coalesced(grads, group=tp.group, tag=SP_GRAD_TAG), strict=True):
        g.copy_(summed)


__all__ = [
    "SEQ_DIM", "SP_GRAD_TAG", "SP_TAG", "SP_VOCAB_TAG", "GatherFromSequenceParallelRegion",
    "LinearWithSequenceGather", "ReduceScatterToSequenceParallelRegion", "SequenceGatherRegion",
    "SequenceParallelColumnLinear", "SequenceParallelRowLinear", "SequenceParallelStyles",
    "SequenceParallelVocabEmbedding", "all_gather_along_sequence", "all_reduce_sequence_parallel_grads",
    "apply_sequence_parallel", "check_sequence_parallel_sizes", "gather_from_sequence_parallel_region",
    "reduce_scatter_along_sequence", "reduce_scatter_to_sequence_parallel_region", "sequence_parallel_parameters",
]
