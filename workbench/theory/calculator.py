"""The memory calculator's arithmetic: per-rank bytes of a layout and whether it fits one device, as plain numbers.

``calculator_table`` is what the notebook widget (``workbench.widgets.memory_calculator``) shows and what
``workbench calc`` prints: pure Python over ``theory.memory``, ``theory.parallelism`` and ``theory.pipeline``, so
the command line prints it without importing ipywidgets or plotly.
"""

from __future__ import annotations

from workbench.theory.composition import check_composition
from workbench.theory.expert import check_ep, preset_expert_params
from workbench.theory.memory import (
    DEFAULT_LAYOUT,
    MEMORY_LAYOUTS,
    formula,
    model_state_bytes,
    offloaded_bytes,
    to_unit,
)
from workbench.theory.models import MODEL_PRESETS
from workbench.theory.parallelism import Layout, Link, analyze_layout, data_parallel_comm
from workbench.theory.pipeline import bubble_fraction
from workbench.theory.pipeline import validate as validate_schedule
from workbench.theory.precisions import is_mixed

CUSTOM = "custom"  # a model given by its parameter count alone (custom_params_b)


def n_params_of(model: str, custom_params_b: float | None) -> int:
    """Parameters of a preset, or of a custom model given in billions; ValueError naming the choices."""
    if model == CUSTOM:
        if custom_params_b is None or not custom_params_b > 0:
            raise ValueError(f"model 'custom' needs custom_params_b > 0, got {custom_params_b!r}")
        return int(round(custom_params_b * 1e9))
    if model not in MODEL_PRESETS:
        choices = ", ".join(sorted([*MODEL_PRESETS, CUSTOM]))
        raise ValueError(f"unknown model {model!r}; valid choices: {choices}")
    return MODEL_PRESETS[model]["n_params"]


def calculator_table(
    model: str = "llama-7B",
    dp: int = 1,
    zero_stage: int = 0,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    offload: bool = False,
    custom_params_b: float | None = None,
    batch: int = 0,
    seq_len: int | None = None,
    recompute: str = "none",
    device_gb: float = 80,
    tp: int = 1,
    sp: bool = False,
    pp: int = 1,
    schedule: str = "1f1b",
    microbatches: int = 1,
    virtual_stages: int = 1,
    links: dict[str, Link] | None = None,
    cp: int = 1,
    cp_layout: str = "zigzag",
    ep: int = 1,
    moe_experts: int | None = None,
    memory_layout: str = DEFAULT_LAYOUT,
) -> dict:
    """Per-rank memory for one configuration, as plain numbers.

    Returns model, n_params, per_rank (device bytes by category of the worst pipeline rank, "activations"
    included when batch > 0), cpu (offloaded bytes by category), total_bytes, total_gib, cpu_gib,
    device_gib, fits, formula and notes; and, for the layout: nproc, stages (one row per pipeline rank),
    worst_stage, bubble, peak_in_flight (per pipeline rank), comm (per axis, ``theory.parallelism.layout_comm``)
    and comm_micro_batch. device_gb is read as GiB: an "80 GB" H100 has 80 GiB of HBM, of which the CUDA
    context and allocator reserve take some, so "fits" is optimistic by a GiB or two.

    ``batch`` is the micro-batch of one rank (sequences), 0 to leave activations out; the tp and pp traffic
    then assume one sequence per micro-batch. tp, sp, pp, schedule, microbatches, virtual_stages, cp and cp_layout
    are ``workbench run``'s flags (``theory.parallelism.Layout``); ZeRO then shards over dp x cp.

    A mixture of experts (``moe_experts``, default the preset's) with expert parallelism ``ep`` (borrowed from dp,
    ``theory.expert``): each rank holds E/ep of every layer's experts, and ZeRO shards those over the dp·cp/ep ranks
    holding the same experts, the rest of the model over dp·cp as before (``_split_experts``).

    ``memory_layout`` (``theory.memory.MEMORY_LAYOUTS``) says where mixed precision keeps its model states:
    "classic" (16-bit parameters and gradients, fp32 master; the default) or "amp" (fp32 parameters and gradients
    under autocast: what ``workbench run`` trains). The notes name the one priced.
    """
    layout = Layout(dp=dp, tp=tp, pp=pp, sp=sp, zero_stage=zero_stage, schedule=schedule,
                    microbatches=microbatches, virtual_stages=virtual_stages, offload=offload, cp=cp,
                    cp_layout=cp_layout)
    if model == CUSTOM:
        return _custom_table(layout, custom_params_b, precision, optimizer, batch, device_gb, memory_layout)
    n_params = n_params_of(model, custom_params_b)
    result = analyze_layout(model, layout, precision, optimizer, batch, seq_len, recompute, links,
                            memory_layout=memory_layout)
    memory = result["memory"]
    notes = _shape_notes(MODEL_PRESETS[model], layout, precision, memory_layout)
    experts = MODEL_PRESETS[model].get("moe_experts", 0) if moe_experts is None else moe_experts
    comm = result["comm"]
    if experts:
        comm = _split_expert_traffic(comm, memory["ranks"], MODEL_PRESETS[model], layout, experts, ep, precision,
                                     memory_layout)
        memory = _split_experts(memory, MODEL_PRESETS[model], layout, experts, ep, precision, optimizer,
                                memory_layout)
        notes.append(f"experts: {experts // ep} of {experts} per rank and layer (ep={ep}), ZeRO over the "
                     f"{layout.shard_group // ep} rank(s) holding the same ones; their gradients travel over those "
                     f"ranks (the expert_dp row), the dense rest over dp")
    worst = memory["ranks"][memory["worst"]]
    if batch:
        notes.append(f"activations: Korthikanti et al. 2022, micro-batch {batch}, recompute={recompute}, "
                     f"{worst['peak_in_flight']} micro-batch(es) in flight on the worst pipeline rank")
    if not MODEL_PRESETS[model]["exact"]:
        notes.append("parameter count: published total; activations use the GPT estimate (4h MLP)")
    stages = [{k: r[k] for k in ("pp_rank", "stages", "layers", "params", "peak_in_flight", "total")}
              for r in memory["ranks"]]
    return _finish_table(model, n_params, dict(memory["per_rank"]), worst["cpu"], layout, device_gb, precision,
                         optimizer, notes, memory_layout, stages=stages, worst_stage=memory["worst"],
                         bubble=result["bubble"], peak_in_flight=[r["peak_in_flight"] for r in memory["ranks"]],
                         comm=comm, comm_micro_batch=result["comm_micro_batch"])


