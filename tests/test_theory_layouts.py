"""One memory model with an explicit layout, shared precision names, and Llama-shaped presets (issue 24 items 3-4,
issue 19's precision names). Pure theory: exact integer/float arithmetic, so equalities are exact unless a
tolerance says why."""

from __future__ import annotations

import pytest

from workbench.theory.calculator import calculator_table
from workbench.theory.memory import (
    MEMORY_LAYOUTS,
    activation_bytes,
    formula,
    kv_heads_per_rank,
    llama_activation_bytes,
    model_state_bytes,
    state_bytes_per_param,
)
from workbench.theory.models import (
    MODEL_PRESETS,
    activation_bytes_per_layer,
    gpt_param_count,
    llama_ffn_hidden,
    llama_param_count,
)
from workbench.theory.parallelism import Layout, layout_memory, stage_params
from workbench.theory.precisions import PRECISION_ALIASES, PRECISION_NAMES, canonical_precision

PSI = 10**9

# ---------------------------------------------------------------- two mixed-precision layouts, one function

# Bytes per parameter, (replicated, sharded over N), AdamW, by ZeRO stage: the table, written out by hand.
# amp: fp32 params 4 + fp32 grads 4 + m, v 8. classic: bf16 params 2 + bf16 grads 2 + fp32 master 4 + m, v 8.
LAYOUT_TABLE = {
    "amp": {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)},
    "classic": {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)},
}


@pytest.mark.parametrize("memory_layout", sorted(LAYOUT_TABLE))
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_each_layout_keeps_its_bytes_replicated_and_sharded(memory_layout: str, zero: int) -> None:
    replicated, sharded = LAYOUT_TABLE[memory_layout][zero]
    got = sum(model_state_bytes(PSI, 8, zero, "bf16", memory_layout=memory_layout).values())
    assert got == (replicated + sharded / 8) * PSI


def test_the_layouts_agree_unsharded_and_under_zero3_and_part_under_zero1_and_2() -> None:
    def total(zero: int, memory_layout: str) -> float:
        return sum(model_state_bytes(PSI, 64, zero, "bf16", memory_layout=memory_layout).values())

    for zero in (0, 3):
        assert total(zero, "amp") == total(zero, "classic")
    assert total(1, "amp") - total(1, "classic") == (8 - 4) * PSI - (12 - 8) * PSI / 64
    assert total(2, "amp") > total(2, "classic")


def test_amp_holds_what_fp32_holds_and_the_classic_layout_has_a_master_copy() -> None:
    assert state_bytes_per_param("bf16", memory_layout="amp") == state_bytes_per_param("fp32")
    assert state_bytes_per_param("fp16", memory_layout="classic") == {
        "parameters": 2.0, "gradients": 2.0, "master_weights": 4.0, "optimizer_state": 8.0}
    for memory_layout in MEMORY_LAYOUTS:  # fp32 has no separate master whichever layout is named
        assert state_bytes_per_param("fp32", memory_layout=memory_layout) == {
            "parameters": 4.0, "gradients": 4.0, "optimizer_state": 8.0}


def test_formula_names_each_layouts_terms() -> None:
    assert formula(1, "bf16", memory_layout="amp") == "4Ψ + 4Ψ + 8Ψ/N"
    assert formula(2, "bf16", memory_layout="amp") == "4Ψ + 12Ψ/N"
    assert formula(1, "bf16", memory_layout="classic") == "2Ψ + 2Ψ + 12Ψ/N"


def test_an_unknown_layout_is_named_with_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"memory_layout 'fp32-master'.*'amp', 'classic'"):
        model_state_bytes(PSI, memory_layout="fp32-master")


def test_layout_memory_and_the_calculator_price_the_layout_they_are_given() -> None:
    layout = Layout(dp=4, zero_stage=1)
    n = MODEL_PRESETS["llama-7B"]["n_params"]
    for memory_layout in MEMORY_LAYOUTS:
        mem = layout_memory("llama-7B", layout, "bf16", memory_layout=memory_layout)
        assert mem["per_rank"] == model_state_bytes(n, 4, 1, "bf16", memory_layout=memory_layout)
        table = calculator_table("llama-7B", dp=4, zero_stage=1, precision="bf16", memory_layout=memory_layout)
        assert table["per_rank"] == mem["per_rank"] and table["memory_layout"] == memory_layout
        assert any(note.startswith(f"memory layout {memory_layout!r}") for note in table["notes"])


