"""Reference solutions of the checked exercises of notebooks 07, 08 and 10 (graded by workbench.labs.nb_exercises).

Notebook 07: Korthikanti et al. 2022 (§4.2.2) count SP's collectives as TP's (each all-reduce becomes a
reduce-scatter plus an all-gather, the same ring bytes); this package's SP also re-gathers, in backward, the
sequence-sharded input of each column-parallel linear (its weight gradient needs the whole input), 2 all-gathers
per block more: 10 against 8 units. Megatron-LM saves that gathered input or overlaps its re-gather with compute.
Notebook 08: the simulator's missing terms, read from the trace. Notebook 10: Young 1974.
"""

from __future__ import annotations

import math
import statistics
from typing import Any


def block_wire_bytes(tokens: int, h: int, tp: int, bytes_per_value: int, mode: str) -> float:
    """Ring-wire bytes one rank sends per block and training step (forward + backward)."""
    ring = (tp - 1) / tp * tokens * h * bytes_per_value  # one all-gather or reduce-scatter of the activation
    units = {"tp": 8, "sp": 10, "sp-saved": 8}  # 4 all-reduces = 8 halves; SP's backward adds 2 all-gathers
    if mode not in units:
        raise ValueError(f"mode {mode!r}: valid are {sorted(units)}")
    return units[mode] * ring


def pipeline_model(run: Any) -> dict[str, float]:
    """{"F", "B": mean span of each kind, "alpha": median wait for a neighbour's message}, milliseconds."""
    acts = {}
    for r, t in enumerate(run.traces):
        for s in t.spans:
            if s.step == run.step and s.category in ("forward", "backward"):
                kind, mb = s.name.split()
                acts[(r, kind, int(mb[2:]))] = (s.t0, s.t1)
    means = {k: 1e3 * statistics.fmean(t1 - t0 for (_, kind, _), (t0, t1) in acts.items() if kind == k)
             for k in ("F", "B")}
    gaps, p = [], len(run.plan)
    for r, actions in enumerate(run.plan):
        previous_end = -math.inf
        for a in actions:
            t0, t1 = acts[(r, a.kind, a.microbatch)]
            dep = ((r - 1, "F", a.microbatch) if a.kind == "F" and r > 0 else
                   (r + 1, "B", a.microbatch) if a.kind == "B" and r < p - 1 else None)
            if dep is not None and acts[dep][1] >= previous_end:  # the rank sat idle until the message came
                gaps.append(t0 - acts[dep][1])
            previous_end = t1
    return {**means, "alpha": 1e3 * statistics.median(gaps) if gaps else 0.0}


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's optimum: the τ minimising δ/τ + τ/(2M)."""
    return math.sqrt(2 * save_s * mtbf_s)


def expected_waste(interval_s: float, save_s: float, mtbf_s: float) -> float:
    """First-order expected fraction of time lost: save stalls plus half an interval redone per failure."""
    return save_s / interval_s + interval_s / (2 * mtbf_s)
