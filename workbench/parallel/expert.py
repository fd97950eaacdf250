"""Expert parallelism: a MoE model's experts split over the ranks of a group, tokens carried to them by all-to-all.

Each of the ``ep`` ranks of an ep group keeps a contiguous block of E/ep experts of every MoE layer
(``theory.expert.experts_of_rank``) and drops the rest; everything else (attention, norms, embeddings, the router)
stays whole on every rank, as in data parallelism. EP borrows its ranks from DP (DeepSpeed-MoE, Rajbhandari et al.
2022; torchtitan): each rank feeds its own batch, so with ``world`` ranks and ``ep`` the dense parameters are
replicated ``world`` times and each expert shard ``world/ep`` times, once per ep group.

One MoE layer's step (GShard's dispatch and combine, Lepikhin et al. 2020 §2.2), on this rank's kept assignments,
the rows x [M, d] already sorted expert-major by ``models.moe``:

1. counts: this rank's kept count per expert [E] (int64) go out by an equal-split all-to-all, E/ep to each rank,
   so rank e learns how many rows each source sends to each of its experts [ep, E/ep] (tag ``EP_COUNTS_TAG``);
2. dispatch: the rows by a variable-split all-to-all, rows for ep rank r being the block of experts r holds
   (expert-major order makes each destination's rows contiguous; tag ``EP_DISPATCH_TAG``);
3. the received rows (source-major) permuted to local-expert-major order, each expert run on its block, and the
   outputs permuted back;
4. combine: the outputs return by the all-to-all with the splits swapped (tag ``EP_COMBINE_TAG``), in the order the
   rows left, where ``models.moe`` scales them by their gate weights and adds them per token.

Both all-to-alls are one ``autograd.Function`` whose backward is the all-to-all with the splits swapped (the
gradient of sending rows is receiving their gradients; tags ``..._grad``). The counts are not differentiable and
are sent once, in forward.

Gradients (``reduce_expert_parallel_grads``): each rank's loss is the mean over its tokens, and the step's loss the
mean over the ``world`` ranks. A dense parameter's gradient is averaged over all dp ranks, as DDP does. An expert's
gradient on its rank already sums the contributions of every rank of its ep group (their rows came to it), so it
is *summed* over the ranks holding the same shard (``theory.expert.expert_data_groups``: one per ep group) and
divided by ``world`` (DeepSpeed reduces expert gradients over its expert-data group the same way).

With a group of one, ``apply_expert_parallel`` keeps every expert and changes nothing: bit for bit the plain model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workbench.dist import comm
from workbench.models.moe import MoEMLP, is_expert_param, moe_layers, run_experts
from workbench.parallel.collectives import hierarchical_groups
from workbench.parallel.grad_norm import clip_by_shares_
from workbench.theory.expert import check_ep, expert_data_groups, expert_parallel_groups, experts_of_rank

EP_COUNTS_TAG = "ep_counts"
EP_DISPATCH_TAG = "ep_dispatch"
EP_COMBINE_TAG = "ep_combine"
GRAD_SUFFIX = "_grad"  # the backward all-to-all of a tag: "ep_dispatch_grad" travels the combine's way


class _AllToAll(torch.autograd.Function):
    """Rows [sum(input_splits), ...] out, [sum(output_splits), ...] in; backward: the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any,
                tag: str) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.tag = (output_splits, input_splits), group, tag
        return _all_to_all(x, output_splits, input_splits, group, tag)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group, ctx.tag + GRAD_SUFFIX), None, None, None, None


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any,
                tag: str) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    comm.all_to_all(out, x.contiguous(), group, tag=tag, output_split_sizes=output_splits,
                    input_split_sizes=input_splits)
    return out


def all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any = None,
                    tag: str = "") -> torch.Tensor:
    """A differentiable variable-split all-to-all of the rows of ``x``: ``input_splits[r]`` rows to group rank r,
    ``output_splits[r]`` from it; the gradient goes back by the all-to-all with the splits swapped."""
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group, tag)


