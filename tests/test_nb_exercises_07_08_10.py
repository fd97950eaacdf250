"""The checked exercises of notebooks 07, 08 and 10 (workbench.labs.nb_exercises): the stub fails with a hint, the
reference solution (labs/solutions/nb_exercises.py) passes, planted mistakes are named, and the notebooks carry
the stub, the checker call and the USE_SOLUTION switch. No ranks: notebook 08's trace is synthetic, laid out by
the simulator itself with known F, B and α, so the fit must recover them and close the gap exactly."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

from workbench.labs import LabCheckFailed
from workbench.labs import nb_exercises as ex
from workbench.theory import pipeline as tp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "labs"))
from solutions import nb_exercises as solution  # noqa: E402  (the reference solutions live beside the labs)

pytestmark = pytest.mark.timeout(60)


def stub(*args: object) -> float:
    raise NotImplementedError("write it")


# ---------------------------------------------------------------------------------------------------------
# Notebook 07


def test_wire_stub_fails_with_hint() -> None:
    with pytest.raises(LabCheckFailed, match=r"still the stub.*hint_wire\(1\)"):
        ex.check_block_wire_bytes(stub)


def test_wire_solution_passes_and_matches_measured_bytes() -> None:
    tokens, h, t = 64, 64, 2
    measured = {m: ex.wire_bytes_reference(tokens, h, t, 4, m) for m in ("tp", "sp")}
    ex.check_block_wire_bytes(solution.block_wire_bytes, measured=measured, tokens=tokens, h=h, tp=t)
    # SP's 25 % more bytes on the wire, and none more once the gathered input is kept (Korthikanti's count)
    assert measured["sp"] == 1.25 * measured["tp"]
    assert solution.block_wire_bytes(tokens, h, t, 4, "sp-saved") == measured["tp"]


def test_wire_mistakes_are_named() -> None:
    def tp_count_for_sp(tokens: int, h: int, t: int, bpv: int, mode: str) -> float:
        return 8 * (t - 1) / t * tokens * h * bpv

    with pytest.raises(LabCheckFailed, match="gather again"):
        ex.check_block_wire_bytes(tp_count_for_sp)

    def off_by_measured(tokens: int, h: int, t: int, bpv: int, mode: str) -> float:
        return solution.block_wire_bytes(tokens, h, t, bpv, mode)

    with pytest.raises(LabCheckFailed, match="the log measured"):
        ex.check_block_wire_bytes(off_by_measured, measured={"sp": 1.0}, tokens=64, h=64, tp=2)


# ---------------------------------------------------------------------------------------------------------
# Notebook 08

TRUE_F_MS, TRUE_B_MS, TRUE_ALPHA_MS = 10.0, 16.6, 0.5  # B/F = 1.66, as the issue measured


def synthetic_run(name: str, p: int, m: int) -> SimpleNamespace:
    """A run whose trace (step 1) is the simulator's own timeline with known F, B and α, in seconds; step 0 holds
    other durations, which a fit must ignore."""
    plan = tp.make_plan(name, p, m)
    traces = [SimpleNamespace(spans=[]) for _ in range(p)]
    for step, scale in ((0, 3.0), (1, 1.0)):
        sim = tp.simulate(plan, {"F": scale * TRUE_F_MS, "B": scale * TRUE_B_MS}, latency=TRUE_ALPHA_MS)
        for r, row in enumerate(sim.timeline):
            traces[r].spans += [SimpleNamespace(name=f"{t.action.kind} mb{t.action.microbatch}",
                                                category="forward" if t.action.kind == "F" else "backward",
                                                t0=100.0 * step + t.start / 1e3, t1=100.0 * step + t.end / 1e3,
                                                step=step) for t in row]
    measured = tp.simulate(plan, {"F": TRUE_F_MS, "B": TRUE_B_MS}, latency=TRUE_ALPHA_MS).bubble_fraction
    return SimpleNamespace(name=name, p=p, plan=plan, traces=traces, step=1, bubble_measured=measured,
                           bubble_theory=tp.bubble_fraction(name, p, m))


RUNS = {"gpipe": synthetic_run("gpipe", 3, 6), "1f1b": synthetic_run("1f1b", 3, 6)}


def test_pipeline_stub_fails_with_hint() -> None:
    with pytest.raises(LabCheckFailed, match=r"still the stub.*hint_pipeline\(1\)"):
        ex.check_pipeline_model(stub, RUNS)


def test_pipeline_solution_recovers_f_b_alpha_and_closes_the_gap() -> None:
    errors = ex.check_pipeline_model(solution.pipeline_model, RUNS)
    for name, run in RUNS.items():
        fit = solution.pipeline_model(run)
        # the timeline is the simulator's own, so the fit is exact up to float rounding of seconds -> ms
        assert math.isclose(fit["F"], TRUE_F_MS, rel_tol=1e-9) and math.isclose(fit["B"], TRUE_B_MS, rel_tol=1e-9)
        assert math.isclose(fit["alpha"], TRUE_ALPHA_MS, rel_tol=1e-6)
        assert abs(errors[name]) < 1e-9  # the model closes the gap ...
        assert abs(run.bubble_measured - run.bubble_theory) > 0.005  # ... that the closed form leaves open
    # with α the last rank waits for every message in 1F1B's steady state: 1F1B measures worse than GPipe
    assert RUNS["1f1b"].bubble_measured > RUNS["gpipe"].bubble_measured


def test_pipeline_mistakes_are_named() -> None:
    def in_seconds(run: SimpleNamespace) -> dict[str, float]:
        fit = solution.pipeline_model(run)
        return {"F": fit["F"] / 1e3, "B": fit["B"] / 1e3, "alpha": fit["alpha"]}

    with pytest.raises(LabCheckFailed, match="return milliseconds"):
        ex.check_pipeline_model(in_seconds, RUNS)

    def no_latency(run: SimpleNamespace) -> dict[str, float]:
        return {**solution.pipeline_model(run), "alpha": 0.0}

    with pytest.raises(LabCheckFailed, match="median wait"):
        ex.check_pipeline_model(no_latency, RUNS)
    with pytest.raises(LabCheckFailed, match="keys 'F', 'B'"):
        ex.check_pipeline_model(lambda run: (1.0, 2.0), RUNS)


# ---------------------------------------------------------------------------------------------------------
# Notebook 10


def test_young_stub_fails_with_hint() -> None:
    with pytest.raises(LabCheckFailed, match=r"still the stub.*hint_young\(1\)"):
        ex.check_young(stub, stub)


def test_young_solution_passes_and_is_the_simulated_optimum() -> None:
    ex.check_young(solution.young_interval, solution.expected_waste)
    tau = solution.young_interval(ex.SIM_SAVE_S, ex.SIM_MTBF_S)
    sims = [ex.simulated_waste(f * tau, ex.SIM_SAVE_S, ex.SIM_MTBF_S) for f in (0.7, 1.0, 1.4)]
    assert sims[1] < min(sims[0], sims[2])


def test_young_mistakes_are_named() -> None:
    with pytest.raises(LabCheckFailed, match="misses the 2"):
        ex.check_young(lambda d, m: math.sqrt(d * m), solution.expected_waste)
    with pytest.raises(LabCheckFailed, match="redone work"):
        ex.check_young(solution.young_interval, lambda t, d, m: d / t + t / m)


def test_simulated_waste_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="interval_s > 0"):
        ex.simulated_waste(0.0, 1.0, 10.0)


# ---------------------------------------------------------------------------------------------------------
# The notebooks carry the exercise: a stub, a checker call that the grader finds, tagged so nbval goes on.

NOTEBOOKS = {"07": "check_block_wire_bytes", "08": "check_pipeline_model", "10": "check_young"}


@pytest.mark.parametrize("number", sorted(NOTEBOOKS))
def test_notebook_has_stub_checker_and_switch(number: str) -> None:
    from workbench.labs.grading import EXERCISE

    (path,) = (ROOT / "notebooks").glob(f"{number}_*.ipynb")
    cells = nbformat.read(path, as_version=4).cells
    checks = [c for c in cells if c.cell_type == "code" and NOTEBOOKS[number] + "(" in c.source
              and EXERCISE.search(c.source)]
    assert len(checks) == 1, f"{path.name}: one exercise cell calling {NOTEBOOKS[number]}"
    assert "raises-exception" in checks[0].metadata.get("tags", []), "the stub's failure must not stop nbval"
    assert any("NotImplementedError" in c.source for c in cells if c.cell_type == "code")
    params = [c for c in cells if "parameters" in c.metadata.get("tags", [])]
    assert "USE_SOLUTION = False" in params[0].source
