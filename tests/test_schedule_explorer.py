"""The pipeline plan figure and the schedule explorer: one row per rank, one box per action, theory's numbers,
validation messages instead of crashes, the run path with a fake runner, and one run on 2 real ranks."""

from __future__ import annotations

import functools
import html
from types import SimpleNamespace

import plotly.graph_objects as go
import pytest

from workbench.models import GPTConfig
from workbench.pipeline_demo import run_schedule
from workbench.theory import pipeline as tp
from workbench.trace import Span, Trace
from workbench.viz.pipeline import box_counts, measured_figure, plan_boxes, plan_figure, plan_vs_measured, trace_boxes
from workbench.widgets.schedule_explorer import FORMULAS, ScheduleExplorer

PLANS = [("naive", 2, 3, 1), ("gpipe", 2, 4, 1), ("1f1b", 3, 5, 1), ("interleaved", 2, 4, 2), ("zb", 4, 8, 1)]


def _as_traces(sim: tp.Simulation, scale: float = 0.01, origin: float = 1000.0, step: int = 0) -> list[Trace]:
    """What the executor would record for a simulated plan: one span per action, named as it names them."""
    multi = tp.num_stages([[t.action for t in row] for row in sim.timeline]) > len(sim.timeline)
    traces = []
    for rank, row in enumerate(sim.timeline):
        spans = [Span(f"{t.action.kind} mb{t.action.microbatch}" + (f" s{t.action.stage}" if multi else ""),
                      "forward" if t.action.kind == "F" else "backward", origin + t.start * scale,
                      origin + t.end * scale, rank, step) for t in row]
        spans.append(Span("send F mb0", "comm", origin, origin + scale / 2, rank, step))  # not an action: ignored
        traces.append(Trace(rank, len(sim.timeline), spans=spans))
    return traces


@pytest.mark.parametrize("name, p, m, v", PLANS, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in PLANS])
def test_plan_figure_has_a_row_per_rank_and_a_box_per_action(name, p, m, v):
    plan = tp.make_plan(name, p, m, v)
    fig = plan_figure(plan)
    assert isinstance(fig, go.Figure)
    assert {y for bar in fig.data for y in bar.y} == {f"rank {r}" for r in range(p)}
    counts = box_counts(fig)
    for kind in tp.COMPUTE_KINDS:
        assert counts.get(kind, 0) == sum(a.kind == kind for row in plan for a in row), kind
    # each box carries its micro-batch index; the idle boxes add up to the bubble
    f_bar = next(bar for bar in fig.data if bar.name.startswith("F"))
    assert sorted(set(f_bar.text)) == sorted({f"{mb}" + (f"·s{s}" if v > 1 else "")
                                              for row in plan for a in row if a.kind == "F"
                                              for mb, s in [(a.microbatch, a.stage)]})
    sim = tp.simulate(plan)
    idle = sum(b.end - b.start for b in plan_boxes(sim) if b.kind == "idle")
    assert idle == pytest.approx(sim.bubble_fraction * p * sim.makespan)


def test_measured_boxes_come_from_the_action_spans_of_one_step():
    sim = tp.simulate(tp.gpipe(2, 4))
    traces = _as_traces(sim, step=3)
    traces[0].spans.append(Span("F mb0", "forward", 0.0, 1.0, 0, 2))  # another step: not drawn
    boxes = trace_boxes(traces, step=3)
    assert sorted((b.rank, b.kind, b.microbatch) for b in boxes if b.kind != "idle") == sorted(
        (r, t.action.kind, t.action.microbatch) for r, row in enumerate(sim.timeline) for t in row)
    idle = sum(b.end - b.start for b in boxes if b.kind == "idle")
    assert idle == pytest.approx(sim.bubble_fraction * 2 * sim.makespan * 0.01)
    assert box_counts(measured_figure(traces, step=3)) == box_counts(plan_figure(sim))
    both = plan_vs_measured(sim, traces, step=3, measured_bubble=0.25)
    assert "bubble 25.0%" in both.layout.annotations[1].text
    assert box_counts(both)["F"] == 2 * 8
    with pytest.raises(ValueError, match="no pipeline action spans"):
        trace_boxes(traces, step=7)


def test_explorer_shows_theory_and_updates_on_control_change():
    explorer = ScheduleExplorer("gpipe", p=2, m=4)
    a = explorer.analysis
    assert a["bubble_theory"] == pytest.approx(1 / 5) and a["peak_in_flight"] == [4, 4]
    assert "20.0%" in explorer.summary.value and FORMULAS["gpipe"] in explorer.summary.value
    assert box_counts(explorer.figure)["F"] == 8
    explorer.controls["schedule"].value = "1f1b"  # as a click would
    assert explorer.analysis["peak_in_flight"] == [2, 1] and "rank 0: 2, rank 1: 1" in explorer.summary.value
    explorer.controls["m"].value = 8
    assert explorer.analysis["bubble_theory"] == pytest.approx(1 / 9) and box_counts(explorer.figure)["B"] == 16
    assert explorer.controls["v"].disabled and explorer.inputs()["v"] == 1
    explorer.set(schedule="interleaved", p=4, m=8, v=2)
    assert explorer.analysis["bubble_theory"] == pytest.approx(3 / 19) and not explorer.controls["v"].disabled
    assert box_counts(explorer.figure)["F"] == 4 * 8 * 2


