"""Checkpoints against ``torch.distributed.checkpoint`` (DCP): the same sharded state saved by both, side by side.

Rows:
* ``ckpt_save_vs_dcp``: seconds of a synchronous save, ``workbench.checkpoint.save`` (one shard file per rank,
  atomic write + fsync, then rank 0 writes the manifest and re-reads every shard to verify its sha256) against
  ``dcp.save`` (one file per rank + a metadata file) of the same state. Lower is better.
* ``async_ckpt_stall_vs_dcp``: how long the training loop is blocked: from calling our
  ``AsyncCheckpointer.save`` until it returns (it snapshots every tensor to fresh CPU memory, then a writer
  thread persists it) against ``dcp.async_save``'s return time (it stages to CPU, then saves in a thread).
  Each side's background write is waited for outside the timed region, before the next repeat. Goal <= 1.0.
  Ours copies into the previous save's CPU tensors (``reuse_staging``: allocated and touched once); DCP's
  default stages into fresh CPU memory at every save. DCP's own cache (``async_stager=BlockingAsyncStager(
  cache_staged_state_dict=True)``) pins its buffers, which needs an accelerator ("Cannot access accelerator
  device" on a CPU-only torch): it is the fair reference on a GPU machine, not measurable here.

The state (what a ZeRO-3 rank holds): the 10.8 M-parameter "bench" GPT's parameters, each flattened, padded
to a multiple of the world size and cut into one shard per rank, plus AdamW's exp_avg / exp_avg_sq of that
shard after one real step (fp32; about 65 MB per rank). Ours saves each rank's local tensors; DCP gets the same
local tensors two ways, each writing the same bytes: as DTensors ``Shard(0)`` on a 1-D CPU mesh (FSDP2's
idiom), and as plain tensors under per-rank keys (DCP de-duplicates tensors it sees as replicated: plain
tensors with one key on every rank would be saved once); the faster of the two is the reference, both are in
``config``. All write to fresh directories under one temporary folder (local disk). 2 gloo ranks, one thread
each; the sides alternate repeat by repeat; a repeat's time is its slowest rank's; median, spread reported.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

WORLD_SIZE = 2
#: Under --device cuda: NCCL, one rank per GPU, up to WORLD_SIZE (one GPU: one rank holding the whole state, from
#: GPU memory: the device-to-host copy is then part of every save, ours and DCP's alike).
DEVICES = ("cpu", "cuda")


def _sharded_state(device: Any) -> dict[str, dict[str, Any]]:
    """This rank's ZeRO-3-style shard of the bench GPT and its AdamW state after one step: {name: tensor}."""
    import torch
    import torch.distributed as dist

    from workbench.models import GPTConfig, build_gpt

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_gpt(GPTConfig.preset("bench"), seed=0, device=device)
    shards = {}
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        pad = -flat.numel() % world
        flat = torch.cat([flat, torch.zeros(pad, dtype=flat.dtype, device=device)])
        shards[name] = torch.nn.Parameter(flat.chunk(world)[rank].clone())
    opt = torch.optim.AdamW(shards.values(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(rank)
    for s in shards.values():
        s.grad = torch.randn(s.shape, generator=g, device="cpu").to(device)
    opt.step()
    state = {"model": {n: s.detach() for n, s in shards.items()}}
    for key in ("exp_avg", "exp_avg_sq"):
        state[key] = {n: opt.state[s][key] for n, s in shards.items()}
    return state


def _as_dtensors(state: dict[str, dict[str, Any]], device: Any) -> dict[str, dict[str, Any]]:
    """The same local tensors, declared as shards of 1-D global tensors, so DCP writes each rank's own."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return {part: {n: DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for n, t in tensors.items()}
            for part, tensors in state.items()}


def _rank(root: str, repeats: int) -> dict[str, Any]:
    import os
    from functools import partial

    import torch
    import torch.distributed.checkpoint as dcp

    from workbench import comm
    from workbench.checkpoint import AsyncCheckpointer, save
    from workbench.launch import rank_device

    torch.set_num_threads(1)
    device = rank_device()
    state = _sharded_state(device)
    dstate = _as_dtensors(state, device)
    nbytes = sum(t.numel() * t.element_size() for part in state.values() for t in part.values())
    rank = torch.distributed.get_rank()
    # DCP two ways: DTensor shards (FSDP2's idiom) and plain tensors under per-rank keys; the faster is the reference.
    dcp_states = {"dtensor": dstate, "plain": {part: {f"{n}.rank{rank}": t for n, t in tensors.items()}
                                              for part, tensors in state.items()}}
    times: dict[str, list[float]] = {k: [] for k in ("ours_sync", "ours_async", *(
        f"dcp_{kind}_{how}" for kind in dcp_states for how in ("sync", "async")))}
    ours_async = AsyncCheckpointer(os.path.join(root, "ours_async"))
    # dcp.async_save coordinates its background save over a CPU-capable group: NCCL alone is refused.
    cpu_group = torch.distributed.new_group(backend="gloo") if device.type == "cuda" else None

    def timed(key: str, i: int, call: Any, finish: Any = None) -> None:
        comm.barrier()
        t0 = time.perf_counter()
        result = call()
        elapsed = time.perf_counter() - t0
        if finish is not None:
            finish(result)  # the background write, outside the timed region
        comm.barrier()
        if i:  # the first repeat is warm-up (file creation, DCP's planner caches, thread pools)
            times[key].append(elapsed)

    for i in range(repeats + 1):
        timed("ours_sync", i, partial(save, os.path.join(root, "ours_sync"), i, state))
        timed("ours_async", i, partial(ours_async.save, i, state), lambda _: ours_async.wait())
        for kind, sd in dcp_states.items():
            timed(f"dcp_{kind}_sync", i, partial(dcp.save, sd, checkpoint_id=os.path.join(root, f"{kind}_sync_{i}")))
            timed(f"dcp_{kind}_async", i,
                  partial(dcp.async_save, sd, checkpoint_id=os.path.join(root, f"{kind}_async_{i}"),
                          process_group=cpu_group),
                  lambda future: future.result())
    ours_async.close()
    return {"times": times, "bytes": nbytes}


def _slowest(results: list[dict[str, Any]], key: str) -> list[float]:
    return [max(r["times"][key][i] for r in results) for i in range(len(results[0]["times"][key]))]


def _row(name: str, results: list[dict[str, Any]], how: str, what: str, device: str) -> dict[str, Any]:
    ours = _slowest(results, f"ours_{how}")
    dcp = {kind: _slowest(results, f"dcp_{kind}_{how}") for kind in ("dtensor", "plain")}
    best = min(dcp, key=lambda kind: statistics.median(dcp[kind]))
    o, f = statistics.median(ours), statistics.median(dcp[best])
    return {
        "benchmark": name, "ours": o, "reference": f, "ratio": o / f, "unit": "s",
        "config": {
            "lower_is_better": True, "compared": what, "reference_is": f"DCP with {best} state (the faster of two)",
            "dcp_median_s": {kind: statistics.median(t) for kind, t in dcp.items()},
            "world_size": len(results), "backend": "nccl" if device == "cuda" else "gloo", "device": device,
            "state": "ZeRO-3-style shard of the bench GPT (10.8 M params) + AdamW exp_avg/exp_avg_sq, fp32",
            "bytes_per_rank": max(r["bytes"] for r in results), "repeats": len(ours), "warmup": 1,
            "statistic": "median of slowest rank per repeat", "storage": "local disk, temporary directory",
            "spread_ours_s": [min(ours), max(ours)], "spread_reference_s": [min(dcp[best]), max(dcp[best])],
        },
    }


def rows(quick: bool) -> list[dict[str, Any]]:
    import tempfile

    from harness import device_and_world  # beside this file (benchmarks/)

    from workbench import launch

    repeats = 3 if quick else 7
    device, world = device_and_world(WORLD_SIZE)
    with tempfile.TemporaryDirectory(prefix="workbench-bench-ckpt-") as root:
        results = launch(_rank, world, root, repeats, device=device, timeout=300)
    return [
        _row("ckpt_save_vs_dcp", results, "sync",
             "workbench.checkpoint.save (atomic shards, manifest, sha256 verify) vs dcp.save, same shards", device),
        _row("async_ckpt_stall_vs_dcp", results, "async",
             "AsyncCheckpointer.save return time vs dcp.async_save return time (training-loop stall)", device),
    ]


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(rows(quick="--full" not in sys.argv), indent=2))
