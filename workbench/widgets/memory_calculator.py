"""Memory calculator: how many bytes per rank does a model need, and does it fit one device?

The numbers come from `workbench.theory` (ZeRO paper §5.1 for model states, Korthikanti et al. 2022
for activations, `theory.parallelism` for where tensor and pipeline parallelism put them, `theory.pipeline`
for the schedule's bubble and in-flight micro-batches, `theory.comm` for the α-β time of each axis's
traffic). `calculator_table` (``workbench.theory.calculator``, re-exported here) is the whole calculation as a
pure function, so tests and `workbench calc` use exactly what the widget shows, without ipywidgets or plotly;
the widget only collects inputs and draws.
"""

from __future__ import annotations

import importlib.util
import json

import ipywidgets as widgets
import plotly.graph_objects as go

from workbench.theory.calculator import CUSTOM, calculator_table, n_params_of
from workbench.theory.memory import (
    DEFAULT_LAYOUT,
    MEMORY_LAYOUTS,
    OPTIMIZERS,
    RECOMPUTE_MODES,
    ZERO_STAGES,
    to_unit,
)
from workbench.theory.models import MODEL_PRESETS
from workbench.theory.parallelism import AXES
from workbench.theory.pipeline import SCHEDULES
from workbench.theory.precisions import PRECISION_NAMES
from workbench.viz.memory import memory_bars

DEVICE_MEMORY_GB: tuple[int, ...] = (24, 40, 80, 141)  # RTX 4090/A100-40/A100-80, H100/H200
DP_CHOICES: tuple[int, ...] = tuple(2**k for k in range(11))  # 1 .. 1024
TP_CHOICES: tuple[int, ...] = tuple(2**k for k in range(7))  # 1 .. 64


def _has_anywidget() -> bool:
    """plotly ≥ 6 builds FigureWidget on anywidget; without it we draw a static figure in an Output."""
    return importlib.util.find_spec("anywidget") is not None


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def _summary_html(table: dict) -> str:
    rows = "".join(f"<tr><td>{k}</td><td style='text-align:right'>{to_unit(v, 'GiB'):.2f}</td></tr>"
                   for k, v in table["per_rank"].items())
    verdict = "fits" if table["fits"] else "does NOT fit"
    colour = "green" if table["fits"] else "crimson"
    cpu = f"<br>offloaded to CPU: {table['cpu_gib']:.2f} GiB per rank" if table["cpu_gib"] else ""
    notes = "".join(f"<br><i>{n}</i>" for n in table["notes"])
    where = (f" (worst pipeline rank: {table['worst_stage']} of {len(table['stages'])})"
             if len(table["stages"]) > 1 else "")
    return (f"<b>{table['model']}</b>: {table['n_params'] / 1e9:.3g} B parameters (Ψ) on {table['nproc']} ranks"
            f"<table><tr><th>category</th><th>GiB per rank{where}</th></tr>{rows}</table>"
            f"<b>total per rank: {table['total_gib']:.2f} GiB</b> — "
            f"<span style='color:{colour}'>{verdict} in {table['device_gib']:g} GiB</span>{cpu}"
            f"<br>model states per rank = <code>{table['formula']}</code> (Ψ = this rank's parameters, N = dp)"
            f"<br>pipeline bubble: {table['bubble']:.1%} of every rank's step time{_comm_html(table)}{notes}")


def _comm_html(table: dict) -> str:
    """The per-axis communication estimate as a small table (absent for a custom size)."""
    comm = table["comm"]
    if not comm:
        return ""
    rows = "".join(
        f"<tr><td>{axis}</td><td style='text-align:right'>{comm[axis]['group_size']}</td>"
        f"<td style='text-align:right'>{comm[axis]['wire_bytes'] / 1e9:.3g}</td>"
        f"<td style='text-align:right'>{comm[axis]['time_s'] * 1e3:.3g}</td><td>{comm[axis]['link']['name']}</td></tr>"
        for axis in (*AXES, "expert_dp") if axis in comm)
    return (f"<br>communication per step (α-β ring model, micro-batch {table['comm_micro_batch']}, not overlapped):"
            f"<table><tr><th>axis</th><th>ranks</th><th>GB sent per rank</th><th>ms</th><th>link</th></tr>{rows}"
            f"</table>total {comm['total_time_s'] * 1e3:.3g} ms")


