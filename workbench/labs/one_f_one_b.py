"""Lab 08: write the 1F1B action lists, and a checker that says what went wrong.

A pipeline schedule is data (``workbench.theory.pipeline``): ``plan[rank]`` is the ordered list of
``Action(stage, kind, microbatch)`` that rank runs, F for a forward and B for a backward of one micro-batch
through its stage. GPipe (Huang et al. 2019) runs all m forwards, then all m backwards, so every stage holds
m micro-batches' activations at the turn. 1F1B (PipeDream-Flush; Narayanan et al. 2021, §2.2.1) starts each
backward as soon as it can: with the same bubble, (p−1)/(m+p−1), rank r never holds more than p−r.

The learner writes ``one_f_one_b(p, m) -> plan`` (one stage per rank: stage r on rank r, no send/recv, the
executor adds those). ``check(fn)``:

1. calls it for several (p, m) and checks the lists: one per rank, ``Action``s of the rank's own stage, F and
   B of every micro-batch exactly once, each B after its own F;
2. plays the ranks' orders against each other (F of stage s needs F of s−1, B of s needs B of s+1) and names
   the first stuck actions if they deadlock;
3. simulates it (``theory.pipeline.simulate``) and compares the peak in-flight micro-batches per rank and
   the bubble with theory's 1F1B: too many warm-up forwards show as memory, too few as bubble;
4. runs it with the real executor on 2 and 3 gloo ranks and compares the loss and every gradient with one
   process on the same batch.

``hint(1)``, ``hint(2)``, ``hint(3)``: more detail at each tier.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workbench.labs import LabCheckFailed, rounding_error, show_hint, within_rounding
from workbench.theory import pipeline as theory
from workbench.theory.pipeline import Action

#: (p, m) the plan is checked for without ranks, the first failing one reported: m a multiple of p and not,
#: m = p, one stage.
CASES: tuple[tuple[int, int], ...] = ((2, 4), (3, 7), (4, 8), (2, 2), (3, 3), (1, 3))
#: (p, m) run on real gloo ranks.
RUN_CASES: tuple[tuple[int, int], ...] = ((2, 4), (3, 6))
#: One forward and backward of the tiny GPT in fp32, split into micro-batches and stages: the same terms as one
#: process added in another order, so loss and gradients agree to rounding at their scale, whatever order the
#: CPU's SIMD width adds in. Units of eps(fp32) × the largest reference gradient of the whole model
#: (``workbench.labs.rounding_error``), not of each tensor: an attention key bias's gradient is zero in exact
#: arithmetic (softmax ignores a shift shared by every key), so that tensor holds rounding noise only, and noise
#: is no scale (there ~1e-10 of the model's largest gradient). For the loss, eps × |loss|. The reference solution
#: measured at most 0.7 units, gradients and loss (ATEN_CPU_CAPABILITY=default and avx2); a micro-batch run twice
#: or skipped is off by far more.
ROUNDING_UNITS = 64

HINTS = {
    1: "Start from the last rank: it owns the loss, so it can run B of a micro-batch right after its F. Rank r "
       "is p−1−r stages further from the loss: the first gradient reaches it only after that many more "
       "forwards have gone down the pipe. Each forward that runs before a backward keeps one more micro-batch's "
       "activations alive; 1F1B runs exactly as many as it needs to stay busy, no more.",
    2: "Three phases on rank r. Warm-up: the forwards of micro-batches 0..w−1, w = min(p−r−1, m). Steady state: "
       "for each of the remaining m−w micro-batches, one forward (the next micro-batch) then one backward (the "
       "oldest micro-batch still held). Cool-down: the w backwards left. Micro-batches go in order 0, 1, 2, … "
       "both ways on every rank, so sends and receives between neighbours match. Look at your plan with "
       "format_plan(one_f_one_b(3, 6)): its grid must be exactly as long as format_plan(gpipe(3, 6))'s.",
    3: "for r in range(p):\n"
       "    w = min(p - r - 1, m)\n"
       "    actions = [Action(r, 'F', i) for i in range(w)]          # warm-up\n"
       "    for i in range(m - w):                                    # steady state: 1F then 1B\n"
       "        actions += [Action(r, 'F', w + i), Action(r, 'B', i)]\n"
       "    actions += [Action(r, 'B', i) for i in range(m - w, m)]  # cool-down\n"
       "    plan.append(actions)",
}


def hint(level: int = 1) -> str:
    """Print (and return) the hint of tier ``level``: 1 the idea, 2 the shape, 3 nearly the code."""
    return show_hint(HINTS, level)


# ---------------------------------------------------------------------------------------------------------
# The checker.


MORE = " (more help: hint(1), hint(2), hint(3))"


def check(fn: Callable[[int, int], Any], run: bool = True) -> None:
    """Check ``fn(p, m)`` against 1F1B's contract, theory and (``run``) the real executor; raise
    ``LabCheckFailed`` with a pointed message, or print what works."""
    try:
        _check(fn, run)
    except LabCheckFailed as error:
        raise LabCheckFailed(f"{error}{MORE}") from None


def _check(fn: Callable[[int, int], Any], run: bool) -> None:
    if not callable(fn):
        raise LabCheckFailed(f"check() wants your function one_f_one_b(p, m), got {fn!r}")
    plans = {(p, m): _call(fn, p, m) for p, m in CASES}
    for (p, m), plan in plans.items():
        _check_lists(plan, p, m)
        _check_each_rank(plan, p, m)
    # A deadlock anywhere outranks memory and bubble: the plan would hang the real ranks.
    for check_case in (_check_no_deadlock, _check_memory, _check_bubble):
        for (p, m), plan in plans.items():
            check_case(plan, p, m)
    print(f"✓ theory: for every (p, m) in {list(CASES)} your plan runs every micro-batch once, never deadlocks, "
          "has 1F1B's bubble (p−1)/(m+p−1) and holds at most p−r micro-batches on rank r.")
    if not run:
        return
    for p, m in RUN_CASES:
        ran = _check_on_ranks(_call(fn, p, m), p, m)
        print(f"✓ ranks: p={p}, m={m} ran on {p} gloo ranks with the real executor: loss {ran['loss']:.6f} equals "
              f"one process's, every gradient to float32 rounding (largest difference {ran['max_diff']:.1e}, "
              f"{ran['max_units']:.2g} × eps × the largest gradient; bound {ROUNDING_UNITS}), peak "
              f"in-flight per rank {ran['peak']} as simulated.")


def _call(fn: Callable[[int, int], Any], p: int, m: int) -> Any:
    try:
        return fn(p, m)
    except NotImplementedError as e:
        raise LabCheckFailed(f"one_f_one_b is still the stub ({e}). Write it, then check again.") from None
    except Exception as e:
        raise LabCheckFailed(f"one_f_one_b({p}, {m}) raised {type(e).__name__}: {e}") from e


def _check_lists(plan: Any, p: int, m: int) -> None:
    """One list per rank, of Actions, of that rank's stage, kinds F and B, micro-batches 0..m−1."""
    if not isinstance(plan, (list, tuple)) or len(plan) != p:
        got = f"{len(plan)} list(s)" if isinstance(plan, (list, tuple)) else f"a {type(plan).__name__}"
        raise LabCheckFailed(f"one_f_one_b({p}, {m}) returned {got}: return p = {p} lists, plan[r] being rank "
                             "r's actions in order")
    for r, actions in enumerate(plan):
        if not isinstance(actions, (list, tuple)):
            raise LabCheckFailed(f"plan[{r}] is a {type(actions).__name__}: each rank's plan is a list of Action")
        for a in actions:
            _check_action(a, r, p, m)


