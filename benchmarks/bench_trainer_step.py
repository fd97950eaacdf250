"""The trainer's own cost: one process's ``Trainer.step()`` against a plain PyTorch loop of the same work.

Rows ``trainer_step_vs_plain_torch_<precision>_b<batch>`` (goal: ratio <= 1.05):
* ``ours``: median seconds per ``Trainer(RunConfig(nproc=1, ...)).step()``, the step ``workbench run --nproc 1``
  takes: data fetch, forward (under the precision policy's autocast), backward, clipping, AdamW, the metrics
  (loss and grad norm, read in one device-to-host copy after ``optimizer.step()`` is queued) and the tracer's
  bookkeeping (``trace_steps=0``: no spans kept, memory probed on the first step only).
* ``reference``: ``plain_loop.plain_torch_step``: the same model (same seed), batches, AdamW, LR schedule and
  clipping, written as a plain loop that reads its loss once per step.
* ``ratio`` = ours / reference.

Why this row exists: on an H100 the trainer used to take 1.67x a plain step at batch 64 fp32, because it read
the grad norm (``float(clip_grad_norm_(...))``) between backward and ``optimizer.step()``: the host waited for
the whole backward before it could queue the optimizer's kernels, so launch work and GPU compute stopped
overlapping. On a CPU the same mistake hides under slow kernels, so the row runs on both.

Regime: the 10.8 M-parameter "bench" GPT, 128-token sequences, one rank (``nproc=1``: the plain
single-process strategy), one CPU thread on the CPU; batches ``CPU_BATCHES`` on the CPU and ``CUDA_BATCHES``
on a GPU (small and large, so launch overhead and compute each get their turn). Setups interleaved step by
step with the order rotated, each from the same initial weights; median after warm-up, spread reported.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

WORLD_SIZE = 1
DEVICES = ("cpu", "cuda")
SEQ_LEN = 128
CPU_BATCHES = (2,)
CUDA_BATCHES = (16, 64)
PRECISIONS = ("fp32", "bf16")
GOAL = 1.05


def _measure(batch: int, steps: int, warmup: int) -> dict[str, Any]:
    """One rank: for each precision, ours and the plain loop interleaved; step times and losses."""
    import torch
    from plain_loop import plain_torch_step  # beside this file (benchmarks/)

    from workbench.train import RunConfig, Trainer

    torch.set_num_threads(1)
    total = warmup + steps
    trainers = {p: Trainer(RunConfig(model="bench", seq_len=SEQ_LEN, nproc=WORLD_SIZE, steps=total,
                                     batch_size=batch, precision=p, trace_steps=0, timeout=300.0))
                for p in PRECISIONS}
    run = {}
    for p, trainer in trainers.items():
        run[f"ours_{p}"] = lambda _i, t=trainer: t.step()["loss"]
        run[f"plain_{p}"] = plain_torch_step(trainer, bf16=p == "bf16")
    names = list(run)
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for index in range(total):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:  # rotated: no setup always runs first
            t0 = time.perf_counter()
            loss = run[name](index)  # both sides end the step by reading its loss: the GPU's work is in the time
            if index >= warmup:
                times[name].append(time.perf_counter() - t0)
            losses[name].append(loss)
    return {"times": times, "losses": losses, "strategy": trainers["fp32"].strategy.describe}


def _rows(result: dict[str, Any], batch: int, device: str, steps: int, warmup: int) -> list[dict[str, Any]]:
    rows = []
    for p in PRECISIONS:
        ours, plain = result["times"][f"ours_{p}"], result["times"][f"plain_{p}"]
        ratio = statistics.median(ours) / statistics.median(plain)
        diffs = [abs(a - b) for a, b in zip(result["losses"][f"ours_{p}"], result["losses"][f"plain_{p}"],
                                            strict=True)]
        rows.append({
            "benchmark": f"trainer_step_vs_plain_torch_{p}_b{batch}", "ours": statistics.median(ours),
            "reference": statistics.median(plain), "ratio": ratio, "unit": "s/step",
            "config": {
                "lower_is_better": True, "goal": f"ratio <= {GOAL}", "met": ratio <= GOAL,
                "compared": "ours = Trainer(nproc=1).step(); reference = plain_loop.plain_torch_step (same model, "
                            "batches, AdamW, LR schedule, clipping; loss read once per step on both sides)",
                "device": device, "precision": p, "batch": batch, "seq_len": SEQ_LEN,
                "model": "GPT bench (6 layers, d=384, 10.8 M params)", "strategy": result["strategy"],
                "threads": 1, "steps_measured": steps, "warmup": warmup,
                "statistic": "median step time, setups interleaved",
                "spread_ours_s": [min(ours), max(ours)], "spread_reference_s": [min(plain), max(plain)],
                # Same weights, batches and schedule: the two sides compute the same losses (fp32: the same
                # kernels in the same order; bf16: the same autocast casts).
                "max_loss_diff": max(diffs),
            },
        })
    return rows


def rows(quick: bool) -> list[dict[str, Any]]:
    from workbench import launch

    cuda = os.environ.get("WORKBENCH_DEVICE") == "cuda"
    device = "cuda" if cuda else "cpu"
    if cuda:
        steps, warmup = (50, 10) if quick else (200, 20)  # steps of ~20 ms: 20 let one slow step move the median
    else:
        steps, warmup = (4, 1) if quick else (8, 2)
    out: list[dict[str, Any]] = []
    for batch in CUDA_BATCHES if cuda else CPU_BATCHES:
        result = launch(_measure, WORLD_SIZE, batch, steps, warmup, device=device, timeout=600)[0]
        out += _rows(result, batch, device, steps, warmup)
    return out


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(rows(quick="--full" not in sys.argv), indent=2))
