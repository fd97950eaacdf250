"""viz.mesh: the groups come from the rank→coordinate mapping (Megatron's or any other), the figure draws every
rank and group, and the communication log is summed and drawn per mesh axis."""

from __future__ import annotations

import plotly.graph_objects as go
import pytest

from workbench.cli import comm_group_labels
from workbench.mesh import MeshShape
from workbench.trace import CommEvent, Span, Trace
from workbench.viz.mesh import (
    AXIS_COLOURS,
    axis_timeline,
    comm_by_axis,
    mesh_figure,
    mesh_groups,
    rank_positions,
)

SHAPES = [(2, 2, 2), (1, 2, 4), (4, 1, 2), (2, 4, 1), (1, 1, 1), (3, 2, 2)]


def _megatron(pp: int, dp: int, tp: int) -> tuple[dict[str, int], dict[int, dict[str, int]]]:
    shape = MeshShape(pp=pp, dp=dp, tp=tp)
    return {"pp": pp, "dp": dp, "tp": tp}, {r: shape.coords(r) for r in range(shape.world_size)}


@pytest.mark.parametrize("pp, dp, tp", SHAPES)
def test_groups_from_megatron_coords_are_the_meshs_groups(pp: int, dp: int, tp: int) -> None:
    sizes, coords = _megatron(pp, dp, tp)
    groups = mesh_groups(sizes, coords)
    shape = MeshShape(pp=pp, dp=dp, tp=tp)
    for axis in ("pp", "dp", "tp"):
        assert groups[axis] == shape.all_axis_groups(axis), axis


def test_two_by_two_by_two_groups_by_hand() -> None:
    groups = mesh_groups(*_megatron(2, 2, 2))
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # neighbours: one NVLink island each
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # a stage per half: a node each on 2 x 4 GPUs


