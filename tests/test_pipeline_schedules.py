"""Pipeline schedules as data: every plan is checked, simulated and compared with theory, without processes."""

from __future__ import annotations

import itertools

import pytest

from workbench.theory import pipeline as tp
from workbench.theory.pipeline import Action

pytestmark = pytest.mark.timeout(60)

# (schedule, p, m, v): every schedule over a few pipeline depths and micro-batch counts.
SIZES = ((1, 1), (2, 2), (2, 4), (3, 5), (4, 8))
CASES = [(name, p, m, 1) for name in ("naive", "gpipe", "1f1b", "zb") for p, m in SIZES]
CASES += [("interleaved", p, m, v) for p, m, v in ((1, 2, 2), (2, 2, 2), (2, 4, 3), (3, 6, 2), (4, 8, 2), (4, 4, 4))]
IDS = [f"{name}-p{p}-m{m}-v{v}" for name, p, m, v in CASES]


@pytest.mark.parametrize("name, p, m, v", CASES, ids=IDS)
def test_every_stage_and_microbatch_runs_forward_and_backward_once(name, p, m, v):
    plan = tp.make_plan(name, p, m, v)
    assert len(plan) == p
    tp.check_plan(plan, m)
    backward = {"B"} if name != "zb" else {"I", "W"}
    for rank, actions in enumerate(plan):
        assert {a.stage for a in actions} == set(tp.rank_stages(rank, p, v))
        assert sorted((a.stage, a.kind, a.microbatch) for a in actions) == sorted(
            (s, k, mb) for s in tp.rank_stages(rank, p, v) for k in {"F"} | backward for mb in range(m))


@pytest.mark.parametrize("name, p, m, v", CASES, ids=IDS)
def test_simulation_honours_every_dependency(name, p, m, v):
    sim = tp.simulate(tp.make_plan(name, p, m, v), durations={"F": 1, "B": 3, "I": 2, "W": 1})
    end = {}
    for row in sim.timeline:
        for t in row:
            end[(t.action.stage, t.action.kind, t.action.microbatch)] = t.end
        for before, after in itertools.pairwise(row):  # one action at a time per rank
            assert after.start >= before.end
    n_stages = p * v
    for row in sim.timeline:
        for t in row:
            s, kind, mb = t.action.stage, t.action.kind, t.action.microbatch
            if kind == "F" and s > 0:
                assert t.start >= end[(s - 1, "F", mb)]
            if kind in ("B", "I"):
                assert t.start >= end[(s, "F", mb)]
                if s < n_stages - 1:
                    assert t.start >= end.get((s + 1, "B", mb), end.get((s + 1, "I", mb)))
            if kind == "W":
                assert t.start >= end[(s, "I", mb)]


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 8)])
def test_1f1b_holds_at_most_p_microbatches_while_gpipe_holds_m(p, m):
    assert tp.simulate(tp.gpipe(p, m)).peak_in_flight == [m] * p
    assert tp.simulate(tp.one_f_one_b(p, m)).peak_in_flight == [p - r for r in range(p)]  # rank r: p − r
    assert tp.simulate(tp.zero_bubble_h1(p, m)).peak_in_flight == [p - r for r in range(p)]  # same as 1F1B
    assert tp.simulate(tp.naive(p, m)).peak_in_flight == [1] * p


@pytest.mark.parametrize("name, p, m, v", [c for c in CASES if c[0] != "zb"], ids=[i for i in IDS if "zb" not in i])
@pytest.mark.parametrize("durations", [None, {"F": 1, "B": 3}], ids=["F1B2", "F1B3"])
def test_simulated_bubble_equals_the_closed_form(name, p, m, v, durations):
    result = tp.analyze(name, p, m, v, durations)
    # a simulation and a closed form in Python floats (no tensors, no SIMD): equal up to float64 rounding
    assert result["bubble_simulated"] == pytest.approx(result["bubble_theory"], abs=1e-12)


@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 24)])
@pytest.mark.parametrize("durations", [None, {"F": 2, "I": 3, "W": 1}, {"F": 1, "I": 1.2, "W": 0.8}])
def test_zb_h1_bubble_is_its_closed_form_and_below_1f1b(p, m, durations):
    zb = tp.analyze("zb", p, m, durations=durations)
    assert zb["bubble_simulated"] == pytest.approx(zb["bubble_theory"], abs=1e-12)  # Python floats, as above
    d = {**tp.DEFAULT_DURATIONS, **(durations or {})}
    one_f_one_b = tp.simulate(tp.one_f_one_b(p, m), {"F": d["F"], "B": d["I"] + d["W"]})
    assert zb["bubble_simulated"] < one_f_one_b.bubble_fraction
    assert zb["simulation"].makespan < one_f_one_b.makespan


def test_zb_h1_bubble_is_a_third_of_1f1b_with_equal_passes():
    # Qi et al. 2023, Table 2: idle (p−1)(T_F+T_B−T_W) against 1F1B's (p−1)(T_F+T_B+T_W).
    p, m = 4, 8
    zb = tp.simulate(tp.zero_bubble_h1(p, m))
    one_f_one_b = tp.simulate(tp.one_f_one_b(p, m))
    assert zb.makespan * p - sum(zb.busy) == pytest.approx((one_f_one_b.makespan * p - sum(one_f_one_b.busy)) / 3)


