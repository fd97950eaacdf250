"""Timing all-reduce algorithms on real ranks, and calibrating the α-β link model from the timings.

Notebook 02 calls ``allreduce_sweep`` for its four algorithms and ``fit_ring_allreduce`` on the ring's and gloo's
times; notebooks 03 and 04 call ``calibrate_link``, the same measurement and the same fit of gloo's all-reduce
(the collective their wrappers call) on fewer sizes, because each notebook runs in its own kernel and α depends
on how many processes share the cores (on a 2-core laptop α is mostly process scheduling, not wire latency).

Protocol (as nccl-tests): every repetition starts after a barrier, we keep the **slowest rank's** time (a
collective is done when its last rank is) and the median over repetitions after one warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from workbench.theory.calibration import fit_ring_allreduce
from workbench.theory.checks import positive_int
from workbench.theory.comm import Link

ALGORITHMS = ("ring", "tree", "hierarchical", "gloo all_reduce")
QUICK_SIZES = (1 << 12, 1 << 16, 1 << 19, 1 << 21)  # 4 KiB ... 2 MiB: enough to pin both α and B


def _sweep_rank(sizes: Sequence[int], reps: int, algorithms: Sequence[str], node_size: int) -> dict:
    import torch
    import torch.distributed as dist

    from workbench.dist import comm
    from workbench.dist.launch import rank_device
    from workbench.parallel import collectives as C

    torch.set_num_threads(1)
    runs = {"ring": C.ring_all_reduce, "tree": C.tree_all_reduce, "gloo all_reduce": dist.all_reduce}
    if "hierarchical" in algorithms:
        intra, inter = C.hierarchical_groups(node_size)
        runs["hierarchical"] = lambda t: C.hierarchical_all_reduce(t, intra, inter)
    times: dict[str, dict[int, list[float]]] = {name: {} for name in algorithms}
    for nbytes in sizes:
        x = torch.randn(max(1, nbytes // 4), device=rank_device())
        for name in algorithms:
            samples = []
            for rep in range(reps + 1):
                t = x.clone()
                comm.barrier()
                t0 = time.perf_counter()
                runs[name](t)
                if rep:  # the first is a warm-up
                    samples.append(time.perf_counter() - t0)
            times[name][nbytes] = samples
    return times


def allreduce_sweep(world: int, sizes: Sequence[int], reps: int = 5, algorithms: Sequence[str] = ("ring",),
                    node_size: int = 1, timeout: float = 120.0) -> dict[str, list[float]]:
    """Median (over ``reps``) of the slowest rank's time, per algorithm and size (bytes, float32), in seconds."""
    from workbench.dist.launch import launch

    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        raise ValueError(f"unknown algorithm(s) {unknown}; valid choices: {', '.join(ALGORITHMS)}")
    positive_int("reps", reps)
    if not sizes or any(s < 4 for s in sizes):
        raise ValueError(f"sizes must be a non-empty list of byte counts >= 4, got {list(sizes)!r}")
    if "hierarchical" in algorithms and (node_size < 1 or world % node_size):
        raise ValueError(f"node_size must divide world ({world}) for the hierarchical all-reduce, got {node_size}")
    per_rank = launch(_sweep_rank, world, list(sizes), reps, list(algorithms), node_size, timeout=timeout)
    return {name: [statistics.median(max(r[name][s][i] for r in per_rank) for i in range(reps)) for s in sizes]
            for name in algorithms}


def calibrate_link(world: int, sizes: Sequence[int] = QUICK_SIZES, reps: int = 5,
                   algorithm: str = "gloo all_reduce", timeout: float = 120.0) -> tuple[Link, list[float]]:
    """Time one all-reduce ``algorithm`` over ``sizes`` on ``world`` ranks and least-squares fit α and B to it.

    The default is the backend's own all-reduce, the collective DDP and ZeRO call; ``"ring"`` calibrates the
    send/recv link our ring, tree and hierarchical all-reduces are built from (notebook 02 fits both). Returns the
    fitted ``Link`` and the measured times (seconds, one per size), so a caller can print the model's error.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"world must be an integer >= 2 to calibrate a link, got {world!r}")
    times = allreduce_sweep(world, sizes, reps, (algorithm,), timeout=timeout)[algorithm]
    return fit_ring_allreduce(list(sizes), times, world), times


__all__ = ["ALGORITHMS", "QUICK_SIZES", "allreduce_sweep", "calibrate_link"]
