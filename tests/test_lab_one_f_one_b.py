"""Lab 08 checker: typical wrong 1F1B plans get their pointed messages; the solution passes on real ranks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from workbench.labs import LabCheckFailed
from workbench.labs.one_f_one_b import HINTS, check, hint, stuck_actions
from workbench.theory import pipeline as tp
from workbench.theory.pipeline import Action

_SOLUTION = Path(__file__).resolve().parent.parent / "labs" / "solutions" / "one_f_one_b.py"


def _solution():
    spec = importlib.util.spec_from_file_location("lab08_solution", _SOLUTION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.one_f_one_b


def _phases(p: int, m: int, warmup) -> list[list[Action]]:
    """1F1B's three phases with ``warmup(p, r, m)`` forwards first: the shape most answers take."""
    plan = []
    for r in range(p):
        w = min(max(warmup(p, r, m), 0), m)
        actions = [Action(r, "F", i) for i in range(w)]
        for i in range(m - w):
            actions += [Action(r, "F", w + i), Action(r, "B", i)]
        plan.append(actions + [Action(r, "B", i) for i in range(m - w, m)])
    return plan


def stub(p, m):
    raise NotImplementedError("return plan[r] = rank r's list of Action(r, 'F' or 'B', microbatch)")


def gpipe_order(p, m):
    return tp.gpipe(p, m)


def one_forward_too_many(p, m):
    return _phases(p, m, lambda p, r, m: p - r)


def no_warmup(p, m):
    return _phases(p, m, lambda p, r, m: 0)


def warmup_by_rank(p, m):
    """Counted from the wrong end: the last rank warms up, the first does not."""
    return _phases(p, m, lambda p, r, m: r)


def backward_first(p, m):
    plan = _solution()(p, m)
    if p > 1:
        plan[0][0], plan[0][-1] = plan[0][-1], plan[0][0]  # rank 0 starts with B of the last micro-batch
    return plan


def missing_microbatch(p, m):
    return [[a for a in actions if a.microbatch != m - 1] for actions in _solution()(p, m)]


def last_rank_reversed(p, m):
    """The last rank takes micro-batches newest first; the others send them oldest first."""
    plan = _solution()(p, m)
    plan[-1] = [Action(p - 1, k, mb) for mb in reversed(range(m)) for k in ("F", "B")]
    return plan


def all_on_stage_zero(p, m):
    return [[Action(0, a.kind, a.microbatch) for a in actions] for actions in _solution()(p, m)]


def one_list_short(p, m):
    return _solution()(p, m)[:-1] if p > 1 else []


def tuples(p, m):
    return [[(a.stage, a.kind, a.microbatch) for a in actions] for actions in _solution()(p, m)]


def with_sends(p, m):
    return tp.with_communication(_solution()(p, m))


def split_backward(p, m):
    return tp.zero_bubble_h1(p, m)


def backwards_out_of_order(p, m):
    """Right warm-up, but rank 0 swaps its first two backwards: no deadlock, a larger bubble."""
    plan = _solution()(p, m)
    if p > 1 and m > 1:
        first, second = [i for i, a in enumerate(plan[0]) if a.kind == "B"][:2]
        plan[0][first], plan[0][second] = plan[0][second], plan[0][first]
    return plan


@pytest.mark.parametrize("fn, message", [
    (stub, "still the stub"),
    (gpipe_order, "rank 0 holds up to 4 micro-batches' activations at once; 1F1B holds at most p−r = 2.*GPipe's order"),
    (one_forward_too_many, "Too many forwards in the warm-up"),
    (no_warmup, "rank 0 runs only 1 forward.s. before its first backward, 1F1B runs p−r = 2.*too few warm-up"),
    (warmup_by_rank, r"deadlocks; the first stuck action is rank 0's B0"),
    (backward_first, r"rank 0 runs B3 before F3: a backward needs the activations its own forward saved"),
    (missing_microbatch, "rank 0 never runs the forward of micro-batch 3 \\(F3\\)"),
    (last_rank_reversed, "deadlocks; the first stuck action is rank 0's B0"),
    (all_on_stage_zero, "rank r runs stage r only"),
    (one_list_short, r"returned 1 list\(s\): return p = 2 lists"),
    (tuples, "not an Action"),
    (with_sends, "leave sends and receives out"),
    (split_backward, "whole backwards"),
    (backwards_out_of_order, "the warm-up counts are right, so look at the steady state"),
])
def test_wrong_plans_get_their_pointed_message(fn, message):
    with pytest.raises(LabCheckFailed, match=message):
        check(fn, run=False)


def test_deadlock_names_what_each_rank_waits_for():
    with pytest.raises(LabCheckFailed) as info:
        check(warmup_by_rank, run=False)
    text = str(info.value)
    assert "rank 0 is stuck at B0, waiting for B0 on rank 1 (micro-batch 0's gradient)" in text
    assert "rank 1 is stuck at F1, waiting for F1 on rank 0 (micro-batch 1's activations)" in text
    assert stuck_actions(_solution()(4, 8)) == {}


def test_hints_grow_more_detailed(capsys):
    texts = [hint(level) for level in (1, 2, 3)]
    assert texts == [HINTS[1], HINTS[2], HINTS[3]] and "hint 3/3" in capsys.readouterr().out
    assert "p−r−1" in texts[1] and "Action(r, 'F'" in texts[2] and "Action(" not in texts[0]
    with pytest.raises(ValueError, match="hint level .*: choose one of"):
        hint(4)


def test_not_a_function():
    with pytest.raises(LabCheckFailed, match="wants your function"):
        check([[Action(0, "F", 0)]])


@pytest.mark.timeout(240)
def test_solution_passes_on_real_ranks(capsys):
    check(_solution())
    out = capsys.readouterr().out
    assert "✓ theory" in out and "ran on 2 gloo ranks" in out and "ran on 3 gloo ranks" in out
    assert _solution()(3, 7) == tp.one_f_one_b(3, 7)
