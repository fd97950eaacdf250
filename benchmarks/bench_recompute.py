"""Activation recomputation: what full (and selective) recomputation costs in step time and saves in
activation bytes, against no recomputation, on the same model, batch and ranks (ours vs ours).

Rows:
* ``recompute_full_cost``: ``apply_recompute(model, "full")`` (every block under ``torch.utils.checkpoint``)
  against the same model without recomputation. ``ours`` = full, ``reference`` = none: there is no PyTorch
  "built-in" to beat here, the reference is the thing recomputation trades against (Chen et al. 2016;
  Korthikanti et al. 2022, §5). Theory: one more forward of every block, about 4/3 of the step's compute,
  for activation bytes of one block input per layer.
* ``recompute_selective_cost``: the attention core only (``"selective"``); with PyTorch's fused attention
  it saves only the kernel's log-sum-exp, so both ratios should sit near 1.

Regime: the 10.8 M-parameter "bench" GPT, 2 gloo ranks, ``LOCAL_BATCH`` sequences of 128 tokens per rank
(enough that activations are a real share of the step), BucketedDDP + AdamW, ``torch.set_num_threads(1)``
per rank. The three modes run in the same processes with their steps interleaved (none, selective, full), so
machine noise hits all alike; each step starts after a barrier; a step's time is its slowest rank's; median
after warm-up, spread reported. Peak activation bytes are the tracer ledger's saved-tensor count of one
forward (what autograd keeps until backward), the same count the tests check against theory. Lower is better.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

WORLD_SIZE = 2
#: Under --device cuda: NCCL, one rank per GPU, up to WORLD_SIZE (the trade-off is per rank: one GPU shows it).
DEVICES = ("cpu", "cuda")
LOCAL_BATCH = 4
SEQ_LEN = 128
MODES = ("none", "selective", "full")


def _rank(steps: int, warmup: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from workbench import comm, trace
    from workbench.launch import rank_device
    from workbench.models import GPTConfig, build_gpt
    from workbench.parallel.ddp import BucketedDDP
    from workbench.recompute import apply_recompute

    torch.set_num_threads(1)
    device = rank_device()
    rank = dist.get_rank()
    cfg = GPTConfig.preset("bench", seq_len=SEQ_LEN)
    models = {m: BucketedDDP(apply_recompute(build_gpt(cfg, seed=0, device=device), m)) for m in MODES}
    optimizers = {m: torch.optim.AdamW(models[m].parameters(), lr=1e-4) for m in MODES}
    tracer = trace.current()
    g = torch.Generator(device="cpu").manual_seed(1000 + rank)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # time the GPU's work, not its queueing
    times: dict[str, list[float]] = {m: [] for m in MODES}
    activations: dict[str, int] = {}
    losses: dict[str, float] = {}
    for step in range(warmup + steps):
        x = torch.randint(0, cfg.vocab_size, (LOCAL_BATCH, SEQ_LEN + 1), generator=g, device="cpu").to(device)
        for mode in MODES:
            model, opt = models[mode], optimizers[mode]
            comm.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            with tracer.activations():
                loss = model(x[:, :-1], x[:, 1:])
            saved = tracer.memory.current.get("activations", 0)
            loss.backward()
            tracer.release_activations()
            model.finish_gradient_synchronization()
            opt.step()
            sync()
            if step >= warmup:
                times[mode].append(time.perf_counter() - t0)
            activations[mode], losses[mode] = saved, loss.item()
    return {"times": times, "activations": activations, "losses": losses}


def theory_compute_ratio(mode: str, n_layer: int, d_model: int, seq_len: int, vocab_size: int) -> float:
    """Step FLOPs with ``mode`` / without recomputation, counting matmuls only (Kaplan et al. 2020's 2 FLOPs per
    multiply-add): per token a block's forward is 24·h² (q, k, v, proj, 4h MLP) + 4·s·h (QKᵀ and the weighted
    sum over s keys), the head 2·V·h; backward is twice the forward. Full re-runs every block's forward,
    selective only the attention core (the 4·s·h part)."""
    block, core = 24 * d_model**2 + 4 * seq_len * d_model, 4 * seq_len * d_model
    forward = n_layer * block + 2 * vocab_size * d_model
    extra = {"none": 0, "selective": n_layer * core, "full": n_layer * block}[mode]
    return (3 * forward + extra) / (3 * forward)


def _row(name: str, mode: str, results: list[dict[str, Any]], steps: int, warmup: int,
         device: str) -> dict[str, Any]:
    per_step = {m: [max(r["times"][m][i] for r in results) for i in range(steps)] for m in ("none", mode)}
    ours, ref = statistics.median(per_step[mode]), statistics.median(per_step["none"])
    saved = {m: max(r["activations"][m] for r in results) for m in ("none", mode)}
    return {
        "benchmark": name, "ours": ours, "reference": ref, "ratio": ours / ref, "unit": "s/step",
        "config": {
            "lower_is_better": True,
            "compared": f"ours with recompute={mode!r} vs ours with recompute='none' (reference = no "
                        "recomputation, not a PyTorch built-in: the trade-off itself is measured)",
            "model": "GPT bench (6 layers, d=384, 10.8 M params)", "world_size": len(results), "device": device,
            "backend": "nccl" if device == "cuda" else "gloo",
            "wrapper": "BucketedDDP + AdamW", "per_rank_batch": LOCAL_BATCH, "seq_len": SEQ_LEN,
            "threads_per_rank": 1, "steps_measured": steps, "warmup": warmup,
            "statistic": "median of slowest rank per step",
            f"spread_{mode}_s": [min(per_step[mode]), max(per_step[mode])],
            "spread_none_s": [min(per_step["none"]), max(per_step["none"])],
            f"peak_activation_bytes_{mode}": saved[mode], "peak_activation_bytes_none": saved["none"],
            "activation_bytes_ratio": saved[mode] / saved["none"],
            "theory_compute_ratio": round(theory_compute_ratio(mode, 6, 384, SEQ_LEN, 256), 4),
            "same_loss": all(r["losses"][mode] == r["losses"]["none"] for r in results),
        },
    }


def rows(quick: bool) -> list[dict[str, Any]]:
    from harness import device_and_world  # beside this file (benchmarks/)

    from workbench import launch

    device, world = device_and_world(WORLD_SIZE)
    steps, warmup = ((20, 5) if quick else (50, 10)) if device == "cuda" else ((4, 1) if quick else (10, 2))
    results = launch(_rank, world, steps, warmup, device=device, timeout=300)
    return [_row("recompute_full_cost", "full", results, steps, warmup, device),
            _row("recompute_selective_cost", "selective", results, steps, warmup, device)]


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(rows(quick="--full" not in sys.argv), indent=2))
