"""Reference solution of lab 02 (``labs/02_ring_allreduce.ipynb``): ring all-reduce from isend/irecv
(Patarasuk & Yuan 2009), the plain textbook version. Kept beside the labs, outside the ``workbench`` package.

Kept simple on purpose: whole chunks, one message per step, wait then add. The package version
(``workbench.parallel.collectives.ring_all_reduce``) pipelines segments so the link never idles during
an add; this one is what to understand first.
"""

from __future__ import annotations

from typing import Any

import torch

from workbench import comm


def ring_all_reduce(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """In-place SUM all-reduce of a contiguous ``tensor`` over ``group``, using only point-to-point messages."""
    rank, world = comm.group_rank(group), comm.group_size(group)
    if world == 1:
        return tensor
    right = comm.global_rank(group, (rank + 1) % world)  # send/recv take global ranks
    left = comm.global_rank(group, (rank - 1) % world)
    chunks = tensor.view(-1).tensor_split(world)  # views into tensor; sizes differ by at most 1 element

    # Reduce-scatter: at step s send chunk (rank - s), receive chunk (rank - s - 1) and add it. The chunk
    # received at step s is the one sent at step s + 1, so each chunk picks up one rank's values per step.
    for step in range(world - 1):
        send_chunk, recv_chunk = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        incoming = torch.empty_like(recv_chunk)
        # isend + irecv together: if every rank did a blocking send first, all would wait forever
        sent = comm.isend(send_chunk, right, group, tag="ring-rs")
        comm.irecv(incoming, left, group, tag="ring-rs").wait()
        sent.wait()
        recv_chunk.add_(incoming)

    # Now rank r holds the full sum of chunk (r + 1). All-gather: pass finished chunks around the ring,
    # receiving straight into place (copy, not add: they are already complete).
    for step in range(world - 1):
        send_chunk, recv_chunk = chunks[(rank + 1 - step) % world], chunks[(rank - step) % world]
        sent = comm.isend(send_chunk, right, group, tag="ring-ag")
        comm.irecv(recv_chunk, left, group, tag="ring-ag").wait()
        sent.wait()
    return tensor
