"""Checked coding exercises of notebooks 07, 08 and 10, graded like the labs (``LabCheckFailed`` with tiered hints).

* notebook 07, ``check_block_wire_bytes(fn, measured=..., ...)``: the learner writes
  ``block_wire_bytes(tokens, h, tp, bytes_per_value, mode)``, the ring-wire bytes one rank sends per transformer
  block and training step (forward + backward) under ``mode`` "tp" (Megatron TP), "sp" (TP + SP as this package
  runs it: backward re-gathers the sequence-sharded input of each column-parallel linear) or "sp-saved" (Megatron:
  the gathered input is saved, or its re-gather overlapped, so SP adds no exposed bytes; Korthikanti et al. 2022,
  §4.2.2). Checked against the ring formulas and against the bytes the notebook's communication log measured.
* notebook 08, ``check_pipeline_model(fn, runs)``: the learner writes ``pipeline_model(run)``, fitting from a
  run's trace the mean forward and backward time and the per-hop message latency α; the checker compares them
  with the trace, simulates the plan with them (``theory.pipeline.simulate(..., latency=α)``) and prints the
  bubble it predicts beside the measured one and the closed form.
* notebook 10, ``check_young(young_interval, expected_waste)``: Young's interval √(2δM) and the first-order
  expected waste δ/τ + τ/(2M); checked against the formulas and against a simulated failure process.

The reference solutions are in the repository's ``labs/solutions/nb_exercises.py``, never in the package.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Mapping
from typing import Any

from workbench.labs import LabCheckFailed, show_hint
from workbench.theory import pipeline as theory
from workbench.theory.comm import bus_bytes

MORE = " (more help: hint_{name}(1), hint_{name}(2), hint_{name}(3))"


def _more(name: str) -> str:
    return MORE.format(name=name)


def _call(fn: Callable[..., Any], name: str, *args: Any) -> Any:
    if not callable(fn):
        raise LabCheckFailed(f"pass your function {name}, got {fn!r}")
    try:
        return fn(*args)
    except NotImplementedError as e:
        raise LabCheckFailed(f"{name} is still the stub ({e}). Write it, then check again.") from None
    except Exception as e:
        raise LabCheckFailed(f"{name}{args!r} raised {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------------------
# Notebook 07: TP vs SP bytes on the wire.

WIRE_MODES = ("tp", "sp", "sp-saved")
WIRE_HINTS = {
    1: "Count collectives per block, forward and backward, each on the block's activation S = tokens·h·bytes. "
       "TP: an all-reduce after attention's output projection and after the MLP, and their mirror images in "
       "backward. SP turns each all-reduce into a reduce-scatter plus an all-gather (the same ring bytes). What "
       "does backward need that forward only had for a moment?",
    2: "Ring wire bytes per rank: all-reduce 2(t−1)/t·S, all-gather and reduce-scatter (t−1)/t·S each "
       "(theory.comm.bus_bytes). TP: 4 all-reduces. SP: forward 2 all-gathers + 2 reduce-scatters, backward the "
       "same 4 swapped, and 2 more all-gathers: the column-parallel linears' weight gradients need their whole "
       "input, which SP saved only as a 1/t shard. 'sp-saved': Megatron keeps (or overlaps) that gathered input, "
       "so nothing extra is exposed.",
    3: "s = tokens * h * bytes_per_value\n"
       "ring = (tp - 1) / tp * s            # one all-gather or reduce-scatter per rank\n"
       "return {'tp': 8 * ring, 'sp': 10 * ring, 'sp-saved': 8 * ring}[mode]",
}


def hint_wire(level: int = 1) -> str:
    """Notebook 07's exercise: hint of tier ``level`` (1 the idea, 2 the shape, 3 nearly the code)."""
    return show_hint(WIRE_HINTS, level)


def wire_bytes_reference(tokens: int, h: int, tp: int, bytes_per_value: int, mode: str) -> float:
    """What the checker expects, from ``theory.comm.bus_bytes``'s ring factors (not the learner's shortcut)."""
    s = tokens * h * bytes_per_value
    tp_bytes = 4 * bus_bytes("all_reduce", s, tp)
    regather = 2 * bus_bytes("all_gather", s, tp)  # backward: the column-parallel linears' whole inputs
    return {"tp": tp_bytes, "sp": tp_bytes + regather, "sp-saved": tp_bytes}[mode]


