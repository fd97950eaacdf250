"""The vocab-parallel cross-entropy (Megatron §3, "output embedding"): the loss from logit slices.

Part of the tensor-parallel strategy (``workbench.parallel.tensor``). The vocab-parallel head produces this
rank's logits [b, s, V/tp]; ``vocab_parallel_cross_entropy`` all-reduces three numbers per token (max, target
logit, sum of exponentials; tag ``"tp_loss"``) and never gathers the b·s·V logits. ``plan.py`` installs it as
the parallelized GPT's loss.
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.dist import comm
from workbench.parallel.tensor.layers import tp_group_of

LOSS_TAG = "tp_loss"  # the vocab-parallel cross-entropy's three per-token all-reduces


# ---------------------------------------------------------------------------------------------------------
# The vocab-parallel cross-entropy (Megatron §3; never the full logits).


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss log Σ_v exp(z_v) − z_target from logit slices [N, V/tp], with 3 all-reduces of [N].

    1. max over the vocabulary (all-reduce MAX), subtracted so that exp cannot overflow;
    2. the target's (shifted) logit: its owner contributes it, the others 0 (all-reduce SUM);
    3. Σ exp over the vocabulary (all-reduce SUM).
    The backward is local: dL/dz = softmax(z) − one_hot(target), on this rank's slice only."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: Any, vocab_start: int) -> torch.Tensor:
        logits_max = logits.max(dim=-1).values  # [N]
        comm.all_reduce(logits_max, op="max", group=group, tag=LOSS_TAG)
        shifted = logits - logits_max.unsqueeze(-1)  # [N, V/tp], <= 0 everywhere
        local_target = targets - vocab_start
        owned = (local_target >= 0) & (local_target < logits.shape[-1])  # [N]
        local_target = local_target.masked_fill(~owned, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        comm.all_reduce(target_logit, group=group, tag=LOSS_TAG)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)  # [N]
        comm.all_reduce(sum_exp, group=group, tag=LOSS_TAG)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, owned)  # this slice's softmax
        return sum_exp.log() - target_logit  # [N]

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, owned = ctx.saved_tensors
        one_hot = torch.zeros_like(softmax).scatter_(-1, local_target.unsqueeze(-1),
                                                     owned.unsqueeze(-1).to(softmax.dtype))
        return (softmax - one_hot) * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, group: Any,
                                 reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` over the full vocabulary, from this rank's logit slice [..., V/tp].

    ``group``: the tp process group (or a Mesh / TPGroup); group rank i holds vocab [i·V/tp, (i+1)·V/tp).
    ``targets`` [...] are global token ids. ``reduction``: "mean" over tokens (F.cross_entropy's default),
    "sum" (divide by a global token count yourself), or "none" (per token). Computed in fp32."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    tp = tp_group_of(group)
    vocab_start = tp.rank * local_logits.shape[-1]
    losses = VocabParallelCrossEntropy.apply(local_logits.flatten(0, -2).float(), targets.flatten(), tp.group,
                                             vocab_start)
    if reduction == "none":
        return losses.view(targets.shape)
    return losses.mean() if reduction == "mean" else losses.sum()


__all__ = ["LOSS_TAG", "VocabParallelCrossEntropy", "vocab_parallel_cross_entropy"]
