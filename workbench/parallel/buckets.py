"""Size-capped gradient buckets: which parameters share one flat tensor and one collective.

Li et al. 2020 ("PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB, §3.2.3) group
gradients into buckets so that one collective moves many small tensors (paying the latency term alpha once per
bucket, not per tensor) while a bucket is still small enough that its collective can start before backward has
finished. DDP's buckets (``ddp.py``), ZeRO's flat buckets (``zero/``, Rajbhandari et al. 2020) and lab 03's
scaffold all cut parameters the same way, here.

A helper, not a strategy: it imports no strategy module, so any strategy may import it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import torch

T = TypeVar("T", bound=torch.Tensor)


def bucket_params(params: Iterable[T], cap_bytes: float) -> list[list[T]]:
    """Cut ``params``, in the order given, into consecutive runs of at most ``cap_bytes`` bytes each.

    The order is the caller's: it passes parameters in the order their gradients will be ready (reverse
    registration order for a model's backward), so the first bucket completes first and its collective overlaps
    the rest of backward. A run also ends where dtype or device changes, because each bucket becomes one flat
    tensor of one dtype on one device. A parameter larger than ``cap_bytes`` gets a bucket of its own (it cannot
    be split: its gradient arrives whole). Every parameter is in exactly one bucket; ``cap_bytes=float("inf")``
    gives one bucket per run of equal dtype and device.
    """
    buckets: list[list[T]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > cap_bytes or not _same_kind(buckets[-1][0], p):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` can sit in one flat tensor."""
    return a.dtype == b.dtype and a.device == b.device
