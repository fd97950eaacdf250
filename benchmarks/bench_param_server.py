"""The parameter server (``workbench run --ps-servers``) where it wins and where it loses. Two rows, tiny GPT
(2 layers, d_model 64, 118,528 parameters = 474 KB of fp32 gradients), batch 12 x 32 tokens, ``run_training`` as a
user runs it; times are medians of steps after the first.

* ``ps_server_link_vs_ring`` (**emulated** time): every rank a node of its own, joined by a slow emulated link
  (``SLOW_LINK``: 0.02 GB/s, 100 µs; ``workbench.dist.emulation``), one server and W = 1, 2, 3 workers, beside DDP
  over the same W ranks. Per W: the time a step waits on the links (rank 0's step time minus its compute spans),
  theory's for the emulator (one push, then the server's W pulls queued on its link: the emulator queues what a
  rank sends, ``theory.param_server.server_link_seconds(..., pushes_queue=False)``; a real NIC would queue the
  pushes too, which its default counts), the ring's (``theory.comm.ring_allreduce_time``), and the server's bytes
  per step measured beside ``theory.param_server.step_bytes``. Headline: PS wait / DDP wait at the largest W (goal:
  none; the row shows the server's link as the bottleneck, the ratio growing with W).
* ``ps_async_vs_sync_straggler``: 3 workers and one server, worker 0 computing ``STRAGGLER_FACTOR`` times slower
  (``--straggler``), synchronous vs asynchronous (and asynchronous with ``--max-staleness 1``), each applying
  ``STEPS`` x 3 gradients. ``ours`` the asynchronous throughput (tokens/s, every worker's gradients together),
  ``reference`` the synchronous one; theory's ratio ((W − 1 + 1/F) · F / W, ignoring communication and the two cores
  the four processes share here) in the config, with each run's staleness histogram and gradients per worker.
  Goal: > 1 (async faster under a straggler).

    python benchmarks/bench_param_server.py [--quick]
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

WORLD_SIZE = 4
DEVICES = ("cpu",)
SLOW_LINK = "0.02,100"
STRAGGLER_FACTOR = 6
BATCH, SEQ_LEN = 12, 32


def _config(**kw: Any) -> Any:
    from workbench.training.config import RunConfig

    return RunConfig(**{"batch_size": BATCH, "seq_len": SEQ_LEN, "trace_steps": 0, **kw})


def _wait_s(summary: dict[str, Any]) -> float:
    rows = summary["history"][1:] or summary["history"]
    return statistics.median(m["step_time_s"] - m.get("compute_s", 0.0) for m in rows)


def server_link_row(quick: bool) -> dict[str, Any]:
    from workbench.run import run_training
    from workbench.theory.comm import ring_allreduce_time
    from workbench.theory.param_server import server_link_seconds, step_bytes
    from workbench.theory.topology import parse_link

    steps = 5 if quick else 10
    link = parse_link(SLOW_LINK)
    per_w = {}
    for w in (1, 2, 3):
        ps = run_training(_config(nproc=w + 1, ps_servers=1, steps=steps, nodes=w + 1, inter_link=SLOW_LINK),
                          progress=False)
        n = ps["n_params"]
        server = ps["parameter_server"]["per_server"][0]
        theory = server_link_seconds([n], w, link.alpha, link.bandwidth, pushes_queue=False)  # the emulator's model
        row = {"ps_wait_s": round(_wait_s(ps), 4), "ps_theory_s": round(theory, 4),
               "server_bytes_in_per_step": server["bytes_in"] / steps,
               "theory_bytes_in_per_step": step_bytes([n], w)["server_in"][0]}
        if w > 1:
            ddp = run_training(_config(nproc=w, steps=steps, nodes=w, inter_link=SLOW_LINK), progress=False)
            row.update(ddp_wait_s=round(_wait_s(ddp), 4),
                       ring_theory_s=round(ring_allreduce_time(4 * n, w, link.alpha, link.bandwidth), 4))
        per_w[w] = row
    last = per_w[3]
    return {"benchmark": "ps_server_link_vs_ring", "ours": last["ps_wait_s"], "reference": last["ddp_wait_s"],
            "ratio": last["ps_wait_s"] / last["ddp_wait_s"],
            "unit": "s/step waiting on links, emulated (PS, 1 server + 3 workers, vs DDP over 3 ranks)",
            "config": {"lower_is_better": True, "emulated_time": True, "link": SLOW_LINK,
                       "placement": "every rank a node of its own", "steps": steps, "batch": BATCH,
                       "seq_len": SEQ_LEN, "model": "GPT tiny", "per_workers": per_w,
                       "statistic": "median over steps after the first of rank 0's step time minus compute"}}


def straggler_row(quick: bool) -> dict[str, Any]:
    from workbench.run import run_training

    steps = 6 if quick else 12
    modes = {"sync": {}, "async": {"ps_async": True}, "async_k1": {"ps_async": True, "max_staleness": 1}}
    straggler = f"rank=0:factor={STRAGGLER_FACTOR}"
    runs = {name: run_training(_config(nproc=4, ps_servers=1, steps=steps, straggler=straggler, **extra),
                               progress=False)["parameter_server"] for name, extra in modes.items()}
    workers = 3
    theory = (workers - 1 + 1 / STRAGGLER_FACTOR) * STRAGGLER_FACTOR / workers
    detail = {name: {"tokens_per_s": round(ps["tokens_per_s"], 1), "staleness": ps["staleness_histogram"],
                     "by_worker": ps["per_server"][0]["by_worker"], "max_gap": ps["max_gap"],
                     "held_s": round(ps["held_s"], 3)} for name, ps in runs.items()}
    ours, ref = runs["async"]["tokens_per_s"], runs["sync"]["tokens_per_s"]
    return {"benchmark": "ps_async_vs_sync_straggler", "ours": ours, "reference": ref, "ratio": ours / ref,
            "unit": "tokens/s, all workers (async vs sync; a straggler at factor "
                    f"{STRAGGLER_FACTOR}, emulated by sleeping)",
            "config": {"lower_is_better": False, "workers": workers, "servers": 1, "steps": steps,
                       "gradients_applied": steps * workers, "straggler_factor": STRAGGLER_FACTOR,
                       "theory_ratio": round(theory, 3), "runs": detail, "batch": BATCH, "seq_len": SEQ_LEN,
                       "note": "4 processes on this machine's cores: the fast workers share them with the server"}}


def rows(quick: bool) -> list[dict[str, Any]]:
    return [server_link_row(quick), straggler_row(quick)]


if __name__ == "__main__":
    for row in rows(quick="--quick" in sys.argv):
        print(f"{row['benchmark']}: ours {row['ours']:.4g} vs reference {row['reference']:.4g} {row['unit']} "
              f"(ratio {row['ratio']:.3f})")
        print(f"  {row['config']}")