def _shape_notes(shape: dict, layout: Layout, precision: str, memory_layout: str) -> list[str]:
    """What the table assumes that a reader could take for something else: the memory layout of a mixed precision,
    a Llama shape's SwiGLU and GQA, and K/V heads replicated when tp exceeds them."""
    notes = []
    if is_mixed(precision):
        notes.append(f"memory layout {memory_layout!r}: {MEMORY_LAYOUTS[memory_layout]}")
    if shape.get("mlp") == "swiglu":
        notes.append(f"Llama shape: SwiGLU MLP of {shape['ffn_hidden']}, {shape['n_kv_head']} K/V heads of "
                     f"{shape['n_head']} (grouped-query attention), untied head")
    kv = shape.get("n_kv_head", shape["n_head"])
    if layout.tp > kv:
        notes.append(f"tp={layout.tp} > n_kv_head={kv}: each K/V head is replicated on {layout.tp // kv} tp ranks "
                     f"(its weights, gradients, states and K/V activations priced on each)")
    return notes


def _split_experts(memory: dict, shape: dict, layout: Layout, experts: int, ep: int, precision: str,
                   optimizer: str, memory_layout: str = DEFAULT_LAYOUT) -> dict:
    """``layout_memory``'s ranks re-priced for expert parallelism: a pipeline rank's expert parameters (its layers
    × E experts, split by tp like any matmul) become E/ep of them, sharded by ZeRO over dp·cp/ep ranks; the dense
    rest keeps dp·cp. Activations are left as they were (the dense MLP's estimate)."""
    check_ep(experts, ep, layout.dp)
    per_expert = preset_expert_params(shape)
    group = layout.shard_group
    ranks = []
    for r in memory["ranks"]:
        expert = round(r["layers"] * experts * per_expert / layout.tp)
        dense, local = r["params"] - expert, expert // ep
        args = (layout.zero_stage, precision, optimizer, layout.offload, memory_layout)
        states = {k: model_state_bytes(dense, group, *args)[k] + model_state_bytes(local, group // ep, *args)[k]
                  for k in model_state_bytes(dense, group, *args)}
        cpu = {k: offloaded_bytes(dense, group, *args)[k] + offloaded_bytes(local, group // ep, *args)[k]
               for k in offloaded_bytes(dense, group, *args)}
        if "activations" in r["per_rank"]:
            states["activations"] = r["per_rank"]["activations"]
        ranks.append({**r, "params": dense + local, "per_rank": states, "cpu": cpu, "total": sum(states.values())})
    worst = max(range(len(ranks)), key=lambda i: ranks[i]["total"])
    return {**memory, "ranks": ranks, "worst": worst, "per_rank": ranks[worst]["per_rank"],
            "total": ranks[worst]["total"]}


def _split_expert_traffic(comm: dict, ranks: list[dict], shape: dict, layout: Layout, experts: int, ep: int,
                          precision: str, memory_layout: str) -> dict:
    """``layout_comm``'s dp row split for expert parallelism: a pipeline rank's dense parameters reduce over dp·cp
    as before, its E/ep experts of every layer over the dp·cp/ep ranks holding the same experts (``expert_dp``: the
    trainer's ``expert_data`` traffic), each priced at the slowest pipeline rank."""
    check_ep(experts, ep, layout.dp)
    link = Link(**comm["dp"]["link"])
    split = []
    for r in ranks:
        expert = round(r["layers"] * experts * preset_expert_params(shape) / layout.tp)
        dense = data_parallel_comm(r["params"] - expert, layout, link, precision, memory_layout)
        local = data_parallel_comm(expert // ep, layout, link, precision, memory_layout, layout.shard_group // ep)
        split.append(({**dense, "pp_rank": r["pp_rank"]}, {**local, "pp_rank": r["pp_rank"]}))
    dense, local = max(split, key=lambda pair: pair[0]["time_s"] + pair[1]["time_s"])
    total = comm["total_time_s"] - comm["dp"]["time_s"] + dense["time_s"] + local["time_s"]
    return {**comm, "dp": dense, "expert_dp": local, "total_time_s": total}


def _custom_table(layout: Layout, custom_params_b: float | None, precision: str, optimizer: str, batch: int,
                  device_gb: float, memory_layout: str) -> dict:
    """A size without a shape: parameters split evenly over tp x pp, no activations, no tp/pp traffic."""
    n_params = n_params_of(CUSTOM, custom_params_b)
    validate_schedule(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages)
    check_composition(layout.combination(), meaningless_only=True)
    local = n_params / (layout.tp * layout.pp)
    args = (layout.dp, layout.zero_stage, precision, optimizer, layout.offload, memory_layout)
    per_rank, cpu = model_state_bytes(local, *args), offloaded_bytes(local, *args)
    notes = [f"memory layout {memory_layout!r}: {MEMORY_LAYOUTS[memory_layout]}"] if is_mixed(precision) else []
    if batch:
        notes.append("activations need a model shape: pick a preset to include them")
    if layout.tp * layout.pp > 1:
        notes.append("custom size: parameters split evenly over tp x pp; pick a preset for tp/pp traffic")
    return _finish_table(CUSTOM, n_params, per_rank, cpu, layout, device_gb, precision, optimizer, notes,
                         memory_layout, stages=[], worst_stage=0, peak_in_flight=[],
                         bubble=bubble_fraction(layout.schedule, layout.pp, layout.microbatches,
                                                layout.virtual_stages), comm={}, comm_micro_batch=0)


def _finish_table(model: str, n_params: int, per_rank: dict, cpu: dict, layout: Layout, device_gb: float,
                  precision: str, optimizer: str, notes: list[str], memory_layout: str, **extra) -> dict:
    total = sum(per_rank.values())
    return {
        "model": model, "n_params": n_params, "per_rank": per_rank, "cpu": cpu,
        "total_bytes": total, "total_gib": to_unit(total, "GiB"),
        "cpu_gib": to_unit(sum(cpu.values()), "GiB"), "device_gib": float(device_gb),
        "fits": to_unit(total, "GiB") <= device_gb,
        "formula": formula(layout.zero_stage, precision, optimizer, layout.offload, memory_layout), "notes": notes,
        "memory_layout": memory_layout, "nproc": layout.nproc, **extra,
    }


__all__ = ["CUSTOM", "calculator_table", "n_params_of"]