WIRE_CASES = ((64, 64, 2, 4), (4096, 8192, 8, 2), (128, 512, 4, 2), (32, 16, 1, 4))


def check_block_wire_bytes(fn: Callable[[int, int, int, int, str], float],
                           measured: Mapping[str, float] | None = None, tokens: int | None = None,
                           h: int | None = None, tp: int | None = None, bytes_per_value: int = 4) -> None:
    """Check ``fn(tokens, h, tp, bytes_per_value, mode)`` against the ring formulas and, when given, the bytes
    per block the notebook's log measured (``measured = {"tp": ..., "sp": ...}`` at ``tokens``, ``h``, ``tp``)."""
    try:
        _check_wire(fn, measured, tokens, h, tp, bytes_per_value)
    except LabCheckFailed as error:
        raise LabCheckFailed(f"{error}{_more('wire')}") from None


def _check_wire(fn: Callable[..., float], measured: Mapping[str, float] | None, tokens: int | None, h: int | None,
                tp: int | None, bpv: int) -> None:
    for case in WIRE_CASES:
        for mode in WIRE_MODES:
            got, want = _call(fn, "block_wire_bytes", *case, mode), wire_bytes_reference(*case, mode)
            if not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-6):
                raise LabCheckFailed(f"block_wire_bytes{(*case, mode)!r} = {got!r}, expected {want:,.0f} bytes per "
                                     f"rank ({_wire_diagnosis(got, want, *case, mode)})")
    print(f"✓ formulas: {len(WIRE_CASES)} shapes × {WIRE_MODES}: TP 8(t−1)/t·S, SP 10(t−1)/t·S (25 % more: the two "
          "backward re-gathers), SP with the gathered input saved 8(t−1)/t·S, as Korthikanti et al. count.")
    if measured is None:
        return
    if None in (tokens, h, tp):
        raise LabCheckFailed("with measured bytes, pass the run's tokens, h and tp too")
    for mode, value in measured.items():
        mine = _call(fn, "block_wire_bytes", tokens, h, tp, bpv, mode)
        if not math.isclose(mine, value, rel_tol=1e-9):
            raise LabCheckFailed(f"the log measured {value:,.0f} wire bytes per block under {mode!r}; your "
                                 f"block_wire_bytes gives {mine:,.0f}")
        print(f"✓ measured: {mode!r} {value:,.0f} bytes per block on the wire per rank = your formula")


def _wire_diagnosis(got: Any, want: float, tokens: int, h: int, tp: int, bpv: int, mode: str) -> str:
    if not isinstance(got, (int, float)):
        return "return a number of bytes"
    ring = (tp - 1) / tp * tokens * h * bpv
    if tp == 1 and got:
        return "one rank sends nothing: every ring factor has (t−1)/t"
    if ring and math.isclose(got, 8 * ring) and mode == "sp":
        return "that is TP's count: which tensor does SP's backward gather again?"
    if ring and math.isclose(got, 10 * ring) and mode == "sp-saved":
        return "with the gathered input saved, the backward re-gathers are gone"
    if ring and math.isclose(got, 4 * ring):
        return "an all-reduce puts 2(t−1)/t·S on the wire, twice an all-gather"
    return f"{got / want:.3g}× the expected value" if want else "expected 0"


# ---------------------------------------------------------------------------------------------------------
# Notebook 08: message latency and the measured backward/forward ratio in the pipeline simulator.

