"""Context parallelism (ring attention): which tokens a rank holds, how much attention work and traffic it has.

The sequence of length S is split over the ``cp`` ranks of a group. Each rank keeps the queries of its tokens;
the key/value blocks travel around the ring, one hop per step, while the block in hand is computed (Liu, Zaharia
& Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context"). Per-block results are
merged with the online-softmax update (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"),
so no rank ever holds more than one block of scores.

Layouts (which tokens rank r holds, in the order it holds them):

* ``"contiguous"``: chunk r of cp. Under a causal mask rank r's queries see r+1 of the cp key blocks, so the last
  rank does ~(2cp−1)x the first rank's (query, key) pairs: the naive split, kept to show the imbalance.
* ``"zigzag"``: the sequence is cut into 2·cp chunks and rank r holds chunks r and 2cp−1−r (the load-balanced
  split of Llama 3's context parallelism, Dubey et al. 2024, "The Llama 3 Herd of Models" §3.3.2; Brandon et al.
  2023, "Striped Attention", balance the ring by dealing tokens round-robin instead). An early chunk and a late
  chunk pair up, so every rank has exactly the same causal work.

Held positions are increasing in both layouts; ``block_span`` relies on that.

Pure arithmetic (no torch): ``workbench.parallel.context`` runs ring attention and counts what it computes
and sends; the tests hold those counts to the functions here, to the byte.
"""

from __future__ import annotations

from workbench.theory.checks import positive_int, positive_number

LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")


def check_cp(seq_len: int, cp: int, layout: str) -> None:
    """``ValueError`` naming the values and what would be valid, unless ``seq_len`` splits over ``cp`` ranks by
    ``layout`` (zigzag: 2·cp chunks of equal length; contiguous: cp). One rank holds everything in either layout,
    so with cp=1 any length is fine."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown context-parallel layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")
    positive_int("cp", cp)
    positive_int("seq_len", seq_len)
    if cp == 1:
        return
    chunks = 2 * cp if layout == "zigzag" else cp
    if seq_len % chunks:
        valid = [c for c in range(1, seq_len + 1) if seq_len % (2 * c if layout == "zigzag" else c) == 0]
        how = f"2*cp={chunks} chunks" if layout == "zigzag" else f"cp={chunks} chunks"
        raise ValueError(f"context parallel: seq_len={seq_len} is not divisible into {how} of equal length "
                         f"(layout {layout!r}); cp values that split it: {valid}"
                         + (f"; or a seq_len that is a multiple of {chunks}" if seq_len > chunks else ""))


def held_ranges(seq_len: int, cp: int, rank: int, layout: str) -> list[tuple[int, int]]:
    """The half-open position ranges rank ``rank`` holds, in the order it holds them."""
    check_cp(seq_len, cp, layout)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cp:
        raise ValueError(f"rank must be an int in [0, cp={cp}), got {rank!r}")
    if cp == 1:
        return [(0, seq_len)]
    if layout == "contiguous":
        n = seq_len // cp
        return [(rank * n, (rank + 1) * n)]
    c = seq_len // (2 * cp)
    late = 2 * cp - 1 - rank
    return [(rank * c, (rank + 1) * c), (late * c, (late + 1) * c)]


def _length(ranges: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in ranges)


def _count_below(ranges: list[tuple[int, int]], x: int) -> int:
    """How many held positions are < x."""
    return sum(max(0, min(b, x) - a) for a, b in ranges)


def _position_at(ranges: list[tuple[int, int]], i: int) -> int:
    """The position held at index ``i``."""
    for a, b in ranges:
        if i < b - a:
            return a + i
        i -= b - a
    raise IndexError(i)


def _causal_pairs(qa: int, qb: int, ka: int, kb: int) -> int:
    """(query, key) pairs with key <= query, queries in [qa, qb), keys in [ka, kb)."""
    total = 0
    lo, hi = max(qa, ka), min(qb, kb)  # queries inside the key range see keys ka..q: 1, 2, ... of them
    if hi > lo:
        total += ((lo + 1 - ka) + (hi - ka)) * (hi - lo) // 2
    after = max(qa, kb)  # queries past the key range see all of it
    if qb > after:
        total += (qb - after) * (kb - ka)
    return total


def block_span(q_ranges: list[tuple[int, int]], k_ranges: list[tuple[int, int]],
               causal: bool = True) -> tuple[int, int, int, int, bool, int] | None:
    """What one ring step computes: the rectangle of a (query block, key block) pair that holds every visible
    pair, or None when the causal mask empties the block.

    Returns ``(row0, row1, col0, col1, masked, visible)``: rows ``row0:row1`` of the queries (held order) against
    columns ``col0:col1`` of the keys, ``masked`` if some pairs in the rectangle are hidden (the diagonal block),
    and the number of visible pairs. With positions increasing, the rows that see some key are a suffix and the
    keys some query sees are a prefix, so the rectangle is contiguous: in zigzag an off-diagonal block is exactly
    half a block (early queries x early keys are hidden, or late keys are), computed unmasked."""
    n_q, n_k = _length(q_ranges), _length(k_ranges)
    if not causal:
        return 0, n_q, 0, n_k, False, n_q * n_k
    row0 = _count_below(q_ranges, k_ranges[0][0])  # queries before the first key see nothing
    col1 = _count_below(k_ranges, q_ranges[-1][1])  # keys after the last query are seen by none
    if row0 >= n_q or col1 == 0:
        return None
    masked = _position_at(q_ranges, row0) < _position_at(k_ranges, col1 - 1)
    visible = sum(_causal_pairs(qa, qb, ka, kb) for qa, qb in q_ranges for ka, kb in k_ranges)
    return row0, n_q, 0, col1, masked, visible


def ring_sources(cp: int, rank: int) -> list[int]:
    """The rank whose key/value block rank ``rank`` holds at each ring step: its own first, then its previous
    neighbour's, and so on (blocks travel to the next rank)."""
    return [(rank - s) % cp for s in range(cp)]


