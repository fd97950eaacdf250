"""Reference solution of lab 14 (``labs/14_online_softmax_merge.ipynb``): the online-softmax merge of two attention
blocks (Milakov & Gimelshein 2018), the step ring attention (Liu et al. 2023) and FlashAttention (Dao et al. 2022)
repeat for every block of keys. Kept beside the labs, outside the ``workbench`` package.

``workbench.parallel.context._forward_block`` does the same on unnormalised accumulators (a running max m, row sum
l and acc = Σ e^(s − m)·v); this version keeps (out, lse) normalised after every merge, which is what travels when
partial results are combined across ranks.
"""

from __future__ import annotations

import torch


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two sets of keys from each set's (out [..., T, d], lse [..., T])."""
    m = torch.maximum(lse, lse_b)
    m = m.masked_fill(m == float("-inf"), 0.0)  # rows that saw no key on either side: shift by 0, never NaN
    w, w_b = torch.exp(lse - m), torch.exp(lse_b - m)  # each <= 1: nothing overflows, the larger side is exactly 1
    total = w + w_b
    lse_new = m + torch.log(total)  # log(0) = -inf for rows still empty
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out_new = (w[..., None] * out + w_b[..., None] * out_b) / safe[..., None]
    return out_new, lse_new
