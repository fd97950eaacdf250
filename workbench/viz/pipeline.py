"""Pipeline schedules drawn: the plan theory lays out, and the timeline a run measured, in one picture style.

One row per rank, time to the right, one box per action coloured by kind (F forward, B backward, I
input-gradient, W weight-gradient; Qi et al. 2023 split B into I and W) with its micro-batch index written
on it, and the idle time (the bubble) drawn as grey boxes. ``plan_figure`` draws a plan or its simulation
(``workbench.theory.pipeline.simulate``: time in units of one forward); ``measured_figure`` draws the action
spans the executor recorded in a trace (``F mb3``, ``B mb0 s2``: milliseconds); ``plan_vs_measured`` puts
the two above each other, so the plan and what the ranks really did can be compared box by box.

Pure presentation: reads theory's plans and the trace's plain records, never torch.distributed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.theory.pipeline import Plan, Simulation, simulate
from workbench.trace import Trace

KIND_COLOURS: dict[str, str] = {"F": "#4C78A8", "B": "#F58518", "I": "#B279A2", "W": "#54A24B", "idle": "#DDDDDD"}
KIND_NAMES: dict[str, str] = {"F": "F forward", "B": "B backward", "I": "I input grad", "W": "W weight grad",
                              "idle": "idle (bubble)"}
_SPAN = re.compile(r"^(?P<kind>[FBIW]) mb(?P<mb>\d+)(?: s(?P<stage>\d+))?$")
_BAR_WIDTH = 0.7


@dataclass(frozen=True)
class Box:
    """One action (or idle gap) of one rank on the time axis; ``stage`` is None where a trace did not say."""

    rank: int
    kind: str  # F, B, I, W or idle
    microbatch: int | None
    stage: int | None
    start: float
    end: float


def plan_boxes(plan_or_simulation: Plan | Simulation, durations: dict[str, float] | None = None) -> list[Box]:
    """The boxes of a plan laid out by ``simulate`` (or of a given simulation), idle gaps included."""
    sim = plan_or_simulation if isinstance(plan_or_simulation, Simulation) else simulate(plan_or_simulation,
                                                                                         durations)
    boxes = [Box(r, t.action.kind, t.action.microbatch, t.action.stage, t.start, t.end)
             for r, row in enumerate(sim.timeline) for t in row]
    return boxes + _idle_boxes(boxes, len(sim.timeline), 0.0, sim.makespan)


def trace_boxes(traces: Sequence[Trace], step: int | None = None) -> list[Box]:
    """The pipeline action spans (F/B/I/W per micro-batch) of ``step`` in each rank's trace, idle gaps
    included, in seconds from the first action of any rank (the window ``measured_bubble`` divides by)."""
    spans = [(t.rank, m, s.t0, s.t1) for t in traces for s in t.spans
             if (step is None or s.step == step) and s.category in ("forward", "backward")
             and (m := _SPAN.match(s.name))]
    if not spans:
        raise ValueError(f"no pipeline action spans (F/B/I/W mb<i>) for step {step} in the traces")
    origin = min(t0 for _, _, t0, _ in spans)
    boxes = [Box(rank, m["kind"], int(m["mb"]), int(m["stage"]) if m["stage"] else None, t0 - origin, t1 - origin)
             for rank, m, t0, t1 in spans]
    end = max(b.end for b in boxes)
    ranks = sorted(t.rank for t in traces)
    return boxes + _idle_boxes(boxes, ranks, 0.0, end)


def _idle_boxes(boxes: Sequence[Box], ranks: int | Sequence[int], start: float, end: float) -> list[Box]:
    """The gaps of each rank between ``start`` and ``end`` where none of its boxes runs."""
    idle = []
    for rank in (range(ranks) if isinstance(ranks, int) else ranks):
        t = start
        for b in sorted((b for b in boxes if b.rank == rank), key=lambda b: b.start):
            if b.start > t + 1e-12:
                idle.append(Box(rank, "idle", None, None, t, b.start))
            t = max(t, b.end)
        if end > t + 1e-12:
            idle.append(Box(rank, "idle", None, None, t, end))
    return idle


def _label(b: Box, multi_stage: bool) -> str:
    """What is written on a box: the micro-batch index (with the stage when a rank holds several)."""
    if b.microbatch is None:
        return ""
    return f"{b.microbatch}" + (f"·s{b.stage}" if multi_stage and b.stage is not None else "")


def _hover(b: Box, unit: str, scale: float) -> str:
    where = f" stage {b.stage}" if b.stage is not None else ""
    what = "idle" if b.kind == "idle" else f"{b.kind} micro-batch {b.microbatch}{where}"
    return f"rank {b.rank}: {what}, {b.start * scale:.3g}–{b.end * scale:.3g} {unit}"


def _add_boxes(fig: go.Figure, boxes: Sequence[Box], unit: str, scale: float, row: int | None = None,
               show_legend: bool = True) -> None:
    """One horizontal bar trace per kind (so the legend reads F, B, I, W, idle)."""
    ranks = {b.rank for b in boxes}
    multi = any(len({b.stage for b in boxes if b.rank == r and b.stage is not None}) > 1 for r in ranks)
    for kind, colour in KIND_COLOURS.items():
        mine = [b for b in boxes if b.kind == kind]
        if not mine:
            continue
        bar = go.Bar(name=KIND_NAMES[kind], legendgroup=kind, showlegend=show_legend, orientation="h",
                     y=[f"rank {b.rank}" for b in mine], base=[b.start * scale for b in mine],
                     x=[(b.end - b.start) * scale for b in mine], marker_color=colour,
                     marker_line={"color": "white", "width": 1}, width=_BAR_WIDTH,
                     text=[_label(b, multi) for b in mine], textposition="inside", insidetextanchor="middle",
                     textangle=0, hovertext=[_hover(b, unit, scale) for b in mine], hoverinfo="text")
        fig.add_trace(bar, row=row, col=1 if row is not None else None)


def _rank_axis(ranks: Sequence[int]) -> dict:
    names = [f"rank {r}" for r in sorted(ranks)]
    return {"categoryorder": "array", "categoryarray": names[::-1]}


def plan_figure(plan_or_simulation: Plan | Simulation, durations: dict[str, float] | None = None,
                title: str | None = None) -> go.Figure:
    """The plan as theory lays it out: rank rows x time in units of one forward, idle in grey.

    ``durations`` (F/B/I/W in units of a forward) as for ``simulate``; ignored when a simulation is given.
    """
    sim = plan_or_simulation if isinstance(plan_or_simulation, Simulation) else simulate(plan_or_simulation,
                                                                                         durations)
    boxes = plan_boxes(sim)
    fig = go.Figure()
    _add_boxes(fig, boxes, "forward times", 1.0)
    default = (f"plan (theory): bubble {sim.bubble_fraction:.1%}, peak in-flight micro-batches per rank "
               f"{sim.peak_in_flight}")
    fig.update_layout(title=title or default, barmode="overlay", xaxis_title="time (units of one forward)",
                      yaxis=_rank_axis(range(len(sim.timeline))), height=max(220, 60 * len(sim.timeline) + 140),
                      uniformtext={"minsize": 8, "mode": "hide"}, legend_title="action")
    return fig


def measured_figure(traces: Sequence[Trace], step: int | None = None, title: str | None = None,
                    unit: str = "ms") -> go.Figure:
    """What the ranks did in ``step``: the executor's action spans per rank, idle gaps in grey (measured)."""
    scale = {"ms": 1e3, "s": 1.0, "us": 1e6}[unit]
    boxes = trace_boxes(traces, step)
    fig = go.Figure()
    _add_boxes(fig, boxes, unit, scale)
    fig.update_layout(title=title or f"measured timeline, step {step}", barmode="overlay",
                      xaxis_title=f"time ({unit}) from the first action", yaxis=_rank_axis([t.rank for t in traces]),
                      height=max(220, 60 * len(traces) + 140), uniformtext={"minsize": 8, "mode": "hide"},
                      legend_title="action")
    return fig


