"""The tracer's own cost: a data-parallel step traced in full against the same step with no tracer at all.

Row ``tracer_overhead`` (issue 20, "measurement that does not distort"; goal: ratio <= 1.03):
* ``ours``: median seconds per ``Trainer.step()`` with every step traced (``trace_steps`` = all steps: spans,
  every collective's event, the memory ledger and its saved-activation hooks, each step);
* ``reference``: the same step of a second ``Trainer`` (same model, seed and batches) run under
  ``trace.untraced()``: no tracer, so ``comm`` and the strategies record nothing;
* ``ratio`` = ours / reference.

Regime: 2 gloo ranks (the figures a learner sees come from multi-rank runs), bucketed DDP, the 10.8 M-parameter
"bench" GPT, 128-token sequences, batch 2 per rank, one thread per rank; the two setups interleaved step by step
with the order alternating, medians of the slowest rank per step after warm-up. Losses must agree exactly: the
tracer only observes.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

WORLD_SIZE = 2
DEVICES = ("cpu",)
GOAL = 1.03


def _measure(steps: int, warmup: int) -> dict[str, Any]:
    import torch

    from workbench import trace
    from workbench.dist import comm
    from workbench.training.config import RunConfig
    from workbench.training.trainer import Trainer

    torch.set_num_threads(1)
    total = steps + warmup
    config = dict(model="bench", seq_len=128, nproc=WORLD_SIZE, steps=total, batch_size=4, timeout=300.0)
    traced = Trainer(RunConfig(**config, trace_steps=total))
    plain = Trainer(RunConfig(**config))
    times: dict[str, list[float]] = {"traced": [], "untraced": []}
    losses: dict[str, list[float]] = {"traced": [], "untraced": []}

    def run(name: str) -> float:
        if name == "traced":
            return traced.step()["loss"]
        with trace.untraced():
            return plain.step()["loss"]

    for index in range(total):
        order = ("traced", "untraced") if index % 2 == 0 else ("untraced", "traced")
        for name in order:
            comm.barrier()
            t0 = time.perf_counter()
            losses[name].append(run(name))
            if index >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {"times": times, "losses": losses}


def rows(quick: bool) -> list[dict[str, Any]]:
    from workbench import launch

    steps, warmup = (6, 2) if quick else (16, 3)
    per_rank = list(launch(_measure, WORLD_SIZE, steps, warmup, timeout=600))
    slowest = {name: [max(r["times"][name][i] for r in per_rank) for i in range(steps)]
               for name in ("traced", "untraced")}
    ours, ref = statistics.median(slowest["traced"]), statistics.median(slowest["untraced"])
    losses = per_rank[0]["losses"]
    return [{
        "benchmark": "tracer_overhead", "ours": ours, "reference": ref, "ratio": ours / ref, "unit": "s/step",
        "config": {"lower_is_better": True, "goal": f"ratio <= {GOAL}", "met": ours / ref <= GOAL,
                   "compared": "ours = Trainer.step() traced every step; reference = the same step under "
                               "trace.untraced() (no tracer)",
                   "world_size": WORLD_SIZE, "model": "GPT bench (10.8 M params)", "seq_len": 128, "batch": 4,
                   "steps_measured": steps, "warmup": warmup, "threads_per_rank": 1,
                   "spread_ours_s": [min(slowest["traced"]), max(slowest["traced"])],
                   "spread_reference_s": [min(slowest["untraced"]), max(slowest["untraced"])],
                   "losses_identical": losses["traced"] == losses["untraced"]},
    }]


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(rows(quick="--quick" in sys.argv), indent=2))