PIPE_HINTS = {
    1: "Theory's grid assumes B = 2 F and messages that arrive instantly. Read both from the trace of the step the "
       "run quotes (run.step): every F and B is a span (name 'F mb3', category forward/backward, t0, t1 in "
       "seconds). A message's latency shows where a rank sat idle waiting for its neighbour: the gap between the "
       "neighbour's end and this action's start.",
    2: "F and B: the mean span duration of each kind over all ranks (the mean keeps the total work, which the "
       "bubble is measured against). α: for each action that needs a neighbour's output (F of rank r>0 needs F "
       "of rank r−1, B of rank r<p−1 needs B of rank r+1) and whose rank was free before that output was ready, "
       "start − the neighbour's end; take the median of those gaps. Return milliseconds.",
    3: "spans = {(r, s.name): (s.t0, s.t1) for r, t in enumerate(run.traces) for s in t.spans\n"
       "         if s.step == run.step and s.category in ('forward', 'backward')}\n"
       "# F, B: 1e3 * mean(t1 - t0) per kind\n"
       "# for r, actions in enumerate(run.plan): walk them in order with the previous end on that rank;\n"
       "#   dep = (r - 1, f'F mb{i}') for F on r > 0, (r + 1, f'B mb{i}') for B on r < p - 1\n"
       "#   if dep's end >= previous end: gaps.append(t0 - dep's end)\n"
       "return {'F': F, 'B': B, 'alpha': 1e3 * median(gaps)}",
}
#: The learner's F and B must equal the trace's means to rounding; α, a median of a few gaps, to 2 % (or 0.01 ms):
#: the rule for which gaps count is the part of the exercise that matters, and choosing another rule (every gap,
#: the mean) moves α by far more than that on a real trace (measured: 1–13 ms against the median's 1–7 ms).
ALPHA_RTOL, ALPHA_ATOL_MS = 0.02, 0.01


def hint_pipeline(level: int = 1) -> str:
    """Notebook 08's exercise: hint of tier ``level`` (1 the idea, 2 the shape, 3 nearly the code)."""
    return show_hint(PIPE_HINTS, level)


def trace_actions(run: Any) -> dict[tuple[int, str, int], tuple[float, float]]:
    """{(rank, kind, micro-batch): (t0, t1)} of the compute spans of the run's quoted step."""
    out = {}
    for r, t in enumerate(run.traces):
        for s in t.spans:
            if s.step == run.step and s.category in ("forward", "backward"):
                kind, mb = s.name.split()
                out[(r, kind, int(mb.removeprefix("mb")))] = (s.t0, s.t1)
    return out


def _reference_model(run: Any) -> dict[str, float]:
    acts = trace_actions(run)
    means = {k: 1e3 * statistics.fmean(t1 - t0 for (_, kind, _), (t0, t1) in acts.items() if kind == k)
             for k in ("F", "B")}
    gaps = []
    for r, actions in enumerate(run.plan):
        previous_end = -math.inf
        for a in actions:
            t0, t1 = acts[(r, a.kind, a.microbatch)]
            dep = ((r - 1, "F", a.microbatch) if a.kind == "F" and r > 0 else
                   (r + 1, "B", a.microbatch) if a.kind == "B" and r < len(run.plan) - 1 else None)
            if dep is not None and acts[dep][1] >= previous_end:  # idle until the message came: latency
                gaps.append(t0 - acts[dep][1])
            previous_end = t1
    return {**means, "alpha": 1e3 * statistics.median(gaps) if gaps else 0.0}


def model_bubble(run: Any, model: Mapping[str, float]) -> float:
    """The bubble the simulator predicts for ``run.plan`` with the fitted F, B and α (milliseconds)."""
    return theory.simulate(run.plan, {"F": model["F"], "B": model["B"]}, latency=model["alpha"]).bubble_fraction


def check_pipeline_model(fn: Callable[[Any], Mapping[str, float]], runs: Mapping[str, Any]) -> dict[str, float]:
    """Check ``fn(run) -> {"F": ms, "B": ms, "alpha": ms}`` on every run of ``runs`` against its trace, and print
    the bubble the simulator predicts with them beside the measurement and the closed form. Returns
    {run name: the model's remaining error (measured − predicted)}."""
    try:
        return _check_pipeline(fn, runs)
    except LabCheckFailed as error:
        raise LabCheckFailed(f"{error}{_more('pipeline')}") from None


