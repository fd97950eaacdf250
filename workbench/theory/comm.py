"""Cost of collectives in the α-β (Hockney 1994) model, and bytes moved per data-parallel step.

A message of S bytes costs α + S/B: α is the per-message latency (s), B the link bandwidth (bytes/s).
Collective algorithms follow Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective
Communication Operations in MPICH": a ring reduce-scatter or all-gather over N ranks takes N−1 steps,
each sending S/N bytes; a ring all-reduce is a reduce-scatter followed by an all-gather. Bus bandwidth
uses the nccl-tests definition (NVIDIA, nccl-tests doc/PERFORMANCE.md) so that measured numbers are
comparable to the link speed whatever the world size.

Sizes are bytes, times seconds, bandwidths bytes/second. S always means the full (unsharded) tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from workbench.theory.checks import positive_int

# Canonical op names, with the torch.distributed spellings the comm wrapper may log.
_OP_ALIASES: dict[str, str] = {
    "all_reduce": "all_reduce", "allreduce": "all_reduce",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all", "alltoall": "all_to_all",
    "broadcast": "broadcast", "reduce": "reduce", "send": "send", "recv": "recv", "barrier": "barrier",
}

# Bytes each rank sends, as a multiple of S (nccl-tests "bus bandwidth" factors).
_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,  # reduce-scatter + all-gather, each (N−1)/N·S
    "reduce_scatter": lambda n: (n - 1) / n,  # S = the full input; each rank ends with S/N
    "all_gather": lambda n: (n - 1) / n,  # S = the full output; each rank starts with S/N
    "all_to_all": lambda n: (n - 1) / n,  # S = one rank's buffer; it keeps its own 1/N
    # A pipelined (chunked ring) broadcast/reduce passes all of S through every link: factor 1.
    # A point-to-point message is S. These do not shrink or grow with N.
    "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "send": lambda n: 1.0, "recv": lambda n: 1.0,
    "barrier": lambda n: 0.0,  # a barrier carries no data
}

OPS: tuple[str, ...] = tuple(_BUS_FACTOR)


def _check_world(name: str, world: int) -> None:
    positive_int(name, world)


def _check_link(nbytes: float, alpha: float, bw: float) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if alpha < 0:
        raise ValueError(f"alpha (latency, s) must be >= 0, got {alpha!r}")
    if bw <= 0:
        raise ValueError(f"bandwidth (bytes/s) must be > 0, got {bw!r}")


def canonical_op(op: str) -> str:
    """Map a collective name (ours or torch.distributed's) to one of OPS; ValueError if unknown."""
    if op not in _OP_ALIASES:
        raise ValueError(f"unknown op {op!r}; valid choices: {', '.join(sorted(_OP_ALIASES))}")
    return _OP_ALIASES[op]


def p2p_time(nbytes: float, alpha: float, beta_bw: float) -> float:
    """One point-to-point message of S bytes: α + S/B, Hockney's model itself (no world size)."""
    _check_link(nbytes, alpha, beta_bw)
    return alpha + nbytes / beta_bw


def ring_allreduce_time(nbytes: float, world: int, alpha: float, beta_bw: float) -> float:
    """Ring all-reduce: 2(N−1)·α + 2(N−1)/N · S/B (Patarasuk & Yuan 2009).

    A reduce-scatter then an all-gather, as in Rabenseifner's algorithm (Thakur et al. 2005); the ring
    reaches the bandwidth lower bound but pays N−1 latencies per phase where recursive halving pays log N.

    The bandwidth term tends to 2·S/B as N grows: per-rank traffic does not grow with N, which is why
    ring all-reduce scales. At N = 1 there is nothing to send and the time is 0.
    """
    _check_world("world", world)
    _check_link(nbytes, alpha, beta_bw)
    return 2 * (world - 1) * alpha + 2 * (world - 1) / world * nbytes / beta_bw


def reduce_scatter_time(nbytes: float, world: int, alpha: float, beta_bw: float) -> float:
    """Ring reduce-scatter of an S-byte tensor: (N−1)·α + (N−1)/N · S/B (N−1 steps of S/N bytes)."""
    _check_world("world", world)
    _check_link(nbytes, alpha, beta_bw)
    return (world - 1) * alpha + (world - 1) / world * nbytes / beta_bw


def all_gather_time(nbytes: float, world: int, alpha: float, beta_bw: float) -> float:
    """Ring all-gather into an S-byte tensor: same cost as reduce-scatter, without the additions."""
    return reduce_scatter_time(nbytes, world, alpha, beta_bw)


def broadcast_time(nbytes: float, world: int, alpha: float, beta_bw: float) -> float:
    """Binomial-tree broadcast (or reduce) of S bytes: ⌈log2 N⌉·(α + S/B), whole message per round.

    Each round doubles the ranks that hold the message (Thakur et al. 2005, short-message broadcast). MPICH
    switches to scatter + all-gather for long messages (≈ 2·S/B); that refinement is not modelled here.
    """
    _check_world("world", world)
    _check_link(nbytes, alpha, beta_bw)
    return math.ceil(math.log2(world)) * (alpha + nbytes / beta_bw)


def all_to_all_time(nbytes: float, world: int, alpha: float, beta_bw: float) -> float:
    """Pairwise-exchange all-to-all of an S-byte buffer per rank: (N−1)·(α + S/(N·B)).

    N−1 rounds; in each, a rank sends one S/N chunk to one peer and receives one (Thakur et al. 2005).
    """
    _check_world("world", world)
    _check_link(nbytes, alpha, beta_bw)
    return (world - 1) * (alpha + nbytes / world / beta_bw)


def barrier_time(world: int, alpha: float) -> float:
    """Dissemination barrier: ⌈log2 N⌉ rounds of one empty message (Hensgen, Finkel & Manber 1988)."""
    _check_world("world", world)
    _check_link(0, alpha, 1.0)
    return math.ceil(math.log2(world)) * alpha


def tree_allreduce_time(nbytes: float, world: int, alpha: float, beta_bw: float) -> float:
    """Binary-tree reduce then broadcast, whole message per hop: 2·⌈log2 N⌉·(α + S/B).

    No pipelining: each hop waits for the full S bytes, so the latency term is logarithmic in N (better
    than ring for small S) but the bandwidth term is too (worse for large S). NCCL's trees split S into
    chunks and overlap the hops, approaching 2·S/B; that refinement is not modelled here.
    """
    _check_world("world", world)
    _check_link(nbytes, alpha, beta_bw)
    return 2 * math.ceil(math.log2(world)) * (alpha + nbytes / beta_bw)


def hierarchical_allreduce_time(
    nbytes: float,
    group_size: int,
    n_groups: int,
    alpha_intra: float,
    bw_intra: float,
    alpha_inter: float,
    bw_inter: float,
) -> float:
    """Two-level all-reduce for N = group_size × n_groups ranks (e.g. GPUs per node × nodes).

    1. ring reduce-scatter inside each group on the fast link: each rank ends with S/group_size summed
       over its group;
    2. ring all-reduce of that S/group_size shard across groups on the slow link (the group_size
       rank-aligned rings run in parallel, one per NIC);
    3. ring all-gather inside each group.
    Only S/group_size crosses the slow link per rank, which is the point of doing it this way.
    """
    _check_world("group_size", group_size)
    _check_world("n_groups", n_groups)
    intra = reduce_scatter_time(nbytes, group_size, alpha_intra, bw_intra)
    inter = ring_allreduce_time(nbytes / group_size, n_groups, alpha_inter, bw_inter)
    return intra + inter + all_gather_time(nbytes, group_size, alpha_intra, bw_intra)


def bus_bytes(op: str, nbytes: float, world: int) -> float:
    """Bytes each rank sends for `op` on S = `nbytes` under the ring algorithm.

    all_reduce 2(N−1)/N·S; reduce_scatter and all_gather (N−1)/N·S with S the full, unsharded tensor;
    all_to_all (N−1)/N·S with S one rank's buffer; broadcast, reduce, send, recv: S (every link of a
    pipelined broadcast carries the whole message once, whatever N).
    """
    _check_world("world", world)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    return _BUS_FACTOR[canonical_op(op)](world) * nbytes


def bus_bandwidth(op: str, nbytes: float, world: int, seconds: float) -> float:
    """nccl-tests bus bandwidth: bus_bytes / time, comparable to the link's peak for any N."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    return bus_bytes(op, nbytes, world) / seconds


def algorithm_bandwidth(nbytes: float, seconds: float) -> float:
    """nccl-tests algorithm bandwidth: S / time (what the user sees, but it depends on N)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    return nbytes / seconds


def dp_step_collectives(n_params: int, bytes_per_param: float, zero_stage: int) -> list[tuple[str, float]]:
    """The collectives of one data-parallel step, as (op, S) with S the full-model tensor size in bytes.

    DDP: all-reduce the gradients. ZeRO-1/2: reduce-scatter the gradients so each rank gets the sum of
    its shard, update the shard, all-gather the parameters (ZeRO paper §7.2: same 2Ψ as DDP).
    ZeRO-3: all-gather parameters for forward, again for backward, reduce-scatter gradients (§7.2.2:
    3Ψ, 1.5× DDP). Ultra-Scale Playbook, "ZeRO" section, gives the same counts.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"unknown zero_stage {zero_stage!r}; valid choices: 0, 1, 2, 3")
    size = float(n_params) * bytes_per_param
    if zero_stage == 0:
        return [("all_reduce", size)]
    if zero_stage in (1, 2):
        return [("reduce_scatter", size), ("all_gather", size)]
    return [("all_gather", size), ("all_gather", size), ("reduce_scatter", size)]


def dp_step_volume(n_params: int, bytes_per_param: float, zero_stage: int, world: int) -> dict[str, float]:
    """Bytes per rank per step for data parallelism, in two forms.

    "logical": the textbook count, 2Ψ·bytes for DDP/ZeRO-1/ZeRO-2 and 3Ψ·bytes for ZeRO-3 (an
    all-reduce counts as 2Ψ, a reduce-scatter or all-gather as Ψ), independent of N.
    "ring_wire": what each rank actually sends under ring algorithms, logical × (N−1)/N (0 at N = 1).
    """
    _check_world("world", world)
    ops = dp_step_collectives(n_params, bytes_per_param, zero_stage)
    logical = sum(2 * s if op == "all_reduce" else s for op, s in ops)
    wire = sum(bus_bytes(op, s, world) for op, s in ops)
    return {"logical": logical, "ring_wire": wire}


def tp_block_collectives(batch: int, seq: int, d_model: int,
                          bytes_per_elem: float = 4) -> dict[str, list[tuple[str, float]]]:
    """Megatron tensor parallelism's collectives in one transformer block for one step, as (op, S) per pass.

    Shoeybi et al. 2019 (Megatron-LM) §3, Fig. 3/4: attention and MLP each start with f (identity forward,
    all-reduce backward) and end with g (all-reduce forward, identity backward), both on the block's
    activation X of b·s·h elements. So per block per step:

        forward:  2 all-reduces (g after attention, g after the MLP)
        backward: 2 all-reduces (f before attention, f before the MLP)
        each of S = b·s·h·bytes_per_elem bytes  →  4·b·s·h·bytes_per_elem tensor bytes per block,

    with b the micro-batch every tp rank sees (TP ranks share one batch), s the sequence length, h =
    ``d_model``. The volume does not shrink as tp grows: only the weights and the work are split.
    """
    for name, value in (("batch", batch), ("seq", seq), ("d_model", d_model)):
        _check_world(name, value)
    size = float(batch * seq * d_model) * bytes_per_elem
    return {"forward": [("all_reduce", size)] * 2, "backward": [("all_reduce", size)] * 2}


def tp_block_volume(batch: int, seq: int, d_model: int, tp: int, bytes_per_elem: float = 4) -> dict[str, float]:
    """Bytes of one tensor-parallel block per step (forward + backward), in three forms.

    "tensor": the sum of S over the 4 all-reduces, 4·b·s·h·bytes (what the comm log's ``nbytes`` adds up to);
    "logical": the textbook count, an all-reduce moving 2S, so 8·b·s·h·bytes (as ``dp_step_volume``);
    "ring_wire": what each rank sends under ring all-reduce, 4 · 2(tp−1)/tp · b·s·h·bytes (0 at tp = 1).
    """
    _check_world("tp", tp)
    ops = [c for phase in tp_block_collectives(batch, seq, d_model, bytes_per_elem).values() for c in phase]
    return {"tensor": sum(s for _, s in ops), "logical": sum(2 * s for _, s in ops),
            "ring_wire": sum(bus_bytes(op, s, tp) for op, s in ops)}


def tp_vocab_collectives(batch: int, seq: int, d_model: int,
                         bytes_per_elem: float = 4) -> dict[str, list[tuple[str, float]]]:
    """The collectives of a vocab-parallel embedding, tied head and loss per step, outside the blocks.

    The embedding ends with g (forward all-reduce of b·s·h), the head starts with f (backward all-reduce of
    b·s·h), and the vocab-parallel cross-entropy all-reduces three fp32 numbers per token in forward: the
    max logit, the target's logit and the sum of exponentials (3 · b·s·4 bytes; never the b·s·V logits).
    Its backward is local (softmax − one-hot on each rank's vocab slice).
    """
    for name, value in (("batch", batch), ("seq", seq), ("d_model", d_model)):
        _check_world(name, value)
    activation = float(batch * seq * d_model) * bytes_per_elem
    per_token = float(batch * seq) * 4
    return {"forward": [("all_reduce", activation)] + [("all_reduce", per_token)] * 3,
            "backward": [("all_reduce", activation)]}


def sp_block_collectives(batch: int, seq: int, d_model: int, bytes_per_elem: float = 4,
                         regather: bool = True) -> dict[str, list[tuple[str, float]]]:
    """Sequence parallelism's collectives in one transformer block for one step, as (op, S) per pass.

    Korthikanti et al. 2022, §4.2.2: each of TP's all-reduces becomes a reduce-scatter plus an all-gather
    along the sequence. Attention and the MLP each start with g (all-gather forward, reduce-scatter
    backward) and end with ḡ (reduce-scatter forward, all-gather backward), so per block, in the order
    ``workbench.parallel.sequence`` runs them:

        forward:  all-gather (g), reduce-scatter (ḡ)                          for attention, then the MLP
        backward: all-gather (ḡ), [all-gather (re-gather)], reduce-scatter (g)  for the MLP, then attention

    each with S = b·s·h·bytes_per_elem, the full tensor (a reduce-scatter's input, an all-gather's output).
    ``regather``: the column layers store their input's shard [b, s/t, h] and all-gather it again in backward
    for dL/dW (Megatron-LM's implementation; what makes the paper's activation count 34/t). Without it the
    column layers would keep the gathered input and SP would move exactly TP's bytes.
    """
    for name, value in (("batch", batch), ("seq", seq), ("d_model", d_model)):
        _check_world(name, value)
    size = float(batch * seq * d_model) * bytes_per_elem
    backward = [("all_gather", size)] * (2 if regather else 1) + [("reduce_scatter", size)]
    return {"forward": [("all_gather", size), ("reduce_scatter", size)] * 2, "backward": backward * 2}


def sp_block_volume(batch: int, seq: int, d_model: int, tp: int, bytes_per_elem: float = 4,
                    regather: bool = True) -> dict[str, float]:
    """Bytes of one sequence-parallel block per step (forward + backward), in ``tp_block_volume``'s forms.

    "tensor": the sum of S over the collectives (the comm log's ``nbytes``): 10·b·s·h·bytes (8 without the
    re-gathers, against TP's 4 all-reduces of S); "logical": the textbook count, a reduce-scatter or an
    all-gather moving S: the same 10 (8) b·s·h·bytes, against TP's 8; "ring_wire": what each rank sends,
    (tp−1)/tp · S per collective. Without the re-gathers every figure but "tensor" equals TP's.
    """
    _check_world("tp", tp)
    ops = [c for phase in sp_block_collectives(batch, seq, d_model, bytes_per_elem, regather).values() for c in phase]
    return {"tensor": sum(s for _, s in ops), "logical": sum(s for _, s in ops),
            "ring_wire": sum(bus_bytes(op, s, tp) for op, s in ops)}


def sp_vocab_collectives(batch: int, seq: int, d_model: int,
                         bytes_per_elem: float = 4) -> dict[str, list[tuple[str, float]]]:
    """The collectives of the embedding, head and loss per step under sequence parallelism.

    The vocab-parallel embedding ends with ḡ (reduce-scatter of b·s·h forward, all-gather backward); the
    vocab-parallel head starts with g (all-gather forward; backward a re-gather of its stored input and a
    reduce-scatter), so the loss sees every token; the loss's three per-token all-reduces are TP's
    (``tp_vocab_collectives``).
    """
    for name, value in (("batch", batch), ("seq", seq), ("d_model", d_model)):
        _check_world(name, value)
    activation = float(batch * seq * d_model) * bytes_per_elem
    per_token = float(batch * seq) * 4
    return {"forward": [("reduce_scatter", activation), ("all_gather", activation)] + [("all_reduce", per_token)] * 3,
            "backward": [("all_gather", activation), ("reduce_scatter", activation), ("all_gather", activation)]}


def sp_grad_collectives(d_model: int, n_layer: int, seq: int, bytes_per_elem: float = 4) -> list[tuple[str, float]]:
    """The all-reduce over tp of the parameters used on a slice of the sequence, once per step.

    Their gradients are partial sums over each rank's positions: per block the two LayerNorms (2·2h) and the
    two row layers' biases, added after ḡ (2h); the final LayerNorm (2h) and the position embedding
    (seq·h). One flat all-reduce of (6·n_layer + 2 + seq)·h elements.
    """
    for name, value in (("d_model", d_model), ("n_layer", n_layer), ("seq", seq)):
        _check_world(name, value)
    return [("all_reduce", float((6 * n_layer + 2 + seq) * d_model) * bytes_per_elem)]


# ---------------------------------------------------------------------------------------------------------
# One link: the α-β pair as a value, priced by the functions above.

# The collectives a Link prices over N ranks, by canonical op name (send/recv are priced by message_time).
_COLLECTIVE_TIME: dict[str, Callable[[float, int, float, float], float]] = {
    "all_reduce": ring_allreduce_time, "reduce_scatter": reduce_scatter_time, "all_gather": all_gather_time,
    "broadcast": broadcast_time, "reduce": broadcast_time, "all_to_all": all_to_all_time,
    "barrier": lambda nbytes, world, alpha, bw: barrier_time(world, alpha),
}


@dataclass(frozen=True)
class Link:
    """A network link in Hockney's α-β model (Hockney 1994): a message of S bytes costs α + S/B.

    ``alpha``: seconds per message (latency, >= 0, finite); ``bandwidth``: bytes/s each way (> 0; ``inf`` is a
    latency-only link, what ``fit_alpha_beta`` returns when the times do not grow with the size); ``name``: a
    label for tables; ``world``: the ranks a fitted link was measured at (``calibration.fit_ring_allreduce``),
    the default N of the collective methods, or None for a link given by hand (presets, the calculator's link flags).

    The methods price the collectives ``comm`` models (ring all-reduce, reduce-scatter, all-gather, tree
    all-reduce, one message) by calling this module's float functions, so every formula is written once.
    This is also ``theory.parallelism.Link`` and ``theory.calibration.LinkModel``: the same class.
    """

    alpha: float
    bandwidth: float
    name: str = ""
    world: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not (isinstance(self.alpha, int | float) and math.isfinite(self.alpha)
                                                and self.alpha >= 0):
            raise ValueError(f"link latency alpha must be a finite number of seconds >= 0, got {self.alpha!r}")
        if isinstance(self.bandwidth, bool) or not (isinstance(self.bandwidth, int | float) and self.bandwidth > 0):
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not isinstance(self.name, str):  # catches Link(a, b, 4), meant as world=4
            raise ValueError(f"link name must be a str, got {self.name!r} (pass the world size as world=...)")
        if self.world is not None and (isinstance(self.world, bool) or not isinstance(self.world, int)
                                       or self.world < 2):
            # N = 1 sends nothing, so no link can have been fitted there.
            raise ValueError(f"link world (ranks it was fitted at) must be an integer >= 2 or None, got {self.world!r}")

    def _n(self, world: int | None) -> int:
        if world is not None:
            return world
        if self.world is None:
            raise ValueError(f"link {self.name or self.describe()!r} has no fitted world size: pass world=N")
        return self.world

    def message_time(self, nbytes: float) -> float:
        """One point-to-point message: α + S/B."""
        return p2p_time(nbytes, self.alpha, self.bandwidth)

    def ring_allreduce(self, nbytes: float, world: int | None = None) -> float:
        """Ring all-reduce of an S-byte tensor over ``world`` ranks (the fitted world size if not given)."""
        return ring_allreduce_time(nbytes, self._n(world), self.alpha, self.bandwidth)

    def reduce_scatter(self, nbytes: float, world: int | None = None) -> float:
        """Ring reduce-scatter of an S-byte (full, unsharded) tensor over ``world`` ranks."""
        return reduce_scatter_time(nbytes, self._n(world), self.alpha, self.bandwidth)

    def all_gather(self, nbytes: float, world: int | None = None) -> float:
        """Ring all-gather into an S-byte (full) tensor over ``world`` ranks."""
        return all_gather_time(nbytes, self._n(world), self.alpha, self.bandwidth)

    def tree_allreduce(self, nbytes: float, world: int | None = None) -> float:
        """Binary-tree all-reduce, whole message per hop, over ``world`` ranks."""
        return tree_allreduce_time(nbytes, self._n(world), self.alpha, self.bandwidth)

    def collective_time(self, op: str, nbytes: float, world: int | None = None) -> float:
        """Time of ``op`` (any spelling ``canonical_op`` knows) on S bytes, by the methods above.

        all_reduce, reduce_scatter, all_gather: the ring algorithms over ``world`` ranks; broadcast, reduce: a
        binomial tree; all_to_all: pairwise exchange; barrier: dissemination (no bytes); send, recv: one
        message. An op ``canonical_op`` does not know is a ValueError rather than a made-up formula.
        """
        name = canonical_op(op)
        if name in ("send", "recv"):
            return self.message_time(nbytes)
        return _COLLECTIVE_TIME[name](nbytes, self._n(world), self.alpha, self.bandwidth)

    def describe(self) -> str:
        """One line for a notebook: α in µs, B in GB/s, the fitted world size when there is one, the name."""
        text = f"alpha = {self.alpha * 1e6:.0f} us per message, B = {self.bandwidth / 1e9:.2f} GB/s"
        if self.world is not None:
            text += f" (fitted at N = {self.world})"
        return f"{self.name}: {text}" if self.name else text


def fit_alpha_beta(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """Least-squares fit of t = α + S/B to measurements; returns (α seconds, B bytes/s).

    Ordinary least squares on (S, t): slope = 1/B, intercept = α. A non-positive slope (times that do
    not grow with size, e.g. all in the latency regime) gives B = inf; a negative intercept is clamped
    to 0 since latency cannot be negative. The package's only fit: ``calibration.fit_ring_allreduce`` calls it
    on bus bytes and wraps the result in a ``Link``.
    """
    if len(sizes) != len(times):
        raise ValueError(f"sizes and times differ in length: {len(sizes)} vs {len(times)}")
    if len(set(sizes)) < 2:
        raise ValueError("fit_alpha_beta needs at least two distinct sizes")
    n = len(sizes)
    mean_s, mean_t = sum(sizes) / n, sum(times) / n
    cov = sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes, times, strict=True))
    var = sum((s - mean_s) ** 2 for s in sizes)
    slope = cov / var
    alpha = max(mean_t - slope * mean_s, 0.0)
    return alpha, (1.0 / slope if slope > 0 else math.inf)


__all__ = [
    "OPS", "Link", "algorithm_bandwidth", "all_gather_time", "all_to_all_time", "barrier_time", "broadcast_time",
    "bus_bandwidth", "bus_bytes", "canonical_op",
    "dp_step_collectives", "dp_step_volume", "fit_alpha_beta", "hierarchical_allreduce_time", "p2p_time",
    "reduce_scatter_time", "ring_allreduce_time", "sp_block_collectives", "sp_block_volume", "sp_grad_collectives",
    "sp_vocab_collectives", "tp_block_collectives", "tp_block_volume", "tp_vocab_collectives", "tree_allreduce_time",
]
