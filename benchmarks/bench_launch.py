"""launch_4_ranks_vs_elastic_launch_fork: seconds from the call to the first all-reduce result on every rank.

Reference: ``torch.distributed.launcher.api.elastic_launch`` with ``start_method="fork"`` (what
accelerate's notebook launcher uses). Ours: ``workbench.launch`` (forkserver with torch preloaded,
cloudpickle). Both measured in this process, alternating, after one warm-up each; the cold first launch of
ours (which starts the forkserver) is reported in ``config``. Lower is better.
"""

from __future__ import annotations

import statistics
import time
import uuid

WORLD = 4


def _first_allreduce() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return time.time()


def _ours() -> float:
    from workbench import launch

    t0 = time.time()
    done = launch(_first_allreduce, WORLD, timeout=60)
    return max(done) - t0


def _elastic() -> float:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=WORLD, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, start_method="fork",
                          monitor_interval=0.05)
    t0 = time.time()
    done = elastic_launch(config, _elastic_entry)()
    return max(done.values()) - t0


def _elastic_entry() -> float:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return _first_allreduce()
    finally:
        dist.destroy_process_group()


def rows(quick: bool) -> list[dict]:
    cold = _ours()
    _elastic()
    repeats = 3 if quick else 10
    ours, ref = [], []
    for _ in range(repeats):
        ours.append(_ours())
        ref.append(_elastic())
    o, r = statistics.median(ours), statistics.median(ref)
    return [{"benchmark": "launch_4_ranks_vs_elastic_launch_fork", "ours": o, "reference": r, "ratio": o / r,
             "unit": "s (lower is better)",
             "config": {"world_size": WORLD, "repeats": repeats, "ours_cold_first_launch_s": cold,
                        "ours_all": ours, "reference_all": ref, "better": "lower"}}]


if __name__ == "__main__":
    print(rows(quick=True))