def _check_pipeline(fn: Callable[[Any], Mapping[str, float]], runs: Mapping[str, Any]) -> dict[str, float]:
    errors = {}
    for name, run in runs.items():
        got, want = _call(fn, "pipeline_model", run), _reference_model(run)
        _check_model_values(name, got, want)
        predicted = model_bubble(run, got)
        errors[name] = run.bubble_measured - predicted
        print(f"✓ {name}: F {got['F']:.2f} ms, B {got['B']:.2f} ms (B/F {got['B'] / got['F']:.2f}), α "
              f"{got['alpha']:.2f} ms. Bubble measured {run.bubble_measured:.1%}; closed form "
              f"{run.bubble_theory:.1%} (error {run.bubble_measured - run.bubble_theory:+.1%}); simulator with "
              f"your F, B, α {predicted:.1%} (remaining error {errors[name]:+.1%})")
    return errors


def _check_model_values(name: str, got: Any, want: Mapping[str, float]) -> None:
    if not isinstance(got, Mapping) or set(got) != {"F", "B", "alpha"}:
        raise LabCheckFailed(f"pipeline_model({name!r} run) returned {got!r}: return a dict with the keys 'F', 'B' "
                             "and 'alpha', each in milliseconds")
    for key in ("F", "B"):
        if not math.isclose(got[key], want[key], rel_tol=1e-6):
            unit = " (seconds? the spans are in seconds, return milliseconds)" if math.isclose(
                got[key] * 1e3, want[key], rel_tol=1e-6) else ""
            raise LabCheckFailed(f"{name}: your {key} = {got[key]:.4g} ms, the mean {key} span of the run's quoted "
                                 f"step (run.step) is {want[key]:.4g} ms{unit}")
    if not math.isclose(got["alpha"], want["alpha"], rel_tol=ALPHA_RTOL, abs_tol=ALPHA_ATOL_MS):
        raise LabCheckFailed(f"{name}: your α = {got['alpha']:.3f} ms, the median wait for a neighbour's message "
                             f"(counted only where the rank was already free) is {want['alpha']:.3f} ms: a gap "
                             "where the rank was still busy with its previous action is not latency")


# ---------------------------------------------------------------------------------------------------------
# Notebook 10: Young's checkpoint interval.

YOUNG_HINTS = {
    1: "Two costs pull the interval τ in opposite directions: every save stalls training δ seconds (δ/τ of the "
       "time), and every failure throws away the work since the last save, on average τ/2, once every M seconds "
       "(τ/(2M) of the time). The best τ balances them.",
    2: "expected_waste(τ, δ, M) = δ/τ + τ/(2M) (Young 1974, first order: δ ≪ τ ≪ M). Set its derivative in τ to "
       "zero: −δ/τ² + 1/(2M) = 0.",
    3: "def young_interval(save_s, mtbf_s):\n    return math.sqrt(2 * save_s * mtbf_s)\n\n"
       "def expected_waste(interval_s, save_s, mtbf_s):\n    return save_s / interval_s + interval_s / (2 * mtbf_s)",
}
YOUNG_CASES = ((10.0, 3600.0), (1.0, 86400.0), (60.0, 3 * 3600.0), (0.5, 600.0))
#: The simulated process: failures at exponential times (mean M), each losing the work since the last committed
#: save; saves every τ of work, each δ. At δ/M = 1e-3 the first-order formula is within O(√(δ/M)) ≈ 3 % of the
#: true waste, and SIM_FAILURES failures give a sampling error of about 1/√SIM_FAILURES ≈ 2 % of the redone part
#: (seeded: the same number every run). 10 % bounds both; a τ off by 2× moves the waste by 25 %, far outside it.
SIM_SAVE_S, SIM_MTBF_S, SIM_FAILURES, SIM_RTOL = 10.0, 10_000.0, 4000, 0.10


def hint_young(level: int = 1) -> str:
    """Notebook 10's exercise: hint of tier ``level`` (1 the idea, 2 the shape, 3 nearly the code)."""
    return show_hint(YOUNG_HINTS, level)


