"""Context parallelism: the sequence split over the ranks of a group, attention run as a ring.

Each of the ``cp`` ranks holds S/cp tokens (``chunk_positions``: ``"zigzag"`` balances the causal work, the naive
``"contiguous"`` split does not) and runs every layer on them alone; only attention needs other tokens. Ring
attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers") keeps this rank's queries and
passes the key/value blocks around the ring: at each of the cp steps the rank sends the block in hand to the next
rank and receives the next one from the previous rank (``comm.isend``/``comm.irecv``, issued *before* the block in
hand is computed, so the transfer overlaps the compute), and folds the block into its running result with the
online-softmax update (Milakov & Gimelshein 2018): a running row max m, row sum l and unnormalised output acc,

    m' = max(m, rowmax(s)),  l' = l·e^(m−m') + Σ e^(s−m'),  acc' = acc·e^(m−m') + e^(s−m')·V,

so no rank ever holds more than one block of scores, and out = acc/l, lse = m + log l at the end. fp32 blocks on
the CPU go through aten's fused flash-attention kernel, which returns each block's (out, lse), merged as
out ← out·e^(lse−lse') + out_b·e^(lse_b−lse'); other blocks (CUDA, 16-bit inputs) are computed explicitly in fp32
as above, whatever the inputs' dtype. The causal mask comes from the tokens' *global* positions, and a
block the mask empties is skipped (``theory.context.block_span``: in zigzag no block is empty, and an
off-diagonal block is exactly half a block, computed unmasked).

Backward is a custom ``autograd.Function``: the K/V ring runs again; dQ stays on this rank, and each block's
dK/dV accumulator travels with its block, collecting every rank's contribution, then takes one more hop home
(Liu et al. 2023 §3). Each rank's loss is the mean over its own tokens; all-reducing (averaging) the gradients
over the cp group then gives the gradient of the mean over the whole sequence, since dK/dV already carry every
rank's share.

Every message is logged by ``comm`` (tags ``CP_KV_TAG``, ``CP_GRAD_TAG``); ``theory.context.ring_kv_bytes`` is
its byte count. With a group of one, ``ring_attention`` is ``F.scaled_dot_product_attention`` itself.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workbench import trace
from workbench.dist import comm
from workbench.models.gpt import CausalSelfAttention
from workbench.theory.context import (
    LAYOUTS,
    attention_work,
    block_span,
    check_cp,
    computed_pairs,
    held_ranges,
    ring_sources,
    skipped_blocks,
)

CP_KV_TAG = "cp_kv"
CP_GRAD_TAG = "cp_grad_kv"
BLOCK_SPAN = "ring attention block"


# -- layouts ------------------------------------------------------------------------------------------------------

def chunk_positions(seq_len: int, cp: int, rank: int, layout: str, device: Any) -> torch.Tensor:
    """The global token positions rank ``rank`` holds, in the order it holds them (a LongTensor on ``device``)."""
    parts = [torch.arange(a, b, device=device) for a, b in held_ranges(seq_len, cp, rank, layout)]
    return torch.cat(parts)


def shard_sequence(t: torch.Tensor, cp: int, rank: int, layout: str, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a full-sequence tensor (dimension ``dim`` is the sequence)."""
    return t.index_select(dim, chunk_positions(t.shape[dim], cp, rank, layout, t.device))


