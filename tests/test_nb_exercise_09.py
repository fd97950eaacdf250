"""Notebook 09's checked exercise (issue 24): ``estimate_step_time(problem)``, a layout's step time composed from its
pieces, graded against ``theory.step_time``. The notebook's stub fails its checker with a hint, each classic mistake
gets its own message, the reference solution passes and agrees with ``theory.step_time`` on the checker's layouts
and on the notebook's, and the notebook wires the exercise as the labs do (USE_SOLUTION, a check cell
``workbench labs check`` grades, a following cell that ranks with the learner's function)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import nbformat
import pytest

from workbench.labs import LabCheckFailed
from workbench.labs.grading import EXERCISE
from workbench.labs.nb09_step_time import MISTAKES, check_problems, check_step_time, hint, step_problem
from workbench.theory.parallelism import Layout
from workbench.theory.step_time import Candidate, rank_layouts

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "labs") not in sys.path:  # the reference solutions live beside the labs, outside the workbench package
    sys.path.insert(0, str(ROOT / "labs"))

from solutions.nb09_step_time import estimate_step_time  # noqa: E402

pytestmark = pytest.mark.timeout(60)  # pure arithmetic: milliseconds each
NOTEBOOK = ROOT / "notebooks" / "09_3d_parallelism.ipynb"


def _cells() -> list:
    return nbformat.read(NOTEBOOK, as_version=4).cells


def _stub():
    """The notebook's own stub, executed from its cell."""
    (source,) = [c.source for c in _cells() if c.cell_type == "code" and "def estimate_step_time(" in c.source]
    namespace: dict = {}
    exec(source, namespace)  # noqa: S102 -- the notebook's stub cell, from this repository
    return namespace["estimate_step_time"]


def test_stub_fails_with_a_hint():
    with pytest.raises(LabCheckFailed, match=r"still the stub.*hint\(1\)"):
        check_step_time(_stub())


def test_solution_passes_and_is_theory_on_every_checked_layout(capsys):
    seconds = check_step_time(estimate_step_time)
    assert "✓" in capsys.readouterr().out and len(seconds) == 4
    for _, problem, want in check_problems():
        assert math.isclose(estimate_step_time(problem), want, rel_tol=1e-12)


def test_the_checked_layouts_are_not_the_notebooks():
    """Graded on another model and cluster than notebook 09 prints: nothing to copy from a printed cell."""
    source = "\n".join(c.source for c in _cells())
    problems = [p for _, p, _ in check_problems()]
    assert not any(p.name in source for p in problems)
    assert {p.recompute for p in problems} >= {"selective", "full"}
    assert any(p.sizes["replicate"] > 1 for p in problems) and any(p.sizes["pp"] > 1 for p in problems)
    assert any(p.overlap < 1 for p in problems)


def test_solution_ranks_the_notebooks_layouts_as_theory_does():
    """What the notebook's cell after the check asserts, on the theory test's Llama-2-70B candidates that fit."""
    L = Layout
    cands = [Candidate("ZeRO-3, full, b=1", L(dp=64, zero_stage=3, microbatches=8), 1, "full"),
             Candidate("ZeRO-3, full, b=8", L(dp=64, zero_stage=3, microbatches=1), 8, "full"),
             Candidate("HSDP 16x4", L(dp=16, zero_stage=3, microbatches=4), 2, "full", replicate=4),
             Candidate("TP=8, ZeRO-1", L(dp=8, tp=8, zero_stage=1, microbatches=64), 1, "selective"),
             Candidate("TP=16, PP=4", L(tp=16, pp=4, sp=True, microbatches=512), 1, "selective")]
    timing = {"peak_flops": 400e12, "mfu": 1.0}
    rows = [r for r in rank_layouts("llama-70B", cands, 512, memory_layout="classic", **timing) if r["fits"]]
    assert len(rows) == 5
    mine = [estimate_step_time(step_problem("llama-70B", r["candidate"], 512, **timing)) for r in rows]
    assert all(math.isclose(m, r["total_s"], rel_tol=1e-12) for m, r in zip(mine, rows, strict=True))


