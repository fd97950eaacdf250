"""ZeRO-Offload: keep what a step only reads once on the host, and copy it to the compute device to use it.

Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training" (USENIX ATC'21).
``ZeroOptimizer(..., offload=True)`` keeps the optimizer state, and a master copy of each shard it steps,
on ``offload_device``: each step copies the gradient shard there, the inner optimizer steps the master on
the host, and the updated master is copied back into the device shard (``optimizer.py``).
``FullyShardedModel(..., offload_params=True)`` keeps the stage-3 parameter shards themselves, and their
gradients, on ``offload_device``; each all-gather first copies the shard to the compute device
(``fully_sharded.py``), and the optimizer steps those shards in place, with no master copy.
Offloaded bytes are not device bytes: the ledger leaves them out and ``offloaded_bytes()`` reports them.

Here: ``offload_copy`` (a copy on the offload device, pinned when it backs a GPU) and ``master_copies``.
"""

from __future__ import annotations

import torch


def offload_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``t`` on the offload device. Host memory that backs a GPU is pinned (page-locked), so the
    PCIe copies run by DMA at full speed instead of through a pageable bounce buffer (ZeRO-Offload, Ren et
    al. 2021, section 4). The copy is blocking: the CPU optimizer reads it right away."""
    pin = t.is_cuda and device.type == "cpu"
    out = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
    return out.copy_(t)


def master_copies(shards: list[torch.Tensor], device: torch.device) -> dict[int, torch.Tensor]:
    """An fp32 master copy of each stepped shard on ``device``, by ``id`` of the shard. Shards that already
    live there (``FullyShardedModel(offload_params=True)``) are stepped in place and get none."""
    return {id(t): offload_copy(t.detach(), device) for t in shards if not getattr(t, "_zero_offloaded", False)}