def test_another_mapping_gives_other_groups() -> None:
    """dp fastest instead of tp: the same sizes, other groups, so the figure follows the mapping it is given."""
    sizes = {"pp": 1, "dp": 2, "tp": 2}
    coords = {r: {"pp": 0, "dp": r % 2, "tp": r // 2} for r in range(4)}
    groups = mesh_groups(sizes, coords)
    assert groups["tp"] == [[0, 2], [1, 3]] and groups["dp"] == [[0, 1], [2, 3]]
    fig = mesh_figure(sizes, coords)
    hovers = {t.hovertext for t in fig.data if t.mode == "lines"}
    assert "tp group 0: ranks [0, 2]" in hovers and "dp group 1: ranks [2, 3]" in hovers


@pytest.mark.parametrize("pp, dp, tp", SHAPES)
def test_positions_put_each_group_on_a_row_a_column_or_across_stages(pp: int, dp: int, tp: int) -> None:
    sizes, coords = _megatron(pp, dp, tp)
    pos, groups = rank_positions(sizes, coords), mesh_groups(sizes, coords)
    assert len(set(pos.values())) == pp * dp * tp
    for g in groups["tp"]:
        assert len({pos[r][1] for r in g}) == 1 and [pos[r][0] for r in g] == sorted(pos[r][0] for r in g)
    for g in groups["dp"]:
        assert len({pos[r][0] for r in g}) == 1
    for g in groups["pp"]:
        assert len({pos[r][1] for r in g}) == 1
        xs = [pos[r][0] for r in g]
        assert all(b - a > tp - 1 for a, b in zip(xs, xs[1:], strict=False))  # each stage in its own block


def test_figure_draws_every_rank_and_every_group() -> None:
    sizes, coords = _megatron(2, 2, 2)
    fig = mesh_figure(sizes, coords, gpus_per_node=4)
    assert isinstance(fig, go.Figure)
    [ranks] = [t for t in fig.data if t.name == "rank"]
    assert list(ranks.text) == [str(r) for r in range(8)]
    assert "rank 5: pp=1, dp=0, tp=1, node 1" in ranks.hovertext
    assert len(set(ranks.marker.color[:4])) == 1 and ranks.marker.color[0] != ranks.marker.color[4]  # two nodes
    lines = [t for t in fig.data if t.mode == "lines"]
    for axis in ("pp", "dp", "tp"):
        mine = [t for t in lines if t.legendgroup == axis]
        assert len(mine) == 4 and sum(t.showlegend for t in mine) == 1
        assert {t.line.color for t in mine} == {AXIS_COLOURS[axis]}
    assert any(t.name == "node 1: ranks 4–7" for t in fig.data)
    texts = {a.text for a in fig.layout.annotations}
    assert {"<b>pipeline stage 0</b>", "<b>pipeline stage 1</b>", "tp 1", "dp 1"} <= texts


def test_axes_of_size_one_draw_no_links() -> None:
    fig = mesh_figure(*_megatron(1, 1, 4))
    assert {t.legendgroup for t in fig.data if t.mode == "lines"} == {"tp"}


@pytest.mark.parametrize("sizes, coords, message", [
    ({"pp": 1, "dp": 2, "tp": 1}, {0: {"pp": 0, "dp": 0, "tp": 0}}, "every rank 0..1"),
    ({"pp": 1, "dp": 2, "tp": 1}, {0: {"pp": 0, "dp": 0, "tp": 0}, 1: {"pp": 0, "dp": 2, "tp": 0}}, "dp=2"),
    ({"pp": 1, "dp": 2, "tp": 1}, {0: {"pp": 0, "dp": 1, "tp": 0}, 1: {"pp": 0, "dp": 1, "tp": 0}},
     "ranks 0 and 1 have the same coordinates"),
    ({"pp": 0, "dp": 1, "tp": 1}, {0: {"pp": 0, "dp": 0, "tp": 0}}, "pp must be a positive int, got 0"),
    ({"pp": 1, "dp": 1, "tp": 1, "cp": 2}, {0: {"pp": 0, "dp": 0, "tp": 0}}, "only the pp, dp and tp axes"),
    ({"pp": 1, "dp": 1, "tp": 1}, {0: {"pp": 0, "dp": 0, "tp": 0, "cp": 1}}, "not drawn"),
])
def test_bad_meshes_raise_naming_the_value(sizes: dict, coords: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mesh_figure(sizes, coords)
    with pytest.raises(ValueError, match="gpus_per_node"):
        mesh_figure(*_megatron(1, 1, 2), gpus_per_node=0)


# ---------------------------------------------------------------- the comm log per axis


def _traces() -> tuple[list[Trace], list[dict]]:
    """Four ranks, dp=2 x tp=2, two steps: tp all-reduces and a dp all-reduce in each, a set-up broadcast."""
    labels = comm_group_labels({"pp": 1, "dp": 2, "cp": 1, "tp": 2})
    traces = []
    for rank in range(4):
        tp_group, dp_group = (0, 1) if rank < 2 else (2, 3), (rank % 2, rank % 2 + 2)
        comms = [CommEvent("broadcast", 64, 32.0, "float32", (16,), dp_group, 0.0, 0.1, rank, tag="init")]
        spans = []
        for step in (0, 1):
            t = 10.0 * (step + 1)
            spans.append(Span("forward", "forward", t, t + 1, rank, step))
            comms += [CommEvent("all_reduce", 4096, 4096.0, "float32", (1024,), tp_group, t + 0.2 * i, t + 0.2 * i
                                + 0.1, rank, tag="tp", step=step) for i in range(3)]
            comms.append(CommEvent("all_reduce", 1000, 1000.0, "float32", (250,), dp_group, t + 2, t + 3, rank,
                                   tag="grad", step=step))
        traces.append(Trace(rank, 4, spans=spans, comms=comms))
    return traces, labels


def test_comm_by_axis_sums_exact_bytes_per_rank_axis_op_and_tag() -> None:
    traces, labels = _traces()
    rows = comm_by_axis(traces, labels, step=1)
    assert {(r["rank"], r["axis"], r["tag"]) for r in rows} == {(k, a, t) for k in range(4)
                                                                for a, t in (("tp", "tp"), ("dp", "grad"))}
    tp = next(r for r in rows if r["rank"] == 2 and r["axis"] == "tp")
    assert tp["count"] == 3 and tp["nbytes"] == 3 * 4096 and isinstance(tp["nbytes"], int)
    every = comm_by_axis(traces, labels)
    assert sum(r["count"] for r in every if r["tag"] == "init") == 4
    assert sum(r["nbytes"] for r in every if r["axis"] == "dp") == 4 * (64 + 2 * 1000)
    assert {r["axis"] for r in comm_by_axis(traces, [])} == {"other"}


def test_axis_timeline_colours_collectives_by_axis_and_keeps_one_step() -> None:
    traces, labels = _traces()
    fig = axis_timeline(traces, labels, step=1)
    bars = {t.name: t for t in fig.data}
    assert set(bars) == {"forward", "tp comm", "dp comm"}
    assert len(bars["tp comm"].y) == 4 * 3 and len(bars["dp comm"].y) == 4
    assert bars["tp comm"].marker.color == AXIS_COLOURS["tp"] and bars["dp comm"].marker.color == AXIS_COLOURS["dp"]
    assert min(bars["forward"].base) == 0.0  # the step's first event is time zero
    assert "tp: all_reduce [tp], 4096 bytes, group [0, 1]" in bars["tp comm"].hovertext[0]
    with pytest.raises(ValueError, match=r"no spans or communication recorded in step 7; traced steps: \[0, 1\]"):
        axis_timeline(traces, labels, step=7)
    with pytest.raises(ValueError, match="unit must be one of"):
        axis_timeline(traces, labels, step=1, unit="h")


def test_async_sends_are_pale_and_underneath_and_actions_are_labelled() -> None:
    traces, labels = _traces()
    labels = labels + [{"ranks": [0, 2], "axis": "pp"}]  # pretend ranks 0 and 2 are one pipeline
    send = CommEvent("send", 512, 512.0, "float32", (128,), (0, 2), 10.1, 13.0, 0, async_op=True, tag="pp_act",
                     step=1, peer=2)
    traces[0].comms.append(send)
    traces[0].spans.append(Span("F mb0", "forward", 10.0, 10.5, 0, 1))
    fig = axis_timeline(traces, labels, step=1)
    names = [t.name for t in fig.data]
    assert "pp comm (async: posted → waited)" in names
    comm = [n for n in names if "comm" in n]
    assert comm[0].endswith("(async: posted → waited)")  # drawn first: under the blocking collectives
    pale = fig.data[names.index("pp comm (async: posted → waited)")]
    assert pale.opacity < 1 and pale.marker.color == AXIS_COLOURS["pp"] and pale.x[0] == pytest.approx(2900)
    forward = fig.data[names.index("forward")]
    assert "F mb0" in forward.text and "" in forward.text  # actions labelled, other spans not
