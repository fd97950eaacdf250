"""theory.parallelism: a (dp, tp, pp) layout's memory per rank, traffic per axis and bubble, checked against the
single-axis formulas it is built from (memory, comm, pipeline) and against hand counts."""

from __future__ import annotations

import math

import pytest

from workbench.theory.comm import (
    dp_step_volume,
    reduce_scatter_time,
    ring_allreduce_time,
    sp_block_volume,
    tp_block_volume,
)
from workbench.theory.memory import activation_bytes, llama_activation_bytes, model_state_bytes, offloaded_bytes
from workbench.theory.models import MODEL_PRESETS
from workbench.theory.parallelism import (
    DEFAULT_LINKS,
    Layout,
    Link,
    analyze_layout,
    layout_comm,
    layout_memory,
    micro_batch_size,
    param_parts,
    stage_params,
)
from workbench.theory.pipeline import analyze, bubble_fraction, peak_held_layers, peak_in_flight, stage_layers

LLAMA7 = MODEL_PRESETS["llama-7B"]


def _act(name: str, b: int, p: int = 2, recompute: str = "none", tp: int = 1, sp: bool = False,
         s: int | None = None) -> float:
    """One layer of a preset, from memory.activation_bytes (GPT shapes) or llama_activation_bytes directly."""
    m = MODEL_PRESETS[name]
    if m.get("mlp") == "swiglu":
        return llama_activation_bytes(b, s or m["seq_len"], m["d_model"], 1, m["n_head"], m["n_kv_head"],
                                      m["ffn_hidden"], p, recompute, tp, sp)
    return activation_bytes(b, s or m["seq_len"], m["d_model"], 1, m["n_head"], p, recompute, dropout=m["dropout"],
                            tp=tp, sequence_parallel=sp)


# ---------------------------------------------------------------- tp = pp = 1 is the existing theory


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_one_rank_per_replica_places_every_parameter_once(name: str) -> None:
    assert stage_params(name)[0]["params"] == MODEL_PRESETS[name]["n_params"]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("precision, offload", [("fp32", False), ("bf16-mixed", False), ("bf16-mixed", True)])
def test_without_tp_and_pp_model_states_equal_model_state_bytes(zero: int, precision: str, offload: bool) -> None:
    n = LLAMA7["n_params"]
    mem = layout_memory("llama-7B", Layout(dp=8, zero_stage=zero, offload=offload), precision)
    assert mem["per_rank"] == model_state_bytes(n, 8, zero, precision, "adamw", offload)
    assert mem["ranks"][0]["cpu"] == offloaded_bytes(n, 8, zero, precision, "adamw", offload)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_without_tp_and_pp_activations_equal_activation_bytes(recompute: str) -> None:
    m = MODEL_PRESETS["gpt2-124M"]
    mem = layout_memory("gpt2-124M", Layout(), "fp32", micro_batch=4, seq_len=512, recompute=recompute)
    expected = activation_bytes(4, 512, m["d_model"], m["n_layer"], m["n_head"], 4, recompute, dropout=False)
    assert mem["per_rank"]["activations"] == expected
    assert "activations" not in layout_memory("gpt2-124M", Layout())["per_rank"]  # micro_batch 0: states only


# ---------------------------------------------------------------- tensor parallelism divides where expected


def test_tp_divides_the_split_weights_and_keeps_norms_whole_llama() -> None:
    d, v, n_layer = LLAMA7["d_model"], LLAMA7["vocab_size"], LLAMA7["n_layer"]
    whole = 2 * d * n_layer + d  # two RMSNorms per layer and the final one
    params = stage_params("llama-7B", tp=8)[0]["params"]
    assert params == (LLAMA7["n_params"] - whole) // 8 + whole
    assert (LLAMA7["n_params"] - whole) % 8 == 0 and v % 8 == 0
    mem = layout_memory("llama-7B", Layout(dp=4, tp=8, zero_stage=1))
    assert mem["per_rank"] == model_state_bytes(params, 4, 1, "bf16-mixed")
    assert mem["per_rank"]["parameters"] == 2 * params


