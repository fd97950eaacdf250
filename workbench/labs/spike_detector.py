"""Checker for lab 11: a spike/NaN/divergence detector, graded on recorded runs.

The learner writes the watchdog a long run needs (``workbench.training.health.SpikeDetector`` is the package's
simpler one): an object fed one step at a time, ``observe(loss, grad_norm) -> str | None``, which returns
``"nan"``, ``"spike"`` or ``"divergence"`` at the first step a problem is detectable and None while the run looks
healthy. It sees only the past (the checker feeds the steps in order, one call each), as a monitor on a live run
does.

It is graded on real runs of the tiny GPT on 2 gloo ranks, recorded by ``scripts/record_health_runs.py`` into
``workbench/assets/health_runs.json`` (rank 0's loss and gradient norm per step, 5 significant digits; a NaN is
stored as null and fed back as ``float("nan")``):

* three **clean** runs (two seeds, and a batch of 4 whose loss is noisier): no alarm at any step. Healthy runs have
  steps whose gradient norm is 10-25x its median while the loss does not move (recorded, not invented), and a loss
  that falls by half in the first 20 steps: neither is a problem.
* two **NaN** runs (``--inject-fault nan``, at step 45 and at step 3, inside any warm-up): ``"nan"`` at exactly
  that step. A NaN is visible the step it happens; no warm-up excuses missing it.
* two **spike** runs (one step's whole batch corrupted in the corpus, at step 50 and at step 15 while the loss is
  still falling fast): ``"spike"`` at exactly that step, the step the loss jumps (about 2-3x).
* one **divergence** run (from step 40 a growing share of every batch corrupted: the loss climbs from 2.5 to 5 over
  20 steps, never by a jump larger than normal noise allows): ``"divergence"`` within ``DIVERGENCE_WINDOW`` steps of
  the onset. A sustained rise is detectable only once it stands out of the noise, so a window is allowed; a
  ``"spike"`` there is the wrong diagnosis (the remedy differs: a spike is skipped, a divergence needs a rollback
  and a change).

In a faulty run the checker reads the first alarm (a real run stops or rolls back there); any alarm before the
fault is a false alarm. Detectors may stay silent on spikes and divergence for the first ``WARMUP_STEPS`` steps
(there is no baseline yet), never on a NaN.
"""

from __future__ import annotations

import importlib.resources
import json
import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from workbench.labs import LabCheckFailed, show_hint

KINDS = ("nan", "spike", "divergence")
WARMUP_STEPS = 10  # no spike or divergence is planted before step 25; the NaN at step 3 needs no baseline
DIVERGENCE_WINDOW = 10  # the reference flags the drift 2 steps after its onset; 10 leaves room for other rules
RUNS_RESOURCE = "assets/health_runs.json"
MORE = " (more help: hint(1), hint(2), hint(3))"

HINTS = {
    1: "Three questions per step, in this order. Is anything non-finite (loss or gradient norm)? That needs no "
       "history at all. Is this loss far above where the run has recently been? Compare with a robust summary "
       "of the recent *healthy* losses (a median resists outliers, a mean does not) and keep the spike itself out "
       "of that history. Has the level of the loss risen, and stayed up, compared with the best level the run has "
       "reached? A median of the last few steps is a level that one spike cannot move. The gradient norm of a "
       "healthy run jumps 10-25x now and then with no harm to the loss: use it for the NaN test, not for spikes.",
    2: "Numbers that separate the recorded runs: a warm-up of 10 steps; a spike is a loss above 1.5x the median of "
       "the last 20 healthy losses; a divergence is the median of the last 5 losses above 1.1x the lowest such "
       "median seen so far (the level never goes back up by 10% in a healthy run, the noise is a few percent). "
       "Check spike before divergence, and do not let a spike's loss into either history.",
    3: "import math, statistics\n"
       "from collections import deque\n"
       "class Detector:\n"
       "    def __init__(self):\n"
       "        self.recent, self.last5, self.best, self.steps = deque(maxlen=20), deque(maxlen=5), math.inf, 0\n"
       "    def observe(self, loss, grad_norm):\n"
       "        self.steps += 1\n"
       "        if not (math.isfinite(loss) and math.isfinite(grad_norm)): return 'nan'\n"
       "        if self.steps > 10 and loss > 1.5 * statistics.median(self.recent): return 'spike'\n"
       "        self.recent.append(loss); self.last5.append(loss)\n"
       "        if len(self.last5) == 5:\n"
       "            level = statistics.median(self.last5)\n"
       "            if self.steps > 10 and level > 1.1 * self.best: return 'divergence'\n"
       "            self.best = min(self.best, level)\n"
       "        return None",
}