# ---------------------------------------------------------------- precision names

def test_aliases_price_exactly_what_their_canonical_names_price() -> None:
    for alias, name in PRECISION_ALIASES.items():
        assert canonical_precision(alias) == name
        for memory_layout in MEMORY_LAYOUTS:
            assert model_state_bytes(PSI, 4, 1, alias, memory_layout=memory_layout) == \
                model_state_bytes(PSI, 4, 1, name, memory_layout=memory_layout)
    assert [canonical_precision(n) for n in PRECISION_NAMES] == list(PRECISION_NAMES)
    with pytest.raises(ValueError, match=r"unknown precision 'fp8'; valid: 'fp32', 'bf16', 'fp16'"):
        canonical_precision("fp8")


# ---------------------------------------------------------------- Llama shapes

def test_llama_ffn_hidden_rounds_as_llamas_code_does() -> None:
    # Llama 2's params.json: multiple_of 256 (4096 for 70B), ffn_dim_multiplier 1.3 for 70B
    assert llama_ffn_hidden(4096) == 11008 and llama_ffn_hidden(5120) == 13824
    assert llama_ffn_hidden(8192, multiple_of=4096, ffn_dim_multiplier=1.3) == 28672


@pytest.mark.parametrize("name, published, rounded_b", [
    ("llama-7B", 6_738_415_616, 6.74), ("llama-13B", 13_015_864_320, 13.02), ("llama-70B", 68_976_648_192, 68.98),
])
def test_llama_presets_count_the_published_parameters(name: str, published: int, rounded_b: float) -> None:
    """The count is computed from the shape, so it must be the model card's integer exactly; and within the
    rounding (0.005 B) of the totals the Llama 2 paper prints."""
    shape = MODEL_PRESETS[name]
    count = llama_param_count(shape["n_layer"], shape["d_model"], shape["n_head"], shape["n_kv_head"],
                              shape["ffn_hidden"], shape["vocab_size"])
    assert count == shape["n_params"] == published
    assert abs(count / 1e9 - rounded_b) <= 0.005
    assert stage_params(name)[0]["params"] == published  # the 3D theory places every parameter once


def test_the_gpt_shaped_70b_is_a_different_model_from_llama_2_70b() -> None:
    gpt, llama = MODEL_PRESETS["gpt-70B"], MODEL_PRESETS["llama-70B"]
    assert (gpt["n_layer"], gpt["d_model"], gpt["n_head"]) == (llama["n_layer"], llama["d_model"], llama["n_head"])
    assert gpt["n_params"] == gpt_param_count(80, 8192, 32000, 4096)  # 4h GeLU MLP, 64 K/V heads, tied head
    assert llama["n_kv_head"] == 8 and gpt.get("n_kv_head") is None
    assert gpt["n_params"] < llama["n_params"]


def test_llama_70b_layer_activations_by_hand() -> None:
    """One Llama-2-70B layer, s = 4096, b = 1, bf16, no recomputation, tp = 1. With sbh = s·b·h:
    norm inputs, q/k/v input and MLP input 4·2·sbh; Q and the out-projection's input 2·2·sbh; K and V, 8 of 64
    heads, 2·2·sbh/8; SwiGLU's four 28672 = 3.5h wide tensors 4·2·3.5·sbh; the softmax output 2·a·s²·b."""
    s, h, a = 4096, 8192, 64
    sbh = s * h
    by_hand = (8 + 4 + 0.5 + 28) * sbh + 2 * a * s * s
    assert activation_bytes_per_layer("llama-70B", 1, recompute="none") == by_hand
    assert activation_bytes_per_layer("llama-70B", 1, recompute="selective") == (8 + 4 + 0.5 + 28) * sbh
    assert activation_bytes_per_layer("llama-70B", 1, recompute="full") == 2 * sbh
    # the GPT-shaped 70B's selective count: 16p·sbh, no dropout; SwiGLU and GQA keep 40.5 / 32 as much
    gpt = activation_bytes_per_layer("gpt-70B", 1, recompute="selective")
    assert gpt == activation_bytes(1, s, h, 1, a, 2, "selective", dropout=False) == 32 * sbh