def test_tp_on_our_gpt_keeps_layernorms_row_biases_and_positions_whole() -> None:
    m = MODEL_PRESETS["bench-gpt"]
    d, v, t, n_layer = m["d_model"], m["vocab_size"], m["seq_len"], m["n_layer"]
    split = n_layer * (12 * d * d + 7 * d) + v * d
    whole = n_layer * 6 * d + t * d + 2 * d
    assert split + whole == m["n_params"]
    assert stage_params("bench-gpt", tp=2)[0]["params"] == split // 2 + whole


def test_tp_pads_a_vocabulary_it_does_not_divide() -> None:
    m = MODEL_PRESETS["gpt2-124M"]  # 50257 = 29 x 1733
    d = m["d_model"]
    params = stage_params("gpt2-124M", tp=4)[0]["params"]
    blocks = m["n_layer"] * ((12 * d * d + 7 * d) // 4 + 6 * d)
    assert params == blocks + math.ceil(50257 / 4) * d + m["seq_len"] * d + 2 * d


# ---------------------------------------------------------------- pipeline stages


def test_pp_cuts_layers_and_places_embedding_first_and_head_last_llama() -> None:
    d, v = LLAMA7["d_model"], LLAMA7["vocab_size"]
    block = param_parts("llama-7B")["block"]
    per_layer = block.split + block.whole
    ranks = stage_params("llama-7B", pp=4)
    assert [r["layers"] for r in ranks] == [8, 8, 8, 8]
    assert [r["params"] for r in ranks] == [8 * per_layer + v * d, 8 * per_layer, 8 * per_layer,
                                            8 * per_layer + v * d + d]
    assert sum(r["params"] for r in ranks) == LLAMA7["n_params"]
    mem = layout_memory("llama-7B", Layout(pp=4, microbatches=4))
    assert mem["worst"] == 3  # the head and the final norm
    assert mem["per_rank"] == model_state_bytes(ranks[3]["params"], 1, 0, "bf16-mixed")


def test_pp_and_tp_together_divide_by_both() -> None:
    ranks = stage_params("llama-7B", tp=4, pp=2)
    whole = LLAMA7["n_layer"] * 2 * LLAMA7["d_model"] + LLAMA7["d_model"]
    assert sum(r["params"] for r in ranks) == (LLAMA7["n_params"] - whole) // 4 + whole


def test_a_tied_head_is_a_second_copy_on_the_last_stage() -> None:
    m = MODEL_PRESETS["bench-gpt"]
    ranks = stage_params("bench-gpt", pp=2)
    assert sum(r["params"] for r in ranks) == m["n_params"] + m["vocab_size"] * m["d_model"]
    assert ranks[0]["first"] and ranks[1]["last"]


def test_uneven_stages_give_the_first_ranks_the_extra_layers() -> None:
    ranks = stage_params("gpt2-124M", pp=5)  # 12 layers
    assert [r["layers"] for r in ranks] == [len(r) for r in stage_layers(12, 5)] == [3, 3, 2, 2, 2]


# ---------------------------------------------------------------- activations per schedule


@pytest.mark.parametrize("schedule, p, m, v", [
    ("naive", 4, 4, 1), ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("zb", 4, 8, 1), ("interleaved", 4, 8, 2),
    ("1f1b", 1, 4, 1), ("gpipe", 1, 4, 1),
])
def test_peak_in_flight_is_the_pipeline_theorys(schedule: str, p: int, m: int, v: int) -> None:
    layout = Layout(pp=p, schedule=schedule, microbatches=m, virtual_stages=v)
    mem = layout_memory("llama-7B", layout, micro_batch=1)
    theory = analyze(schedule, p, m, v, n_layer=32)
    assert [r["peak_in_flight"] for r in mem["ranks"]] == theory["peak_in_flight"]
    per_stage = 32 // (p * v)  # equal stages: held layers = micro-batches in flight x layers per stage
    for r in mem["ranks"]:
        assert r["peak_held_layers"] == r["peak_in_flight"] * per_stage
        assert r["per_rank"]["activations"] == r["peak_held_layers"] * _act("llama-7B", 1)


def test_1f1b_holds_one_micro_batch_of_the_whole_model_on_rank_0_gpipe_holds_m() -> None:
    full = _act("llama-7B", 2) * 32
    one_f_one_b = layout_memory("llama-7B", Layout(pp=4, microbatches=16), micro_batch=2)
    assert one_f_one_b["ranks"][0]["per_rank"]["activations"] == pytest.approx(full)
    gpipe = layout_memory("llama-7B", Layout(pp=4, schedule="gpipe", microbatches=16), micro_batch=2)
    assert gpipe["ranks"][0]["per_rank"]["activations"] == pytest.approx(16 * full / 4)


def test_uneven_stages_weigh_each_held_micro_batch_by_its_layers() -> None:
    mem = layout_memory("gpt2-124M", Layout(pp=5, microbatches=5), micro_batch=1)  # layers [3, 3, 2, 2, 2]
    assert [r["peak_held_layers"] for r in mem["ranks"]] == [5 * 3, 4 * 3, 3 * 2, 2 * 2, 1 * 2]
    plan = analyze("1f1b", 5, 5)["plan"]
    assert peak_held_layers(plan[0], [1] * 5) == peak_in_flight(plan[0])


def test_sequence_parallel_splits_what_tp_keeps_whole() -> None:
    tp = layout_memory("llama-7B", Layout(tp=8), micro_batch=1)["per_rank"]["activations"]
    sp = layout_memory("llama-7B", Layout(tp=8, sp=True), micro_batch=1)["per_rank"]["activations"]
    assert tp == 32 * _act("llama-7B", 1, tp=8)
    assert sp == 32 * _act("llama-7B", 1, tp=8, sp=True)
    assert sp < tp


# ---------------------------------------------------------------- communication per axis


def test_tp_bytes_are_tp_block_volume_times_layers() -> None:
    layout = Layout(tp=8, pp=2, microbatches=2)
    comm = layout_comm("llama-7B", layout, micro_batch=1)["tp"]
    per_block = tp_block_volume(1, 4096, 4096, 8, bytes_per_elem=2)
    layers, mbs = 16, 2
    assert comm["tensor_bytes"] == per_block["tensor"] * layers * mbs
    assert comm["wire_bytes"] == pytest.approx(per_block["ring_wire"] * layers * mbs)
    link = DEFAULT_LINKS["tp"]
    size = 4096 * 4096 * 2
    assert comm["time_s"] == pytest.approx(4 * layers * mbs * ring_allreduce_time(size, 8, link.alpha, link.bandwidth))


def test_sp_bytes_are_sp_block_volume_and_full_recompute_repeats_the_forward() -> None:
    sp = layout_comm("llama-7B", Layout(tp=4, sp=True), micro_batch=2)["tp"]
    assert sp["tensor_bytes"] == sp_block_volume(2, 4096, 4096, 4, bytes_per_elem=2)["tensor"] * 32
    tp = layout_comm("llama-7B", Layout(tp=4), micro_batch=2)["tp"]
    tp_full = layout_comm("llama-7B", Layout(tp=4), micro_batch=2, recompute="full")["tp"]
    assert tp_full["tensor_bytes"] == pytest.approx(tp["tensor_bytes"] * 6 / 4)  # 2 forward all-reduces again


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_dp_bytes_are_dp_step_volume_of_the_ranks_own_parameters(zero: int) -> None:
    layout = Layout(dp=16, tp=2, pp=2, zero_stage=zero, microbatches=2)
    comm = layout_comm("llama-7B", layout)["dp"]
    params = max(r["params"] for r in stage_params("llama-7B", 2, 2))
    assert comm["wire_bytes"] == pytest.approx(dp_step_volume(params, 2, zero, 16)["ring_wire"])
    link = DEFAULT_LINKS["dp"]
    one = params * 2
    expected = (ring_allreduce_time(one, 16, link.alpha, link.bandwidth) if zero == 0 else
                (2 if zero < 3 else 3) * reduce_scatter_time(one, 16, link.alpha, link.bandwidth))
    assert comm["time_s"] == pytest.approx(expected)


def test_pp_sends_one_activation_and_one_gradient_per_micro_batch_and_boundary() -> None:
    link = Link(alpha=1e-5, bandwidth=1e10)
    comm = layout_comm("llama-7B", Layout(pp=4, microbatches=8), micro_batch=1, links={"pp": link})["pp"]
    size = 1 * 4096 * 4096 * 2
    assert comm["pp_rank"] in (1, 2)  # a middle rank sends both ways
    assert comm["ops"] == [["send", size, 2 * 8]]
    assert comm["time_s"] == pytest.approx(16 * (link.alpha + size / link.bandwidth))
    tied = layout_comm("bench-gpt", Layout(pp=2, microbatches=2), micro_batch=1)["pp"]  # + the tied gradient
    m = MODEL_PRESETS["bench-gpt"]
    assert tied["tensor_bytes"] == 2 * (1 * 128 * 384 * 2) + m["vocab_size"] * m["d_model"] * 2


def test_axes_of_size_one_move_nothing() -> None:
    comm = layout_comm("llama-7B", Layout())
    assert all(comm[a]["ops"] == [] and comm[a]["time_s"] == 0 for a in ("dp", "tp", "pp"))
    assert comm["total_time_s"] == 0


def test_analyze_layout_bubble_is_the_schedules() -> None:
    result = analyze_layout("llama-70B", Layout(dp=2, tp=8, pp=4, zero_stage=1, microbatches=16))
    assert result["bubble"] == bubble_fraction("1f1b", 4, 16) == pytest.approx(3 / 19)
    assert result["comm_micro_batch"] == 1 and "activations" not in result["memory"]["per_rank"]
    assert result["comm"]["total_time_s"] == pytest.approx(sum(result["comm"][a]["time_s"] for a in ("dp", "tp", "pp")))


# ---------------------------------------------------------------- bad layouts name the value


@pytest.mark.parametrize("layout, kwargs, message", [
    (Layout(tp=3), {}, "tp=3 must divide the model's n_head=32"),
    (Layout(pp=33), {}, "33 pipeline stages but the model has only 32 layers"),
    (Layout(pp=8, schedule="interleaved", virtual_stages=8, microbatches=8), {}, "64 pipeline stages"),
    (Layout(dp=2, tp=2, pp=2), {"nproc": 16}, "dp x tp x pp = 2 x 2 x 2 = 8 but nproc=16"),
    (Layout(sp=True), {}, "sp \\(sequence parallelism\\) needs tp > 1"),
    (Layout(tp=8, sp=True), {"seq_len": 100}, "seq_len=100 must be divisible by tp=8"),
    (Layout(pp=4, microbatches=2), {}, "needs at least as many micro-batches as stages"),
    (Layout(pp=2, schedule="2f2b"), {}, "unknown pipeline schedule '2f2b'"),
    (Layout(zero_stage=4), {}, "unknown zero_stage 4"),
    (Layout(dp=0), {}, "dp must be a positive int, got 0"),
])
def test_bad_layouts_raise_naming_the_value(layout: Layout, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layout.validate("llama-7B", **kwargs)


def test_bad_inputs_of_the_estimates() -> None:
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        layout_memory("llama-7B", Layout(), "fp8")
    with pytest.raises(ValueError, match="micro_batch must be a positive int, got 0"):
        layout_comm("llama-7B", Layout(), micro_batch=0)
    with pytest.raises(ValueError, match="batch_size=6 must divide into dp x microbatches = 2 x 4"):
        micro_batch_size(6, 2, 4)
    assert micro_batch_size(64, 2, 16) == 2
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        Link(alpha=0.0, bandwidth=0.0)
    with pytest.raises(ValueError, match="unknown model 'gpt-5'"):
        layout_memory("gpt-5", Layout())
