"""Reference solution of lab 12 (``labs/12_hierarchical_allreduce.ipynb``): a two-level all-reduce from three
collectives, each on the group whose link it should use (Thakur et al. 2005; NCCL and Horovod do the same on NVLink +
InfiniBand, Sergeev & Del Balso 2018). Kept beside the labs, outside the ``workbench`` package.

The package version (``workbench.parallel.collectives.hierarchical_all_reduce``) builds each phase from send/recv
rings; this one uses ``comm``'s collectives, which is all the design needs.
"""

from __future__ import annotations

from typing import Any

import torch

from workbench import comm


def hierarchical_all_reduce(tensor: torch.Tensor, intra_group: Any, inter_group: Any) -> torch.Tensor:
    """In-place SUM all-reduce over nodes x ranks-per-node: only a 1/ranks_per_node shard crosses nodes."""
    flat = tensor.view(-1)
    node_size = comm.group_size(intra_group)
    mine = torch.empty(flat.numel() // node_size, dtype=flat.dtype, device=flat.device)
    comm.reduce_scatter(mine, flat, group=intra_group)  # fast link: local rank i owns chunk i summed over the node
    comm.all_reduce(mine, group=inter_group)  # slow link: the chunk summed over every node, 1/node_size of the bytes
    comm.all_gather(flat, mine, group=intra_group)  # fast link: every rank gets every finished chunk, in place
    return tensor
