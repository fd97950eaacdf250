"""The device mesh drawn: which ranks form each tensor-, data- and pipeline-parallel group, and what ran on each.

A 3D layout puts ``pp × dp × tp`` ranks on a grid (Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", §3): a *tp group* splits every layer, a *dp group* holds replicas
of one stage, a *pp group* is one pipeline. Which global ranks land in which group is the mesh's rank→
coordinate mapping (``workbench.mesh.MeshShape.coords``; Megatron order, tp fastest). Everything here takes that
mapping as plain data, so the figure shows the mapping a run really used, and a different mapping draws
differently:

- ``mesh_groups`` derives every group of every axis from the coordinates;
- ``mesh_figure`` draws the ranks as a grid, one block per pipeline stage (columns: tp index, rows: dp index),
  with the tp, dp and pp groups as coloured links, and optionally which node each rank sits on;
- ``comm_by_axis`` sums a run's communication log per rank, mesh axis, op and tag, in exact bytes;
- ``axis_timeline`` draws one step per rank with each collective coloured by the axis it ran on.

Plain data in, plotly out: no torch, no torch.distributed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from workbench.trace import Trace

#: The axes drawn, slowest- to fastest-varying in Megatron's order.
MESH_AXES: tuple[str, ...] = ("pp", "dp", "tp")
#: One colour per axis, used by the mesh figure and the timeline alike ("world": a group of every rank).
AXIS_COLOURS: dict[str, str] = {"tp": "#54A24B", "dp": "#4C78A8", "pp": "#B279A2", "cp": "#F58518",
                                "world": "#7F7F7F", "other": "#333333"}
#: Spans in greys on the axis timeline, darker for more work: colour is kept for the axes.
SPAN_GREYS: dict[str, str] = {"forward": "#C4C4C4", "backward": "#8F8F8F", "optimizer": "#5C5C5C", "comm": "#E3E3E3",
                              "wait": "#EFEFEF", "idle": "#F7F7F7", "data": "#D5D5D5", "other": "#ABABAB"}
_ACTION = re.compile(r"^[FBIW] mb\d+")  # a pipeline action's span name ("F mb3"), labelled on its bar
NODE_COLOURS = ("#F2F2F2", "#FFF3D6", "#E3F0FA", "#EAF6E8", "#F8E6F0", "#EEEEFF", "#FDEBE3", "#E8F6F5")
_GAP = 0.8  # horizontal space between two pipeline stages' blocks
_ROW = 1.4  # vertical distance between two dp rows


def _check_sizes(sizes: Mapping[str, int]) -> dict[str, int]:
    out = {}
    for axis in MESH_AXES:
        value = sizes.get(axis, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mesh size {axis} must be a positive int, got {value!r}")
        out[axis] = value
    extra = {a: v for a, v in sizes.items() if a not in MESH_AXES and v != 1}
    if extra:
        raise ValueError(f"only the pp, dp and tp axes are drawn; got {extra} (sizes other than 1)")
    return out


def _check_coords(sizes: dict[str, int], coords: Mapping[int, Mapping[str, int]]) -> dict[int, dict[str, int]]:
    """Every rank 0..world−1 once, each coordinate in range, no two ranks at the same place."""
    world = sizes["pp"] * sizes["dp"] * sizes["tp"]
    if sorted(coords) != list(range(world)):
        raise ValueError(f"coords must give every rank 0..{world - 1} of a pp={sizes['pp']} x dp={sizes['dp']} x "
                         f"tp={sizes['tp']} mesh exactly once; got ranks {sorted(coords)}")
    out: dict[int, dict[str, int]] = {}
    seen: dict[tuple[int, ...], int] = {}
    for rank in range(world):
        c = coords[rank]
        for axis in MESH_AXES:
            if axis not in c or not 0 <= c[axis] < sizes[axis]:
                raise ValueError(f"rank {rank}: coordinate {axis}={c.get(axis)!r} is not in 0..{sizes[axis] - 1}")
        extra = {a: v for a, v in c.items() if a not in MESH_AXES and v != 0}
        if extra:
            raise ValueError(f"rank {rank}: coordinates {extra} on an axis that is not drawn (only pp, dp, tp)")
        key = tuple(c[a] for a in MESH_AXES)
        if key in seen:
            same = dict(zip(MESH_AXES, key, strict=True))
            raise ValueError(f"ranks {seen[key]} and {rank} have the same coordinates {same}")
        seen[key] = rank
        out[rank] = {a: c[a] for a in MESH_AXES}
    return out


def mesh_groups(sizes: Mapping[str, int], coords: Mapping[int, Mapping[str, int]]) -> dict[str, list[list[int]]]:
    """Every group of each axis: the ranks that agree on the other two coordinates, in order of the axis index.

    Groups are listed by their lowest rank, so for Megatron's mapping this equals
    ``MeshShape.all_axis_groups(axis)``; an axis of size 1 gives one-rank groups.
    """
    sizes = _check_sizes(sizes)
    where = _check_coords(sizes, coords)
    groups: dict[str, list[list[int]]] = {}
    for axis in MESH_AXES:
        others = [a for a in MESH_AXES if a != axis]
        by_rest: dict[tuple[int, ...], list[int]] = {}
        for rank in range(len(where)):
            by_rest.setdefault(tuple(where[rank][a] for a in others), []).append(rank)
        found = [sorted(g, key=lambda r: where[r][axis]) for g in by_rest.values()]
        groups[axis] = sorted(found, key=min)
    return groups


def rank_positions(sizes: Mapping[str, int], coords: Mapping[int, Mapping[str, int]]) -> dict[int, tuple[float, float]]:
    """Where each rank is drawn: stage blocks left to right, tp index across a block, dp index down it."""
    sizes = _check_sizes(sizes)
    where = _check_coords(sizes, coords)
    return {r: (c["pp"] * (sizes["tp"] + _GAP) + c["tp"], -c["dp"] * _ROW) for r, c in where.items()}


def _group_line(axis: str, group: list[int], pos: dict[int, tuple[float, float]], tp_size: int,
                where: dict[int, dict[str, int]]) -> tuple[list[float], list[float]]:
    """The path of one group: straight through tp and dp groups, arcs between consecutive stages for pp
    (a straight pp line would run through the other tp ranks of a stage)."""
    if axis != "pp":
        return [pos[r][0] for r in group], [pos[r][1] for r in group]
    xs, ys = [pos[group[0]][0]], [pos[group[0]][1]]
    lift = 0.5 + 0.3 * where[group[0]]["tp"] / max(tp_size, 1)  # one arc height per tp column, above the squares
    for a, b in zip(group, group[1:], strict=False):
        (xa, ya), (xb, yb) = pos[a], pos[b]
        xs += [(xa + xb) / 2, xb]
        ys += [max(ya, yb) + lift, yb]
    return xs, ys


def mesh_figure(sizes: Mapping[str, int], coords: Mapping[int, Mapping[str, int]], title: str | None = None,
                gpus_per_node: int | None = None) -> go.Figure:
    """The mesh as a grid: one block per pipeline stage, a square per rank, the groups of each axis as links.

    ``sizes``: {"pp", "dp", "tp"}; ``coords``: {rank: {"pp", "dp", "tp"}} (e.g. ``MeshShape.coords(rank)`` for
    every rank). ``gpus_per_node``: shade each rank by the node it would sit on (ranks r // gpus_per_node), to
    show which groups stay inside a node.
    """
    sizes = _check_sizes(sizes)
    where = _check_coords(sizes, coords)
    pos = rank_positions(sizes, where)
    groups = mesh_groups(sizes, where)
    fig = go.Figure()
    for axis, width, dash in (("pp", 3, "dot"), ("dp", 5, "solid"), ("tp", 9, "solid")):
        real = [g for g in groups[axis] if len(g) > 1]
        for i, group in enumerate(real):
            xs, ys = _group_line(axis, group, pos, sizes["tp"], where)
            fig.add_scatter(x=xs, y=ys, mode="lines", line={"color": AXIS_COLOURS[axis], "width": width, "dash": dash},
                            line_shape="spline" if axis == "pp" else "linear", legendgroup=axis, showlegend=i == 0,
                            name=f"{len(real)} {axis} group(s) of {sizes[axis]} ranks", hoverinfo="text",
                            hovertext=f"{axis} group {i}: ranks {group}")
    fig.add_scatter(**_rank_markers(pos, where, gpus_per_node))
    _label_blocks(fig, sizes)
    _add_node_legend(fig, len(where), gpus_per_node)
    world = len(where)
    fig.update_layout(title=title or f"{world} ranks on a pp={sizes['pp']} x dp={sizes['dp']} x tp={sizes['tp']} mesh",
                      xaxis={"visible": False}, yaxis={"visible": False, "scaleanchor": "x"},
                      plot_bgcolor="white", height=260 + 110 * sizes["dp"], legend_title="groups")
    return fig


def _rank_markers(pos: dict[int, tuple[float, float]], where: dict[int, dict[str, int]],
                  gpus_per_node: int | None) -> dict[str, Any]:
    ranks = sorted(pos)
    if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int)
                                      or gpus_per_node < 1):
        raise ValueError(f"gpus_per_node must be a positive int or None, got {gpus_per_node!r}")
    fill = [NODE_COLOURS[(r // gpus_per_node) % len(NODE_COLOURS)] if gpus_per_node else "white" for r in ranks]
    hover = [f"rank {r}: " + ", ".join(f"{a}={where[r][a]}" for a in MESH_AXES)
             + (f", node {r // gpus_per_node}" if gpus_per_node else "") for r in ranks]
    return {"x": [pos[r][0] for r in ranks], "y": [pos[r][1] for r in ranks], "mode": "markers+text",
            "text": [str(r) for r in ranks], "textfont": {"size": 16}, "hovertext": hover, "hoverinfo": "text",
            "marker": {"symbol": "square", "size": 44, "color": fill, "line": {"color": "#333333", "width": 2}},
            "name": "rank", "showlegend": False}


def _label_blocks(fig: go.Figure, sizes: dict[str, int]) -> None:
    top = 0.75
    for stage in range(sizes["pp"]):
        x0 = stage * (sizes["tp"] + _GAP)
        fig.add_annotation(x=x0 + (sizes["tp"] - 1) / 2, y=top + 0.45, text=f"<b>pipeline stage {stage}</b>",
                           showarrow=False)
        for t in range(sizes["tp"]):
            fig.add_annotation(x=x0 + t, y=top, text=f"tp {t}", showarrow=False, font={"size": 10})
    for d in range(sizes["dp"]):
        fig.add_annotation(x=-0.75, y=-d * _ROW, text=f"dp {d}", showarrow=False, font={"size": 10})


def _add_node_legend(fig: go.Figure, world: int, gpus_per_node: int | None) -> None:
    if not gpus_per_node:
        return
    for node in range((world + gpus_per_node - 1) // gpus_per_node):
        first, last = node * gpus_per_node, min(world, (node + 1) * gpus_per_node) - 1
        fig.add_scatter(x=[None], y=[None], mode="markers", name=f"node {node}: ranks {first}–{last}",
                        legendgroup="nodes", marker={"symbol": "square", "size": 14,
                                                     "color": NODE_COLOURS[node % len(NODE_COLOURS)],
                                                     "line": {"color": "#333333", "width": 1}})


# ---------------------------------------------------------------------------------------------------------
# What ran on each axis.


def _as_trace(t: Trace | dict) -> Trace:
    return t if isinstance(t, Trace) else Trace.from_dict(t)


def group_axes(group_labels: Sequence[Mapping[str, Any]]) -> dict[tuple[int, ...], str]:
    """``[{"ranks": [...], "axis": "dp"}, ...]`` (summary.json's ``comm_groups``) as {sorted ranks: axis}."""
    return {tuple(sorted(g["ranks"])): str(g["axis"]) for g in group_labels}


def comm_by_axis(traces: Sequence[Trace | dict], group_labels: Sequence[Mapping[str, Any]],
                 step: int | None = None) -> list[dict[str, Any]]:
    """The communication log summed per (rank, axis, op, tag): ``count`` and exact ``nbytes`` (ints).

    ``axis`` names the mesh axis of the group each event ran on ("other" for a group no label matches).
    ``step``: only that training step (None: every event, set-up included).
    """
    names = group_axes(group_labels)
    rows: dict[tuple[int, str, str, str], dict[str, Any]] = {}
    for t in map(_as_trace, traces):
        for c in t.comms:
            if step is not None and c.step != step:
                continue
            axis = names.get(tuple(sorted(c.group)), "other")
            row = rows.setdefault((t.rank, axis, c.op, c.tag), {"rank": t.rank, "axis": axis, "op": c.op,
                                                                "tag": c.tag, "count": 0, "nbytes": 0})
            row["count"] += 1
            row["nbytes"] += int(c.nbytes)
    return sorted(rows.values(), key=lambda r: (r["rank"], r["axis"], r["op"], r["tag"]))


def axis_timeline(traces: Sequence[Trace | dict], group_labels: Sequence[Mapping[str, Any]], step: int,
                  title: str | None = None, unit: str = "ms") -> go.Figure:
    """One training step per rank: spans on the upper half of a row, communication on the lower half coloured
    by the mesh axis it ran on.

    Spans are drawn in greys (colour is kept for the axes), pipeline actions labelled (``F mb0``). An async op
    (a pipeline send, posted early and waited on late) lasts from its post to its wait: it is drawn pale and
    underneath, so the blocking collectives stay visible on top.
    """
    scale = {"ms": 1e3, "s": 1.0, "us": 1e6}.get(unit)
    if scale is None:
        raise ValueError(f"unit must be one of ms, s, us; got {unit!r}")
    traces = [_as_trace(t) for t in traces]
    spans = [(t.rank, s) for t in traces for s in t.spans if s.step == step]
    comms = [(t.rank, c) for t in traces for c in t.comms if c.step == step]
    if not spans and not comms:
        steps = sorted({s.step for t in traces for s in t.spans if s.step is not None})
        raise ValueError(f"no spans or communication recorded in step {step}; traced steps: {steps}")
    origin = min([s.t0 for _, s in spans] + [c.t0 for _, c in comms])
    names = group_axes(group_labels)
    fig = go.Figure()
    for category, colour in SPAN_GREYS.items():
        rows = [(r, s) for r, s in spans if s.category == category]
        if rows:
            bar = _bar(category, colour, [(r, s.t0, s.t1, f"{s.name} ({(s.t1 - s.t0) * 1e3:.2f} ms)") for r, s in rows],
                       origin, scale, 0.02, "spans")
            bar.update(text=[s.name if _ACTION.match(s.name) else "" for _, s in rows], textposition="inside",
                       insidetextanchor="middle", textangle=0)
            fig.add_trace(bar)
    for pale in (True, False):  # async first: underneath
        for axis, colour in AXIS_COLOURS.items():
            rows = [(r, c) for r, c in comms
                    if names.get(tuple(sorted(c.group)), "other") == axis and bool(c.async_op) == pale]
            if rows:
                bar = _bar(f"{axis} comm" + (" (async: posted → waited)" if pale else ""), colour,
                           [(r, c.t0, c.t1, _comm_hover(axis, c)) for r, c in rows], origin, scale, -0.4, "comm")
                bar.update(opacity=0.35 if pale else 1.0)
                fig.add_trace(bar)
    ranks = [f"rank {t.rank}" for t in sorted(traces, key=lambda t: t.rank)]
    fig.update_layout(title=title or f"step {step}: spans (upper) and communication by mesh axis (lower)",
                      barmode="overlay", xaxis_title=f"time ({unit})", plot_bgcolor="white",
                      yaxis={"categoryorder": "array", "categoryarray": ranks[::-1]},
                      uniformtext={"minsize": 8, "mode": "hide"},
                      height=max(250, 60 * len(traces) + 140), legend_title="upper: spans / lower: comm")
    return fig


def _bar(name: str, colour: str, rows: list[tuple[int, float, float, str]], origin: float, scale: float,
         offset: float, group: str) -> go.Bar:
    return go.Bar(name=name, y=[f"rank {r}" for r, *_ in rows], base=[(t0 - origin) * scale for _, t0, _, _ in rows],
                  x=[max((t1 - t0) * scale, 1e-3) for _, t0, t1, _ in rows], orientation="h", marker_color=colour,
                  marker_line={"color": "white", "width": 0.5}, hovertext=[h for *_, h in rows], hoverinfo="text",
                  legendgroup=group, width=0.38, offset=offset)


def _comm_hover(axis: str, c: Any) -> str:
    peer = f" peer {c.peer}" if c.peer is not None else ""
    tag = f" [{c.tag}]" if c.tag else ""
    return f"{axis}: {c.op}{tag}{peer}, {c.nbytes} bytes, group {list(c.group)}, {(c.t1 - c.t0) * 1e3:.2f} ms"


__all__ = ["AXIS_COLOURS", "MESH_AXES", "axis_timeline", "comm_by_axis", "group_axes", "mesh_figure", "mesh_groups",
           "rank_positions"]