def hint(level: int = 1) -> str:
    """Print (and return) hint ``level``: 1 the idea, 2 numbers that work, 3 nearly the code."""
    return show_hint(HINTS, level)


@lru_cache(maxsize=1)
def _runs() -> tuple[dict[str, Any], ...]:
    text = importlib.resources.files("workbench").joinpath(RUNS_RESOURCE).read_text(encoding="utf-8")
    return tuple(json.loads(text)["runs"])


def load_runs() -> list[dict[str, Any]]:
    """The recorded runs: each a dict with ``name``, ``fault`` (None, ``"nan"``, ``"spike"``, ``"divergence"``),
    ``step`` (where it was planted), ``how`` (the mechanism), ``config``, and per step ``loss`` and ``grad_norm``
    (floats, NaN where the run had one)."""
    nan = float("nan")
    return [{**run, "loss": [nan if v is None else v for v in run["loss"]],
             "grad_norm": [nan if v is None else v for v in run["grad_norm"]]} for run in _runs()]


def replay(make_detector: Callable[[], Any], run: dict[str, Any]) -> list[tuple[int, str]]:
    """Feed ``run``'s steps in order to a fresh ``make_detector()``; the alarms it raised, as (step, kind).
    ``LabCheckFailed`` if the detector cannot be made, raises, or answers something other than a kind or None."""
    detector = _make(make_detector)
    alarms = []
    for step, (loss, grad_norm) in enumerate(zip(run["loss"], run["grad_norm"], strict=True)):
        try:
            kind = detector.observe(loss, grad_norm)
        except Exception as error:  # the learner's code: show it pointed at the run and the step
            stub = " (still the stub: replace its body)" if isinstance(error, NotImplementedError) else ""
            raise LabCheckFailed(f"run {run['name']!r}, step {step} (loss {loss:.4g}, grad norm {grad_norm:.4g}): "
                                 f"your observe raised {type(error).__name__}: {error}{stub}") from None
        if kind is not None:
            if kind not in KINDS:
                raise LabCheckFailed(f"run {run['name']!r}, step {step}: observe returned {kind!r}; it must return "
                                     f"None or one of {', '.join(map(repr, KINDS))}")
            alarms.append((step, kind))
    return alarms


def _make(make_detector: Callable[[], Any]) -> Any:
    if not callable(make_detector):
        raise LabCheckFailed(f"pass something that makes a fresh detector (your class itself), got "
                             f"{type(make_detector).__name__}")
    try:
        detector = make_detector()
    except Exception as error:
        raise LabCheckFailed(f"making a detector raised {type(error).__name__}: {error}") from None
    if not callable(getattr(detector, "observe", None)):
        raise LabCheckFailed(f"the detector ({type(detector).__name__}) has no observe(loss, grad_norm) method")
    return detector


def _context(run: dict[str, Any], step: int) -> str:
    """The losses around ``step``, so a message shows what the detector saw."""
    lo = max(0, step - 5)
    shown = ", ".join(f"{v:.3g}" for v in run["loss"][lo:step + 1])
    return f"losses of steps {lo}-{step}: {shown}; grad norm at step {step}: {run['grad_norm'][step]:.3g}"


