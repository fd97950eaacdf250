"""The memory calculator widget and the memory figures: they build, react, and agree with theory."""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
import pytest

from workbench.theory.memory import activation_bytes, model_state_bytes, offloaded_bytes
from workbench.theory.models import MODEL_PRESETS
from workbench.theory.parallelism import Layout, analyze_layout
from workbench.viz.memory import CATEGORY_COLORS, measured_vs_theory, memory_bars
from workbench.widgets.memory_calculator import calculator_table, memory_calculator

GIB = 2**30


def test_calculator_table_agrees_with_model_state_bytes():
    n = MODEL_PRESETS["llama-7B"]["n_params"]
    table = calculator_table("llama-7B", dp=64, zero_stage=1, precision="bf16-mixed", optimizer="adamw")
    expected = model_state_bytes(n, 64, 1, "bf16-mixed", "adamw")
    assert table["per_rank"] == expected
    assert table["total_bytes"] == pytest.approx(2 * n + 2 * n + 12 * n / 64)
    assert table["total_gib"] == pytest.approx(table["total_bytes"] / GIB)
    assert table["formula"] == "2Ψ + 2Ψ + 12Ψ/N"
    assert table["fits"] is True


def test_calculator_table_fit_and_offload():
    # 70B in bf16 with Adam on 8 ranks, ZeRO-0: 16 B/param ≈ 1028 GiB per rank, far above 80 GiB
    assert calculator_table("llama-70B", dp=8, zero_stage=0)["fits"] is False
    t = calculator_table("llama-70B", dp=8, zero_stage=3, offload=True, device_gb=24)
    n = MODEL_PRESETS["llama-70B"]["n_params"]
    assert t["cpu"] == offloaded_bytes(n, 8, 3, "bf16-mixed", "adamw", True)
    assert t["total_bytes"] == pytest.approx(2 * n / 8)  # only the gradient shard stays on the device
    assert t["cpu_gib"] == pytest.approx(14 * n / 8 / GIB)


def test_calculator_table_custom_and_activations():
    t = calculator_table("custom", custom_params_b=1.0, dp=1, zero_stage=0, precision="fp32")
    assert t["n_params"] == 10**9 and t["total_bytes"] == 16e9
    with pytest.raises(ValueError, match="custom_params_b"):
        calculator_table("custom")
    with pytest.raises(ValueError, match="'gpt-5'"):
        calculator_table("gpt-5")
    p = MODEL_PRESETS["gpt2-124M"]
    t = calculator_table("gpt2-124M", batch=4, seq_len=512, recompute="selective")
    act = activation_bytes(4, 512, p["d_model"], p["n_layer"], p["n_head"], 2, "selective", dropout=p["dropout"])
    assert t["per_rank"]["activations"] == act
    assert t["total_bytes"] == pytest.approx(16 * p["n_params"] + act)


def test_widget_builds_and_reacts():
    w = memory_calculator("llama-7B")
    assert isinstance(w, widgets.VBox)
    n = MODEL_PRESETS["llama-7B"]["n_params"]
    c = w.controls
    c["precision"].value, c["optimizer"].value, c["dp"].value, c["zero_stage"].value = "bf16", "adamw", 8, 0
    assert w.table["total_bytes"] == pytest.approx(16 * n)
    c["zero_stage"].value = 3
    assert w.table["total_bytes"] == pytest.approx(16 * n / 8)
    assert "16Ψ/N" in w.summary.value
    c["dp"].value = 64
    assert w.table["total_bytes"] == pytest.approx(16 * n / 64)
    assert w.table == calculator_table(**w.inputs())


