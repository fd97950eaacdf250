"""Activation recomputation ("activation checkpointing"), applied to a plain GPT from outside.

Backward needs tensors that forward computed; keeping them all is the activation memory. Recomputation
keeps fewer and recomputes the rest during backward (Chen et al. 2016, "Training Deep Nets with Sublinear
Memory Cost"; Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §5):

- ``"full"``: each transformer block's forward runs under ``torch.utils.checkpoint.checkpoint``. Forward
  keeps only the block's input [b, s, h]; backward re-runs the whole block (one extra block forward per
  block, about a third more compute), including its tensor-parallel all-reduces when TP is on.
- ``"selective"``: only the attention core is recomputed (paper §5: the part whose activations grow with
  s², cheap in FLOPs). Here that is exactly the ``F.scaled_dot_product_attention`` call of
  ``CausalSelfAttention``: from q, k, v (after the q/k/v projections and the head split) to the attention
  output (before the head merge and the output projection). Forward no longer keeps what the kernel saves
  for itself (its output and, on the CPU, the fp32 log-sum-exp per head and position); q, k, v are kept
  (the recomputation needs them) and the output is kept by the output projection anyway. PyTorch's fused
  kernel already recomputes the s² softmax in its own backward, so with it the saving here is only the
  log-sum-exp, 4·a·s·b bytes per layer: the as² terms the paper removes are already gone.
- ``"none"``: nothing changes.

Checkpointing uses ``use_reentrant=False`` and ``preserve_rng_state=True``: the recomputation replays the
forward's RNG state, so a dropout inside a region draws the same mask twice and gradients equal those of
no recomputation.

What the trace ledger sees. ``Tracer.activations`` counts tensors through saved-tensor hooks. Inside a
non-reentrant checkpoint region PyTorch installs its own hooks (the innermost hooks win), which keep
nothing, so the region's internals are invisible to the ledger, in forward and in the backward's
recomputation alike. The region's inputs are held by the checkpoint itself, not saved through a hook; so
that the ledger counts them, each region's inputs pass through ``_HeldInputs``, an identity that saves them
for backward: no extra memory (the same storage) and the ledger then measures what forward really keeps
until backward (the transient activations of the one region being recomputed are not counted, as in
``theory.memory.activation_bytes``).

Apply after tensor parallelism (it swaps the Linears inside, which the regions then call) and before
data parallelism, ZeRO and the pipeline cut (DESIGN.md, item 10).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from workbench.models.gpt import GPT, CausalSelfAttention

RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")


def check_mode(mode: object) -> str:
    """``mode`` if it is a valid recompute mode, else a ValueError naming the valid ones."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode {mode!r}; valid modes: {', '.join(map(repr, RECOMPUTE_MODES))}")
    return str(mode)


class _HeldInputs(torch.autograd.Function):
    """Identity that saves its inputs for backward, so the ledger's saved-tensor hooks see the tensors a
    checkpoint region keeps alive (the checkpoint holds them outside autograd's saved tensors)."""

    @staticmethod
    def forward(ctx: Any, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(*xs)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


def _checkpointed(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
        return fn(*xs)
    held = _HeldInputs.apply(*xs)
    return checkpoint(fn, *held, use_reentrant=False, preserve_rng_state=True)


def _attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The recomputed region of "selective": causal attention of [B, H_local, T, hd] heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _selective_attention_forward(attn: CausalSelfAttention) -> Callable[[torch.Tensor], torch.Tensor]:
    """``CausalSelfAttention.forward`` with the attention core checkpointed; the same ops in the same order."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (attn._split_heads(lin(x)) for lin in (attn.q, attn.k, attn.v))
        y = _checkpointed(_attention_core, q, k, v)  # [B, H_local, T, hd]
        b, h_local, t_len, hd = y.shape
        return attn.proj(y.transpose(1, 2).reshape(b, t_len, h_local * hd))

    return forward


def _full_block_forward(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    inner = block.forward  # the class's forward, bound: the region re-runs it, hooks stay outside

    def forward(x: torch.Tensor) -> torch.Tensor:
        return _checkpointed(inner, x)

    return forward


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Make ``model`` (a ``workbench.models.gpt.GPT``, plain or tensor-parallel) recompute ``mode``'s
    activations in backward: "none", "selective" (the attention core) or "full" (each block). In place;
    returns ``model``. Forward values and gradients are unchanged; see the module docstring for what is
    recomputed and what the ledger then measures."""
    check_mode(mode)
    if mode == "none":  # any model, untouched
        return model
    if not isinstance(model, GPT):
        raise ValueError(f"apply_recompute needs a workbench.models.gpt.GPT (before DP/ZeRO/pipeline wrapping), "
                         f"got {type(model).__name__}")
    if getattr(model, "_recompute_mode", "none") != "none":
        raise ValueError(f"recompute is already applied to this model ({model._recompute_mode!r}); "
                         "apply it once, to a fresh model")
    if mode == "full":
        for block in model.blocks:
            block.forward = _full_block_forward(block)
    else:
        for module in model.modules():
            if isinstance(module, CausalSelfAttention):
                module.forward = _selective_attention_forward(module)
    model._recompute_mode = mode
    return model


__all__ = ["RECOMPUTE_MODES", "apply_recompute", "check_mode"]
