"""Reference solution of notebook 05's exercise (``notebooks/05_mixed_precision.ipynb``): fp8 e4m3 with one scale
per channel. Kept beside the labs, outside the ``workbench`` package."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn


def fp8_per_channel(x: torch.Tensor) -> torch.Tensor:
    """``x`` quantised to e4m3 and back with one scale per channel (column of the last dimension): 448 / that
    channel's largest magnitude over every other dimension; a channel of zeros keeps the scale 1."""
    top = torch.finfo(E4M3).max
    amax = x.detach().float().abs().amax(dim=tuple(range(x.dim() - 1)), keepdim=True)
    scale = torch.where(amax > 0, top / amax, torch.ones_like(amax))
    q = (x.detach().float() * scale).clamp(-top, top).to(E4M3)  # clamp: e4m3fn has no inf, out of range is NaN
    return (q.float() / scale).to(x.dtype)
