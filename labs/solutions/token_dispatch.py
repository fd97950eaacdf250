"""Reference solution of lab 15 (``labs/15_token_dispatch_and_combine.ipynb``): the two all-to-alls of expert
parallelism (GShard, Lepikhin et al. 2020 §2.2). Kept beside the labs, outside the ``workbench`` package.

``workbench.parallel.expert.ExpertParallelRunner`` does the same inside an ``autograd.Function``; here the pair is
plain, and the checker supplies the gradients' journey (dispatch's gradient is combine's data movement).
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.labs.token_dispatch import all_to_all, group_size


def dispatch(rows: torch.Tensor, counts: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert-major row to the rank holding its expert: (received source-major, incoming [ep, E/ep])."""
    ep = group_size(group)
    incoming = torch.empty_like(counts)
    all_to_all(incoming, counts, group=group)  # chunk r of counts (rank r's experts) to rank r: sizes before rows
    incoming = incoming.view(ep, -1)
    send, recv = counts.view(ep, -1).sum(1).tolist(), incoming.sum(1).tolist()
    received = rows.new_empty((sum(recv), *rows.shape[1:]))
    all_to_all(received, rows, output_split_sizes=recv, input_split_sizes=send, group=group)
    return received, incoming


def combine(out: torch.Tensor, incoming: torch.Tensor, counts: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The experts' outputs back to the ranks their rows came from, in the order the rows left."""
    ep = group_size(group)
    send, recv = incoming.sum(1).tolist(), counts.view(ep, -1).sum(1).tolist()  # dispatch's splits, swapped
    back = out.new_empty((sum(recv), *out.shape[1:]))
    all_to_all(back, out, output_split_sizes=recv, input_split_sizes=send, group=group)
    return back