def plan_vs_measured(plan_or_simulation: Plan | Simulation, traces: Sequence[Trace], step: int | None = None,
                     title: str = "", measured_bubble: float | None = None, unit: str = "ms") -> go.Figure:
    """The plan (top, units of one forward) above the measured timeline of ``step`` (bottom, ``unit``)."""
    sim = plan_or_simulation if isinstance(plan_or_simulation, Simulation) else simulate(plan_or_simulation)
    scale = {"ms": 1e3, "s": 1.0, "us": 1e6}[unit]
    said = "" if measured_bubble is None else f": bubble {measured_bubble:.1%}"
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.18, subplot_titles=(
        f"plan (theory): bubble {sim.bubble_fraction:.1%}", f"measured on {len(traces)} ranks, step {step}{said}"))
    _add_boxes(fig, plan_boxes(sim), "forward times", 1.0, row=1)
    _add_boxes(fig, trace_boxes(traces, step), unit, scale, row=2, show_legend=False)
    ranks = _rank_axis([t.rank for t in traces])
    fig.update_yaxes(**ranks)
    fig.update_xaxes(title_text="time (units of one forward)", row=1, col=1)
    fig.update_xaxes(title_text=f"time ({unit}) from the first action", row=2, col=1)
    fig.update_layout(title=title or None, barmode="overlay", height=max(380, 120 * len(traces) + 260),
                      uniformtext={"minsize": 8, "mode": "hide"}, legend_title="action")
    return fig


def box_counts(fig: go.Figure) -> dict[str, int]:
    """How many boxes of each kind a figure draws (F, B, I, W, idle): what tests and notebooks check."""
    counts: dict[str, int] = {}
    for bar in fig.data:
        kind = next(k for k, name in KIND_NAMES.items() if name == bar.name)
        counts[kind] = counts.get(kind, 0) + len(bar.x)
    return counts


__all__ = ["KIND_COLOURS", "Box", "box_counts", "measured_figure", "plan_boxes", "plan_figure", "plan_vs_measured",
           "trace_boxes"]
