"""launch_4_ranks_vs_elastic_launch_fork: seconds from the call to the first all-reduce result on every rank.

Reference: ``torch.distributed.launcher.api.elastic_launch`` with ``start_method="fork"`` (what
accelerate's notebook launcher uses). Ours: ``workbench.launch`` (forkserver with torch preloaded,
cloudpickle), measured in this process after one warm-up; its cold first launch (which starts the
forkserver) is reported in ``config``. Lower is better.

Each reference launch runs in a fresh interpreter of its own (``python bench_launch.py --reference-once``),
alternating with ours, under ``REFERENCE_TIMEOUT_S``. Forking from a process that already runs threads (as
this one does once ours and torch have run in it) can leave a forked worker stuck on a lock forever; a
fresh single-threaded process is what fork-based launchers expect, so it is both the fair and the safe
place to measure them. That process imports torch and the elastic agent before its clock starts (as ours
has torch preloaded), so no warm-up launch is needed: measured, its first launch in a fresh process is as
fast as later ones, within the noise. A reference that hangs or fails marks this row failed and stops
further reference launches; ours is still measured and reported.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from harness import error_reason, run_bounded

WORLD = 4
#: This benchmark times CPU (gloo) launches only.
DEVICES = ("cpu",)
#: Seconds one reference launch may take, interpreter start and torch import included (normally ~2 s).
REFERENCE_TIMEOUT_S = 60.0


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


def _reference_once(out: Path) -> int:
    """Child side: one timed ``elastic_launch`` in this fresh process; writes ``{"seconds"}`` or ``{"error"}``."""
    # Imported before the clock starts, as ours has torch preloaded in its forkserver: only launching is timed.
    import torch.distributed  # noqa: F401
    import torch.distributed.elastic.agent.server.local_elastic_agent  # noqa: F401
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401
    import torch.distributed.launcher.api  # noqa: F401

    try:
        result: dict[str, Any] = {"seconds": _elastic()}
    except Exception as exc:  # noqa: BLE001 - the parent turns it into the row's reason
        result = {"error": error_reason(exc)}
    out.write_text(json.dumps(result))
    return 0 if "seconds" in result else 1


def _elastic_in_fresh_process() -> float:
    """One reference launch in its own bounded subprocess; raises RuntimeError with the reason if it fails."""
    with tempfile.TemporaryDirectory(prefix="workbench-bench-launch-") as tmp:
        out = Path(tmp) / "reference.json"
        outcome = run_bounded([sys.executable, str(Path(__file__).resolve()), "--reference-once", str(out)],
                              REFERENCE_TIMEOUT_S)
        result = json.loads(out.read_text()) if out.exists() else {}
    if outcome.timed_out:
        raise RuntimeError(outcome.describe(REFERENCE_TIMEOUT_S))
    if "seconds" in result:
        return float(result["seconds"])
    raise RuntimeError(result.get("error") or f"{outcome.describe(REFERENCE_TIMEOUT_S)} without a result")


def _elastic_entry() -> float:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return _first_allreduce()
    finally:
        dist.destroy_process_group()


def rows(quick: bool) -> list[dict]:
    cold = _ours()
    repeats = 3 if quick else 10
    ours: list[float] = []
    ref: list[float] = []
    failure = None
    for i in range(repeats):
        ours.append(_ours())
        if failure is None:
            try:
                ref.append(_elastic_in_fresh_process())
            except RuntimeError as exc:
                # Each further try could hang as long again; one failure already decides the row.
                failure = f"reference (elastic_launch, fork) failed on repeat {i + 1} of {repeats}: {exc}"
    o = statistics.median(ours)
    r = statistics.median(ref) if failure is None else None
    row = {"benchmark": "launch_4_ranks_vs_elastic_launch_fork", "ours": o, "reference": r,
           "ratio": o / r if r else None, "unit": "s (lower is better)", "status": "ok",
           "config": {"world_size": WORLD, "repeats": repeats, "ours_cold_first_launch_s": cold,
                      "ours_all": ours, "reference_all": ref, "better": "lower",
                      "reference_process": "fresh interpreter per launch, torch imported before the clock",
                      "reference_timeout_s": REFERENCE_TIMEOUT_S}}
    if failure is not None:
        row.update(status="failed", reason=failure)
    return [row]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--reference-once"]:
        sys.exit(_reference_once(Path(sys.argv[2])))
    print(rows(quick=True))