def exchange_counts(counts: torch.Tensor, group: Any = None) -> torch.Tensor:
    """[ep, E/ep]: row s the rows ep rank s sends to each of this rank's experts, from every rank's ``counts`` [E]
    (an equal-split all-to-all: chunk r of ``counts`` is what rank r's experts get from here)."""
    incoming = torch.empty_like(counts)
    comm.all_to_all(incoming, counts.contiguous(), group, tag=EP_COUNTS_TAG)
    ep = comm.group_size(group)
    return incoming.view(ep, -1)


def run_local_experts(received: torch.Tensor, incoming: torch.Tensor, experts: nn.ModuleDict) -> torch.Tensor:
    """Received rows (source-major, then expert; ``incoming`` [ep, E/ep] the rows from each source for each local
    expert) through this rank's experts, returned in the same order (step 3 of the module docstring)."""
    ep, local = incoming.shape
    expert_of_row = torch.arange(local, device=received.device).repeat(ep).repeat_interleave(incoming.reshape(-1))
    order = torch.argsort(expert_of_row, stable=True)  # local-expert-major, source order within an expert
    out = run_experts(received.index_select(0, order), incoming.sum(0).tolist(), experts)
    return out.index_select(0, torch.argsort(order))


class ExpertParallelRunner:
    """``MoEMLP.run_experts`` over an ep group: counts, dispatch, local experts, combine (a plain callable: it owns
    no parameters)."""

    def __init__(self, group: Any, experts: int) -> None:
        self.group, self.experts, self.ep = group, experts, comm.group_size(group)
        check_ep(experts, self.ep)

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleDict) -> torch.Tensor:
        if counts.numel() != self.experts or len(experts) != self.experts // self.ep:
            raise ValueError(f"expert parallel: {counts.numel()} counts and {len(experts)} local experts for "
                             f"E={self.experts} over ep={self.ep}")
        incoming = exchange_counts(counts, self.group)  # [ep, E/ep]
        send = counts.view(self.ep, -1).sum(1).tolist()  # rows to each ep rank (its contiguous expert block)
        recv = incoming.sum(1).tolist()
        received = all_to_all_rows(rows, recv, send, self.group, EP_DISPATCH_TAG)
        out = run_local_experts(received, incoming, experts)
        return all_to_all_rows(out, send, recv, self.group, EP_COMBINE_TAG)

    def __repr__(self) -> str:
        return f"ExpertParallelRunner(ep={self.ep}, experts={self.experts})"


