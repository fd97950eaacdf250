"""One α-β link model per machine, fitted once and reused: the calibration notebooks 02–04 share.

Notation (CURRICULUM.md): α seconds per message, bandwidth B in bytes/s; a message of S bytes costs
α + S/B (Hockney 1994). A ring all-reduce over N ranks sends 2(N−1) messages carrying 2(N−1)/N · S bytes
per rank (Patarasuk & Yuan 2009), so its time is a straight line in the bus bytes x = 2(N−1)/N · S:

    t = 2(N−1)·α + x / B

and an ordinary least-squares fit of t against x over a size sweep gives B (the slope's inverse) and α (the
intercept over 2(N−1)). Pure Python: the timing itself lives in ``workbench.measure``.

Also ``check_prediction``: a learner's prediction beside the measurement and the theory, as one line (pure; the
notebooks' own, which stops a person who left a prediction empty, is ``workbench.predictions``).
"""

from __future__ import annotations

import math

from workbench.theory.comm import Link, bus_bytes, fit_alpha_beta

# The fitted model is the package's one α-β link type; the old name stays for notebooks 02-04 and their readers.
LinkModel = Link


def fit_ring_allreduce(sizes: list[float], times: list[float], world: int) -> Link:
    """Least-squares fit of ring all-reduce times (seconds) over tensor sizes S (bytes) at ``world`` ranks.

    ``comm.fit_alpha_beta`` (the one least-squares fit) on (bus bytes, t) gives B and the intercept 2(N−1)·α;
    the result is a ``Link`` that remembers ``world``, so ``m.ring_allreduce(S)`` predicts at the fitted N.

    >>> m = fit_ring_allreduce([1e3, 1e6, 4e6], [6e-4 + 1.5 * s / 1e9 for s in (1e3, 1e6, 4e6)], world=4)
    >>> round(m.alpha * 1e6), round(m.bandwidth / 1e9, 3)
    (100, 1.0)
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"world must be an integer >= 2 to fit a link (N = 1 sends nothing), got {world!r}")
    if any(t <= 0 for t in times):
        raise ValueError(f"times must all be > 0 seconds, got {times!r}")
    intercept, bandwidth = fit_alpha_beta([bus_bytes("all_reduce", s, world) for s in sizes], list(times))
    return Link(alpha=intercept / (2 * (world - 1)), bandwidth=bandwidth, world=world)


def relative_error(measured: float, model: float) -> float:
    """(model − measured) / measured: +0.5 means the model predicts 50 % more than was measured."""
    if measured <= 0:
        raise ValueError(f"measured must be > 0 to compute a relative error, got {measured!r}")
    return (model - measured) / measured


def worst_error(measured: list[float], model: list[float]) -> tuple[int, float]:
    """(index, relative error) of the point where the model is furthest from the measurement, as a ratio."""
    if len(measured) != len(model) or not measured:
        raise ValueError(f"measured and model must be non-empty and of equal length, got {len(measured)} "
                         f"and {len(model)}")
    ratios = [abs(math.log(b / a)) for a, b in zip(measured, model, strict=True)]
    i = max(range(len(ratios)), key=ratios.__getitem__)
    return i, relative_error(measured[i], model[i])


def check_prediction(what: str, predicted: float | str | bool | None, measured: float | str | bool | None,
                     theory: float | str | bool | None = None, tol: float = 0.05) -> str:
    """One line: a learner's prediction beside the measurement and the theory. Nothing is graded.

    Numbers are compared by relative distance to the measurement (within ``tol`` earns a ✓); choices (strings,
    booleans) by equality. ``measured=None`` compares with the theory alone (a prediction of a formula's value).
    ``predicted=None`` says in the line that no prediction was given. Pure: the notebooks call
    ``workbench.predictions.check_prediction``, which also stops a person who left the prediction empty.
    """
    def show(v: float | str | bool | None) -> str:
        if isinstance(v, (str, bool)) or v is None:
            return str(v)
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"

    if measured is None and theory is None:
        raise ValueError(f"{what}: give the measurement, the theory or both to compare a prediction with")
    shown = [f"measured {show(measured)}"] if measured is not None else []
    shown += [] if theory is None else [f"theory {show(theory)}"]
    line = f"{what}: " + ", ".join(shown)
    if predicted is None:
        return line + "  (no prediction given: headless, or fill in the cell before the experiment and re-run)"
    reference = theory if measured is None else measured
    if any(isinstance(v, (str, bool)) for v in (reference, predicted)):
        hit = str(predicted).strip().lower() == str(reference).strip().lower()
        return line + f"; you predicted {show(predicted)}" + ("  ✓" if hit else "  ✗")
    parts = [f"; you predicted {show(predicted)}"]
    for name, ref in (("the measurement", measured), ("the theory", theory)):
        if isinstance(ref, (int, float)) and ref:
            parts.append(f", {(predicted - ref) / abs(ref):+.0%} from {name}")
    close = bool(reference) and abs(predicted - reference) <= tol * abs(reference)
    return line + "".join(parts) + ("  ✓" if close else "")


__all__ = ["LinkModel", "check_prediction", "fit_ring_allreduce", "relative_error", "worst_error"]