class MemoryCalculator(widgets.VBox):
    """The calculator widget. `controls` names every input; `table` and `figure` hold the last result."""

    def __init__(self, default_model: str = "llama-7B") -> None:
        self.controls = _make_controls(default_model)
        self.summary = widgets.HTML()
        self.use_figure_widget = _has_anywidget()
        self.output = widgets.Output()
        self.figure_widget = go.FigureWidget() if self.use_figure_widget else None
        self.table: dict = {}
        self.figure: go.Figure = go.Figure()
        plot = self.figure_widget if self.use_figure_widget else self.output
        super().__init__(children=[_layout_controls(self.controls), self.summary, plot])
        for control in self.controls.values():
            control.observe(self._on_change, names="value")
        self.update()

    def _on_change(self, _change: dict) -> None:
        self.update()

    def inputs(self) -> dict:
        """The current control values as `calculator_table` keyword arguments."""
        c = self.controls
        return {
            "model": c["model"].value, "dp": c["dp"].value, "zero_stage": c["zero_stage"].value,
            "precision": c["precision"].value, "memory_layout": c["memory_layout"].value,
            "optimizer": c["optimizer"].value,
            "offload": c["offload"].value, "custom_params_b": c["custom_params_b"].value,
            "batch": c["batch"].value if c["activations"].value else 0, "seq_len": c["seq_len"].value,
            "recompute": c["recompute"].value, "device_gb": c["device_gb"].value,
            "tp": c["tp"].value, "sp": c["sp"].value, "pp": c["pp"].value, "schedule": c["schedule"].value,
            "microbatches": c["microbatches"].value, "virtual_stages": c["virtual_stages"].value,
        }

    def update(self) -> None:
        """Recompute the table for the current inputs and redraw the summary and the figure."""
        kwargs = self.inputs()
        self.controls["custom_params_b"].disabled = kwargs["model"] != CUSTOM
        try:
            self.table = calculator_table(**kwargs)
        except ValueError as err:  # e.g. a custom size of 0 while typing: say why, keep the last figure
            self.summary.value = f"<span style='color:crimson'>{err}</span>"
            return
        self.summary.value = _summary_html(self.table)
        self.figure = _stage_figure(kwargs, self.table)
        self._draw()

    def _draw(self) -> None:
        if self.figure_widget is not None:
            with self.figure_widget.batch_update():
                self.figure_widget.data = ()
                self.figure_widget.add_traces(self.figure.data)
                self.figure_widget.layout = self.figure.layout
            return
        if _in_kernel():  # outside a kernel there is nothing to render into
            # Set the Output's contents directly rather than capturing display() inside `with output:` plus
            # clear_output(wait=True): that capture path intermittently left headless runs (papermill)
            # waiting forever on the cell that first displays the widget.
            bundle = {"application/vnd.plotly.v1+json": json.loads(self.figure.to_json()),
                      "text/plain": "memory per rank by ZeRO stage (plotly figure)"}
            self.output.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)


def _stage_figure(kwargs: dict, table: dict) -> go.Figure:
    """All four ZeRO stages at the chosen settings, so the chosen one is seen against the others."""
    per_stage = {}
    for stage in ZERO_STAGES:
        row = calculator_table(**{**kwargs, "zero_stage": stage})
        per_stage[f"ZeRO-{stage}" + (" ◀" if stage == kwargs["zero_stage"] else "")] = row["per_rank"]
    shape = f"dp = {kwargs['dp']}" + "".join(f", {a} = {kwargs[a]}" for a in ("tp", "pp") if kwargs[a] > 1)
    title = f"{table['model']}, {shape}, {kwargs['precision']}, {kwargs['optimizer']}"
    fig = memory_bars(per_stage, title=title + (", offload" if kwargs["offload"] else ""), unit="GiB")
    fig.add_hline(y=table["device_gib"], line_dash="dash", line_color="crimson",
                  annotation_text=f"device {table['device_gib']:g} GiB")
    return fig


