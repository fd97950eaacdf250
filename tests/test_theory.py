"""Hand-checked numbers for workbench.theory (pure Python: no torch is imported here)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

import workbench.theory
from workbench.theory.comm import (
    all_gather_time,
    bus_bandwidth,
    bus_bytes,
    dp_step_collectives,
    dp_step_volume,
    fit_alpha_beta,
    hierarchical_allreduce_time,
    reduce_scatter_time,
    ring_allreduce_time,
    tree_allreduce_time,
)
from workbench.theory.memory import (
    activation_bytes,
    formula,
    model_state_bytes,
    offloaded_bytes,
    to_unit,
    total_bytes,
)
from workbench.theory.models import MODEL_PRESETS, activation_bytes_per_layer, gpt_param_count

PSI = 10**9


# ---------------------------------------------------------------- model states (ZeRO paper §5.1)

def test_fp32_adam_zero0_is_16_bytes_per_param():
    got = model_state_bytes(PSI, dp=1, zero_stage=0, precision="fp32", optimizer="adamw")
    assert got == {"parameters": 4e9, "gradients": 4e9, "optimizer_state": 8e9}  # no master copy in fp32
    assert sum(got.values()) == 16e9 == total_bytes(PSI)


def test_bf16_mixed_zero1_n64():
    got = model_state_bytes(PSI, dp=64, zero_stage=1, precision="bf16-mixed")
    # 2Ψ + 2Ψ + 12Ψ/64, with K = 12 split as 4Ψ master + 8Ψ Adam
    assert got == {"parameters": 2e9, "gradients": 2e9, "master_weights": 4e9 / 64, "optimizer_state": 8e9 / 64}
    assert sum(got.values()) == pytest.approx(2 * PSI + 2 * PSI + 12 * PSI / 64)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_stages_follow_paper_figure1(precision):
    n = 8
    totals = [sum(model_state_bytes(PSI, n, s, precision).values()) for s in range(4)]
    assert totals == pytest.approx([16 * PSI, 4 * PSI + 12 * PSI / n, 2 * PSI + 14 * PSI / n, 16 * PSI / n])


def test_stage3_divides_every_category():
    full = model_state_bytes(PSI, 1, 3, "bf16-mixed")
    sharded = model_state_bytes(PSI, 16, 3, "bf16-mixed")
    assert all(sharded[k] == pytest.approx(full[k] / 16) for k in full)


def test_optimizer_state_counts():
    assert model_state_bytes(PSI, optimizer="sgd-momentum")["optimizer_state"] == 4e9
    assert model_state_bytes(PSI, optimizer="sgd")["optimizer_state"] == 0.0
    # mixed-precision SGD still keeps the fp32 master copy
    assert model_state_bytes(PSI, precision="bf16-mixed", optimizer="sgd")["master_weights"] == 4e9


def test_offload_moves_k_term_and_stage3_params_to_cpu():
    dev = model_state_bytes(PSI, 4, 2, "bf16-mixed", offload=True)
    cpu = offloaded_bytes(PSI, 4, 2, "bf16-mixed", offload=True)
    assert dev == {"parameters": 2e9, "gradients": 0.5e9, "master_weights": 0.0, "optimizer_state": 0.0}
    assert cpu == {"parameters": 0.0, "gradients": 0.0, "master_weights": 1e9, "optimizer_state": 2e9}
    dev3 = model_state_bytes(PSI, 4, 3, "bf16-mixed", offload=True)
    assert dev3["parameters"] == 0.0 and dev3["gradients"] == 0.5e9
    # device + cpu is the un-offloaded total
    plain = model_state_bytes(PSI, 4, 3, "bf16-mixed")
    cpu3 = offloaded_bytes(PSI, 4, 3, "bf16-mixed")
    assert all(dev3[k] + cpu3[k] == plain[k] for k in plain)
    assert sum(offloaded_bytes(PSI, 4, 3, "bf16-mixed", offload=False).values()) == 0.0


def test_formula_strings():
    assert formula(0, "bf16-mixed", "adamw") == "2Ψ + 2Ψ + 12Ψ"
    assert formula(1, "bf16-mixed", "adamw") == "2Ψ + 2Ψ + 12Ψ/N"
    assert formula(2, "bf16-mixed", "adamw") == "2Ψ + 14Ψ/N"
    assert formula(3, "bf16-mixed", "adamw") == "16Ψ/N"
    assert formula(0, "fp32", "adamw") == "4Ψ + 4Ψ + 8Ψ"
    assert formula(1, "bf16-mixed", "adamw", offload=True) == "2Ψ + 2Ψ  (CPU: 12Ψ/N)"


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        ({"zero_stage": 4}, "4"),
        ({"precision": "fp8"}, "'fp8'"),
        ({"optimizer": "adam"}, "'adam'"),
        ({"dp": 0}, "0"),
    ],
)
def test_invalid_config_names_the_value(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        model_state_bytes(PSI, **kwargs)


def test_invalid_choice_lists_valid_ones():
    with pytest.raises(ValueError, match="bf16-mixed"):
        model_state_bytes(PSI, precision="fp8")
    with pytest.raises(ValueError, match="'full'"):
        activation_bytes(1, 8, 8, 1, 1, recompute="everything")


def test_to_unit():
    assert to_unit(2**30, "GiB") == 1.0 and to_unit(1e9, "GB") == 1.0
    with pytest.raises(ValueError, match="'GiBs'"):
        to_unit(1, "GiBs")


# ---------------------------------------------------------------- activations (Korthikanti et al. 2022)

def test_activation_bytes_matches_paper_at_16_bit():
    s, b, h, a, layers = 2048, 1, 4096, 32, 2
    expected = layers * s * b * h * (34 + 5 * a * s / h)  # sbh(34 + 5as/h) per layer
    assert activation_bytes(b, s, h, layers, a, bytes_per_value=2) == pytest.approx(expected)


def test_activation_bytes_modes():
    s, b, h, a = 128, 4, 256, 8
    sbh = s * b * h
    # fp32 values, 1-byte masks: (16·4 + 2)·sbh + (2·4 + 1)·as²b
    assert activation_bytes(b, s, h, 1, a, 4) == pytest.approx(66 * sbh + 9 * a * s * s * b)
    # no dropout: 16p·sbh + p·as²b
    assert activation_bytes(b, s, h, 1, a, 4, dropout=False) == pytest.approx(64 * sbh + 4 * a * s * s * b)
    # selective recompute drops the attention-core term; full keeps only the layer input
    assert activation_bytes(b, s, h, 3, a, 2, recompute="selective") == pytest.approx(3 * 34 * sbh)
    assert activation_bytes(b, s, h, 3, a, 2, recompute="full") == pytest.approx(3 * 2 * sbh)
    # tensor parallelism, paper eq. sbh(10 + 24/t + 5as/(ht)); with sequence parallelism all / t
    t = 4
    assert activation_bytes(b, s, h, 1, a, 2, tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert activation_bytes(b, s, h, 1, a, 2, tp=t, sequence_parallel=True) == pytest.approx(
        sbh * (34 + 5 * a * s / h) / t
    )


def test_activation_bytes_per_layer_uses_preset_shape():
    p = MODEL_PRESETS["bench-gpt"]
    one = activation_bytes_per_layer("bench-gpt", batch=2)
    assert one == activation_bytes(2, p["seq_len"], p["d_model"], 1, p["n_head"], 2, dropout=p["dropout"])


# ---------------------------------------------------------------- parameter counts

def test_gpt_param_count_bench_by_hand():
    d, layers, vocab, t = 384, 6, 256, 128
    # per block: ln1 2d + qkv (3d² + 3d) + proj (d² + d) + ln2 2d + fc (4d² + 4d) + proj (4d² + d)
    #          = 12d² + 13d = 12·147456 + 4992 = 1,774,464
    block = 12 * d * d + 13 * d
    assert block == 1_774_464
    # 6 blocks 10,646,784 + wte 256·384 = 98,304 + wpe 128·384 = 49,152 + ln_f 768 = 10,795,008
    assert gpt_param_count(layers, d, vocab, t) == 6 * block + vocab * d + t * d + 2 * d == 10_795_008
    # untied adds an lm_head of V·d
    assert gpt_param_count(layers, d, vocab, t, tied=False) == 10_795_008 + vocab * d


def test_gpt2_small_is_124m():
    assert gpt_param_count(12, 768, 50257, 1024) == 124_439_808  # the well-known GPT-2 small count
    assert MODEL_PRESETS["gpt2-124M"]["n_params"] == 124_439_808


def test_gpt_param_count_without_biases():
    d = 64
    # per block: 2 LayerNorm weights + 12d² linear weights; plus wte, wpe, ln_f weight
    assert gpt_param_count(2, d, 256, 64, biases=False) == 2 * (12 * d * d + 2 * d) + 256 * d + 64 * d + d


def test_presets_have_what_the_calculator_needs():
    for name in ("tiny-gpt", "bench-gpt", "gpt2-124M", "llama-7B", "llama-13B", "llama-70B"):
        preset = MODEL_PRESETS[name]
        assert {"n_params", "n_layer", "d_model", "n_head", "seq_len"} <= set(preset)
    assert MODEL_PRESETS["tiny-gpt"]["n_params"] == gpt_param_count(2, 64, 256, 64)


def test_gpt_param_count_rejects_bad_shape():
    with pytest.raises(ValueError, match="d_model"):
        gpt_param_count(2, 0, 256, 64)


# ---------------------------------------------------------------- collectives (α-β model)

def test_ring_allreduce_formula():
    s, bw, alpha = 1e9, 100e9, 1e-5
    assert ring_allreduce_time(s, 1, alpha, bw) == 0.0  # one rank: no latency, no bandwidth term
    assert ring_allreduce_time(s, 1, 0.0, bw) == 0.0
    assert ring_allreduce_time(s, 4, alpha, bw) == pytest.approx(6 * alpha + 1.5 * s / bw)
    assert ring_allreduce_time(s, 4, alpha, bw) == pytest.approx(
        reduce_scatter_time(s, 4, alpha, bw) + all_gather_time(s, 4, alpha, bw)
    )


def test_tree_and_hierarchical():
    s, bw, alpha = 1e6, 10e9, 1e-5
    assert tree_allreduce_time(s, 8, alpha, bw) == pytest.approx(6 * (alpha + s / bw))  # 2·log2(8) hops
    assert tree_allreduce_time(s, 5, alpha, bw) == pytest.approx(6 * (alpha + s / bw))  # ceil(log2 5) = 3
    got = hierarchical_allreduce_time(s, 8, 4, 1e-6, 300e9, 1e-5, 25e9)
    intra = 7 * 1e-6 + 7 / 8 * s / 300e9
    inter = 2 * 3 * 1e-5 + 2 * 3 / 4 * (s / 8) / 25e9
    assert got == pytest.approx(2 * intra + inter)
    # one group: just a flat ring on the fast link
    assert hierarchical_allreduce_time(s, 8, 1, 1e-6, 300e9, 1e-5, 25e9) == pytest.approx(
        ring_allreduce_time(s, 8, 1e-6, 300e9)
    )


def test_bus_bytes_and_bandwidth():
    s = 800.0
    assert bus_bytes("all_reduce", s, 8) == 2 * 7 / 8 * s == 1400
    assert bus_bytes("reduce_scatter", s, 8) == bus_bytes("all_gather", s, 8) == 700
    assert bus_bytes("all_gather_into_tensor", s, 8) == 700  # torch's name is accepted
    assert bus_bytes("broadcast", s, 8) == bus_bytes("send", s, 2) == s
    assert bus_bytes("all_reduce", s, 1) == 0.0
    assert bus_bandwidth("all_reduce", s, 8, 2.0) == 700.0
    with pytest.raises(ValueError, match="'allgatherv'"):
        bus_bytes("allgatherv", s, 8)


def test_dp_step_volume_zero3_is_one_and_a_half_ddp():
    ddp = dp_step_volume(PSI, 2, 0, 64)
    assert ddp["logical"] == 2 * PSI * 2
    assert ddp["ring_wire"] == pytest.approx(2 * PSI * 2 * 63 / 64)
    for stage in (1, 2):
        assert dp_step_volume(PSI, 2, stage, 64) == ddp
    z3 = dp_step_volume(PSI, 2, 3, 64)
    assert z3["logical"] / ddp["logical"] == 1.5
    assert z3["ring_wire"] / ddp["ring_wire"] == pytest.approx(1.5)
    assert [op for op, _ in dp_step_collectives(PSI, 2, 3)] == ["all_gather", "all_gather", "reduce_scatter"]
    assert dp_step_volume(PSI, 2, 3, 1)["ring_wire"] == 0.0


def test_fit_alpha_beta_recovers_synthetic():
    alpha, bw = 25e-6, 12.5e9
    sizes = [2**k for k in range(10, 28, 2)]
    times = [alpha + s / bw for s in sizes]
    got_alpha, got_bw = fit_alpha_beta(sizes, times)
    assert got_alpha == pytest.approx(alpha, rel=1e-6)
    assert got_bw == pytest.approx(bw, rel=1e-9)
    assert fit_alpha_beta([1, 2], [1.0, 1.0])[1] == math.inf  # flat times: latency-bound
    with pytest.raises(ValueError):
        fit_alpha_beta([5, 5], [1.0, 2.0])


def test_comm_rejects_bad_inputs():
    with pytest.raises(ValueError, match="0"):
        ring_allreduce_time(1.0, 0, 1e-6, 1e9)
    with pytest.raises(ValueError, match="bandwidth"):
        ring_allreduce_time(1.0, 2, 1e-6, 0.0)
    with pytest.raises(ValueError, match="7"):
        dp_step_volume(PSI, 2, 7, 8)


def test_theory_imports_only_stdlib_and_itself():
    """theory is the bottom layer: no torch, nothing of workbench outside workbench.theory (DESIGN.md)."""
    import sys

    allowed = set(sys.stdlib_module_names) | {"__future__", "workbench"}
    for path in Path(workbench.theory.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
                assert not name.startswith("workbench.") or name.startswith("workbench.theory"), name
