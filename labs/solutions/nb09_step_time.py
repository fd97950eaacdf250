"""Reference solution of notebook 09's exercise (``notebooks/09_3d_parallelism.ipynb``): a layout's estimated step
time, graded by ``workbench.labs.nb09_step_time.check_step_time``. Kept beside the labs, outside the ``workbench``
package."""

from __future__ import annotations

from typing import Any

MESH_ORDER = ("tp", "dp", "replicate", "pp")  # Megatron's rank order: tp varies fastest, pp slowest


def estimate_step_time(problem: Any) -> float:
    """(compute × recompute factor + tp + pp) / (1 − bubble) + the dp traffic compute does not hide, in seconds."""
    # full recomputation reruns the forward, one of the three passes (Korthikanti et al. 2022): 4F / 3F
    factor = {"none": 1.0, "selective": problem.selective_factor, "full": 4 / 3}[problem.recompute]
    compute = problem.flops / problem.flops_per_s * factor
    reach, link = 1, {}
    for axis in MESH_ORDER:  # an axis stays inside a node while its groups (and the faster axes') fit in one
        reach *= problem.sizes[axis]
        link[axis] = problem.intra if reach <= problem.gpus_per_node else problem.inter

    def seconds(axis: str) -> float:
        return sum(link[axis].collective_time(op, size, problem.sizes[axis]) * n
                   for op, size, n in problem.traffic.get(axis, ()))

    p, m = problem.sizes["pp"], problem.microbatches
    busy = compute + seconds("tp") + seconds("pp")  # TP's and PP's messages sit between the matmuls
    dp = seconds("dp") + seconds("replicate")
    # without a pipeline, FSDP prefetches and DDP reduces buckets during backward; this package's pipeline
    # reduces after the schedule, so there it is exposed whole
    exposed = dp if p > 1 else max(0.0, dp - problem.overlap * compute)
    return busy / (1 - (p - 1) / (m + p - 1)) + exposed
