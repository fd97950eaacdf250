"""``moe_ep_vs_one_rank``: the same mixture-of-experts GPT (tiny: 2 layers, d_model 64, 8 experts per layer, top-2,
no token dropped) trained three ways on one global batch (16 x 32 tokens), through ``run_training`` as a user runs it:
one rank holding every expert; 4 ranks of plain data parallelism (``--ep 1``: every rank every expert, their
gradients all-reduced); 4 ranks of expert parallelism (``--ep 4``: each rank 2 experts per layer, tokens dispatched
and combined by all-to-all). ``ours`` is EP's tokens/s, ``reference`` DP's at the same 4 ranks; the config has one
rank's, and each run's ledger peaks per rank (parameters, gradients, optimizer state: EP holds 1/4 of the experts'
share), and the all-to-all bytes per step measured beside ``theory.expert``. Medians of steps after the first;
4 ranks share this machine's cores, so the throughputs compare layouts here, not a cluster.

    python benchmarks/bench_moe.py [--quick]
"""

from __future__ import annotations

import sys
from typing import Any

WORLD_SIZE = 4
DEVICES = ("cpu",)
MOE = {"moe_experts": 8, "moe_top_k": 2, "moe_capacity_factor": None}
BATCH, SEQ_LEN = 16, 32
CATEGORIES = ("parameters", "gradients", "optimizer_state")


def _run(nproc: int, ep: int, steps: int) -> dict[str, Any]:
    from workbench.run import run_training
    from workbench.training.config import RunConfig

    summary = run_training(RunConfig(nproc=nproc, ep=ep, steps=steps, batch_size=BATCH, seq_len=SEQ_LEN,
                                     trace_steps=2, **MOE), progress=False)
    peak = summary["memory_peak_bytes"][0]
    return {"tokens_per_s": summary["tokens_per_s"], "step_time_s": summary["step_time_s"],
            "rank0_peak_bytes": {c: peak.get(c, 0) for c in CATEGORIES},
            "all_to_all": (summary.get("moe") or {}).get("all_to_all"), "losses": summary["losses"]}


def moe_ep_row(quick: bool) -> dict[str, Any]:
    steps = 6 if quick else 12
    one, dp, ep = _run(1, 1, steps), _run(WORLD_SIZE, 1, steps), _run(WORLD_SIZE, WORLD_SIZE, steps)
    return {"benchmark": "moe_ep_vs_one_rank", "ours": ep["tokens_per_s"], "reference": dp["tokens_per_s"],
            "ratio": ep["tokens_per_s"] / dp["tokens_per_s"],
            "unit": f"tokens/s (EP={WORLD_SIZE} vs DP on {WORLD_SIZE} ranks, same MoE and global batch)",
            "config": {"lower_is_better": False, "model": "GPT tiny, 8 experts top-2, capacity none", "steps": steps,
                       "batch": BATCH, "seq_len": SEQ_LEN, "one_rank": one, "dp4": dp, "ep4": ep,
                       "statistic": "median tokens/s over steps after the first; ledger peaks of rank 0"}}


def rows(quick: bool) -> list[dict[str, Any]]:
    return [moe_ep_row(quick)]


if __name__ == "__main__":
    for row in rows(quick="--quick" in sys.argv):
        print(f"{row['benchmark']}: ours {row['ours']:.4g} vs reference {row['reference']:.4g} {row['unit']} "
              f"(ratio {row['ratio']:.3f})")
        print(f"  {row['config']}")
