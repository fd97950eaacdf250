"""Mixture of experts and expert parallelism: capacity, dropped tokens, all-to-all bytes, expert memory.

A mixture-of-experts layer (Shazeer et al. 2017; Lepikhin et al. 2020, "GShard"; Fedus et al. 2021, "Switch
Transformers") replaces a block's MLP by E expert MLPs and a router that sends each token to k of them. With
expert parallelism over ``ep`` ranks, rank e of an ep group holds experts [e·E/ep, (e+1)·E/ep) (contiguous
blocks) and tokens travel to their experts by all-to-all: *dispatch* (token rows to the experts' ranks) and
*combine* (expert outputs back), and in backward the same two with the splits swapped. EP borrows its ranks from
data parallelism (DeepSpeed-MoE, Rajbhandari et al. 2022; torchtitan): of ``world`` dp ranks, consecutive blocks
of ``ep`` form the ep groups, and the ranks with the same ep rank hold the same expert shard (the expert-data
groups, over which the experts' gradients are reduced).

Capacity (Switch §2.2): each expert takes at most ``ceil(C · tokens · k / E)`` of the tokens routed in one call;
the rest of its assignments are dropped (the token keeps its residual). ``C = None`` means no limit.

Pure arithmetic (no torch): ``workbench.models.moe`` applies ``expert_capacity``; ``workbench.parallel.expert``
logs its all-to-alls, and the tests hold their bytes to the functions here, exactly.
"""

from __future__ import annotations

import math
from fractions import Fraction

from workbench.theory.checks import positive_int

#: Bytes of one routing count (int64) in the counts exchange that precedes each dispatch.
COUNT_BYTES = 8


def check_moe(experts: int, top_k: int, capacity_factor: float | None = None) -> None:
    """``ValueError`` naming the value and what is valid, unless E experts, top-k routing and the capacity factor
    make sense: 1 <= top_k <= experts, and a capacity factor that is None (no token dropped) or a finite number > 0."""
    positive_int("moe experts", experts)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"moe top_k must be an int in [1, experts={experts}] (each token picks k distinct experts), "
                         f"got {top_k!r}")
    if capacity_factor is not None and (isinstance(capacity_factor, bool)
                                        or not isinstance(capacity_factor, (int, float))
                                        or not 0 < capacity_factor < math.inf):
        raise ValueError(f"moe capacity_factor must be a finite number > 0 (1.0: room for an even share of the "
                         f"tokens; 1.25 is Switch's default) or None (no token is ever dropped), got "
                         f"{capacity_factor!r}")


def check_ep(experts: int, ep: int, world: int | None = None) -> None:
    """``ValueError`` unless ``ep`` ranks can split the experts into equal contiguous blocks (ep divides E) and, when
    ``world`` (the data-parallel ranks EP borrows from) is given, ep divides world."""
    positive_int("moe experts", experts)
    positive_int("ep", ep)
    if experts % ep:
        valid = [n for n in range(1, experts + 1) if experts % n == 0 and (world is None or world % n == 0)]
        raise ValueError(f"expert parallel: ep={ep} does not divide experts={experts} (each ep rank holds E/ep "
                         f"whole experts); ep values that do: {valid}")
    if world is not None:
        positive_int("world", world)
        if world % ep:
            valid = [n for n in range(1, world + 1) if world % n == 0 and experts % n == 0]
            raise ValueError(f"expert parallel: ep={ep} does not divide the {world} data-parallel ranks it borrows "
                             f"from; ep values that divide both {world} and experts={experts}: {valid}")


def experts_of_rank(experts: int, ep: int, ep_rank: int) -> range:
    """The experts ep rank ``ep_rank`` holds: a contiguous block of E/ep."""
    check_ep(experts, ep)
    if isinstance(ep_rank, bool) or not isinstance(ep_rank, int) or not 0 <= ep_rank < ep:
        raise ValueError(f"ep_rank must be an int in [0, ep={ep}), got {ep_rank!r}")
    n = experts // ep
    return range(ep_rank * n, (ep_rank + 1) * n)


