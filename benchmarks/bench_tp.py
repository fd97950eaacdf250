"""tp_vs_dtensor: a tensor-parallel training step of the bench GPT on 2 gloo ranks, ours against DTensor's
``parallelize_module`` with the same split, side by side in one run.

Both sides split the same layers the same way (Megatron's MLP/attention split: q, k, v and fc column-wise,
the attention and MLP output projections row-wise) and leave the embedding, norms and head replicated, so
the row compares the implementations, not the plans. Ours applies f once to each sub-layer's input (one
backward all-reduce for q, k and v together); DTensor redistributes per linear. Same seeded weights, same
batch on both ranks (tensor parallelism splits the model, not the data), AdamW, ``torch.set_num_threads(1)``
per rank, ours and DTensor interleaved step by step in the same processes so machine noise hits both; each
step starts after a barrier; a step's time is its slowest rank's; median after warm-up. Lower is better.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

DEVICES = ("cpu",)
WORLD_SIZE = 2
BATCH = 4
SEQ_LEN = 128
SIDES = ("ours", "dtensor")


def _ours(cfg: Any, mesh: Any) -> Any:
    from workbench.models import build_gpt
    from workbench.parallel.tensor import BLOCK_PLAN, apply_plan

    model = build_gpt(cfg, seed=0, device=mesh.device)
    plan = {f"blocks.{i}.{name}": style for i in range(cfg.n_layer) for name, style in BLOCK_PLAN.items()}
    return apply_plan(model, plan, mesh)


def _dtensor(cfg: Any, mesh: Any) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from workbench.models import build_gpt

    model = build_gpt(cfg, seed=0, device=mesh.device)
    device_mesh = init_device_mesh(mesh.device.type, (WORLD_SIZE,))
    plan = {}
    for i in range(cfg.n_layer):
        plan.update({f"blocks.{i}.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
        plan.update({f"blocks.{i}.attn.proj": RowwiseParallel(), f"blocks.{i}.mlp.fc": ColwiseParallel(),
                     f"blocks.{i}.mlp.proj": RowwiseParallel()})
    return parallelize_module(model, device_mesh, plan)


def _rank(steps: int, warmup: int) -> dict[str, Any]:
    import torch

    from workbench import comm
    from workbench.mesh import Mesh
    from workbench.models import GPTConfig

    torch.set_num_threads(1)
    mesh = Mesh(tp=WORLD_SIZE)
    cfg = GPTConfig.preset("bench", seq_len=SEQ_LEN)
    models = {"ours": _ours(cfg, mesh), "dtensor": _dtensor(cfg, mesh)}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    g = torch.Generator(device="cpu").manual_seed(1234)  # the same batch on every tp rank
    times: dict[str, list[float]] = {s: [] for s in SIDES}
    losses: dict[str, list[float]] = {s: [] for s in SIDES}
    for step in range(warmup + steps):
        x = torch.randint(0, cfg.vocab_size, (BATCH, SEQ_LEN + 1), generator=g, device="cpu").to(mesh.device)
        for side in SIDES:
            comm.barrier()
            t0 = time.perf_counter()
            optimizers[side].zero_grad()
            loss = models[side](x[:, :-1], x[:, 1:])
            loss.backward()
            optimizers[side].step()
            if step >= warmup:
                times[side].append(time.perf_counter() - t0)
            losses[side].append(loss.detach().item())
    return {"times": times, "losses": losses}


def rows(quick: bool) -> list[dict[str, Any]]:
    from workbench import launch

    steps, warmup = (4, 1) if quick else (10, 2)
    results = launch(_rank, WORLD_SIZE, steps, warmup, device="cpu", timeout=300)
    per_step = {s: [max(r["times"][s][i] for r in results) for i in range(steps)] for s in SIDES}
    ours, ref = statistics.median(per_step["ours"]), statistics.median(per_step["dtensor"])
    loss_gap = max(abs(a - b) for a, b in zip(results[0]["losses"]["ours"], results[0]["losses"]["dtensor"],
                                                 strict=True))
    return [{
        "benchmark": "tp_vs_dtensor", "ours": ours, "reference": ref, "ratio": ours / ref, "unit": "s/step",
        "config": {
            "lower_is_better": True, "target": "<= 0.90",
            "model": "GPT bench (6 layers, d=384, 10.8 M params)", "world_size": WORLD_SIZE, "tp": WORLD_SIZE,
            "backend": "gloo", "batch": BATCH, "seq_len": SEQ_LEN, "optimizer": "AdamW", "threads_per_rank": 1,
            "split": "q/k/v/fc column-wise, attn.proj/mlp.proj row-wise; embedding, norms, head replicated",
            "steps_measured": steps, "warmup": warmup, "statistic": "median of slowest rank per step",
            "spread_ours_s": [min(per_step["ours"]), max(per_step["ours"])],
            "spread_dtensor_s": [min(per_step["dtensor"]), max(per_step["dtensor"])],
            "max_loss_difference": loss_gap,  # both sides train the same model: a check, not a figure
        },
    }]


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(rows(quick="--full" not in sys.argv), indent=2))