def _make_controls(default_model: str) -> dict[str, widgets.ValueWidget]:
    n_params_of(default_model, 1.0)  # ValueError naming the choices if the model is unknown
    preset = MODEL_PRESETS.get(default_model, MODEL_PRESETS["llama-7B"])
    style = {"description_width": "initial"}
    return {
        "model": widgets.Dropdown(options=[*MODEL_PRESETS, CUSTOM], value=default_model, description="model"),
        "custom_params_b": widgets.BoundedFloatText(value=round(preset["n_params"] / 1e9, 3), min=0.0,
                                                    max=1e5, step=0.1, description="custom size (B params)",
                                                    style=style),
        "dp": widgets.SelectionSlider(options=list(DP_CHOICES), value=8, description="dp (N)"),
        "zero_stage": widgets.ToggleButtons(options=list(ZERO_STAGES), value=0, description="ZeRO stage",
                                            style={"button_width": "40px"}),
        "precision": widgets.Dropdown(options=list(PRECISION_NAMES), value="bf16", description="precision"),
        # where bf16/fp16 keep model states: classic (bf16 params + grads, fp32 master) or amp (workbench run's)
        "memory_layout": widgets.Dropdown(options=list(MEMORY_LAYOUTS), value=DEFAULT_LAYOUT,
                                          description="memory layout", style=style),
        "optimizer": widgets.Dropdown(options=list(OPTIMIZERS), value="adamw", description="optimizer"),
        "offload": widgets.Checkbox(value=False, description="offload to CPU"),
        "activations": widgets.Checkbox(value=False, description="include activations"),
        "batch": widgets.BoundedIntText(value=1, min=1, max=4096, description="micro-batch"),
        "seq_len": widgets.BoundedIntText(value=preset["seq_len"], min=1, max=1 << 20, description="seq len"),
        "recompute": widgets.Dropdown(options=list(RECOMPUTE_MODES), value="none", description="recompute"),
        "device_gb": widgets.Dropdown(options=list(DEVICE_MEMORY_GB), value=80, description="device GiB"),
        "tp": widgets.Dropdown(options=list(TP_CHOICES), value=1, description="tp"),
        "sp": widgets.Checkbox(value=False, description="sequence parallel"),
        "pp": widgets.BoundedIntText(value=1, min=1, max=256, description="pp"),
        "schedule": widgets.Dropdown(options=list(SCHEDULES), value="1f1b", description="schedule"),
        "microbatches": widgets.BoundedIntText(value=1, min=1, max=4096, description="micro-batches"),
        "virtual_stages": widgets.BoundedIntText(value=1, min=1, max=64, description="virtual stages",
                                                 style=style),
    }


def _layout_controls(c: dict[str, widgets.ValueWidget]) -> widgets.Widget:
    return widgets.VBox([
        widgets.HBox([c["model"], c["custom_params_b"]]),
        widgets.HBox([c["dp"], c["zero_stage"]]),
        widgets.HBox([c["tp"], c["sp"], c["pp"]]),
        widgets.HBox([c["schedule"], c["microbatches"], c["virtual_stages"]]),
        widgets.HBox([c["precision"], c["memory_layout"], c["optimizer"], c["offload"]]),
        widgets.HBox([c["activations"], c["batch"], c["seq_len"], c["recompute"]]),
        c["device_gb"],
    ])


def memory_calculator(default_model: str = "llama-7B") -> MemoryCalculator:
    """Build the calculator (an ipywidgets VBox); display it as the last expression of a cell."""
    return MemoryCalculator(default_model)


__all__ = ["DEVICE_MEMORY_GB", "MemoryCalculator", "calculator_table", "memory_calculator"]
