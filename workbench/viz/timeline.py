"""Per-rank timelines: one row per rank, spans and collectives as horizontal bars on a shared clock."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from workbench.trace import Trace

SPAN_COLOURS = {
    "forward": "#4C78A8", "backward": "#F58518", "optimizer": "#54A24B", "comm": "#E45756",
    "wait": "#B279A2", "idle": "#DDDDDD", "data": "#9D755D", "other": "#BAB0AC",
}
_ACTION = re.compile(r"^[FBIW] mb\d+")
COMM_COLOURS = {
    "all_reduce": "#E45756", "reduce_scatter": "#FF9DA6", "all_gather": "#72B7B2", "broadcast": "#EECA3B",
    "send": "#9467BD", "recv": "#8C564B", "reduce": "#D62728", "all_to_all": "#17BECF", "barrier": "#7F7F7F",
}


def _as_trace(t: Trace | dict) -> Trace:
    return t if isinstance(t, Trace) else Trace.from_dict(t)


def _origin(traces: Sequence[Trace]) -> float:
    starts = [s.t0 for t in traces for s in t.spans] + [c.t0 for t in traces for c in t.comms]
    return min(starts) if starts else 0.0


def _bars(name: str, colour: str, y: list[str], base: list[float], width: list[float], text: list[str],
          legendgroup: str, offset: float, labels: list[str] | None = None) -> go.Bar:
    on_bar = {} if labels is None else {"text": labels, "textposition": "inside", "insidetextanchor": "middle",
                                        "textangle": 0}
    return go.Bar(name=name, y=y, base=base, x=width, orientation="h", marker_color=colour,
                  hovertext=text, hoverinfo="text", legendgroup=legendgroup, width=0.38, offset=offset, **on_bar)


def _micro_batch_label(name: str) -> str:
    """``"F mb3"`` -> ``"F mb3"``; any other span name -> ``""`` (only pipeline actions get text on the bar)."""
    return name if _ACTION.match(name) else ""


def idle_gaps(t: Trace) -> list[tuple[float, float]]:
    """The gaps between a rank's compute spans (forward/backward/optimizer), from its first to its last."""
    busy = sorted((s.t0, s.t1) for s in t.spans if s.category in ("forward", "backward", "optimizer"))
    gaps, end = [], None
    for t0, t1 in busy:
        if end is not None and t0 > end:
            gaps.append((end, t0))
        end = t1 if end is None else max(end, t1)
    return gaps


def steps_only(t: Trace | dict, steps: Sequence[int] | None = None) -> Trace:
    """A copy of ``t`` keeping the spans and comms of training steps (``steps``, or any step), dropping
    set-up work such as the wrap-time broadcast."""
    t = _as_trace(t)
    keep = (lambda s: s is not None) if steps is None else (lambda s: s in set(steps))
    return Trace(t.rank, t.world_size, spans=[s for s in t.spans if keep(s.step)],
                 comms=[c for c in t.comms if keep(c.step)], memory=t.memory, metrics=t.metrics)


def timeline(traces: Sequence[Trace | dict], title: str = "per-rank timeline (measured)",
             unit: str = "ms", labels: bool = False, idle: bool = False) -> go.Figure:
    """Spans (upper half of each rank's row) and communication events (lower half), per rank.

    Times are relative to the earliest event of any rank, so ranks line up on one clock: a collective that
    starts late on one rank shows the others waiting for it. ``labels``: pipeline actions carry their name
    (``F mb3``) as text on the bar (hidden where the bar is too narrow; the hover always names it).
    ``idle``: the gaps between a rank's compute spans drawn as grey ``idle`` bars.
    """
    traces = [_as_trace(t) for t in traces]
    t_origin = _origin(traces)
    scale = {"ms": 1e3, "s": 1.0, "us": 1e6}[unit]
    fig = go.Figure()
    for category, colour in SPAN_COLOURS.items():
        rows = [(f"rank {t.rank}", s.name, s.t0, s.t1) for t in traces for s in t.spans if s.category == category]
        if idle and category == "idle":
            rows += [(f"rank {t.rank}", "idle", t0, t1) for t in traces for t0, t1 in idle_gaps(t)]
        if rows:
            fig.add_trace(_bars(category, colour, [r[0] for r in rows],
                                [(t0 - t_origin) * scale for _, _, t0, _ in rows],
                                [max((t1 - t0) * scale, 1e-3) for _, _, t0, t1 in rows],
                                [f"{name} ({(t1 - t0) * 1e3:.2f} ms)" for _, name, t0, t1 in rows],
                                "spans", 0.02,
                                [_micro_batch_label(name) for _, name, _, _ in rows] if labels else None))
    for op in sorted({c.op for t in traces for c in t.comms}):
        rows = [(f"rank {t.rank}", c) for t in traces for c in t.comms if c.op == op]
        fig.add_trace(_bars(op, COMM_COLOURS.get(op, "#333333"), [r for r, _ in rows],
                            [(c.t0 - t_origin) * scale for _, c in rows],
                            [max((c.t1 - c.t0) * scale, 1e-3) for _, c in rows],
                            [_comm_label(c) for _, c in rows], "comms", -0.4))
    ranks = [f"rank {t.rank}" for t in sorted(traces, key=lambda t: t.rank)]
    fig.update_layout(title=title, barmode="overlay", xaxis_title=f"time ({unit})",
                      yaxis={"categoryorder": "array", "categoryarray": ranks[::-1]},
                      height=max(250, 90 * len(traces) + 120), legend_title="upper: spans / lower: comm")
    if labels:
        fig.update_layout(uniformtext={"minsize": 8, "mode": "hide"})
    return fig


def _comm_label(c: Any) -> str:
    peer = f" peer {c.peer}" if c.peer is not None else ""
    tag = f" [{c.tag}]" if c.tag else ""
    return (f"{c.op}{tag}{peer}: {c.nbytes / 2**20:.3f} MiB {c.dtype} {list(c.shape)}, group {list(c.group)}, "
            f"{(c.t1 - c.t0) * 1e3:.2f} ms")


def comm_table(traces: Sequence[Trace | dict], step: int | None = None,
               group_labels: Sequence[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Rows (rank, op, tag, count, MiB, bus MiB, ms) summing the communication log, for tables and tests.

    ``group_labels`` (``[{"ranks": [...], "axis": "dp"}, ...]``, e.g. summary.json's ``comm_groups``) adds a
    ``group`` column naming the mesh axis each collective ran on (its ranks where no label matches)."""
    names = {tuple(sorted(g["ranks"])): g["axis"] for g in group_labels or ()}
    rows: dict[tuple, dict[str, Any]] = {}
    for t in (_as_trace(t) for t in traces):
        for c in t.comms:
            if step is not None and c.step != step:
                continue
            group = names.get(tuple(sorted(c.group)), str(list(c.group)))
            key = (t.rank, c.op, c.tag) + ((group,) if group_labels is not None else ())
            row = rows.setdefault(key, {"rank": t.rank, "op": c.op, "tag": c.tag,
                                        **({"group": group} if group_labels is not None else {}),
                                        "count": 0, "MiB": 0.0, "bus_MiB": 0.0, "ms": 0.0})
            row["count"] += 1
            row["MiB"] += c.nbytes / 2**20
            row["bus_MiB"] += c.bus_bytes / 2**20
            row["ms"] += (c.t1 - c.t0) * 1e3
    return sorted(rows.values(), key=lambda r: (r["rank"], r["op"], r["tag"], r.get("group", "")))