def apply_expert_parallel(model: nn.Module, group: Any = None) -> nn.Module:
    """Keep this rank's E/ep experts of every MoE layer of ``model`` (contiguous blocks, by its rank in ``group``)
    and route tokens to the others' by all-to-all; returns ``model``. Parameter names do not change (experts are
    keyed by their global index). Reduce gradients with ``reduce_expert_parallel_grads``."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"apply_expert_parallel: {type(model).__name__} has no MoE layer; build the GPT with "
                         f"moe_experts > 0")
    ep, rank = comm.group_size(group), comm.group_rank(group)
    for layer in layers:
        check_ep(layer.cfg.experts, ep)
        if ep == 1:
            continue  # every expert here already: the plain layer
        _keep_experts(layer, experts_of_rank(layer.cfg.experts, ep, rank))
        layer.run_experts = ExpertParallelRunner(group, layer.cfg.experts)
    return model


def _keep_experts(layer: MoEMLP, mine: range) -> None:
    if sorted(int(k) for k in layer.experts) != list(range(layer.cfg.experts)):
        raise ValueError("apply_expert_parallel: a layer's experts are already split; apply it once")
    for key in list(layer.experts):
        if int(key) not in mine:
            del layer.experts[key]


def expert_process_groups(ep: int, group: Any = None) -> tuple[Any, Any]:
    """(ep_group, expert_data_group) of this rank over ``group``'s ranks (default: the world): consecutive blocks of
    ``ep`` ranks exchange tokens; ranks with the same ep rank hold the same experts. Call on every rank."""
    world = comm.group_size(group)
    expert_parallel_groups(world, ep)  # ValueError unless ep divides the dp ranks
    return hierarchical_groups(ep, group)


def split_expert_params(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
    """(dense, expert) trainable parameters by name: the dense ones are replicated on every dp rank, each expert's
    on the ranks of one expert-data group."""
    dense, expert = {}, {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            (expert if is_expert_param(name) else dense)[name] = p
    return dense, expert


def _reduce(params: list[nn.Parameter], op: str, group: Any, divide: int, tag: str) -> None:
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]  # same tensors on every rank
    for p, g in zip(params, comm.all_reduce_coalesced(grads, op=op, group=group, tag=tag), strict=True):
        p.grad = g.div_(divide) if divide != 1 else g


def reduce_expert_parallel_grads(model: nn.Module, dp_group: Any = None, expert_data_group: Any = None,
                                 tag: str = "grad") -> None:
    """After backward on every dp rank: dense gradients averaged over ``dp_group`` (the world), expert gradients
    summed over ``expert_data_group`` and divided by the dp size (the module docstring says why). Then every rank
    holds the gradient of the mean loss over all ranks' tokens, each for the parameters it has."""
    dense, expert = split_expert_params(model)
    _reduce(list(dense.values()), "avg", dp_group, 1, tag)
    _reduce(list(expert.values()), "sum", expert_data_group, comm.group_size(dp_group), tag)


def clip_expert_parallel_grad_norm_(model: nn.Module, max_norm: float, ep_group: Any = None) -> torch.Tensor:
    """After ``reduce_expert_parallel_grads``: clip to the global norm of the whole model's gradient and return it
    (0-dim, before clipping). The ranks of an ep group hold the same dense gradients and, between them, every
    expert once: each adds its experts' squares and 1/ep of the dense ones, and one all-reduce over the ep group
    sums them into the one-process total (``grad_norm.clip_by_shares_``)."""
    dense, expert = split_expert_params(model)
    ep = comm.group_size(ep_group)
    named = [(n, p.grad) for n, p in {**dense, **expert}.items() if p.grad is not None]
    device = next(model.parameters()).device
    return clip_by_shares_(named, {n: 1.0 / ep for n in dense}, (ep_group,), max_norm, device)


def full_expert_parallel_parameters(model: nn.Module, ep_group: Any = None) -> dict[str, torch.Tensor]:
    """Every parameter of the unsplit model by name, on every rank of the ep group (a collective: call it on all of
    them): the dense ones as held, the experts gathered from the ranks that hold them (through the host, as
    objects: this runs once, for the final hash and ``--export``, not per step)."""
    dense, expert = split_expert_params(model)
    full = {n: p.detach() for n, p in dense.items()}
    mine = {n: p.detach().cpu() for n, p in expert.items()}
    device = next(model.parameters()).device
    for part in comm.all_gather_object(mine, group=ep_group) if comm.group_size(ep_group) > 1 else [mine]:
        full.update({n: t.to(device) for n, t in part.items()})
    return full  # by name: the hash sorts names and a state dict loads by name, so order does not matter


__all__ = ["EP_COMBINE_TAG", "EP_COUNTS_TAG", "EP_DISPATCH_TAG", "GRAD_SUFFIX", "ExpertParallelRunner",
           "all_to_all_rows", "apply_expert_parallel", "clip_expert_parallel_grad_norm_",
           "full_expert_parallel_parameters", "exchange_counts", "run_local_experts", "expert_data_groups",
           "expert_parallel_groups", "expert_process_groups", "reduce_expert_parallel_grads", "split_expert_params"]