def unshard_sequence(shards: list[torch.Tensor], layout: str, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (in rank order): the inverse of ``shard_sequence``."""
    cp = len(shards)
    seq_len = sum(s.shape[dim] for s in shards)
    device = shards[0].device
    order = torch.cat([chunk_positions(seq_len, cp, r, layout, device) for r in range(cp)])
    return torch.cat(shards, dim).index_select(dim, torch.argsort(order))


def shard_inputs(idx: torch.Tensor, targets: torch.Tensor | None, group: Any = None,
                 layout: str = "zigzag") -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """This rank's (idx, targets, positions) of a [B, S] batch, for ``model(idx, targets, positions=positions)``."""
    cp, rank = comm.group_size(group), comm.group_rank(group)
    positions = chunk_positions(idx.shape[1], cp, rank, layout, idx.device)
    mine = idx.index_select(1, positions)
    return mine, None if targets is None else targets.index_select(1, positions), positions


# -- counters (per process) -----------------------------------------------------------------------------------------

@dataclass
class RingStats:
    """What this process's ring attention computed since the last ``take_ring_stats`` (forward passes only,
    summed over calls; pairs are per batch element and head): compare with ``theory.context``."""

    blocks: int = 0  # ring steps whose block was computed
    skipped: int = 0  # ring steps whose block the causal mask emptied
    pairs_computed: int = 0  # (query, key) pairs multiplied: computed_pairs
    pairs_visible: int = 0  # of those, the ones the mask lets through: attention_work
    backward_blocks: int = 0


_STATS = RingStats()


def take_ring_stats() -> dict[str, int]:
    """The counters since the last call, and start counting afresh."""
    global _STATS
    stats, _STATS = asdict(_STATS), RingStats()
    return stats


# -- one block ------------------------------------------------------------------------------------------------------

def _block_scores(qs: torch.Tensor, k: torch.Tensor, span: tuple, q_pos: torch.Tensor,
                  k_pos: torch.Tensor) -> torch.Tensor:
    """fp32 scores of the span's rectangle (q pre-scaled), hidden pairs at -inf."""
    r0, r1, c0, c1, masked, _ = span
    s = qs[..., r0:r1, :] @ k[..., c0:c1, :].transpose(-1, -2)
    if masked:
        hidden = q_pos[r0:r1, None] < k_pos[None, c0:c1]
        s = s.masked_fill(hidden, -math.inf)
    return s


def _forward_block(qs, k, v, span, q_pos, k_pos, m, row_sum, acc) -> None:
    """Fold one block into (m, l = ``row_sum``, acc) in place: the online-softmax update."""
    r0, r1 = span[0], span[1]
    s = _block_scores(qs, k, span, q_pos, k_pos)
    m_old = m[..., r0:r1]
    m_new = torch.maximum(m_old, s.amax(-1))
    # A row with no visible key yet keeps m = -inf; shift it by 0 instead, so exp gives 0, never NaN.
    m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
    p = torch.exp(s - m_safe[..., None])
    alpha = torch.exp(m_old - m_safe)
    row_sum[..., r0:r1] = row_sum[..., r0:r1] * alpha + p.sum(-1)
    acc[..., r0:r1, :] = acc[..., r0:r1, :] * alpha[..., None] + p @ v[..., span[2]:span[3], :]
    m[..., r0:r1] = m_new


def _backward_block(qs, k, v, span, q_pos, k_pos, lse, do, delta, dq, scale):
    """dQ (into ``dq``) and this block's dK, dV (returned, rows col0:col1 of the block) for one block."""
    r0, r1, c0, c1 = span[:4]
    p = torch.exp(_block_scores(qs, k, span, q_pos, k_pos) - lse[..., r0:r1, None])  # hidden pairs: 0
    do_rows = do[..., r0:r1, :]
    dv = p.transpose(-1, -2) @ do_rows
    ds = p * (do_rows @ v[..., c0:c1, :].transpose(-1, -2) - delta[..., r0:r1, None])
    dq[..., r0:r1, :] += (ds @ k[..., c0:c1, :]) * scale
    dk = ds.transpose(-1, -2) @ qs[..., r0:r1, :]  # qs carries the scale already
    return dk, dv


# -- one block, by torch's fused CPU kernel ----------------------------------------------------------------------
# The same block through aten's flash-attention kernel for the CPU, which returns the block's log-sum-exp too: the
# explicit fp32 arithmetic above took 85-95 % of a ring step (benchmarks/bench_context.py), 2.7x the fused kernel's
# time on a 1024 x 1024 block. Its backward takes the *final* output and log-sum-exp (FlashAttention-2's backward,
# Dao 2023), which is exactly what a ring block's backward needs. Used for fp32 CPU tensors; anything else (CUDA,
# 16-bit inputs, a gradient flowing into the log-sum-exp) takes the explicit path, which computes the same.

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _fused(q: torch.Tensor) -> bool:
    return _FLASH_CPU is not None and q.device.type == "cpu" and q.dtype == torch.float32


def _block_mask(span: tuple, q_pos: torch.Tensor, k_pos: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The additive mask of a masked span (0 visible, -inf hidden) and which of its rows see no key at all."""
    r0, r1, c0, c1, masked, _ = span
    if not masked:
        return None, q_pos.new_zeros(r1 - r0, dtype=torch.bool)
    hidden = q_pos[r0:r1, None] < k_pos[None, c0:c1]
    mask = torch.zeros(hidden.shape, dtype=torch.float32, device=q_pos.device).masked_fill(hidden, -math.inf)
    return mask, hidden.all(-1)


def _rows(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return t[..., a:b, :].contiguous()


def _forward_block_fused(q, k, v, span, q_pos, k_pos, out, lse) -> None:
    """Fold one block into the running (out, lse) in place: out ← out·e^(lse−lse') + out_b·e^(lse_b−lse')."""
    r0, r1, c0, c1 = span[:4]
    mask, blind = _block_mask(span, q_pos, k_pos)
    out_b, lse_b = _FLASH_CPU(_rows(q, r0, r1), _rows(k, c0, c1), _rows(v, c0, c1), 0.0, False, attn_mask=mask)
    lse_b = lse_b.masked_fill(blind, -math.inf)  # the kernel reports 0 for a row with no visible key
    old = lse[..., r0:r1]
    new = torch.logaddexp(old, lse_b)
    safe = new.masked_fill(new == -math.inf, 0.0)  # no key seen yet in any block: weights 0, never NaN
    out[..., r0:r1, :] = (out[..., r0:r1, :] * torch.exp(old - safe)[..., None]
                          + out_b.nan_to_num() * torch.exp(lse_b - safe)[..., None])
    lse[..., r0:r1] = new


def _backward_block_fused(q, k, v, span, q_pos, k_pos, out, lse, do, dq):
    r0, r1, c0, c1 = span[:4]
    mask, _ = _block_mask(span, q_pos, k_pos)
    dq_b, dk, dv = _FLASH_CPU_BACKWARD(_rows(do, r0, r1), _rows(q, r0, r1), _rows(k, c0, c1), _rows(v, c0, c1),
                                       _rows(out, r0, r1), lse[..., r0:r1].contiguous(), 0.0, False,
                                       attn_mask=mask)
    dq[..., r0:r1, :] += dq_b
    return dk, dv


# -- the ring ------------------------------------------------------------------------------------------------------

class _Ring:
    """This rank's place in the ring: neighbours (global ranks), held ranges and positions, each step's span."""

    def __init__(self, group: Any, t_local: int, causal: bool, layout: str, device: Any) -> None:
        self.group, self.cp, self.rank = group, comm.group_size(group), comm.group_rank(group)
        seq_len = t_local * self.cp
        check_cp(seq_len, self.cp, layout)  # zigzag: T_local even (two equal chunks)
        self.next = comm.global_rank(group, (self.rank + 1) % self.cp)
        self.prev = comm.global_rank(group, (self.rank - 1) % self.cp)
        self.sources = ring_sources(self.cp, self.rank)
        mine = held_ranges(seq_len, self.cp, self.rank, layout)
        self.spans = [block_span(mine, held_ranges(seq_len, self.cp, src, layout), causal) for src in self.sources]
        self.positions = [chunk_positions(seq_len, self.cp, src, layout, device) for src in self.sources]

    def shift(self, block: torch.Tensor, tag: str) -> tuple[torch.Tensor, list[comm.Work]]:
        """Send ``block`` to the next rank and receive the previous rank's into a new buffer (both in flight)."""
        incoming = torch.empty_like(block)
        works = [comm.isend(block, self.next, self.group, tag=tag), comm.irecv(incoming, self.prev, self.group,
                                                                               tag=tag)]
        return incoming, works


def _wait(works: list[comm.Work]) -> None:
    for w in works:
        w.wait()


def _count(span: tuple) -> None:
    _STATS.blocks += 1
    _STATS.pairs_computed += (span[1] - span[0]) * (span[3] - span[2])
    _STATS.pairs_visible += span[5]


def _ring_forward_pass(k: torch.Tensor, v: torch.Tensor, ring: _Ring, fold: Any) -> None:
    """The forward ring: at each step send the block in hand on, fold it into this rank's result
    (``fold(kv, span, k_positions)``), then take the block that arrived meanwhile."""
    kv = torch.stack([k, v])  # one message per hop: K and V together
    for step, span in enumerate(ring.spans):
        works: list[comm.Work] = []
        if step < ring.cp - 1:  # the next block is on its way before this one is computed
            kv_next, works = ring.shift(kv, CP_KV_TAG)
        if span is None:
            _STATS.skipped += 1
        else:
            with trace.span(BLOCK_SPAN, "forward"):
                fold(kv, span, ring.positions[step])
            _count(span)
        _wait(works)
        if works:
            kv = kv_next


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: _Ring) -> tuple[torch.Tensor, ...]:
    q_pos = ring.positions[0]
    if _fused(q):  # each block by the fused CPU kernel, merged as (out, lse) pairs
        out, lse = torch.zeros_like(q), q.new_full(q.shape[:-1], -math.inf)
        _ring_forward_pass(k, v, ring, lambda kv, span, k_pos: _forward_block_fused(
            q, kv[0], kv[1], span, q_pos, k_pos, out, lse))
        return out, lse
    qs = q.float() * (1.0 / math.sqrt(q.shape[-1]))
    m = qs.new_full(q.shape[:-1], -math.inf)
    row_sum = qs.new_zeros(q.shape[:-1])  # l in the online-softmax update
    acc = qs.new_zeros(q.shape)
    _ring_forward_pass(k, v, ring, lambda kv, span, k_pos: _forward_block(
        qs, kv[0].float(), kv[1].float(), span, q_pos, k_pos, m, row_sum, acc))
    return (acc / row_sum[..., None]).to(q.dtype), m + torch.log(row_sum)


def _ring_backward(q, k, v, out, lse, dout, dlse, ring: _Ring) -> tuple[torch.Tensor, ...]:
    scale = 1.0 / math.sqrt(q.shape[-1])
    qs = q.float() * scale
    do = dout.float() if dout is not None else qs.new_zeros(q.shape)
    dq = torch.zeros_like(qs)
    if _fused(q) and dlse is None and dout is not None:
        block = lambda kv, span, k_pos: _backward_block_fused(  # noqa: E731
            q, kv[0], kv[1], span, ring.positions[0], k_pos, out, lse, do, dq)
    else:
        delta = (do * out.float()).sum(-1)  # D_i = Σ_d dO·O: the softmax's row term
        if dlse is not None:
            delta = delta - dlse.float()  # ∂lse/∂s = p, so a gradient on lse enters ds = p·(dp − D + dlse)
        block = lambda kv, span, k_pos: _backward_block(  # noqa: E731
            qs, kv[0].float(), kv[1].float(), span, ring.positions[0], k_pos, lse, do, delta, dq, scale)
    kv = torch.stack([k, v])
    acc, acc_works, kv_works = None, [], []
    for step, span in enumerate(ring.spans):
        kv_works = []
        if step < ring.cp - 1:
            kv_next, kv_works = ring.shift(kv, CP_KV_TAG)
        part = None
        if span is not None:
            with trace.span(BLOCK_SPAN, "backward"):
                part = block(kv, span, ring.positions[step])
            _STATS.backward_blocks += 1
        _wait(acc_works)  # this block's accumulator, from the ranks it visited before (step 0: none yet)
        if acc is None:
            acc = dq.new_zeros((2, *k.shape))
        if part is not None:
            c0, c1 = span[2], span[3]
            acc[0, ..., c0:c1, :] += part[0]
            acc[1, ..., c0:c1, :] += part[1]
        if ring.cp > 1:  # on to the next rank; after the last step that hop takes each accumulator home
            acc, acc_works = ring.shift(acc, CP_GRAD_TAG)
        _wait(kv_works)
        if kv_works:
            kv = kv_next
    _wait(acc_works)
    return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout):
        ring = _Ring(group, q.shape[-2], causal, layout, q.device)
        out, lse = _ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None, None, None
        dq, dk, dv = _ring_backward(q, k, v, out, lse, dout, dlse, ctx.ring)
        return dq, dk, dv, None, None, None


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown context-parallel layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"ring attention needs q, k, v of one shape [B, H, T_local, head_dim]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def ring_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None, *,
                            causal: bool = True, layout: str = "zigzag") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries over the whole sequence, and its log-sum-exp.

    ``q``, ``k``, ``v``: this rank's shards [B, H, T_local, hd], tokens in the order ``chunk_positions`` gives for
    ``layout``; ``group`` the cp ranks (None: the default group, or one process). Returns out (q's shape and
    dtype) and lse = log Σ_j exp(q·k_j/√hd) [B, H, T_local] in fp32, both differentiable."""
    _check_qkv(q, k, v, layout)
    return _RingAttention.apply(q, k, v, group, causal, layout)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None, *, causal: bool = True,
                   layout: str = "zigzag") -> torch.Tensor:
    """``ring_attention_with_lse``'s output. With a group of one: ``F.scaled_dot_product_attention`` itself, so a
    model with context parallelism applied over one rank computes bit for bit what the plain model does."""
    _check_qkv(q, k, v, layout)
    if comm.group_size(group) == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return _RingAttention.apply(q, k, v, group, causal, layout)[0]


# -- the GPT ------------------------------------------------------------------------------------------------------

class ContextParallelAttention:
    """A ``CausalSelfAttention.attend`` that runs ring attention over ``group`` (a plain callable, not a module:
    it owns no parameters and adds nothing to the state dict)."""

    def __init__(self, group: Any = None, layout: str = "zigzag", causal: bool = True) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown context-parallel layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")
        self.group, self.layout, self.causal = group, layout, causal

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, causal=self.causal, layout=self.layout)

    def __repr__(self) -> str:
        return f"ContextParallelAttention(cp={comm.group_size(self.group)}, layout={self.layout!r})"


def apply_context_parallel(model: nn.Module, group: Any = None, layout: str = "zigzag") -> nn.Module:
    """Make every ``CausalSelfAttention`` of ``model`` attend by ring attention over ``group``; returns ``model``.

    Feed each rank its tokens and their positions: ``idx, targets, positions = shard_inputs(x, y, group, layout)``
    then ``model(idx, targets, positions=positions)``; average the gradients over ``group``."""
    attend = ContextParallelAttention(group, layout)
    found = 0
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            module.attend = attend
            found += 1
    if not found:
        raise ValueError(f"apply_context_parallel: {type(model).__name__} has no CausalSelfAttention to make a ring")
    return model


__all__ = ["BLOCK_SPAN", "CP_GRAD_TAG", "CP_KV_TAG", "LAYOUTS", "ContextParallelAttention", "RingStats",
           "apply_context_parallel", "attention_work", "check_cp", "chunk_positions", "computed_pairs",
           "ring_attention", "ring_attention_with_lse", "shard_inputs", "shard_sequence", "skipped_blocks",
           "take_ring_stats", "unshard_sequence"]