def _check_action(a: Any, r: int, p: int, m: int) -> None:
    if not isinstance(a, Action):
        raise LabCheckFailed(f"rank {r}'s list holds {a!r}, not an Action: build each step as Action(stage, kind, "
                             "microbatch), e.g. Action(0, 'F', 3)")
    if a.kind in theory.COMM_KINDS:
        raise LabCheckFailed(f"rank {r} lists {a}: leave sends and receives out, the executor adds them "
                             "(theory.pipeline.with_communication); the plan holds only F and B")
    if a.kind in ("I", "W"):
        raise LabCheckFailed(f"rank {r} lists {a}: 1F1B runs whole backwards, kind 'B' (splitting B into I and W "
                             "is the zero-bubble schedule, ZB-H1)")
    if a.stage != r:
        raise LabCheckFailed(f"for p={p}, m={m}, rank {r} lists {a}, an action of stage {a.stage}: with one stage "
                             f"per rank, rank r runs stage r only, Action({r}, kind, microbatch)")
    if not 0 <= a.microbatch < m:
        raise LabCheckFailed(f"for p={p}, m={m}, rank {r} lists {a}: micro-batches are numbered 0..{m - 1}")


def _check_each_rank(plan: list[list[Action]], p: int, m: int) -> None:
    """Every micro-batch's F and B exactly once per rank, F first."""
    for r, actions in enumerate(plan):
        seen: set[tuple[str, int]] = set()
        for a in actions:
            if (a.kind, a.microbatch) in seen:
                raise LabCheckFailed(f"for p={p}, m={m}, rank {r} runs {a.kind}{a.microbatch} twice: each "
                                     "micro-batch goes forward once and backward once on every rank")
            if a.kind == "B" and ("F", a.microbatch) not in seen:
                raise LabCheckFailed(f"for p={p}, m={m}, rank {r} runs B{a.microbatch} before F{a.microbatch}: a "
                                     "backward needs the activations its own forward saved, so on every rank "
                                     f"F{a.microbatch} comes first")
            seen.add((a.kind, a.microbatch))
        for kind, name in (("F", "forward"), ("B", "backward")):
            missing = [mb for mb in range(m) if (kind, mb) not in seen]
            if missing:
                raise LabCheckFailed(f"for p={p}, m={m}, rank {r} never runs the {name} of micro-batch "
                                     f"{missing[0]} ({kind}{missing[0]})" + (f" nor of {missing[1:]}" if missing[1:]
                                                                            else "")
                                     + f": every rank runs F and B of all m = {m} micro-batches")


