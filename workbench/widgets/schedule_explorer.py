"""Schedule explorer: pick a pipeline schedule, p, m and v; see its plan, bubble and activation memory; run it.

Everything shown before a run comes from ``workbench.theory.pipeline``, from the very action lists the
executor runs: the plan drawn on a rank x time grid (``viz.pipeline.plan_figure``), the bubble fraction in
closed form beside the simulated one, and the peak number of micro-batches whose activations each rank holds.
An invalid combination (interleaved with m not a multiple of p, 1F1B with fewer micro-batches than stages,
...) shows ``theory.pipeline.validate``'s message instead of a plan.

**run** hands the current settings to ``runner(schedule, p, m, v)``, which runs the plan on real ranks and
returns its measurement (``workbench.pipeline_demo.run_schedule`` does, on gloo ranks); the measured
timeline is then drawn under the plan with its measured bubble. The widget never starts ranks itself
(presentation does not import torch.distributed, DESIGN.md), and a notebook run headless (papermill, nbval)
calls ``explorer.set(...)`` and ``explorer.run()`` instead of clicking: nothing waits for input.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import ipywidgets as widgets
import plotly.graph_objects as go

from workbench.theory import pipeline as theory
from workbench.trace import Trace
from workbench.viz.pipeline import plan_figure, plan_vs_measured

MAX_P = 8  # the plan: any depth a slider can show
MAX_M = 32
MAX_V = 4
MAX_RUN_P = 4  # real ranks on a laptop: the run button asks for p <= 4

#: The closed form behind ``theory.pipeline.bubble_fraction``, as the explorer prints it.
FORMULAS: dict[str, str] = {
    "naive": "(p−1)/p",
    "gpipe": "(p−1)/(m+p−1)",
    "1f1b": "(p−1)/(m+p−1)",
    "interleaved": "(p−1)/(v·m+p−1)",
    "zb": "(p−1)(T_F+T_I−T_W) / (m(T_F+T_I+T_W) + (p−1)(T_F+T_I−T_W))",
}


class MeasuredRun(Protocol):
    """What a runner returns (``workbench.pipeline_demo.PipelineRun`` is one)."""

    traces: Sequence[Trace]
    step: int
    bubble_measured: float
    peak_in_flight: list[int]


Runner = Callable[[str, int, int, int], MeasuredRun]


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def _show(output: widgets.Output, fig: go.Figure | None, what: str) -> None:
    """Put a figure into an Output by setting its outputs directly: capturing ``display`` inside ``with
    output:`` intermittently left headless runs (papermill) waiting on the cell (see the memory calculator)."""
    if fig is None:
        output.outputs = ()
    elif _in_kernel():
        bundle = {"application/vnd.plotly.v1+json": json.loads(fig.to_json()), "text/plain": what}
        output.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)


class ScheduleExplorer(widgets.VBox):
    """The explorer. ``controls`` names the inputs; ``analysis`` (``theory.pipeline.analyze``'s dict) or
    ``error`` (the validation message) and ``figure`` describe the current settings; ``result`` and
    ``measured_figure`` the last run."""

    def __init__(self, schedule: str = "1f1b", p: int = 2, m: int = 4, v: int = 2, runner: Runner | None = None,
                 max_run_p: int = MAX_RUN_P) -> None:
        self.runner, self.max_run_p = runner, max_run_p
        self.controls = _make_controls(schedule, p, m, v)
        self.summary, self.status = widgets.HTML(), widgets.HTML()
        self.run_button = widgets.Button(description="run on real ranks", icon="play",
                                         tooltip="run this plan on p gloo ranks and measure its timeline")
        self.plan_output, self.measured_output = widgets.Output(), widgets.Output()
        self.analysis: dict[str, Any] | None = None
        self.error: str | None = None
        self.figure: go.Figure | None = None
        self.result: MeasuredRun | None = None
        self.measured_figure: go.Figure | None = None
        self._quiet = False
        c = self.controls
        super().__init__(children=[widgets.HBox([c["schedule"], c["p"]]), widgets.HBox([c["m"], c["v"]]),
                                   self.summary, self.plan_output, widgets.HBox([self.run_button, self.status]),
                                   self.measured_output])
        for control in c.values():
            control.observe(self._on_change, names="value")
        self.run_button.on_click(self._on_click)
        self.update()

    # -- settings ---------------------------------------------------------------------------------------

    def inputs(self) -> dict[str, Any]:
        """The current settings; v is 1 for the schedules that run one stage per rank."""
        c = self.controls
        schedule = c["schedule"].value
        return {"schedule": schedule, "p": c["p"].value, "m": c["m"].value,
                "v": c["v"].value if schedule == "interleaved" else 1}

    def set(self, **values: Any) -> ScheduleExplorer:
        """Change controls from code (``explorer.set(schedule="gpipe", m=8)``), as a learner's clicks would."""
        unknown = set(values) - set(self.controls)
        if unknown:
            raise ValueError(f"unknown control(s) {sorted(unknown)}; valid: {', '.join(self.controls)}")
        self._quiet = True  # one update for all changes, not one per control (and no invalid halfway state)
        try:
            for name, value in values.items():
                self.controls[name].value = value
        finally:
            self._quiet = False
        self.update()
        return self

    def _on_change(self, _change: dict) -> None:
        if not self._quiet:
            self.update()

    def update(self) -> None:
        """Recompute theory for the current settings and redraw; a run's figure is cleared (it is stale)."""
        kw = self.inputs()
        self.controls["v"].disabled = kw["schedule"] != "interleaved"
        self.result, self.measured_figure = None, None
        _show(self.measured_output, None, "")
        try:
            self.analysis = theory.analyze(kw["schedule"], kw["p"], kw["m"], kw["v"])
        except ValueError as err:
            self.analysis, self.error, self.figure = None, str(err), None
            self.summary.value = f"<span style='color:crimson'>invalid settings: {html.escape(str(err))}</span>"
            _show(self.plan_output, None, "")
            self._update_run_button()
            return
        self.error = None
        self.summary.value = _summary_html(self.analysis)
        self.figure = plan_figure(self.analysis["simulation"], title=_title(kw))
        _show(self.plan_output, self.figure, "pipeline plan (plotly figure)")
        self._update_run_button()

    def _update_run_button(self) -> None:
        reason = self.cannot_run()
        self.run_button.disabled = reason is not None
        self.status.value = "" if reason is None else f"<i>{html.escape(reason)}</i>"

    def cannot_run(self) -> str | None:
        """Why the current settings cannot be run on real ranks (None: they can)."""
        if self.error is not None:
            return "fix the settings first"
        if self.runner is None:
            return "no runner given: ScheduleExplorer(runner=workbench.pipeline_demo.run_schedule) runs plans"
        if self.inputs()["p"] > self.max_run_p:
            return f"running asks for p <= {self.max_run_p} ranks on this machine; the plan above is theory"
        return None

    # -- running ----------------------------------------------------------------------------------------

    def run(self) -> MeasuredRun:
        """Run the current plan with the runner; draw the measured timeline under the plan; return the result.

        ValueError (the reason) when the settings are invalid, there is no runner, or p is too large.
        """
        reason = self.cannot_run()
        if reason is not None:
            raise ValueError(f"cannot run {self.inputs()}: {self.error or reason}")
        kw = self.inputs()
        self.status.value = f"<i>running {kw['schedule']} on {kw['p']} ranks…</i>"
        result = self.runner(kw["schedule"], kw["p"], kw["m"], kw["v"])
        self.result = result
        self.measured_figure = plan_vs_measured(self.analysis["simulation"], result.traces, result.step,
                                                title=_title(kw), measured_bubble=result.bubble_measured)
        _show(self.measured_output, self.measured_figure, "plan and measured timeline (plotly figure)")
        self.status.value = _measured_html(self.analysis, result)
        return result

    def _on_click(self, _button: widgets.Button) -> None:
        try:
            self.run()
        except Exception as err:  # a click must not raise into the front end: say what happened
            self.status.value = f"<span style='color:crimson'>run failed: {html.escape(str(err))}</span>"


def _title(kw: dict[str, Any]) -> str:
    v = f", v={kw['v']}" if kw["schedule"] == "interleaved" else ""
    return f"{kw['schedule']}: p={kw['p']} stages, m={kw['m']} micro-batches{v}"


def _summary_html(a: dict[str, Any]) -> str:
    peaks = ", ".join(f"rank {r}: {n}" for r, n in enumerate(a["peak_in_flight"]))
    return (f"<b>theoretical bubble</b> {a['bubble_theory']:.1%} = {html.escape(FORMULAS[a['schedule']])} "
            f"(simulated from the plan: {a['bubble_simulated']:.1%}; F = 1, B = 2 time units, I = W = 1)<br>"
            f"<b>peak in-flight micro-batches</b> (activations held at once) {peaks}")


def _measured_html(a: dict[str, Any], result: MeasuredRun) -> str:
    error = result.bubble_measured - a["bubble_theory"]
    return (f"<b>measured bubble</b> {result.bubble_measured:.1%} (step {result.step}) vs theory "
            f"{a['bubble_theory']:.1%}: error {error:+.1%}; measured peak in-flight per rank "
            f"{list(result.peak_in_flight)} vs theory {a['peak_in_flight']}")


def _make_controls(schedule: str, p: int, m: int, v: int) -> dict[str, widgets.ValueWidget]:
    if schedule not in theory.SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; valid: {', '.join(theory.SCHEDULES)}")
    for name, value, top in (("p", p, MAX_P), ("m", m, MAX_M), ("v", v, MAX_V)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise ValueError(f"{name} must be an int in 1..{top}, got {value!r}")
    style = {"description_width": "initial"}
    return {
        "schedule": widgets.Dropdown(options=list(theory.SCHEDULES), value=schedule, description="schedule"),
        "p": widgets.IntSlider(value=p, min=1, max=MAX_P, description="p (stages)", style=style),
        "m": widgets.IntSlider(value=m, min=1, max=MAX_M, description="m (micro-batches)", style=style),
        "v": widgets.IntSlider(value=v, min=1, max=MAX_V, description="v (interleaved chunks)", style=style),
    }


def schedule_explorer(schedule: str = "1f1b", p: int = 2, m: int = 4, v: int = 2,
                      runner: Runner | None = None) -> ScheduleExplorer:
    """Build the explorer (an ipywidgets VBox); display it as the last expression of a cell."""
    return ScheduleExplorer(schedule, p, m, v, runner)


__all__ = ["FORMULAS", "MeasuredRun", "ScheduleExplorer", "schedule_explorer"]