def test_tp_splits_kv_heads_up_to_their_number_then_replicates_them() -> None:
    assert [kv_heads_per_rank(64, 8, tp) for tp in (1, 4, 8, 16, 64)] == [8, 2, 1, 1, 1]
    with pytest.raises(ValueError, match="tp=6 with n_kv_head=4"):
        kv_heads_per_rank(12, 4, 6)  # neither divides the other: no even split, no even replication
    one_head_kv = 2 * 8192 * 128  # k and v weights of one K/V head
    block = MODEL_PRESETS["llama-70B"]["n_params"] - 2 * 32000 * 8192 - 8192
    per_layer = block // 80
    kv, norms = 2 * 8192 * 1024, 2 * 8192
    rank = stage_params("llama-70B", tp=16, pp=80)[1]  # a middle stage: one layer, no embedding or head
    assert rank["params"] == (per_layer - norms - kv) / 16 + norms + one_head_kv
    split8 = stage_params("llama-70B", tp=8, pp=80)[1]
    assert split8["params"] == (per_layer - norms) / 8 + norms  # at tp = n_kv_head everything still splits


def test_tp_past_the_kv_heads_is_noted_and_an_uneven_split_refused() -> None:
    table = calculator_table("llama-70B", dp=1, tp=16, pp=4, microbatches=8)
    assert any("tp=16 > n_kv_head=8: each K/V head is replicated on 2 tp ranks" in n for n in table["notes"])
    assert not any("replicated" in n for n in calculator_table("llama-70B", tp=8, pp=4, microbatches=8)["notes"])
    odd = {**MODEL_PRESETS["llama-70B"], "n_head": 12, "n_kv_head": 4, "d_model": 1536}
    with pytest.raises(ValueError, match="tp=6 with n_kv_head=4"):
        Layout(tp=6).validate(odd)


def test_llama_activations_split_with_tp_and_sp() -> None:
    args = (1, 4096, 8192, 1, 64, 8, 28672, 2)
    whole = llama_activation_bytes(*args, "selective")
    tp8 = llama_activation_bytes(*args, "selective", tp=8)
    sp8 = llama_activation_bytes(*args, "selective", tp=8, sequence_parallel=True)
    sbh = 4096 * 8192
    assert tp8 == 8 * sbh + (4 + 28) * sbh / 8 + 0.5 * sbh / 8  # the 4 unsplit p·sbh stay whole
    assert sp8 == whole / 8


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_dp_traffic_moves_the_bytes_the_memory_layout_keeps(zero: int) -> None:
    """The dp row of ``layout_comm`` reduces gradients and gathers parameters at the memory layout's bytes: 16-bit
    under "classic", fp32 under "amp" (what ``workbench run`` all-reduces under autocast), so amp's traffic is
    exactly twice classic's in a mixed precision, and fp32 is the same under both."""
    from workbench.theory.parallelism import layout_comm

    layout = Layout(dp=8, zero_stage=zero)
    classic, amp = (layout_comm("llama-7B", layout, "bf16", memory_layout=m)["dp"] for m in ("classic", "amp"))
    assert amp["wire_bytes"] == 2 * classic["wire_bytes"] > 0
    assert [op for op, _, _ in amp["ops"]] == [op for op, _, _ in classic["ops"]]
    fp32 = [layout_comm("llama-7B", layout, "fp32", memory_layout=m)["dp"]["wire_bytes"] for m in ("classic", "amp")]
    assert fp32[0] == fp32[1] == amp["wire_bytes"]
    table = calculator_table("llama-7B", dp=8, zero_stage=zero, precision="bf16", memory_layout="amp")
    assert table["comm"]["dp"]["wire_bytes"] == amp["wire_bytes"]  # calc prices the layout it is given