def attention_work(seq_len: int, cp: int, layout: str, causal: bool = True) -> list[int]:
    """Per rank, the (query, key) pairs its queries attend to (per batch element and head): the causal work.

    Contiguous: rank r sees r·L² + L(L+1)/2 pairs (L = S/cp), so max/min → 2cp−1 as L grows. Zigzag: every rank
    sees (2cp−1)c² + c(c+1) pairs (c = S/2cp): max/min = 1 exactly. The ranks' sum is S(S+1)/2 (causal) or S²."""
    return [sum(span[5] for span in _spans(seq_len, cp, rank, layout, causal) if span is not None)
            for rank in range(cp)]


def computed_pairs(seq_len: int, cp: int, layout: str, causal: bool = True) -> list[int]:
    """Per rank, the (query, key) pairs ring attention multiplies (per batch element and head): the rectangles of
    ``block_span``, masked entries included, emptied blocks skipped.

    Zigzag: one full diagonal block plus cp−1 half blocks on every rank (balanced). Contiguous: rank r computes
    r+1 whole blocks, so the last rank works cp times as long as the first: with whole-block skipping, the
    cp x imbalance a real kernel sees."""
    return [sum((s[1] - s[0]) * (s[3] - s[2]) for s in _spans(seq_len, cp, rank, layout, causal) if s is not None)
            for rank in range(cp)]


def skipped_blocks(seq_len: int, cp: int, layout: str, causal: bool = True) -> list[int]:
    """Per rank, the ring steps whose block the causal mask empties (contiguous: rank r skips cp−1−r; zigzag: 0)."""
    return [sum(s is None for s in _spans(seq_len, cp, rank, layout, causal)) for rank in range(cp)]


def _spans(seq_len: int, cp: int, rank: int, layout: str, causal: bool) -> list:
    mine = held_ranges(seq_len, cp, rank, layout)
    return [block_span(mine, held_ranges(seq_len, cp, src, layout), causal) for src in ring_sources(cp, rank)]


