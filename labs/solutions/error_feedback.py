"""Reference solution of lab 13 (``labs/13_error_feedback.ipynb``): error feedback for a gradient compressor
(Seide et al. 2014; Stich, Cordonnier & Jaggi 2018; Karimireddy et al. 2019). Kept beside the labs, outside the
``workbench`` package.

``workbench.parallel.compression`` does the same inside ``TopKCompressor`` and ``SignCompressor`` (``_ErrorFeedback``
keeps one flat residual per unit of gradients): add the residual to the gradient, compress, keep what the message
left out.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch


class ErrorFeedback:
    """Per-key residuals around ``compress(p) -> c`` (what the receivers rebuild from the message)."""

    def __init__(self, compress: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.compress = compress
        self.residuals: dict[Hashable, torch.Tensor] = {}

    def step(self, key: Hashable, grad: torch.Tensor) -> torch.Tensor:
        """What to send for this gradient of tensor ``key``; the key's residual becomes what it leaves out."""
        p = grad + self.residuals.get(key, torch.zeros_like(grad))  # everything still owed
        c = self.compress(p)
        self.residuals[key] = p - c  # what was compressed minus what was sent
        return c

    def residual(self, key: Hashable) -> torch.Tensor:
        return self.residuals[key]
