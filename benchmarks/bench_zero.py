"""ZeRO against PyTorch's built-ins: step time and per-rank model-state bytes on 2 gloo ranks, side by side.

Rows:
* ``zero1_vs_zero_redundancy_optimizer``: our ``BucketedDDP`` + ``ZeroOptimizer(stage=1)`` against torch
  ``DistributedDataParallel`` + ``ZeroRedundancyOptimizer(AdamW)``: the same design (DDP averages the
  gradients, the optimizer state is sharded, updated parameters are shared after the step).
* ``zero3_vs_fsdp2``: ``FullyShardedModel`` (one unit per block + root) + ``ZeroOptimizer(stage=3)`` against
  FSDP2 ``fully_shard`` per block + root with AdamW.

Regime (BENCHMARKS.md): the 10.8 M-parameter "bench" GPT with ONE 128-token sequence per rank, so the
collectives are a large share of the step. ``torch.set_num_threads(1)`` per rank; ours and torch run in
the same processes with their steps interleaved so machine noise hits both alike; every step starts after a
barrier; a step's time is its slowest rank's; median after warm-up, spread reported. Lower is better.

Memory, in ``config``: per-rank bytes of parameters + gradients + optimizer state after a step, measured
from the tensors each side really holds (ours: the tracer's ledger; torch: local tensors/shards, DDP's
gradient buckets included). On gloo, reduce-scatter is emulated as an all-reduce plus a chunk, so ZeRO-3's
communication saving over all-reduce does not show in time (BENCHMARKS.md); bytes are in the comm log.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

WORLD_SIZE = 2
#: Measured on the CPU (gloo) only so far; run.py skips this module under --device cuda.
DEVICES = ("cpu",)
LOCAL_BATCH = 1
SEQ_LEN = 128
LR = 1e-4


def _tensor_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _state_bytes(optimizer: Any) -> int:
    return _tensor_bytes(t for s in optimizer.state.values() for t in s.values() if hasattr(t, "dim") and t.dim() > 0)


def _setups(cfg: Any, row: str) -> dict[str, Any]:
    """{name: (model_to_call, optimizer, finish, memory_fn)} for the two sides of ``row``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from workbench import trace
    from workbench.models import build_gpt
    from workbench.parallel.ddp import BucketedDDP
    from workbench.parallel.zero import FullyShardedModel, ZeroOptimizer

    def ledger() -> int:
        current = trace.current().memory.current
        return sum(current.get(k, 0) for k in ("parameters", "gradients", "optimizer_state"))

    if row == "zero1":
        ours_model = BucketedDDP(build_gpt(cfg, seed=0))
        ours_opt = ZeroOptimizer(ours_model.parameters(), torch.optim.AdamW, stage=1, lr=LR)
        ref_model = DistributedDataParallel(build_gpt(cfg, seed=0))
        ref_opt = ZeroRedundancyOptimizer(ref_model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)

        def ref_memory() -> int:
            params = list(ref_model.parameters())
            buckets = 4 * sum(p.numel() for p in params)  # DDP's flat gradient buckets (a copy of the grads)
            return (_tensor_bytes(params) + _tensor_bytes(p.grad for p in params if p.grad is not None) + buckets
                    + _state_bytes(ref_opt.optim))

        def ours_memory() -> int:
            # BucketedDDP keeps gradients as views of its buckets; the ledger's "gradients" counts .grad once.
            return ledger()

        return {"ours": (ours_model, ours_opt, ours_model.finish_gradient_synchronization, ours_memory),
                "torch": (ref_model, ref_opt, lambda: None, ref_memory)}
    ours_model = FullyShardedModel(build_gpt(cfg, seed=0))
    ours_opt = ZeroOptimizer(ours_model.parameters(), torch.optim.AdamW, stage=3, lr=LR)
    ref_model = build_gpt(cfg, seed=0)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for block in ref_model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(ref_model, mesh=mesh)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR)

    def fsdp_memory() -> int:
        params = list(ref_model.parameters())
        return _tensor_bytes(params) + _tensor_bytes(p.grad for p in params if p.grad is not None) + _state_bytes(
            ref_opt)

    return {"ours": (ours_model, ours_opt, lambda: None, ledger), "torch": (ref_model, ref_opt, lambda: None,
                                                                           fsdp_memory)}


def _rank(row: str, steps: int, warmup: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from workbench import comm, trace
    from workbench.models import GPTConfig

    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = GPTConfig.preset("bench", seq_len=SEQ_LEN)
    setups = _setups(cfg, row)
    g = torch.Generator().manual_seed(1000 + rank)
    times: dict[str, list[float]] = {name: [] for name in setups}
    memory: dict[str, int] = {}
    for step in range(warmup + steps):
        x = torch.randint(0, cfg.vocab_size, (LOCAL_BATCH, SEQ_LEN + 1), generator=g)
        for name, (model, opt, finish, memory_fn) in setups.items():
            comm.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            model(x[:, :-1], x[:, 1:]).backward()
            finish()
            opt.step()
            if step >= warmup:
                times[name].append(time.perf_counter() - t0)
            memory[name] = memory_fn()
    peak_gathered = trace.current().memory.peak.get("gathered_params", 0)
    return {"times": times, "memory": memory, "gathered_peak": peak_gathered}


def _row(name: str, results: list[dict[str, Any]], steps: int, warmup: int, what: str) -> dict[str, Any]:
    per_step = {side: [max(r["times"][side][i] for r in results) for i in range(steps)] for side in ("ours", "torch")}
    ours, ref = statistics.median(per_step["ours"]), statistics.median(per_step["torch"])
    return {
        "benchmark": name, "ours": ours, "reference": ref, "ratio": ours / ref, "unit": "s/step",
        "config": {
            "lower_is_better": True, "compared": what,
            "model": "GPT bench (6 layers, d=384, 10.8 M params)", "world_size": WORLD_SIZE, "backend": "gloo",
            "per_rank_batch": LOCAL_BATCH, "seq_len": SEQ_LEN, "optimizer": "AdamW", "threads_per_rank": 1,
            "steps_measured": steps, "warmup": warmup, "statistic": "median of slowest rank per step",
            "spread_ours_s": [min(per_step["ours"]), max(per_step["ours"])],
            "spread_torch_s": [min(per_step["torch"]), max(per_step["torch"])],
            "model_state_bytes_per_rank_ours": max(r["memory"]["ours"] for r in results),
            "model_state_bytes_per_rank_torch": max(r["memory"]["torch"] for r in results),
            "gathered_params_peak_bytes_ours": max(r["gathered_peak"] for r in results),
        },
    }


def rows(quick: bool) -> list[dict[str, Any]]:
    from workbench import launch

    steps, warmup = (4, 2) if quick else (12, 3)
    zero1 = launch(_rank, WORLD_SIZE, "zero1", steps, warmup, timeout=300)
    zero3 = launch(_rank, WORLD_SIZE, "zero3", steps, warmup, timeout=300)
    return [
        _row("zero1_vs_zero_redundancy_optimizer", zero1, steps, warmup,
             "BucketedDDP + ZeroOptimizer(stage=1) vs torch DDP + ZeroRedundancyOptimizer"),
        _row("zero3_vs_fsdp2", zero3, steps, warmup,
             "FullyShardedModel (block units + root) + ZeroOptimizer(stage=3) vs fully_shard per block + root"),
    ]


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(rows(quick="--full" not in sys.argv), indent=2))
