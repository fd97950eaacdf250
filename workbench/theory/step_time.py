"""Estimated step time of a layout, and layouts ranked by it: which of the layouts that fit trains fastest.

A memory ranking ("stop at the first layout that fits") favours tensor parallelism; a practitioner ranks the layouts
that fit by time. Here a step is

    step = (compute + tp + pp) / (1 − bubble) + exposed dp

- **compute**: 6·Ψ·tokens FLOPs (Kaplan et al. 2020) split evenly over the ranks, at ``peak × mfu`` (an
  *assumption*, 40 % of the peak by default, not a measurement), times the recomputation factor: ``none`` 1, ``full``
  4/3 (the forward, one of the three passes, runs twice), ``selective`` 1 + the attention core's forward FLOPs
  (4·s²·h a layer and sequence, Korthikanti et al. 2022 §5) over the three passes: 1.02–1.05 at s = 4096.
- **tp**: the blocks' all-reduces (or SP's gathers and reduce-scatters), again in the forward under full
  recomputation: ``theory.parallelism``'s ops, **not overlapped** (they sit between the matmuls; async TP is not
  modelled).
- **pp**: the activations and gradients between stages, not overlapped, plus the bubble (p−1)/(m+p−1) of the
  schedule (``pipeline.bubble_fraction``): the busy time is (1 − bubble) of the step. Stages are taken as balanced
  (the embedding and head make the first and last heavier).
- **dp**: DDP's gradient all-reduce, ZeRO-1's reduce-scatter + all-gather once per step; ZeRO-2's reduce-scatter
  and ZeRO-3's two all-gathers and reduce-scatter once **per micro-batch** (FSDP reshards after every forward and
  backward, so gradient accumulation repeats them); HSDP adds an all-reduce of the gradient shard across the
  replicas per micro-batch. With pp = 1 this traffic **overlaps** compute (FSDP prefetches the next unit's gather,
  DDP reduces buckets as backward produces them): only what exceeds ``overlap × compute`` is exposed. With pp > 1 it
  is exposed whole: this package's pipeline reduces after the schedule.

HSDP (hybrid sharding, FSDP's ``HYBRID_SHARD``, ``fully_shard`` on a 2D mesh) is ZeRO-3 over a *shard group* and
plain replication across ``replicate`` such groups: each rank's model states are those of ZeRO-3 over the shard
group alone (``memory.model_state_bytes`` depends only on the group a rank shards over), so a ``Candidate`` prices it
as its ``layout`` (dp = the shard group) plus ``replicate`` copies.

Everything is α-β time on the links each axis crosses (``links`` or ``node_links``); no contention between axes.
Pure Python, floor 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from workbench.theory.checks import positive_int
from workbench.theory.comm import Link, dp_step_collectives
from workbench.theory.memory import DEFAULT_LAYOUT, RECOMPUTE_MODES
from workbench.theory.models import resolve_preset
from workbench.theory.parallelism import (
    DEFAULT_LINKS,
    INFINIBAND,
    NVLINK,
    Layout,
    layout_comm,
    layout_memory,
    stage_params,
)
from workbench.theory.pipeline import bubble_fraction
from workbench.theory.topology import GPU_PEAK_FLOPS

H100_BF16_PEAK = GPU_PEAK_FLOPS["h100-bf16"]  # FLOP/s, dense: the one table of GPU peaks
DEFAULT_MFU = 0.4  # an assumption: large dense runs report 35-45 % of peak


@dataclass(frozen=True)
class Candidate:
    """A layout to rank: its name, its ``Layout``, the sequences per micro-batch, the recomputation it uses, and
    ``replicate`` > 1 for HSDP (the layout's dp ranks shard ZeRO-3, ``replicate`` such groups hold copies)."""

    name: str
    layout: Layout
    micro_batch: int = 1
    recompute: str = "none"
    replicate: int = 1

    @property
    def nproc(self) -> int:
        return self.layout.nproc * self.replicate


def recompute_factor(model: str | dict, mode: str, seq_len: int | None = None) -> float:
    """The compute a step runs over the 6·Ψ·tokens it would run without recomputation (see the module docstring)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute {mode!r}; valid: {', '.join(RECOMPUTE_MODES)}")
    if mode == "none":
        return 1.0
    if mode == "full":
        return 4 / 3
    shape = resolve_preset(model)
    s, h = (seq_len or shape["seq_len"]), shape["d_model"]
    attention = 4 * s * s * h * shape["n_layer"]  # QKᵀ and AV in the forward, per sequence (2·s²·h FLOPs each)
    return 1 + attention / (3 * (2 * shape["n_params"] * s + attention))


def _check(candidate: Candidate, global_batch: int, overlap: float, mfu: float, peak_flops: float) -> None:
    positive_int("global_batch", global_batch)
    positive_int("replicate", candidate.replicate)
    if candidate.replicate > 1 and candidate.layout.zero_stage != 3:
        raise ValueError(f"replicate={candidate.replicate} is HSDP, which shards with ZeRO-3: zero_stage must be 3, "
                         f"got {candidate.layout.zero_stage}")
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1] (the fraction of compute dp traffic hides behind), got {overlap}")
    if not 0 < mfu <= 1 or peak_flops <= 0:
        raise ValueError(f"mfu must be in (0, 1] and peak_flops > 0, got mfu={mfu}, peak_flops={peak_flops}")
    lay = candidate.layout
    per_step = lay.dp * candidate.replicate * lay.microbatches * candidate.micro_batch
    if per_step != global_batch:
        raise ValueError(f"{candidate.name}: dp x replicate x microbatches x micro_batch = {lay.dp} x "
                         f"{candidate.replicate} x {lay.microbatches} x {candidate.micro_batch} = {per_step}, but "
                         f"global_batch={global_batch}")


def _dp_time(params: float, candidate: Candidate, precision: str, links: Mapping[str, Link]) -> float:
    """The dp (and HSDP replicate) traffic of one step, as the module docstring counts it."""
    lay = candidate.layout
    p = 4 if precision == "fp32" else 2
    m = lay.microbatches
    t = 0.0
    if lay.shard_group > 1:
        for op, size in dp_step_collectives(params, p, lay.zero_stage):
            per_mb = lay.zero_stage == 3 or (lay.zero_stage == 2 and op == "reduce_scatter")
            t += links["dp"].collective_time(op, size, lay.shard_group) * (m if per_mb else 1)
    if candidate.replicate > 1:  # the gradient shard, averaged across the replicas after each reduce-scatter
        t += links["replicate"].collective_time("all_reduce", params * p / lay.shard_group, candidate.replicate) * m
    return t


def step_time(
    model: str | dict,
    candidate: Candidate,
    global_batch: int,
    seq_len: int | None = None,
    precision: str = "bf16-mixed",
    links: Mapping[str, Link] | None = None,
    peak_flops: float = H100_BF16_PEAK,
    mfu: float = DEFAULT_MFU,
    overlap: float = 1.0,
) -> dict:
    """Estimated seconds of one optimizer step of ``candidate`` (see the module docstring for what is counted).

    Returns "compute_s" (recomputation included), "tp_s", "pp_s" (the sends), "bubble" (fraction), "bubble_s",
    "dp_s" (all dp traffic), "dp_exposed_s", "recompute_factor" and "total_s". ``links``: per axis "dp", "tp",
    "pp", "cp" and "replicate" (HSDP's); missing ones default to ``parallelism.DEFAULT_LINKS`` (replicate: InfiniBand).
    """
    shape = resolve_preset(model)
    _check(candidate, global_batch, overlap, mfu, peak_flops)
    lay, b = candidate.layout, candidate.micro_batch
    lay.validate(shape, seq_len)
    s = seq_len or shape["seq_len"]
    link = {**DEFAULT_LINKS, "replicate": INFINIBAND, **(links or {})}
    factor = recompute_factor(shape, candidate.recompute, s)
    compute = 6 * shape["n_params"] * global_batch * s / (candidate.nproc * peak_flops * mfu) * factor
    ranks = stage_params(shape, lay.tp, lay.pp, lay.virtual_stages)
    comm = layout_comm(shape, lay, precision, b, s, candidate.recompute, link)  # each axis at its slowest stage
    per_axis = {axis: comm[axis]["time_s"] for axis in ("tp", "pp", "cp")}
    dp = max(_dp_time(info["params"], candidate, precision, link) for info in ranks)
    bubble = bubble_fraction(lay.schedule, lay.pp, lay.microbatches, lay.virtual_stages)
    busy = compute + per_axis["tp"] + per_axis["pp"] + per_axis["cp"]
    piped = busy / (1 - bubble)
    exposed = dp if lay.pp > 1 else max(0.0, dp - overlap * compute)
    return {"compute_s": compute, "recompute_factor": factor, "tp_s": per_axis["tp"], "pp_s": per_axis["pp"],
            "cp_s": per_axis["cp"], "bubble": bubble, "bubble_s": piped - busy, "dp_s": dp, "dp_exposed_s": exposed,
            "total_s": piped + exposed}


def node_links(candidate: Candidate, gpus_per_node: int, intra: Link = NVLINK, inter: Link = INFINIBAND) -> dict:
    """The link each axis crosses in the mesh's rank order (tp fastest, then cp, dp, replicate, pp): an axis stays on
    ``intra`` while its groups fit in a node of ``gpus_per_node`` ranks (block placement, tp dividing a node)."""
    positive_int("gpus_per_node", gpus_per_node)
    lay = candidate.layout
    reach = {"tp": lay.tp, "cp": lay.tp * lay.cp, "dp": lay.tp * lay.cp * lay.dp,
             "replicate": lay.tp * lay.cp * lay.dp * candidate.replicate, "pp": candidate.nproc}
    return {axis: inter if r > gpus_per_node else intra for axis, r in reach.items()}


def rank_layouts(
    model: str | dict,
    candidates: Iterable[Candidate],
    global_batch: int,
    device_gib: float = 80,
    gpus_per_node: int = 8,
    seq_len: int | None = None,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    memory_layout: str = DEFAULT_LAYOUT,
    intra: Link = NVLINK,
    inter: Link = INFINIBAND,
    **timing: float,
) -> list[dict]:
    """Every candidate priced (memory per GPU, worst stage, by ``layout_memory``; time by ``step_time`` on
    ``node_links``): the ones that fit in ``device_gib`` first, fastest first, then the rest by memory.

    Each row: name, candidate, gib, fits, time ({``step_time``'s keys}), total_s. ``timing``: ``step_time``'s
    peak_flops, mfu, overlap.
    """
    rows = []
    for c in candidates:
        memory = layout_memory(model, c.layout, precision, optimizer, c.micro_batch, seq_len, c.recompute,
                               memory_layout)
        time = step_time(model, c, global_batch, seq_len, precision, node_links(c, gpus_per_node, intra, inter),
                         **timing)
        gib = memory["total"] / 2**30
        rows.append({"name": c.name, "candidate": c, "gib": gib, "fits": gib <= device_gib, "time": time,
                     "total_s": time["total_s"]})
    return sorted(rows, key=lambda r: (not r["fits"], r["total_s"] if r["fits"] else r["gib"]))


def with_recompute(candidate: Candidate, recompute: str) -> Candidate:
    """The same candidate with another recomputation mode (the knob), its name suffixed."""
    return replace(candidate, recompute=recompute, name=f"{candidate.name}, {recompute} recompute")


__all__ = ["DEFAULT_MFU", "H100_BF16_PEAK", "Candidate", "node_links", "rank_layouts", "recompute_factor",
           "step_time", "with_recompute"]