def expert_parallel_groups(world: int, ep: int) -> list[list[int]]:
    """The ep groups of ``world`` dp ranks: consecutive blocks of ``ep`` (4 ranks, ep 2: [0, 1], [2, 3]); the
    members of one group hold the E experts between them and exchange tokens by all-to-all."""
    positive_int("world", world)
    positive_int("ep", ep)
    if world % ep:
        raise ValueError(f"ep={ep} does not divide world={world}; ep values that do: "
                         f"{[n for n in range(1, world + 1) if world % n == 0]}")
    return [list(range(g * ep, (g + 1) * ep)) for g in range(world // ep)]


def expert_data_groups(world: int, ep: int) -> list[list[int]]:
    """The ranks holding the same expert shard (same ep rank): 4 ranks, ep 2: [0, 2], [1, 3]. An expert's
    gradient is reduced over its group, the dense parameters' over all ``world`` ranks."""
    groups = expert_parallel_groups(world, ep)
    return [[g[e] for g in groups] for e in range(ep)]


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """Assignments one expert accepts per call: ceil(C · tokens · k / E) (Switch §2.2, with k assignments per token
    as GShard's top-2); None without a capacity factor. Exact for the float C given (no rounding up of 40.000001)."""
    check_moe(experts, top_k, capacity_factor)
    if capacity_factor is None:
        return None
    return math.ceil(Fraction(capacity_factor) * tokens * top_k / experts)


def dropped_assignments(counts: list[int], capacity: int | None) -> int:
    """Assignments dropped when expert i was chosen ``counts[i]`` times and takes ``capacity`` of them."""
    if capacity is None:
        return 0
    return sum(max(0, c - capacity) for c in counts)


def expected_dropped_fraction(tokens: int, experts: int, top_k: int, capacity_factor: float | None) -> float:
    """The share of assignments dropped, in expectation, when routing is uniformly random: each token picks k
    distinct experts uniformly, so one expert's count is Binomial(tokens, k/E) and it drops E[max(0, X − capacity)]
    (Switch §2.2 sets C above 1 for exactly this: fluctuations, not imbalance, overflow an expert at C = 1).
    The binomial's upper tail summed in log space (exact to float rounding); 0.0 without a capacity."""
    capacity = expert_capacity(tokens, experts, top_k, capacity_factor)
    if capacity is None or capacity >= tokens:
        return 0.0
    p = top_k / experts
    if p >= 1:
        return (tokens - capacity) / tokens  # every token picks every expert
    log_p, log_q = math.log(p), math.log1p(-p)
    log_pmf = [math.lgamma(tokens + 1) - math.lgamma(x + 1) - math.lgamma(tokens - x + 1) + x * log_p
               + (tokens - x) * log_q for x in range(capacity + 1, tokens + 1)]  # log space: no overflow at any size
    overflow = math.fsum((x - capacity) * math.exp(lp) for x, lp in zip(range(capacity + 1, tokens + 1), log_pmf,
                                                                         strict=True))
    return experts * overflow / (tokens * top_k)


def kept_counts(counts: list[int], capacity: int | None) -> list[int]:
    """Assignments each expert keeps: min(count, capacity)."""
    return list(counts) if capacity is None else [min(c, capacity) for c in counts]


def rows_to_ranks(kept: list[int], ep: int) -> list[int]:
    """Token rows this rank sends to each ep rank, from its kept assignments per expert (contiguous blocks)."""
    check_ep(len(kept), ep)
    n = len(kept) // ep
    return [sum(kept[r * n:(r + 1) * n]) for r in range(ep)]


def all_to_all_bytes(tokens: int, d_model: int, top_k: int, experts: int, ep: int,
                     bytes_per_value: int = 4) -> dict[str, float]:
    """Bytes one rank sends per MoE layer per step when routing is even (each of its tokens · k assignments lands on
    a uniformly random expert, none dropped): of the tokens · k rows, (ep−1)/ep go to other ranks.

    dispatch and combine each move that in forward; backward moves the same again (the gradient of dispatch
    travels the combine's way and vice versa). ``counts``: the exchange of E int64 counts before each dispatch."""
    check_ep(experts, ep)
    row = d_model * bytes_per_value
    one = tokens * top_k * row * (ep - 1) / ep
    counts = experts * COUNT_BYTES * (ep - 1) / ep
    return {"dispatch": one, "combine": one, "dispatch_backward": one, "combine_backward": one,
            "counts": counts, "total": 4 * one + counts}


def all_to_all_vs_compute(tokens: int, d_model: int, hidden: int, experts: int, top_k: int, ep: int,
                          bandwidth: float, flops: float, alpha: float = 0.0, matrices: int = 3,
                          bytes_per_value: int = 2) -> dict[str, float]:
    """One MoE layer's forward on one rank under even routing: its dispatch and combine on a link of ``bandwidth``
    bytes/s and ``alpha`` s per message (``all_to_all_bytes`` each way), beside its experts' compute, tokens·k rows
    through ``matrices`` d×h matmuls (3 for SwiGLU experts, 2 for a GELU MLP) at 2 FLOP per multiply-add and
    ``flops`` sustained. The experts cannot start before their rows arrive, so the transfer adds to the step unless
    other work hides it (DeepSeek-AI 2024 §3.2 overlaps it with another micro-batch's compute). Per row, compute is
    2·matrices·d·h FLOP and transfer (ep−1)/ep·d·bytes each way: their ratio does not depend on d or the tokens."""
    moved = all_to_all_bytes(tokens, d_model, top_k, experts, ep, bytes_per_value)
    transfer = 2 * (alpha + moved["dispatch"] / bandwidth) if ep > 1 else 0.0
    compute = tokens * top_k * 2 * matrices * d_model * hidden / flops
    return {"dispatch_bytes": moved["dispatch"], "transfer_s": transfer, "compute_s": compute,
            "compute_over_transfer": compute / transfer if transfer else math.inf}


def measured_all_to_all_bytes(rows_to: list[int], rows_from: list[int], my_rank: int, d_model: int,
                              experts: int, bytes_per_value: int = 4) -> dict[str, int]:
    """Bytes this rank sends per MoE layer per step for measured loads: ``rows_to[r]`` rows it dispatches to ep
    rank r (``rows_to_ranks``), ``rows_from[r]`` it receives from r. Dispatch sends rows_to but its own share;
    combine returns rows_from but its own; backward swaps them. ``counts``: E int64 counts, (ep−1)/ep sent."""
    ep = len(rows_to)
    if len(rows_from) != ep or not 0 <= my_rank < ep:
        raise ValueError(f"rows_to and rows_from need one entry per ep rank and my_rank in [0, {ep}), got "
                         f"{rows_to}, {rows_from}, {my_rank}")
    row = d_model * bytes_per_value
    out = (sum(rows_to) - rows_to[my_rank]) * row
    back = (sum(rows_from) - rows_from[my_rank]) * row
    counts = experts * COUNT_BYTES * (ep - 1) // ep if ep > 1 else 0
    return {"dispatch": out, "combine": back, "dispatch_backward": back, "combine_backward": out,
            "counts": counts, "total": 2 * (out + back) + counts}


def expert_param_count(d_model: int, hidden: int) -> int:
    """Parameters of one expert (the GPT's MLP: fc d→h with bias, proj h→d with bias)."""
    return d_model * hidden + hidden + hidden * d_model + d_model


def preset_expert_params(shape: dict) -> int:
    """Parameters of one expert of a model shape (``theory.models.MODEL_PRESETS``): Llama-shaped experts are
    SwiGLU without biases (gate and up d→h, down h→d: 3·d·h, h = ``ffn_hidden``), GPT-shaped ones the GPT's MLP
    (``expert_param_count``, h = 4·d unless ``ffn_hidden`` says otherwise)."""
    d = shape["d_model"]
    hidden = shape.get("ffn_hidden", 4 * d)
    return 3 * d * hidden if shape.get("arch") == "llama" else expert_param_count(d, hidden)


def expert_memory_per_rank(n_layer: int, d_model: int, hidden: int, experts: int, ep: int,
                           bytes_per_param: int = 4) -> dict[str, int]:
    """Parameter bytes per rank of the MoE MLPs: each rank holds E/ep experts per layer; the router (d·E, no bias)
    is replicated like the dense parameters. Gradients and optimizer state scale the same way."""
    check_ep(experts, ep)
    positive_int("n_layer", n_layer)
    experts_bytes = n_layer * (experts // ep) * expert_param_count(d_model, hidden) * bytes_per_param
    router = n_layer * d_model * experts * bytes_per_param
    return {"experts": experts_bytes, "router": router, "total": experts_bytes + router,
            "experts_unsplit": experts_bytes * ep}


def moe_layout(n_layer: int, d_model: int, params_per_expert: int, experts: int, top_k: int, ep: int, dp: int,
               tokens_per_rank: int, capacity_factor: float | None = None, bytes_per_value: int = 2,
               bytes_per_param: int = 2) -> dict[str, float]:
    """What ``workbench calc`` prints of a MoE layout: experts per rank and copies of each shard (EP borrows its
    ranks from the ``dp`` ones), the experts' parameter bytes per rank split and unsplit, each expert's capacity
    per layer call for ``tokens_per_rank`` tokens (None: unbounded), and the all-to-all bytes one rank sends per
    step over every MoE layer (forward and backward, even routing: ``all_to_all_bytes``)."""
    check_moe(experts, top_k, capacity_factor)
    check_ep(experts, ep, dp)
    a2a = all_to_all_bytes(tokens_per_rank, d_model, top_k, experts, ep, bytes_per_value) if tokens_per_rank else None
    split = n_layer * (experts // ep) * params_per_expert * bytes_per_param
    return {"experts_per_rank": experts // ep, "copies_of_each_shard": dp // ep, "expert_param_bytes": split,
            "expert_param_bytes_unsplit": split * ep,
            "capacity": expert_capacity(tokens_per_rank, experts, top_k, capacity_factor) if tokens_per_rank else None,
            "all_to_all_bytes_per_layer": a2a["total"] if a2a else 0.0,
            "all_to_all_bytes_per_step": n_layer * a2a["total"] if a2a else 0.0}


__all__ = ["COUNT_BYTES", "all_to_all_bytes", "all_to_all_vs_compute", "check_ep", "check_moe", "dropped_assignments",
           "expected_dropped_fraction", "expert_capacity", "expert_data_groups", "expert_memory_per_rank",
           "expert_param_count", "expert_parallel_groups", "experts_of_rank", "kept_counts", "preset_expert_params",
           "measured_all_to_all_bytes", "moe_layout", "rows_to_ranks"]