@pytest.mark.parametrize("settings, message", [
    ({"schedule": "interleaved", "p": 2, "m": 3, "v": 2}, "must be a multiple of pp=2"),
    ({"schedule": "1f1b", "p": 4, "m": 2}, "needs at least as many micro-batches as stages"),
    ({"schedule": "interleaved", "p": 2, "m": 4, "v": 1}, "interleaved needs virtual stages v >= 2"),
])
def test_invalid_combinations_show_the_validation_message(settings, message):
    explorer = ScheduleExplorer(runner=lambda *a: pytest.fail("must not run"))
    explorer.set(**settings)
    assert message in explorer.error and message in html.unescape(explorer.summary.value)
    assert explorer.figure is None and explorer.analysis is None and explorer.run_button.disabled
    with pytest.raises(ValueError, match=message):
        explorer.run()
    explorer.set(schedule="gpipe", p=2, m=4, v=1)  # and it recovers
    assert explorer.error is None and explorer.figure is not None and not explorer.run_button.disabled


def test_bad_arguments_raise_clearly():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        ScheduleExplorer("pipedream")
    with pytest.raises(ValueError, match="p must be an int in 1..8"):
        ScheduleExplorer(p=0)
    with pytest.raises(ValueError, match=r"unknown control\(s\) \['q'\]"):
        ScheduleExplorer().set(q=3)


def _fake_runner(calls: list):
    def runner(schedule, p, m, v):
        calls.append((schedule, p, m, v))
        sim = tp.simulate(tp.make_plan(schedule, p, m, v))
        return SimpleNamespace(traces=_as_traces(sim, step=1), step=1, bubble_measured=0.3,
                               peak_in_flight=sim.peak_in_flight)
    return runner


def test_run_hands_the_settings_to_the_runner_and_draws_the_measurement():
    calls: list = []
    explorer = ScheduleExplorer("interleaved", p=2, m=4, v=2, runner=_fake_runner(calls))
    result = explorer.run()
    assert calls == [("interleaved", 2, 4, 2)] and explorer.result is result
    assert len(explorer.measured_figure.layout.annotations) == 2  # plan above, measured below
    assert box_counts(explorer.measured_figure)["F"] == 2 * 16
    assert "measured bubble</b> 30.0%" in explorer.status.value and "theory 11.1%" in explorer.status.value
    explorer.controls["m"].value = 8  # the measurement belonged to m=4: cleared
    assert explorer.result is None and explorer.measured_figure is None
    explorer.set(schedule="gpipe", v=1)
    explorer.run_button.click()  # the button runs it too
    assert calls[-1] == ("gpipe", 2, 8, 1) and explorer.result is not None


def test_run_is_refused_without_runner_or_for_too_many_ranks_and_a_failing_run_is_reported():
    explorer = ScheduleExplorer("1f1b", p=2, m=4)
    assert explorer.run_button.disabled and "no runner given" in explorer.status.value
    with pytest.raises(ValueError, match="no runner given"):
        explorer.run()
    explorer = ScheduleExplorer("1f1b", p=8, m=8, runner=_fake_runner([]))
    assert explorer.run_button.disabled and "p <= 4" in html.unescape(explorer.status.value)

    def broken(*_):
        raise RuntimeError("rank 1 failed: boom")

    explorer = ScheduleExplorer("1f1b", p=2, m=4, runner=broken)
    explorer.run_button.click()  # a click never raises into the front end
    assert "run failed: rank 1 failed: boom" in explorer.status.value and explorer.result is None


@pytest.mark.timeout(120)
def test_one_real_run_on_two_ranks():
    tiny = GPTConfig.preset("tiny", n_layer=2, seq_len=16)
    explorer = ScheduleExplorer("1f1b", p=2, m=4, runner=functools.partial(run_schedule, steps=2, cfg=tiny,
                                                                           timeout=60))
    result = explorer.run()
    assert result.peak_in_flight == explorer.analysis["peak_in_flight"] == [2, 1]
    assert result.step == 1 and 0.0 < result.bubble_measured < 1.0
    assert result.losses[0] == result.losses[1]  # the same batch, no optimizer step
    assert box_counts(explorer.measured_figure) == {**box_counts(explorer.measured_figure), "F": 16, "B": 16}
    assert all(b > 0 for b in result.peak_activation_bytes)
