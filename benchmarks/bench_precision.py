"""Mixed precision: what our bf16 policy costs or saves in step time against fp32, beside what PyTorch's own
autocast costs or saves on the same model, batch and machine.

Row ``bf16_step_vs_fp32``:
* ``ours``: the step time of ``Trainer(RunConfig(precision="bf16"))`` over that of ``precision="fp32"``: the
  same path ``workbench run --precision`` takes (``workbench.precision``: forward under ``torch.autocast`` to
  bf16, fp32 master weights and fp32 AdamW state; Micikevicius et al. 2018).
* ``reference``: PyTorch's built-in, ``torch.autocast(device_type, dtype=torch.bfloat16)`` around the plain
  model's forward, stepped by ``torch.optim.AdamW``, over the same plain loop in fp32.
* ``ratio`` = ours / reference: above 1 means our policy adds cost beyond what autocast itself costs.

Both speed-up ratios are bf16/fp32 step time (lower is better). On a CPU without bf16 matrix units (no AMX or
AVX512-BF16) autocast's bf16 is often *slower* than fp32: every matmul casts its fp32 weight and input to bf16
and the bf16 kernel is not faster than the fp32 one, so the casts are pure overhead. That is the measured fact
this row reports, not a defect of either side. On GPUs with tensor cores (NVIDIA Volta and later for fp16,
Ampere and later for bf16) the theory turns around: an A100 peaks at 312 TFLOP/s dense bf16 against 19.5
plain fp32 (156 with TF32, which PyTorch leaves off for matmuls by default), and bf16 halves the bytes of every
activation read, so there a matmul-bound step should be markedly faster in bf16: ``--device cuda`` measures it
(the GPU lane, ``CUDA_BATCH`` sequences, so the GPU has matmuls worth the name).

Regime: the 10.8 M-parameter "bench" GPT, ONE rank (``nproc=1``: ``parallelize`` picks the plain single-process
strategy, so both sides run the same model + AdamW and differ only in our Trainer's bookkeeping),
``LOCAL_BATCH`` sequences of 128 tokens, ``torch.set_num_threads(1)``. The four setups (ours fp32, ours bf16,
torch fp32, torch bf16) start from the same initial weights, train on the same batches with the same learning
rate schedule and gradient clipping, and run in the same process with their steps interleaved (order rotated
each step), so machine noise hits all alike. Median after warm-up, spread reported.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

WORLD_SIZE = 1
#: One rank: one GPU under --device cuda (bf16 on tensor cores there: the ratio the docstring predicts).
DEVICES = ("cpu", "cuda")
LOCAL_BATCH = 2
CUDA_BATCH = 16  # on a GPU, 2 x 128 tokens would time kernel launches, not matmuls
SEQ_LEN = 128
SETUPS = ("ours_fp32", "ours_bf16", "torch_fp32", "torch_bf16")


def _cpu_bf16_units() -> list[str]:
    """The CPU's bf16 matrix/vector extensions named in /proc/cpuinfo (Linux), e.g. ["amx_bf16"]; [] if none."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return sorted({f for f in flags if f in ("avx512_bf16", "amx_bf16", "amx_tile")})


def _rank(steps: int, warmup: int, batch: int) -> dict[str, Any]:
    import torch
    from plain_loop import plain_torch_step  # beside this file (benchmarks/)

    from workbench.train import RunConfig, Trainer

    torch.set_num_threads(1)
    total = warmup + steps
    common = dict(model="bench", seq_len=SEQ_LEN, nproc=WORLD_SIZE, steps=total, batch_size=batch,
                  trace_steps=0, timeout=300.0)
    trainers = {p: Trainer(RunConfig(precision=p, **common)) for p in ("fp32", "bf16")}

    def ours(precision: str) -> Any:
        return lambda _index: trainers[precision].step()["loss"]

    run = {"ours_fp32": ours("fp32"), "ours_bf16": ours("bf16"),
           "torch_fp32": plain_torch_step(trainers["fp32"], bf16=False),
           "torch_bf16": plain_torch_step(trainers["fp32"], bf16=True)}
    times: dict[str, list[float]] = {s: [] for s in SETUPS}
    losses: dict[str, list[float]] = {s: [] for s in SETUPS}
    for index in range(total):
        shift = index % len(SETUPS)
        for name in SETUPS[shift:] + SETUPS[:shift]:  # rotated: no setup always runs first (cold caches)
            t0 = time.perf_counter()
            loss = run[name](index)
            elapsed = time.perf_counter() - t0
            if index >= warmup:
                times[name].append(elapsed)
            losses[name].append(loss)
    return {"times": times, "losses": losses, "strategy": trainers["bf16"].strategy.describe, "batch": batch}


def _row(result: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    times, losses = result["times"], result["losses"]
    med = {s: statistics.median(times[s]) for s in SETUPS}
    ours, ref = med["ours_bf16"] / med["ours_fp32"], med["torch_bf16"] / med["torch_fp32"]
    return {
        "benchmark": "bf16_step_vs_fp32", "ours": ours, "reference": ref, "ratio": ours / ref,
        "unit": "bf16/fp32 step time",
        "config": {
            "lower_is_better": True,
            "compared": "ours = Trainer(precision='bf16') / Trainer(precision='fp32') median step time; reference "
                        "= torch.autocast(bf16) + AdamW / the same plain loop in fp32; ratio = ours / reference",
            "note": "on a CPU without bf16 matrix units bf16 autocast is usually slower than fp32 (casts with no "
                    "faster kernel behind them); on tensor-core GPUs (A100: 312 TFLOP/s bf16 vs 19.5 fp32, 156 "
                    "TF32) the expected ratio is well below 1 for a matmul-bound step (not measured here)",
            "model": "GPT bench (6 layers, d=384, 10.8 M params)", "world_size": WORLD_SIZE,
            "strategy": result["strategy"], "batch": result["batch"], "seq_len": SEQ_LEN, "threads": 1,
            "cpu_bf16_units": _cpu_bf16_units() or "none (no avx512_bf16 / amx_bf16 in /proc/cpuinfo)",
            "steps_measured": steps, "warmup": warmup, "statistic": "median step time, setups interleaved",
            **{f"median_{s}_s": med[s] for s in SETUPS},
            **{f"spread_{s}_s": [min(times[s]), max(times[s])] for s in SETUPS},
            # Same weights, batches and schedule: ours and torch should track each other in each precision.
            **{f"max_loss_diff_{p}": max(abs(a - b) for a, b in zip(losses[f"ours_{p}"], losses[f"torch_{p}"],
                                                                      strict=True)) for p in ("fp32", "bf16")},
            "final_loss": {s: losses[s][-1] for s in SETUPS},
        },
    }


def rows(quick: bool) -> list[dict[str, Any]]:
    import os

    from workbench import launch

    cuda = os.environ.get("WORKBENCH_DEVICE") == "cuda"
    steps, warmup = ((50, 10) if quick else (200, 20)) if cuda else ((4, 1) if quick else (8, 1))
    results = launch(_rank, WORLD_SIZE, steps, warmup, CUDA_BATCH if cuda else LOCAL_BATCH,
                     device="cuda" if cuda else "cpu", timeout=300)
    return [_row(results[0], steps, warmup)]


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(rows(quick="--full" not in sys.argv), indent=2))
