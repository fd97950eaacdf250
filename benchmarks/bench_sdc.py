"""What the silent-corruption check (``--sdc-check-every K``) costs a data-parallel run.

Row ``sdc_check_overhead`` (goal: ratio <= 1.02 at K = 10):
* ``reference``: the median step time of ``Trainer.step()`` on 2 data-parallel ranks (DDP, AdamW), the check off.
* ``ours``: that step time plus the median ``Trainer.check_replicas()`` time / K. The check runs between steps and
  touches nothing a step uses, so a run checking every K steps pays exactly one check per K steps; measuring the
  check on its own, after every step, gives K times more samples of it than a run would, on the same processes.
* ``ratio`` = ours / reference; the config carries the check's median seconds and the tensors it fingerprints.

Regime: the 10.8 M-parameter "bench" GPT, 128-token sequences, one sequence per rank, 2 gloo ranks with one thread
each (or NCCL on up to 2 GPUs with ``--device cuda``). On a GPU a step is short, so the ratio is the strict one there.
Each step and each check starts after a barrier and is timed on its slowest rank; median after warm-up.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

WORLD_SIZE = 2
DEVICES = ("cpu", "cuda")
SEQ_LEN = 128
CHECK_EVERY = 10
GOAL = 1.02


def _rank(steps: int, warmup: int) -> dict[str, Any]:
    import torch

    from workbench import comm
    from workbench.train import RunConfig, Trainer

    world = comm.group_size()
    trainer = Trainer(RunConfig(model="bench", seq_len=SEQ_LEN, nproc=world, batch_size=world,
                                steps=warmup + steps, sdc_check_every=CHECK_EVERY, trace_steps=0, timeout=300.0))
    cuda = trainer.device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # time the device's work, not its queueing
    step_s, check_s = [], []
    for index in range(warmup + steps):
        for run, out in ((trainer.step, step_s), (trainer.check_replicas, check_s)):
            sync()
            comm.barrier()
            t0 = time.perf_counter()
            result = run()
            sync()
            if index >= warmup:
                out.append(time.perf_counter() - t0)
            if run is trainer.check_replicas and result:
                raise RuntimeError(f"replicas disagree in a clean run: {result}")
    return {"step_s": step_s, "check_s": check_s, "tensors": len(trainer.replicated_state()[0])}


def _slowest(results: list[dict[str, Any]], key: str) -> list[float]:
    return [max(r[key][i] for r in results) for i in range(len(results[0][key]))]


def rows(quick: bool) -> list[dict[str, Any]]:
    from harness import device_and_world  # beside this file (benchmarks/)

    from workbench import launch

    steps, warmup = (5, 2) if quick else (15, 3)
    device, world = device_and_world(WORLD_SIZE)
    results = launch(_rank, world, steps, warmup, device=device, timeout=300)
    step, check = statistics.median(_slowest(results, "step_s")), statistics.median(_slowest(results, "check_s"))
    ours = step + check / CHECK_EVERY
    return [{
        "benchmark": "sdc_check_overhead", "ours": ours, "reference": step, "ratio": ours / step, "unit": "s/step",
        "config": {"lower_is_better": True, "goal": GOAL, "check_every": CHECK_EVERY,
                   "model": "GPT bench (6 layers, d=384, 10.8 M params)", "world_size": world,
                   "backend": "nccl" if device == "cuda" else "gloo", "per_rank_batch": 1, "seq_len": SEQ_LEN,
                   "check_s": check, "tensors_fingerprinted": results[0]["tensors"],
                   "steps_measured": steps, "warmup": warmup,
                   "statistic": "median of slowest rank; ours = step + check / check_every"},
    }]


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(rows(quick="--full" not in sys.argv), indent=2))