def test_interleaving_divides_the_bubble_time_by_v():
    p, m = 4, 8
    base = tp.simulate(tp.one_f_one_b(p, m))
    for v in (2, 4):
        # each chunk holds 1/v of the layers, so its F and B take 1/v of the time
        inter = tp.simulate(tp.interleaved_1f1b(p, m, v), {"F": 1 / v, "B": 2 / v})
        idle, base_idle = inter.makespan - inter.busy[0], base.makespan - base.busy[0]
        assert idle == pytest.approx(base_idle / v)


def test_format_plan_draws_the_grid():
    text = tp.format_plan(tp.gpipe(2, 2))
    assert text.splitlines() == [
        "rank 0 | F0 F1 .  .  .  B0 B0 B1 B1",
        "rank 1 | .  F0 F1 B0 B0 B1 B1 .  .",
        "bubble 0.333, peak in-flight micro-batches per rank [2, 2]",
    ]
    assert "F0s2" in tp.format_plan(tp.interleaved_1f1b(2, 2, 2))  # stages named when a rank holds several
    with pytest.raises(ValueError, match="whole time units"):
        tp.format_plan(tp.gpipe(2, 2), {"F": 1.5})


def test_communication_is_explicit_and_matched_in_order():
    for name, p, m, v in CASES:
        plan = tp.make_plan(name, p, m, v)
        lowered = tp.with_communication(plan)
        assert [[a for a in row if a.is_compute] for row in lowered] == plan
        for src, dst in itertools.product(range(p), repeat=2):
            sent = [tp.matching_receive(a) for a in lowered[src]
                    if a.kind.startswith("SEND") and tp.message_peer(a, p) == dst]
            received = [a for a in lowered[dst] if a.kind.startswith("RECV") and tp.message_peer(a, p) == src]
            assert received == sent, f"{name} p={p}: link {src}->{dst} posted out of order"
            assert src != dst or not sent  # a stage's neighbour on the same rank is handed over locally
    # a receive comes before the compute that needs it; a send right after the compute that makes it
    row = tp.with_communication(tp.one_f_one_b(2, 2))[1]
    assert row[:4] == [Action(1, "RECV_F", 0), Action(1, "F", 0), Action(1, "B", 0), Action(1, "SEND_B", 0)]


def test_stage_layers_balances_and_names_the_too_many_stages_error():
    assert tp.stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert tp.stage_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]  # extra layers go first
    with pytest.raises(ValueError, match="4 pipeline stages but the model has only 2 layers"):
        tp.stage_layers(2, 4)


@pytest.mark.parametrize("args, message", [
    (("1f1b", 4, 2), "1f1b.*at least as many micro-batches as stages: m=2 < p=4"),
    (("zb", 4, 3), "at least as many micro-batches"),
    (("interleaved", 2, 3, 2), "m=3 must be a multiple of pp=2"),
    (("interleaved", 2, 4, 2, 6), "layers must be divisible by 4"),
    (("interleaved", 2, 4, 1), "v >= 2"),
    (("gpipe", 2, 4, 2), "use schedule 'interleaved' for v > 1"),
    (("gpipe", 4, 4, 1, 2), "4 pipeline stages but the model has only 2 layers"),
    (("gpipe", 0, 4), "pipeline stages"),
    (("1F1B", 2, 4), "unknown pipeline schedule '1F1B'; valid: naive, gpipe, 1f1b, interleaved, zb"),
])
def test_bad_sizes_raise_with_the_fix(args, message):
    with pytest.raises(ValueError, match=message):
        tp.make_plan(*args)


def test_check_plan_and_simulate_reject_broken_plans():
    with pytest.raises(ValueError, match="needs B, or I and W"):
        tp.check_plan([[Action(0, "F", 0)]], 1)
    with pytest.raises(ValueError, match="appears twice"):
        tp.check_plan([[Action(0, "F", 0), Action(0, "F", 0), Action(0, "B", 0)]], 1)
    with pytest.raises(ValueError, match="lives on rank 1"):
        tp.check_plan([[Action(1, "F", 0)], []], 1)
    # rank 0 waits for a gradient that rank 1 only makes after a forward that waits for rank 0
    deadlock = [[Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
                [Action(1, "F", 1), Action(1, "B", 1), Action(1, "F", 0), Action(1, "B", 0)]]
    with pytest.raises(ValueError, match="plan deadlocks: rank 0 waits at B0s0; rank 1 waits at F1s1"):
        tp.simulate(deadlock)


def test_measured_bubble_from_intervals():
    # two ranks, makespan 4: rank 0 busy 3, rank 1 busy 2 -> idle 3 of 8
    assert tp.measured_bubble({0: [(10, 13)], 1: [(11, 12), (13, 14)]}) == pytest.approx(3 / 8)