# Each classic mistake, written as a learner would (independently of the checker's own planted variants).
def _learner(pb, mistake: str = "") -> float:
    factors = {"none": 1.0, "selective": pb.selective_factor, "full": 2.0 if mistake == "full_twice" else 4 / 3}
    factor = 1.0 if mistake == "no_factor" else factors[pb.recompute]
    compute = pb.flops / pb.flops_per_s * factor
    reach, link = 1, {}
    for axis in ("tp", "dp", "replicate", "pp"):
        reach *= pb.sizes[axis]
        link[axis] = pb.intra if reach <= pb.gpus_per_node or mistake == "all_fast" else pb.inter
    if mistake == "tp_slow":
        link["tp"] = pb.inter

    def seconds(axis):
        return sum(link[axis].collective_time(op, s, pb.sizes[axis]) * (1 if mistake == "once" else n)
                   for op, s, n in pb.traffic[axis])

    tp = seconds("tp") * (factors[pb.recompute] if mistake == "tp_factor" else 1)
    p, m = pb.sizes["pp"], pb.microbatches
    bubble = 0.0 if mistake == "no_bubble" else (p - 1) / (m + p - 1)
    busy = compute + tp + seconds("pp")
    dp = seconds("dp") + (0 if mistake == "no_replicate" else seconds("replicate"))
    overlap = 1.0 if mistake == "full_overlap" else pb.overlap
    if mistake == "no_overlap" or (p > 1 and mistake != "hidden_under_pp"):
        exposed = dp
    else:
        exposed = max(0.0, dp - overlap * compute)
    if mistake == "bubble_added":
        return busy * (1 + bubble) + exposed
    if mistake == "dp_stretched":
        return (busy + exposed) / (1 - bubble)
    return busy / (1 - bubble) + exposed


def test_the_learner_model_of_this_test_is_the_solution():
    for _, problem, want in check_problems():
        assert math.isclose(_learner(problem), want, rel_tol=1e-12)


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_planted_mistake_is_named_by_its_own_message(mistake):
    with pytest.raises(LabCheckFailed) as caught:
        check_step_time(lambda pb: _learner(pb, mistake))
    message = str(caught.value)
    assert MISTAKES[mistake] in message and "hint(1)" in message
    assert sum(m in message for m in MISTAKES.values()) == 1  # no other mistake's message


@pytest.mark.parametrize("fn,message", [
    (lambda pb: 1e3 * estimate_step_time(pb), "returned milliseconds"),
    (lambda pb: {"total_s": estimate_step_time(pb)}, "as one number"),
    (lambda pb: float("nan"), "as one number"),
    (lambda pb: pb.sizes["cp"], "raised KeyError"),
    (lambda pb: 1.1 * estimate_step_time(pb), "the model gives another number"),
    ("estimate_step_time", "wants your function"),
])
def test_other_wrong_answers_get_a_pointed_message(fn, message):
    with pytest.raises(LabCheckFailed, match=message):
        check_step_time(fn)


def test_hints_are_tiered_and_step_problem_names_what_it_cannot_price(capsys):
    assert "4/3" in hint(2) and "def estimate_step_time" in hint(3)
    assert "hint 3/3" in capsys.readouterr().out
    with pytest.raises(ValueError, match="cp = 1"):
        step_problem("llama-13B", Candidate("cp", Layout(dp=2, cp=2)), 2)
    with pytest.raises(ValueError, match="global_batch=3"):  # step_time's own validation
        step_problem("llama-13B", Candidate("c", Layout(dp=2)), 3)


def test_notebook_wires_the_exercise_as_the_labs_do():
    """USE_SOLUTION is a parameter, its cell imports the solution, the check cell is an exercise for ``workbench labs
    check`` that a headless run steps past (tagged raises-exception), and the next cell ranks with the learner's
    function when the check passed."""
    cells = _cells()
    (params,) = [c for c in cells if "parameters" in c.metadata.get("tags", [])]
    assert "USE_SOLUTION = False" in params.source
    assert any("import estimate_step_time" in c.source and "if USE_SOLUTION:" in c.source for c in cells)
    checks = [i for i, c in enumerate(cells) if c.cell_type == "code" and EXERCISE.search(c.source)]
    assert len(checks) == 1  # the one exercise `workbench labs check` grades in this notebook
    check = cells[checks[0]]
    assert check.source.startswith("graded = check_step_time(estimate_step_time)")
    assert "raises-exception" in check.metadata.get("tags", [])
    after = cells[checks[0] + 1].source
    assert '"graded" in globals()' in after and "estimate_step_time(step_problem(" in after and "assert" in after
