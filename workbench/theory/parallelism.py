"""Memory per rank and communication per step of a (dp, cp, tp, pp) layout: 3D (4D) parallelism on paper.

A *layout* places ``nproc = dp × tp × pp`` ranks: tp ranks split every layer (Megatron-LM, Shoeybi et al.
2019), pp ranks hold consecutive stages of layers run by a schedule (``theory.pipeline``), dp ranks hold
replicas of that, sharded by ZeRO (Rajbhandari et al. 2020). This module puts the existing pieces
together: ``memory.model_state_bytes`` for what one rank's parameters cost, ``memory.activation_bytes`` for
one layer's saved activations, ``pipeline.make_plan`` for how many micro-batches a stage holds at once, and
``comm``'s ring and point-to-point times in the α-β model for the traffic on each axis.

Assumptions (each one a place where a real run differs):

- **Tensor parallelism** splits the attention and MLP weights (heads, hidden) and the vocabulary of the
  embedding and head; it keeps whole on every tp rank what Megatron keeps whole: the norms, the biases
  of the row-parallel layers and the learned position embedding. A vocabulary tp does not divide is padded
  to the next multiple, as Megatron pads it. tp must divide the heads. Under grouped-query attention (Llama-2-70B:
  8 K/V heads) tp past the K/V heads replicates them: each rank keeps one K/V head's weights and activations.
- **Pipeline stages** hold contiguous layers balanced as ``pipeline.stage_layers`` cuts them (extra layers
  on the first stages), exactly the cut of ``workbench.parallel.pipeline``: the first stage also holds the
  token (and position) embedding, the last the final norm and the head. A tied head (our GPT) is a second
  copy of the embedding on the last stage, with its own gradient and optimizer state, as in Megatron-LM;
  with pp = 1 the tie is kept and the matrix counted once. We report every pipeline rank and the *worst*.
- **ZeRO** shards each rank's model states over its dp group as ``memory.model_state_bytes`` does, in the memory
  layout named (``memory_layout``: "classic" 16-bit parameters and gradients, or "amp", the trainer's fp32 ones);
  offload moves the same categories to the CPU.
- **Activations** of a rank are one layer's ``activation_bytes`` (Korthikanti et al. 2022, with tp/SP; SwiGLU
  and GQA for a Llama shape, ``models.preset_activation_bytes``) for
  one micro-batch, times the most layer-micro-batches the schedule's action list keeps alive on that rank
  (F done, B or I not yet: ``pipeline.peak_held_layers``, ``peak_in_flight`` weighted by the layers of
  each stage). Embedding, final norm, logits and loss activations are not counted (as in
  ``activation_bytes``); ZB's W keeps (input, output gradient) pairs after I, also not counted.
- **Communication** per optimizer step, ring algorithms, no overlap with compute or with each other:
  dp: ``comm.dp_step_collectives`` on the rank's own parameters (16-bit gradients under mixed precision);
  tp: the block's all-reduces (``comm.tp_block_collectives``) or SP's all-gathers and reduce-scatters
  (``comm.sp_block_collectives``) per layer per micro-batch, the forward ones again under full recompute
  (Korthikanti et al. 2022, §5); the embedding/head/loss collectives are left out;
  pp: one activation per micro-batch forward and one gradient back across every stage boundary the rank
  owns (b·s·h values; each tp rank sends all of it, Megatron's scatter/gather optimisation of Narayanan
  et al. 2021 §4.1 is not modelled; under SP the activation is already split by tp), plus the tied
  embedding's gradient exchanged between first and last stage once per step;
  cp: ring attention's K/V blocks (and, in backward, the blocks again with their fp32 dK/dV accumulators) per
  layer per micro-batch (``theory.context.ring_kv_bytes``, for the model's K/V heads: ``n_kv_head`` under
  grouped-query attention, else every head), as point-to-point messages, the forward ones again under full
  recompute.
- **Context parallelism** splits each sequence over cp ranks (Liu et al. 2023, ring attention): a rank's
  activations are those of s/cp tokens (Korthikanti's formula at s/cp, whose score term is then the one
  (s/cp)² block a rank holds at a time); cp ranks hold the same parameters, so ZeRO shards over dp × cp.

Pure Python: no torch, no imports from the rest of workbench.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from workbench.theory.checks import positive_int
from workbench.theory.comm import (
    Link,  # defined in comm, the α-β model's home; re-exported here, where the presets and layouts use it
    bus_bytes,
    dp_step_collectives,
    sp_block_collectives,
    tp_block_collectives,
)
from workbench.theory.composition import Combination, check_composition
from workbench.theory.context import check_cp, ring_kv_bytes
from workbench.theory.memory import (
    DEFAULT_LAYOUT,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE_MODES,
    ZERO_STAGES,
    kv_heads_per_rank,
    model_state_bytes,
    offloaded_bytes,
    state_bytes_per_param,
)
from workbench.theory.models import preset_activation_bytes, resolve_preset
from workbench.theory.pipeline import (
    bubble_fraction,
    make_plan,
    peak_held_layers,
    peak_in_flight,
    rank_stages,
    stage_layers,
)
from workbench.theory.pipeline import validate as validate_schedule

AXES: tuple[str, ...] = ("dp", "cp", "tp", "pp")


# Orders of magnitude, not measurements: fit your own (calibration.fit_ring_allreduce) and pass them in.
# NVLink 4 (H100 SXM) carries 900 GB/s per GPU in both directions together, 450 GB/s each way; one
# 400 Gb/s InfiniBand NDR NIC per GPU carries 50 GB/s. Latencies of a few microseconds (NCCL in a node)
# and about ten across nodes. Tensor parallelism stays inside a node; data and pipeline cross nodes.
NVLINK = Link(alpha=5e-6, bandwidth=450e9, name="NVLink (450 GB/s, 5 µs)")
INFINIBAND = Link(alpha=10e-6, bandwidth=50e9, name="InfiniBand NDR (50 GB/s, 10 µs)")
DEFAULT_LINKS: dict[str, Link] = {"dp": INFINIBAND, "cp": NVLINK, "tp": NVLINK, "pp": INFINIBAND}


def _choice(name: str, value: object, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(map(str, choices))}")


@dataclass(frozen=True)
class Layout:
    """How ``dp × cp × tp × pp`` ranks train one model: the flags of ``workbench run`` as plain numbers.

    ``microbatches`` are the micro-batches each dp replica runs per optimizer step (the pipeline's m; with
    pp = 1 they are gradient accumulation), ``virtual_stages`` the stages per pipeline rank (interleaved).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    zero_stage: int = 0
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    offload: bool = False
    cp: int = 1
    cp_layout: str = "zigzag"

    def combination(self) -> Combination:
        """The settings the composition rules look at (``theory.composition``)."""
        return Combination(tp=self.tp, pp=self.pp, sp=self.sp, zero=self.zero_stage, offload=self.offload, cp=self.cp)

    @property
    def nproc(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def shard_group(self) -> int:
        """The ranks ZeRO shards a rank's model states over: dp × cp (cp ranks hold the same parameters)."""
        return self.dp * self.cp

    def validate(self, model: str | dict, seq_len: int | None = None, nproc: int | None = None) -> None:
        """ValueError naming the value and the fix for a layout this model cannot take."""
        for name in ("dp", "cp", "tp", "pp", "microbatches", "virtual_stages"):
            positive_int(name, getattr(self, name))
        _choice("zero_stage", self.zero_stage, ZERO_STAGES)
        if nproc is not None and self.nproc != nproc:
            cp = (" x cp", f" x {self.cp}") if self.cp > 1 else ("", "")
            raise ValueError(f"dp{cp[0]} x tp x pp = {self.dp}{cp[1]} x {self.tp} x {self.pp} = {self.nproc} but "
                             f"nproc={nproc}: the mesh must use every rank; leave dp out to get nproc / "
                             f"({cp[0][3:] + ' x ' if cp[0] else ''}tp x pp)")
        shape = resolve_preset(model)
        if shape["n_head"] % self.tp:
            valid = [t for t in range(1, shape["n_head"] + 1) if shape["n_head"] % t == 0]
            raise ValueError(f"tp={self.tp} must divide the model's n_head={shape['n_head']} (heads are split "
                             f"across tp ranks); valid tp: {', '.join(map(str, valid))}")
        if shape.get("n_kv_head", shape["n_head"]) != shape["n_head"]:  # GQA: tp past the K/V heads replicates
            kv_heads_per_rank(shape["n_head"], shape["n_kv_head"], self.tp)
        check_composition(self.combination(), meaningless_only=True)  # e.g. sp without tp; calc asks all rules
        s = seq_len if seq_len is not None else shape["seq_len"]
        if self.sp and s % self.tp:
            raise ValueError(f"sp splits the sequence over tp ranks: seq_len={s} must be divisible by tp={self.tp}")
        check_cp(s, self.cp, self.cp_layout)
        # unknown schedule, m < p for 1F1B/ZB, more stages than layers, interleaved divisibility: checked where
        # the schedules live, with the messages `workbench run` gives
        validate_schedule(self.schedule, self.pp, self.microbatches, self.virtual_stages, shape["n_layer"])


def micro_batch_size(global_batch: int, dp: int, microbatches: int) -> int:
    """Sequences per micro-batch on one rank: the global batch split over dp replicas and m micro-batches."""
    positive_int("batch_size", global_batch)
    per, rem = divmod(global_batch, dp * microbatches)
    if rem or per == 0:
        raise ValueError(f"batch_size={global_batch} must divide into dp x microbatches = {dp} x {microbatches}; "
                         f"use a multiple of {dp * microbatches}")
    return per


# ---------------------------------------------------------------------------------------------------------
# Where the parameters live.


@dataclass(frozen=True)
class ParamPart:
    """A group of parameters: ``split`` of them are divided by tensor parallelism, ``whole`` kept on every
    tp rank. ``vocab`` marks a vocabulary-parallel matrix (its rows are padded to a multiple of tp)."""

    split: int
    whole: int
    vocab: bool = False
    kv: int = 0  # of ``split``, the K and V weights of grouped-query attention (Llama shapes)
    kv_heads: int = 0  # their heads: past tp = kv_heads each K/V head is replicated, not split

    def on_tp_rank(self, tp: int, vocab_size: int, d_model: int) -> int | float:
        if self.vocab:  # Megatron pads the vocabulary to a multiple of tp
            return math.ceil(vocab_size / tp) * d_model + self.whole
        split, extra = self.split, 0
        if self.kv and tp > self.kv_heads:  # one K/V head's weights on every rank (Megatron replicates them)
            split, extra = self.split - self.kv, self.kv // self.kv_heads
        return (split // tp if split % tp == 0 else split / tp) + self.whole + extra


def param_parts(model: str | dict) -> dict[str, ParamPart]:
    """The model's parameters in four parts: "block" (one layer), "embedding" (first stage), "head" (last
    stage: final norm and an untied head) and "tied_head" (the copy a tied head adds on a separate last stage).

    "gpt" (ours, exact): per block 12d² + 7d split (q, k, v, fc weights and biases, the out and MLP
    projections' weights) and 6d whole (two LayerNorms, the two row layers' biases); the embedding V·d
    split plus the position table T·d whole; the final LayerNorm 2d whole; the head tied to the embedding.
    "llama" (published totals): the block is the total less embedding, head and final norm, over n_layer;
    its two RMSNorms (2d) whole; untied embedding and head of V·d each, split; final RMSNorm d whole. Past
    tp = n_kv_head the block's k and v weights are replicated, one K/V head per rank (``ParamPart.kv``).
    """
    shape = resolve_preset(model)
    d, v, n_layer = shape["d_model"], shape["vocab_size"], shape["n_layer"]
    arch = shape.get("arch", "gpt" if shape.get("exact") else "llama")
    if arch == "gpt":
        return {"block": ParamPart(12 * d * d + 7 * d, 6 * d), "embedding": ParamPart(v * d, shape["seq_len"] * d,
                True), "head": ParamPart(0, 2 * d), "tied_head": ParamPart(v * d, 0, True)}
    if arch != "llama":
        raise ValueError(f"unknown arch {arch!r}; valid: gpt, llama")
    block, rem = divmod(shape["n_params"] - 2 * v * d - d, n_layer)
    if rem or block <= 2 * d:
        raise ValueError(f"n_params={shape['n_params']} is not n_layer={n_layer} equal blocks plus an untied "
                         f"embedding and head of {v}x{d} and a final norm")
    kv_heads = shape.get("n_kv_head", shape["n_head"])
    kv = 2 * d * kv_heads * (d // shape["n_head"])  # k and v weights: fewer than q's under GQA
    return {"block": ParamPart(block - 2 * d, 2 * d, kv=kv, kv_heads=kv_heads), "embedding": ParamPart(v * d, 0, True),
            "head": ParamPart(v * d, d, True), "tied_head": ParamPart(0, 0)}


def stage_params(model: str | dict, tp: int = 1, pp: int = 1, virtual_stages: int = 1) -> list[dict]:
    """Per pipeline rank: its stages, its layers, and its parameters on one tp rank ("params").

    With tp = pp = 1 the one rank's "params" is the model's n_params.
    """
    shape = resolve_preset(model)
    parts = param_parts(shape)
    n_stages = pp * virtual_stages
    layers = [len(r) for r in stage_layers(shape["n_layer"], n_stages)]
    on_rank = {k: part.on_tp_rank(tp, shape["vocab_size"], shape["d_model"]) for k, part in parts.items()}
    ranks = []
    for r in range(pp):
        stages = rank_stages(r, pp, virtual_stages)
        n = sum(layers[s] for s in stages) * on_rank["block"]
        has_first, has_last = 0 in stages, n_stages - 1 in stages
        n += on_rank["embedding"] if has_first else 0
        n += on_rank["head"] if has_last else 0
        n += on_rank["tied_head"] if has_last and not has_first else 0
        ranks.append({"pp_rank": r, "stages": stages, "layers": sum(layers[s] for s in stages), "params": n,
                      "first": has_first, "last": has_last})
    return ranks


# ---------------------------------------------------------------------------------------------------------
# Memory.


def _bytes_per_value(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def layout_memory(
    model: str | dict,
    layout: Layout,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    micro_batch: int = 0,
    seq_len: int | None = None,
    recompute: str = "none",
    memory_layout: str = DEFAULT_LAYOUT,
) -> dict:
    """Device bytes per rank of every pipeline rank (all tp and dp ranks of a stage hold the same), and the
    worst one. ``micro_batch`` = 0 leaves activations out (model states only). ``memory_layout``: where mixed
    precision keeps its model states (``memory.MEMORY_LAYOUTS``: "classic" or "amp", the trainer's).

    Returns "ranks" (per pipeline rank: stages, layers, params, peak_in_flight, peak_held_layers,
    per_rank {category: bytes}, cpu {category: bytes}, total), "worst" (the index of the largest total),
    "per_rank" and "total" of the worst, and "activation_per_layer" (one layer, one micro-batch).
    """
    shape = resolve_preset(model)
    layout.validate(shape, seq_len)
    _choice("precision", precision, sorted(PRECISIONS))
    _choice("optimizer", optimizer, list(OPTIMIZERS))
    _choice("recompute", recompute, RECOMPUTE_MODES)
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 0:
        raise ValueError(f"micro_batch must be an int >= 0 (0: no activations), got {micro_batch!r}")
    plan = make_plan(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages, shape["n_layer"])
    layers = [len(r) for r in stage_layers(shape["n_layer"], layout.pp * layout.virtual_stages)]
    per_layer = _layer_activation(shape, micro_batch, seq_len, precision, recompute, layout)
    ranks = []
    for info, actions in zip(stage_params(shape, layout.tp, layout.pp, layout.virtual_stages), plan, strict=True):
        group = layout.shard_group
        args = (group, layout.zero_stage, precision, optimizer, layout.offload, memory_layout)
        states = model_state_bytes(info["params"], *args)
        cpu = offloaded_bytes(info["params"], *args)
        held = peak_held_layers(actions, layers)
        if micro_batch:
            states["activations"] = held * per_layer
        ranks.append({**info, "peak_in_flight": peak_in_flight(actions), "peak_held_layers": held,
                      "per_rank": states, "cpu": cpu, "total": sum(states.values())})
    worst = max(range(len(ranks)), key=lambda r: ranks[r]["total"])
    return {"ranks": ranks, "worst": worst, "per_rank": ranks[worst]["per_rank"], "total": ranks[worst]["total"],
            "activation_per_layer": per_layer}


def _layer_activation(shape: dict, micro_batch: int, seq_len: int | None, precision: str, recompute: str,
                      layout: Layout) -> float:
    """One layer, one micro-batch, one rank: Korthikanti et al. 2022 with tp and SP (``activation_bytes``), at the
    s/cp tokens a context-parallel rank holds."""
    if not micro_batch:
        return 0.0
    s = (seq_len if seq_len is not None else shape["seq_len"]) // layout.cp
    return preset_activation_bytes(shape, micro_batch, s, _bytes_per_value(precision), recompute, layout.tp,
                                   layout.sp)


# ---------------------------------------------------------------------------------------------------------
# Communication.


def _axis_cost(ops: list[tuple[str, float, int]], world: int, link: Link) -> dict:
    """Totals of (op, S, count) triples on one axis of ``world`` ranks: S summed ("tensor_bytes", what a comm
    log's nbytes adds up to), bytes each rank sends under ring algorithms ("wire_bytes"), and α-β time."""
    return {"group_size": world, "link": asdict(link), "ops": [list(o) for o in ops],
            "tensor_bytes": sum(s * n for _, s, n in ops),
            "wire_bytes": sum(bus_bytes(op, s, world) * n for op, s, n in ops),
            "time_s": sum(link.collective_time(op, s, world) * n for op, s, n in ops)}


def _count(collectives: list[tuple[str, float]], times: int) -> list[tuple[str, float, int]]:
    counted: dict[tuple[str, float], int] = {}
    for op, size in collectives:
        counted[(op, size)] = counted.get((op, size), 0) + times
    return [(op, size, n) for (op, size), n in counted.items() if n]


def _dp_ops(params: float, layout: Layout, precision: str, memory_layout: str) -> list[tuple[str, float, int]]:
    """Gradients reduced and parameters gathered at the bytes the memory layout keeps them in: 16-bit in the
    classic mixed layout, fp32 under "amp" (autocast over fp32 parameters, whose gradients are fp32: what
    ``workbench run`` all-reduces), so a mixed-precision run's dp traffic is the amp layout's, 2x the classic."""
    if layout.shard_group == 1:
        return []
    nbytes = state_bytes_per_param(precision, memory_layout=memory_layout)["gradients"]
    return _count(dp_step_collectives(params, nbytes, layout.zero_stage), 1)  # data_parallel_comm's ops


def data_parallel_comm(params: float, layout: Layout, link: Link, precision: str = "bf16-mixed",
                       memory_layout: str = DEFAULT_LAYOUT, group: int | None = None) -> dict:
    """``layout_comm``'s dp row for ``params`` parameters over ``group`` ranks (default the layout's dp x cp): what
    expert parallelism's experts need, ZeRO-sharded over the dp·cp/ep ranks that hold the same ones."""
    world = layout.shard_group if group is None else group
    positive_int("group", world)
    if world == 1:
        return _axis_cost([], 1, link)
    nbytes = state_bytes_per_param(precision, memory_layout=memory_layout)["gradients"]
    return _axis_cost(_count(dp_step_collectives(params, nbytes, layout.zero_stage), 1), world, link)


def _cp_ops(shape: dict, layers: int, b: int, s: int, layout: Layout, precision: str,
            recompute: str) -> list[tuple[str, float, int]]:
    """Ring attention's messages per step: per layer and micro-batch, the forward's K/V hops (again under full
    recompute) and the backward's K/V hops and dK/dV hops (fp32 accumulators)."""
    if layout.cp == 1:
        return []
    kv_heads = max(1, shape.get("n_kv_head", shape["n_head"]) // layout.tp)  # GQA: fewer K/V heads travel
    ring = ring_kv_bytes(b, kv_heads, s, shape["d_model"] // shape["n_head"], layout.cp, _bytes_per_value(precision))
    times = layers * layout.microbatches
    forward = ring["forward_messages"] * (2 if recompute == "full" else 1)
    return [(op, float(size), n * times) for op, size, n in (
        ("send", ring["kv_message"], forward + ring["backward_kv_messages"]),
        ("send", ring["grad_message"], ring["backward_grad_messages"])) if n]


def _tp_ops(shape: dict, layers: int, b: int, s: int, layout: Layout, precision: str,
            recompute: str) -> list[tuple[str, float, int]]:
    if layout.tp == 1:
        return []
    p, d = _bytes_per_value(precision), shape["d_model"]
    block = sp_block_collectives(b, s, d, p) if layout.sp else tp_block_collectives(b, s, d, p)
    forward = block["forward"] * (2 if recompute == "full" else 1)  # full recompute reruns the forward's
    return _count(forward + block["backward"], layers * layout.microbatches)


def _pp_ops(shape: dict, info: dict, b: int, s: int, layout: Layout, precision: str) -> list[tuple[str, float, int]]:
    if layout.pp == 1:
        return []
    p, n_stages = _bytes_per_value(precision), layout.pp * layout.virtual_stages
    activation = float(b * s * shape["d_model"] * p) / (layout.tp if layout.sp else 1)
    sends = sum((st < n_stages - 1) + (st > 0) for st in info["stages"]) * layout.microbatches
    ops = [("send", activation, sends)]
    if param_parts(shape)["tied_head"].split and (info["first"] or info["last"]):
        tied = math.ceil(shape["vocab_size"] / layout.tp) * shape["d_model"] * p
        ops.append(("send", float(tied), 1))  # the tied embedding's gradient, once per step
    return ops


def _axis_ops(axis: str, shape: dict, info: dict, b: int, s: int, layout: Layout, precision: str,
              recompute: str, memory_layout: str = DEFAULT_LAYOUT) -> list[tuple[str, float, int]]:
    if axis == "dp":
        return _dp_ops(info["params"], layout, precision, memory_layout)
    if axis == "cp":
        return _cp_ops(shape, info["layers"], b, s, layout, precision, recompute)
    local = s // layout.cp  # a context-parallel rank's activations are those of its s/cp tokens
    if axis == "tp":
        return _tp_ops(shape, info["layers"], b, local, layout, precision, recompute)
    return _pp_ops(shape, info, b, local, layout, precision)


def layout_comm(
    model: str | dict,
    layout: Layout,
    precision: str = "bf16-mixed",
    micro_batch: int = 1,
    seq_len: int | None = None,
    recompute: str = "none",
    links: Mapping[str, Link] | None = None,
    memory_layout: str = DEFAULT_LAYOUT,
) -> dict:
    """Communication of one optimizer step per axis, for the pipeline rank where that axis is slowest.

    Returns {axis: {group_size, link, ops [(op, S bytes, count)], tensor_bytes, wire_bytes, time_s, pp_rank}}
    for "dp" (over dp x cp: cp ranks average their gradients too), "cp", "tp", "pp", and "total_time_s" (their
    sum: nothing overlapped). Axes of size 1 have no ops. ``memory_layout`` sets the bytes of the dp row's gradients
    and parameters (``theory.memory.MEMORY_LAYOUTS``: 16-bit under "classic", fp32 under "amp"); activations travel
    at the compute precision either way.
    """
    shape = resolve_preset(model)
    layout.validate(shape, seq_len)
    positive_int("micro_batch", micro_batch)
    link = {**DEFAULT_LINKS, **(links or {})}
    s = seq_len if seq_len is not None else shape["seq_len"]
    ranks = stage_params(shape, layout.tp, layout.pp, layout.virtual_stages)
    out: dict = {}
    for axis in AXES:
        world = layout.shard_group if axis == "dp" else getattr(layout, axis)  # gradients: over dp x cp
        costs = [{**_axis_cost(_axis_ops(axis, shape, info, micro_batch, s, layout, precision, recompute,
                                         memory_layout), world, link[axis]), "pp_rank": info["pp_rank"]}
                 for info in ranks]
        out[axis] = max(costs, key=lambda c: c["time_s"])
    out["total_time_s"] = sum(out[a]["time_s"] for a in AXES)
    return out


def analyze_layout(
    model: str | dict,
    layout: Layout,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    micro_batch: int = 0,
    seq_len: int | None = None,
    recompute: str = "none",
    links: Mapping[str, Link] | None = None,
    comm_micro_batch: int | None = None,
    memory_layout: str = DEFAULT_LAYOUT,
) -> dict:
    """Memory (``layout_memory``), communication (``layout_comm``) and the schedule's bubble in one dict.

    Communication needs a micro-batch even when activations are left out (``micro_batch`` = 0): it uses
    ``comm_micro_batch``, by default ``micro_batch`` or 1 sequence.
    """
    memory = layout_memory(model, layout, precision, optimizer, micro_batch, seq_len, recompute, memory_layout)
    comm_b = comm_micro_batch if comm_micro_batch is not None else (micro_batch or 1)
    comm = layout_comm(model, layout, precision, comm_b, seq_len, recompute, links, memory_layout)
    bubble = bubble_fraction(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages)
    return {"layout": asdict(layout), "memory": memory, "comm": comm, "comm_micro_batch": comm_b,
            "bubble": bubble}


__all__ = [
    "AXES", "DEFAULT_LINKS", "INFINIBAND", "NVLINK", "Layout", "Link", "ParamPart", "analyze_layout",
    "data_parallel_comm",
    "layout_comm", "layout_memory", "micro_batch_size", "param_parts", "stage_params",
]