def _needs(a: Action, p: int) -> list[tuple[int, str, int]]:
    """What ``a`` waits for: the forward of the stage before, or its own forward and the next stage's B."""
    if a.kind == "F":
        return [(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
    after = [(a.stage + 1, "B", a.microbatch)] if a.stage < p - 1 else []
    return [(a.stage, "F", a.microbatch), *after]


def stuck_actions(plan: list[list[Action]]) -> dict[int, tuple[Action, list[tuple[int, str, int]]]]:
    """Play every rank's order as far as it goes; per stuck rank, the action it waits at and what is missing."""
    p, done, nxt = len(plan), set(), [0] * len(plan)
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while nxt[r] < len(plan[r]) and all(d in done for d in _needs(plan[r][nxt[r]], p)):
                a = plan[r][nxt[r]]
                done.add((a.stage, a.kind, a.microbatch))
                nxt[r] += 1
                progressed = True
    return {r: (plan[r][nxt[r]], [d for d in _needs(plan[r][nxt[r]], p) if d not in done])
            for r in range(p) if nxt[r] < len(plan[r])}


def _what(need: tuple[int, str, int]) -> str:
    stage, kind, mb = need
    sent = f"micro-batch {mb}'s activations" if kind == "F" else f"micro-batch {mb}'s gradient"
    return f"{kind}{mb} on rank {stage} ({sent})"


def _check_no_deadlock(plan: list[list[Action]], p: int, m: int) -> None:
    stuck = stuck_actions(plan)
    if not stuck:
        return
    first = min(stuck)
    lines = [f"rank {r} is stuck at {a.kind}{a.microbatch}, waiting for " + " and ".join(map(_what, needs))
             for r, (a, needs) in sorted(stuck.items())]
    a = stuck[first][0]
    raise LabCheckFailed(
        f"for p={p}, m={m} the plan deadlocks; the first stuck action is rank {first}'s {a.kind}{a.microbatch}:\n  "
        + ";\n  ".join(lines) + ".\nEach waits for something that comes later in another rank's list. A rank "
        "receives a gradient only after the next rank ran that micro-batch's backward, and the next rank runs it "
        "only after the forward it needs. Count how many forwards rank r must run before the first gradient can "
        "come back to it (fewer on the later ranks, none on the last), and keep micro-batches in the same order "
        "on every rank.")


def _forwards_first(actions: list[Action]) -> int:
    """Forwards a rank runs before its first backward: 1F1B's p−r−1 warm-up ones plus the steady state's first."""
    return next((i for i, a in enumerate(actions) if a.kind == "B"), len(actions))


def _check_memory(plan: list[list[Action]], p: int, m: int) -> None:
    want = theory.simulate(theory.one_f_one_b(p, m)).peak_in_flight
    got = theory.simulate(plan).peak_in_flight
    for r in range(p):
        if got[r] > want[r]:
            ahead = _forwards_first(plan[r])
            gpipe = " — all m forwards before any backward is GPipe's order, which holds all m" if ahead == m else ""
            raise LabCheckFailed(
                f"for p={p}, m={m}, rank {r} holds up to {got[r]} micro-batches' activations at once; 1F1B holds at "
                f"most p−r = {want[r]} there. Too many forwards in the warm-up: rank {r} runs {ahead} forward(s) "
                f"before its first backward, 1F1B runs p−r = {min(p - r, m)} (p−r−1 warm-up forwards, then the "
                f"steady state's first){gpipe}.")


def _check_bubble(plan: list[list[Action]], p: int, m: int) -> None:
    got, bubble = theory.simulate(plan).bubble_fraction, theory.bubble_fraction("1f1b", p, m)
    if got <= bubble + 1e-9:
        return
    short = [r for r in range(p) if _forwards_first(plan[r]) < min(p - r, m)]
    if short:
        r = short[0]
        where = (f"rank {r} runs only {_forwards_first(plan[r])} forward(s) before its first backward, 1F1B runs "
                 f"p−r = {min(p - r, m)} (p−r−1 warm-up forwards, then the steady state's first): too few warm-up "
                 "forwards, so the next stage runs out of work and waits")
    else:
        where = ("the warm-up counts are right, so look at the steady state: after its warm-up a rank alternates "
                 "one forward (the next micro-batch) and one backward (the oldest it holds)")
    raise LabCheckFailed(f"for p={p}, m={m} the simulated bubble is {got:.1%} of the ranks' time; 1F1B's is "
                         f"(p−1)/(m+p−1) = {bubble:.1%}: {where}.")


def _check_on_ranks(plan: list[list[Action]], p: int, m: int) -> dict[str, Any]:
    """Run the plan with the real executor on p gloo ranks; compare loss and gradients with one process."""
    import torch

    from workbench import pipeline_demo
    from workbench.dist.launch import RankError
    from workbench.models import GPTConfig

    cfg = GPTConfig.preset("tiny", n_layer=p, seq_len=16)
    try:
        run = pipeline_demo.run_plan(plan, cfg=cfg, name="one_f_one_b", timeout=60)
    except (RankError, ValueError) as e:
        raise LabCheckFailed(f"p={p}, m={m}: your plan passed theory but the executor failed on real ranks:\n"
                             f"{e}") from e
    loss, grads = pipeline_demo.reference(cfg, m)
    if abs(run.losses[-1] - loss) > ROUNDING_UNITS * torch.finfo(torch.float32).eps * abs(loss):
        raise LabCheckFailed(f"p={p}, m={m}: the pipeline's loss {run.losses[-1]:.6f} differs from one process's "
                             f"{loss:.6f}: every micro-batch must run through every stage exactly once")
    diffs, units = {}, {}
    scale = max(g.abs().max().item() for g in grads.values())  # the model's largest gradient
    for name, want in grads.items():
        got = run.grads[name]
        if not within_rounding(got, want, ROUNDING_UNITS, scale):
            raise LabCheckFailed(f"p={p}, m={m}: the gradient of {name} differs from one process's by "
                                 f"{(got - want).abs().max().item():.2e} ({rounding_error(got, want, scale):.3g} × "
                                 f"eps × the model's largest gradient; rounding stays within {ROUNDING_UNITS}): "
                                 "every micro-batch's backward must run exactly once on every stage")
        diffs[name], units[name] = (got - want).abs().max().item(), rounding_error(got, want, scale)
    if run.peak_in_flight != run.simulation.peak_in_flight:
        raise LabCheckFailed(f"p={p}, m={m}: the executor held {run.peak_in_flight} micro-batches per rank at its "
                             f"peak, the simulation {run.simulation.peak_in_flight}")
    return {"loss": loss, "max_diff": max(diffs.values()), "max_units": max(units.values()),
            "peak": run.peak_in_flight}


__all__ = ["CASES", "HINTS", "RUN_CASES", "check", "hint", "stuck_actions"]