def test_widget_figure_follows_controls():
    w = memory_calculator("bench-gpt")
    fig = w.figure
    assert isinstance(fig, go.Figure)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [b.name for b in bars] == ["parameters", "gradients", "master_weights", "optimizer_state"]
    assert list(bars[0].x) == ["ZeRO-0 ◀", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    w.controls["activations"].value = True
    assert "activations" in [t.name for t in w.figure.data]
    assert w.table["per_rank"]["activations"] > 0
    w.controls["precision"].value = "fp32"
    assert "master_weights" not in [t.name for t in w.figure.data]


def test_widget_custom_size_and_device_memory():
    w = memory_calculator()
    w.controls["model"].value = "custom"
    assert not w.controls["custom_params_b"].disabled
    w.controls["custom_params_b"].value = 2.0
    assert w.table["n_params"] == 2 * 10**9
    w.controls["device_gb"].value = 24
    assert w.table["device_gib"] == 24.0
    w.controls["custom_params_b"].value = 0.0  # invalid while typing: message shown, no exception
    assert "custom_params_b" in w.summary.value


def test_calculator_table_takes_the_run_layout():
    layout = Layout(dp=2, tp=8, pp=4, sp=True, zero_stage=1, schedule="interleaved", microbatches=8, virtual_stages=2)
    t = calculator_table("llama-70B", dp=2, zero_stage=1, batch=1, tp=8, sp=True, pp=4, schedule="interleaved",
                         microbatches=8, virtual_stages=2)
    theory = analyze_layout("llama-70B", layout, micro_batch=1)
    assert t["per_rank"] == theory["memory"]["per_rank"] and t["worst_stage"] == theory["memory"]["worst"]
    assert t["nproc"] == 64 and len(t["stages"]) == 4
    assert t["bubble"] == pytest.approx(3 / (2 * 8 + 3))  # interleaved: (p-1)/(v·m + p-1)
    assert t["peak_in_flight"] == [r["peak_in_flight"] for r in theory["memory"]["ranks"]]
    assert t["comm"] == theory["comm"] and t["comm"]["tp"]["time_s"] > 0
    with pytest.raises(ValueError, match="tp=3 must divide"):
        calculator_table("llama-7B", tp=3)
    custom = calculator_table("custom", custom_params_b=8.0, tp=2, pp=4, microbatches=4, precision="fp32")
    assert custom["total_bytes"] == pytest.approx(16 * 8e9 / 8) and custom["comm"] == {}
    assert custom["bubble"] == pytest.approx(3 / 7)


def test_widget_shows_layout_bubble_and_communication():
    w = memory_calculator("llama-70B")
    c = w.controls
    c["dp"].value, c["tp"].value, c["pp"].value, c["microbatches"].value = 2, 8, 4, 16
    assert w.table == calculator_table(**w.inputs())
    assert w.table["nproc"] == 64 and "on 64 ranks" in w.summary.value
    assert "pipeline bubble: 15.8%" in w.summary.value
    assert "communication per step" in w.summary.value and "NVLink" in w.summary.value
    assert "tp = 8, pp = 4" in w.figure.layout.title.text
    c["pp"].value = 81  # more stages than the 80 layers: said in the summary, no exception
    assert "81 pipeline stages but the model has only 80 layers" in w.summary.value


def test_memory_bars_and_measured_vs_theory():
    per_config = {f"ZeRO-{s}": model_state_bytes(10**6, 4, s, "bf16-mixed") for s in range(4)}
    fig = memory_bars(per_config, unit="MiB")
    bars = {t.name: t for t in fig.data if t.type == "bar"}
    assert bars["optimizer_state"].marker.color == CATEGORY_COLORS["optimizer_state"]
    assert bars["parameters"].y[0] == pytest.approx(2e6 / 2**20)
    measured = {k: {**v, "activations": 1e6} for k, v in per_config.items()}
    fig2 = measured_vs_theory(measured, per_config, unit="MB")
    names = [t.name for t in fig2.data]
    assert names[-1] == "activations" and len(names) == 5
    params = fig2.data[0]
    assert list(params.x[1])[:2] == ["measured", "theory"]
    assert params.y[0] == params.y[1] == pytest.approx(2.0)
    fig2.to_json()  # serialisable: renders in a notebook and in nbval
    with pytest.raises(ValueError, match="'MiBs'"):
        memory_bars(per_config, unit="MiBs")