def _grade(run: dict[str, Any], alarms: list[tuple[int, str]]) -> None:
    name, fault, planted = run["name"], run["fault"], run["step"]
    early = [(s, k) for s, k in alarms if fault is None or s < planted]
    if early:
        step, kind = early[0]
        why = ("the gradient norm jumped there with the loss steady: healthy runs do that" if
               _grad_jump(run, step) else "normal noise, or the fast fall of the first steps, is not a problem")
        where = "a clean run" if fault is None else f"before its fault at step {planted}"
        raise LabCheckFailed(f"false alarm in run {name!r} ({where}): {kind!r} at step {step} ({_context(run, step)}); "
                             f"{why}")
    if fault is None:
        return
    if not alarms:
        raise LabCheckFailed(f"missed: run {name!r} ({run['how']}) raised no alarm; the {fault} shows at step "
                             f"{planted} ({_context(run, planted)}){MISSED[fault]}")
    step, kind = alarms[0]
    window = DIVERGENCE_WINDOW if fault == "divergence" else 0
    if kind != fault:
        raise LabCheckFailed(f"run {name!r} ({run['how']}): your first alarm says {kind!r} at step {step}, but this "
                             f"is a {fault} ({_misnamed(fault, kind)})")
    if step > planted + window:
        allowed = f"within {window} steps of its onset" if window else "at that very step"
        raise LabCheckFailed(f"late: run {name!r} ({run['how']}) first alarmed at step {step}; the {fault} starts at "
                             f"step {planted} and must be flagged {allowed} ({_context(run, planted + window)})")


MISSED = {
    "nan": ". A NaN fails every comparison (NaN > x is False): test math.isfinite first, from the first step",
    "spike": ". Is the spike's loss compared with a baseline of the recent healthy losses, from step "
             f"{WARMUP_STEPS} on?",
    "divergence": ". A slow rise never stands far above a baseline that climbs with it: compare the level (a median "
                  "of the last few losses) with the best level so far",
}


def _grad_jump(run: dict[str, Any], step: int) -> bool:
    norms = [g for g in run["grad_norm"][max(0, step - 20):step] if math.isfinite(g)]
    return bool(norms) and run["grad_norm"][step] > 3 * sorted(norms)[len(norms) // 2]


def _misnamed(fault: str, kind: str) -> str:
    if fault == "divergence" and kind == "spike":
        return "the loss climbs a little every step and stays up; no single step jumps. Each rise went into your " \
               "baseline, which climbed with it, until one step stood out: test the level, a median of the last " \
               "few steps, against the best level so far"
    if fault == "spike" and kind == "divergence":
        return "one step jumped and the next came back: a level such as a median of the last few steps cannot " \
               "move for one step, so test a single loss against the recent median for a spike, first"
    if fault == "nan":
        return "a NaN loss or gradient norm is its own kind, tested first: no comparison with a NaN is ever true"
    return "look at which test fired first"


def check(make_detector: Callable[[], Any]) -> None:
    """Replay every recorded run through a fresh ``make_detector()`` (your class) and grade its alarms; print a
    summary or raise ``LabCheckFailed`` naming the run, the step and the mistake."""
    try:
        runs = load_runs()
        found = {}
        for run in runs:
            alarms = replay(make_detector, run)
            _grade(run, alarms)
            found[run["name"]] = alarms[0] if alarms else None
    except LabCheckFailed as error:
        raise LabCheckFailed(f"{error}{MORE}") from None
    faulty = [f"{name}: {kind} at step {step}" for name, hit in found.items() if hit for step, kind in [hit]]
    clean = [name for name, hit in found.items() if hit is None]
    print(f"Correct: on {len(runs)} recorded runs, no false alarm on {', '.join(clean)}, and every fault flagged "
          f"with the right kind, in time: {'; '.join(faulty)}.")


__all__ = ["DIVERGENCE_WINDOW", "HINTS", "KINDS", "WARMUP_STEPS", "check", "hint", "load_runs", "replay"]
