"""Ring all-reduce built from isend/irecv (workbench.parallel.collectives) vs gloo's ``dist.all_reduce``.

Both run in the same launch, on the same 2 ranks and the same tensor, alternating rep by rep so that
machine noise (shared cores) hits both alike. Each rep: barrier, time the op on every rank, keep the
slowest rank; report the median over reps after warm-up, as bus bandwidth (nccl-tests accounting:
2(N-1)/N * S / t). Higher is better.

    python benchmarks/bench_collectives.py [--quick]
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from workbench import launch
from workbench.parallel.collectives import DEFAULT_SEGMENT_BYTES, ring_all_reduce

WORLD_SIZE = 2
#: Measured on the CPU (gloo) only so far; run.py skips this module under --device cuda.
DEVICES = ("cpu",)
SIZES = {"64MiB": 64 << 20, "1MiB": 1 << 20}
#: Timed reps per size (quick, full): small messages are cheap and noisier, so they get more.
REPS = {"64MiB": (7, 21), "1MiB": (50, 200)}


def _measure(nbytes: int, reps: int, warmup: int) -> dict[str, list[float]]:
    """Per-rep seconds of each implementation on this rank (run inside launch)."""
    x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    ops = {"ours": lambda t: ring_all_reduce(t), "gloo": lambda t: dist.all_reduce(t)}
    times: dict[str, list[float]] = {name: [] for name in ops}
    work = x.clone()
    for rep in range(warmup + reps):
        for name, op in ops.items():
            work.copy_(x)
            dist.barrier()
            t0 = time.perf_counter()
            op(work)
            elapsed = time.perf_counter() - t0
            if rep >= warmup:
                times[name].append(elapsed)
    return times


def _row(label: str, nbytes: int, per_rank: list[dict[str, list[float]]], reps: int) -> dict[str, Any]:
    bus = 2 * (WORLD_SIZE - 1) / WORLD_SIZE * nbytes
    stats = {}
    for name in ("ours", "gloo"):
        slowest = [max(rank[name][i] for rank in per_rank) for i in range(reps)]
        stats[name] = (statistics.median(slowest), min(slowest), max(slowest))
    ours, ref = bus / stats["ours"][0] / 1e9, bus / stats["gloo"][0] / 1e9
    return {
        # the headline row (64 MiB, bandwidth-bound) keeps the plain name; the latency-bound one is suffixed
        "benchmark": "ring_allreduce_vs_gloo" if label == "64MiB" else f"ring_allreduce_vs_gloo_{label}",
        "ours": ours, "reference": ref, "ratio": ours / ref,
        "unit": "GB/s bus bandwidth",
        "config": {"higher_is_better": True, "world_size": WORLD_SIZE, "bytes": nbytes, "dtype": "float32",
                   "reps": reps, "segment_bytes": DEFAULT_SEGMENT_BYTES, "reference_impl": "dist.all_reduce (gloo)",
                   "median_ms": {k: round(v[0] * 1e3, 2) for k, v in stats.items()},
                   "spread_ms": {k: [round(v[1] * 1e3, 2), round(v[2] * 1e3, 2)] for k, v in stats.items()}},
    }


def rows(quick: bool) -> list[dict[str, Any]]:
    out = []
    for label, nbytes in SIZES.items():
        reps = REPS[label][0 if quick else 1]
        per_rank = launch(_measure, WORLD_SIZE, nbytes, reps, 2, timeout=300)
        out.append(_row(label, nbytes, list(per_rank), reps))
    return out


if __name__ == "__main__":
    for row in rows(quick="--quick" in sys.argv):
        print(f"{row['benchmark']}: ours {row['ours']:.3f} vs gloo {row['reference']:.3f} {row['unit']} "
              f"(ratio {row['ratio']:.2f}) {row['config']['median_ms']} spread {row['config']['spread_ms']}")