def ring_kv_bytes(batch: int, heads: int, seq_len: int, head_dim: int, cp: int, bytes_per_value: int = 4,
                  grad_bytes_per_value: int = 4) -> dict[str, int]:
    """Bytes one rank sends per attention layer in ring attention (what ``workbench.parallel.context`` does).

    K and V travel together as one message of 2·B·H·(S/cp)·hd values (``kv_message``). Forward: cp−1 hops
    (each rank sees every other rank's block once; Liu et al. 2023 §3). Backward: the K/V ring again (cp−1 hops),
    and the dK/dV accumulators travel with their blocks, one fp32 message (``grad_message``, 2·B·H·(S/cp)·hd
    values of ``grad_bytes_per_value``) per step: cp−1 hops around the ring plus one home to the block's owner,
    cp in all. The same bytes arrive as are sent (a ring). With cp=1 nothing moves.
    """
    for name, value in dict(batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim, cp=cp,
                            bytes_per_value=bytes_per_value, grad_bytes_per_value=grad_bytes_per_value).items():
        positive_int(name, value)
    if seq_len % cp:
        raise ValueError(f"seq_len={seq_len} must be divisible by cp={cp}")
    values = 2 * batch * heads * (seq_len // cp) * head_dim
    kv, grad = values * bytes_per_value, values * grad_bytes_per_value
    hops = cp - 1
    grad_hops = cp if cp > 1 else 0
    forward = hops * kv
    backward = hops * kv + grad_hops * grad
    return {"kv_message": kv, "grad_message": grad, "forward_messages": hops, "backward_kv_messages": hops,
            "backward_grad_messages": grad_hops, "forward": forward, "backward": backward,
            "total": forward + backward}


def kv_transfer_vs_compute(batch: int, heads: int, seq_len: int, head_dim: int, cp: int, link_gbps: float,
                           flops: float, bytes_per_value: int = 2, causal: bool = True,
                           layout: str = "zigzag", latency_s: float = 0.0) -> dict[str, float | bool]:
    """One K/V hop against one ring step's attention compute (forward), and whether the ring hides the transfer.

    ``link_gbps`` is the link's bandwidth in GB/s (1e9 bytes/s), ``flops`` the attention kernel's sustained
    FLOP/s. A hop moves ``ring_kv_bytes``'s ``kv_message`` (α + S/B, ``latency_s`` = α). A step computes
    QKᵀ and PV over its rectangle: 4·B·H·rows·cols·hd FLOPs (a full block: rows = cols = S/cp; an off-diagonal
    zigzag block under a causal mask: half of that). The transfer hides behind compute when compute >= transfer;
    for a full block that is S/cp >= F·bytes/(2·BW) tokens per rank, independent of B, H and hd: the block-size
    condition of Liu et al. 2023 §3 (e.g. F = 400 TFLOP/s, bf16, 50 GB/s: 8,000 tokens per rank).
    ``min_tokens_per_rank`` is that threshold for this layout's off-diagonal step (the step that must hide a hop).
    """
    positive_number("link_gbps", link_gbps, "GB/s")
    positive_number("flops", flops, "FLOP/s")
    if latency_s < 0:
        raise ValueError(f"latency_s must be >= 0, got {latency_s!r}")
    check_cp(seq_len, cp, layout)
    kv = ring_kv_bytes(batch, heads, seq_len, head_dim, cp, bytes_per_value)["kv_message"]
    bandwidth = link_gbps * 1e9
    hop_s = latency_s + kv / bandwidth
    t_local = seq_len // cp
    share = 0.5 if causal and layout == "zigzag" and cp > 1 else 1.0  # an off-diagonal zigzag step: half a block
    # Contiguous + causal: an off-diagonal step is a full block or skipped; the full block must hide the hop.
    block_flops = 4 * batch * heads * t_local * t_local * head_dim * share
    block_s = block_flops / flops
    return {"hop_bytes": kv, "hop_s": hop_s, "block_flops": block_flops, "block_s": block_s,
            "compute_over_transfer": block_s / hop_s, "hidden": block_s >= hop_s,
            "min_tokens_per_rank": flops * bytes_per_value / (2 * share * bandwidth)}


def activation_memory_per_rank(batch: int, heads: int, seq_len: int, head_dim: int, cp: int, n_layer: int = 1,
                               bytes_per_value: int = 4) -> dict[str, int]:
    """Attention's memory on one rank for a long context, by what ring attention keeps (bytes).

    ``saved``: what each layer keeps for backward, Q, K, V and the output of its S/cp tokens (4·B·H·(S/cp)·hd
    values) and the fp32 log-sum-exp (B·H·S/cp), times ``n_layer``: divided by cp, since no rank ever holds
    another rank's K/V after the step that used it. ``forward_buffers``: the in-flight transients of one layer at
    a time, the K/V block in hand and the one arriving; ``ring_buffers`` (the backward's, the larger): those plus
    the fp32 dK/dV accumulator going out and the one arriving. ``score_block``: one step's fp32 scores and
    probabilities (2·B·H·(S/cp)² values), transient: divided by cp². ``full_scores``: what materialised
    attention (no blocks) would hold for one layer, 2·B·H·S² fp32 values, the quadratic term that blockwise
    attention (Liu et al. 2023; Dao et al. 2022, FlashAttention) removes. ``peak``: saved + ring_buffers +
    score_block.
    """
    for name, value in dict(batch=batch, heads=heads, seq_len=seq_len, head_dim=head_dim, cp=cp, n_layer=n_layer,
                            bytes_per_value=bytes_per_value).items():
        positive_int(name, value)
    if seq_len % cp:
        raise ValueError(f"seq_len={seq_len} must be divisible by cp={cp}")
    t = seq_len // cp
    bhtd = batch * heads * t * head_dim
    saved = n_layer * (4 * bhtd * bytes_per_value + batch * heads * t * 4)
    kv_block = 2 * bhtd * bytes_per_value
    forward_buffers = 2 * kv_block if cp > 1 else 0
    buffers = forward_buffers + 2 * (2 * bhtd * 4) if cp > 1 else 0
    score_block = 2 * batch * heads * t * t * 4
    return {"saved": saved, "forward_buffers": forward_buffers, "ring_buffers": buffers, "score_block": score_block,
            "full_scores": 2 * batch * heads * seq_len * seq_len * 4, "peak": saved + buffers + score_block}


__all__ = ["LAYOUTS", "activation_memory_per_rank", "attention_work", "block_span", "check_cp", "computed_pairs",
           "held_ranges", "kv_transfer_vs_compute", "ring_kv_bytes", "ring_sources", "skipped_blocks"]
