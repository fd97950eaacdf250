"""BucketedDDP against torch DistributedDataParallel: step time on 2 gloo ranks (or, with ``--device cuda``,
on up to 2 GPUs with NCCL, one rank each), side by side in one run.

Regime (BENCHMARKS.md, "pick a regime where the thing measured matters"): the 10.8 M-parameter "bench" GPT
with ONE 128-token sequence per rank, so the 43 MB gradient all-reduce is a large share of the step instead
of hiding under a long backward. Both wrappers use 25 MiB buckets, AdamW, ``torch.set_num_threads(1)`` per
rank, and run in the same processes with their steps interleaved (ours, torch, ours no_sync, torch no_sync),
so machine noise hits all four alike. Each step starts after a barrier; a step's time is its slowest rank's;
we report the median after warm-up. The communication share is 1 - t(no_sync) / t(sync): the part of the
step that gradient synchronisation adds.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

WORLD_SIZE = 2
#: gloo on the CPU, or NCCL with one GPU per rank (min(2, GPUs) ranks: with one GPU the row measures the
#: wrappers' own overhead, since a group of one moves nothing).
DEVICES = ("cpu", "cuda")
LOCAL_BATCH = 1
SEQ_LEN = 128
BUCKET_MB = 25.0
CONFIGS = ("ours", "torch", "ours_no_sync", "torch_no_sync")


def _rank(steps: int, warmup: int) -> dict[str, list[float]]:
    import contextlib

    import torch
    import torch.distributed as dist

    from workbench import comm
    from workbench.launch import rank_device
    from workbench.models import GPTConfig, build_gpt
    from workbench.parallel.ddp import BucketedDDP

    device = rank_device()
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = GPTConfig.preset("bench", seq_len=SEQ_LEN)
    torch_ddp = torch.nn.parallel.DistributedDataParallel(build_gpt(cfg, seed=0, device=device),
                                                          device_ids=[device.index] if cuda else None,
                                                          bucket_cap_mb=BUCKET_MB)
    wrapped = {"ours": BucketedDDP(build_gpt(cfg, seed=0, device=device), bucket_mb=BUCKET_MB), "torch": torch_ddp}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in wrapped.items()}
    g = torch.Generator(device="cpu").manual_seed(1000 + rank)
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # time the GPU's work, not its queueing
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for step in range(warmup + steps):
        x = torch.randint(0, cfg.vocab_size, (LOCAL_BATCH, SEQ_LEN + 1), generator=g, device="cpu").to(device)
        for config in CONFIGS:
            kind = config.split("_")[0]
            ddp, opt = wrapped[kind], optimizers[kind]
            sync()
            comm.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            with ddp.no_sync() if config.endswith("no_sync") else contextlib.nullcontext():
                ddp(x[:, :-1], x[:, 1:]).backward()
            if kind == "ours":
                ddp.finish_gradient_synchronization()
            opt.step()
            sync()
            if step >= warmup:
                times[config].append(time.perf_counter() - t0)
    return times


def _slowest_rank_steps(results: list[dict[str, list[float]]], config: str) -> list[float]:
    return [max(r[config][i] for r in results) for i in range(len(results[0][config]))]


def rows(quick: bool) -> list[dict[str, Any]]:

    from harness import device_and_world  # beside this file (benchmarks/)

    from workbench import launch

    steps, warmup = (5, 2) if quick else (15, 3)
    device, world = device_and_world(WORLD_SIZE)
    cuda = device == "cuda"
    results = launch(_rank, world, steps, warmup, device=device, timeout=300)
    per_step = {c: _slowest_rank_steps(results, c) for c in CONFIGS}
    median = {c: statistics.median(v) for c, v in per_step.items()}
    ours, ref = median["ours"], median["torch"]
    return [{
        "benchmark": "ddp_bucketed_vs_torch_ddp",
        "ours": ours,
        "reference": ref,
        "ratio": ours / ref,
        "unit": "s/step",
        "config": {
            "lower_is_better": True,
            "model": "GPT bench (6 layers, d=384, 10.8 M params)",
            "world_size": world, "backend": "nccl" if cuda else "gloo", "per_rank_batch": LOCAL_BATCH,
            "seq_len": SEQ_LEN, "bucket_mb": BUCKET_MB, "optimizer": "AdamW",
            "threads_per_rank": None if cuda else 1,
            "steps_measured": steps, "warmup": warmup, "statistic": "median of slowest rank per step",
            "spread_ours_s": [min(per_step["ours"]), max(per_step["ours"])],
            "spread_torch_s": [min(per_step["torch"]), max(per_step["torch"])],
            "no_sync_ours_s": median["ours_no_sync"], "no_sync_torch_s": median["torch_no_sync"],
            "comm_share_ours": 1 - median["ours_no_sync"] / ours,
            "comm_share_torch": 1 - median["torch_no_sync"] / ref,
        },
    }]


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(rows(quick="--full" not in sys.argv), indent=2))