def simulated_waste(interval_s: float, save_s: float, mtbf_s: float, failures: int = SIM_FAILURES,
                    seed: int = 0) -> float:
    """Fraction of wall-clock time lost (saves + redone work) by a run saving every ``interval_s`` seconds of work
    under exponential failures of mean ``mtbf_s``, measured over ``failures`` failures; restarts cost nothing."""
    if interval_s <= 0 or save_s < 0 or mtbf_s <= 0:
        raise ValueError(f"interval_s > 0, save_s >= 0 and mtbf_s > 0 needed, got {interval_s}, {save_s}, {mtbf_s}")
    rng = random.Random(seed)
    wall = useful = 0.0
    for _ in range(failures):
        life = rng.expovariate(1.0 / mtbf_s)  # wall-clock time until the next failure
        segments = int(life // (interval_s + save_s))  # whole segments of work + save committed before it
        useful += segments * interval_s
        wall += life
    return 1.0 - useful / wall


def check_young(young_interval: Callable[[float, float], float],
                expected_waste: Callable[[float, float, float], float]) -> None:
    """Check ``young_interval(save_s, mtbf_s)`` and ``expected_waste(interval_s, save_s, mtbf_s)`` against Young's
    formulas and a simulated failure process."""
    try:
        _check_young(young_interval, expected_waste)
    except LabCheckFailed as error:
        raise LabCheckFailed(f"{error}{_more('young')}") from None


def _check_young(young_interval: Callable[..., float], expected_waste: Callable[..., float]) -> None:
    for save_s, mtbf_s in YOUNG_CASES:
        tau, want = _call(young_interval, "young_interval", save_s, mtbf_s), math.sqrt(2 * save_s * mtbf_s)
        if not isinstance(tau, (int, float)) or not math.isclose(tau, want, rel_tol=1e-9):
            extra = " (√(δM) misses the 2: a failure loses half an interval on average)" if isinstance(
                tau, (int, float)) and math.isclose(tau, math.sqrt(save_s * mtbf_s), rel_tol=1e-9) else ""
            raise LabCheckFailed(f"young_interval({save_s}, {mtbf_s}) = {tau!r}, expected {want:.6g} s{extra}")
        for interval in (tau / 2, tau, 2 * tau):
            got = _call(expected_waste, "expected_waste", interval, save_s, mtbf_s)
            ref = save_s / interval + interval / (2 * mtbf_s)
            if not isinstance(got, (int, float)) or not math.isclose(got, ref, rel_tol=1e-9):
                raise LabCheckFailed(f"expected_waste({interval:.6g}, {save_s}, {mtbf_s}) = {got!r}, expected "
                                     f"{ref:.6g}: save stalls δ/τ plus redone work τ/(2M)")
    print(f"✓ formulas: τ* = √(2δM) and waste δ/τ + τ/(2M) at {len(YOUNG_CASES)} (δ, M) pairs")
    tau = young_interval(SIM_SAVE_S, SIM_MTBF_S)
    sims = {f: simulated_waste(f * tau, SIM_SAVE_S, SIM_MTBF_S) for f in (0.5, 1.0, 2.0)}
    predicted = expected_waste(tau, SIM_SAVE_S, SIM_MTBF_S)
    if not math.isclose(sims[1.0], predicted, rel_tol=SIM_RTOL):
        raise LabCheckFailed(f"at τ* = {tau:.0f} s the simulated failure process wastes {sims[1.0]:.2%}, your "
                             f"expected_waste says {predicted:.2%}")
    if not sims[1.0] < min(sims[0.5], sims[2.0]):
        raise LabCheckFailed(f"τ* = {tau:.0f} s is not the best of τ*/2, τ*, 2τ* in simulation: {sims}")
    print(f"✓ simulation (δ = {SIM_SAVE_S:.0f} s, M = {SIM_MTBF_S:.0f} s, {SIM_FAILURES} failures): waste at τ*/2, "
          f"τ*, 2τ* = {sims[0.5]:.2%}, {sims[1.0]:.2%}, {sims[2.0]:.2%}; your formula at τ* {predicted:.2%} "
          f"(error {sims[1.0] - predicted:+.2%})")


__all__ = ["check_block_wire_bytes", "check_pipeline_model", "check_young", "hint_pipeline", "hint_wire",
           "hint_young", "model_bubble", "simulated_waste", "trace_actions"]
