"""PowerSGD in BucketedDDP against torch DistributedDataParallel with torch's ``powerSGD_hook``: step time on 2 gloo
ranks, side by side in one run, and the bytes each sends per step.

Regime (BENCHMARKS.md, "pick a regime where the thing measured matters"): bench_ddp's, the 10.8 M-parameter "bench"
GPT with ONE 128-token sequence per rank, so gradient synchronisation (and the compression's own compute) is a
large share of the step. Both sides: rank 4, error feedback, warm start, ONE bucket (64 MiB cap: the 43 MB of
gradients in one), plain all-reduce for the first 2 steps (torch's ``start_powerSGD_iter``, whose minimum is 2),
a matrix compressed when r(n+m) < nm (torch's ``min_compression_rate=1``, our rule), AdamW,
``torch.set_num_threads(1)`` per rank. The configurations run in the same processes with their steps interleaved
(ours, torch's hook, torch DDP uncompressed), so machine noise hits all alike. Each step starts after a barrier; a
step's time is its slowest rank's; we report the median after warm-up. Uncompressed torch DDP is in the config
for scale: on loopback gloo (about 1.3 GB/s) a 43 MB all-reduce costs less than PowerSGD's products, so
compression only pays on slower links (emulate one with ``launch(..., nodes=2, inter_link="ethernet")``).

Why one bucket: torch's hook issues its P and Q all-reduces from future callbacks, which run on gloo's threads,
while autograd issues the next bucket's first all-reduce from its own thread. With two buckets (25 MiB) a rank
was aborted (SIGABRT, no message) in 2 of 3 torch-only runs here, and with one bucket 6 of 6 ran: most likely the
ranks issued those collectives in different orders and gloo paired mismatched ones. Ours issues every collective
from one thread in unit order, so it is safe with any number of buckets; one bucket is what torch's side finishes.

Bytes per step and rank: ours from the communication log (``tag="grad"``, payload as ``theory.compression`` counts
it), torch's from its ``PowerSGDState`` counters (elements after compression x 4 bytes): the two must agree.

Row ``compression_over_slow_link``: every scheme of ``parallel.compression`` (none, bf16, PowerSGD rank 4, top-k
1 %, sign) in our BucketedDDP (one bucket) on 2 ranks placed as 2 *emulated* nodes joined by a slow link
(``SLOW_LINK``: 0.05 GB/s, 1 ms; ``workbench.dist.emulation``), so the bench GPT's 43 MB fp32 all-reduce (about
0.87 s modelled) dominates the uncompressed step (its share is reported as ``link_share``). Step times are **emulated**
time: real compute plus the α-β model's link time of every gradient collective. The five setups run in the same two
processes, their steps interleaved (the order rotated each step); compressors compress from their first step
(``warmup_steps=0``) and the bench drops its own warm-up steps. Per scheme: median step (slowest rank), the link
seconds the model charged (``modelled_s`` of the step's ``tag="grad"`` ops), bytes sent per step and rank
(``Compressor.history``) beside ``theory.compression.step_bytes``' payload, and step / uncompressed step. Headline:
the best compressor's step against the uncompressed one's. Only the inter-node link is emulated: compute, and the
compressors' own compression work, are this CPU's.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

WORLD_SIZE = 2
DEVICES = ("cpu",)  # a group of one GPU would move nothing; the row needs 2 ranks that exchange data
LOCAL_BATCH = 1
SEQ_LEN = 128
BUCKET_MB = 64.0
RANK = 4
START_ITER = 2
CONFIGS = ("ours", "torch", "torch_uncompressed")
# compression_over_slow_link: 2 emulated nodes of one rank each; "GBPS,US" (parse_link). At 0.05 GB/s (400 Mbit/s) the
# 43 MB fp32 all-reduce is modelled at ~0.87 s (ring, N = 2: S/B + 2 alpha). A batch-1 step's compute with both ranks
# on 2 shared cores measured ~0.6 s here (0.1 GB/s left the link only ~40 % of the uncompressed step).
SLOW_LINK = "0.05,1000"
SLOW_NODES = 2
SCHEMES = ("none", "bf16", "powersgd", "topk", "sign")
TOPK_RATIO = 0.01


def _torch_hooked(model: Any) -> tuple[Any, Any]:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=RANK, start_powerSGD_iter=START_ITER,
                               min_compression_rate=1, use_error_feedback=True, warm_start=True)
    ddp.register_comm_hook(state, psgd.powerSGD_hook)
    return ddp, state


def _step(ddp: Any, opt: Any, x: Any, ours: bool) -> float:
    from workbench import comm

    comm.barrier()
    t0 = time.perf_counter()
    opt.zero_grad()
    ddp(x[:, :-1], x[:, 1:]).backward()
    if ours:
        ddp.finish_gradient_synchronization()
    opt.step()
    return time.perf_counter() - t0


def _rank(steps: int, warmup: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from workbench import trace
    from workbench.models import GPTConfig, build_gpt
    from workbench.parallel.compression import PowerSGDCompressor
    from workbench.parallel.ddp import BucketedDDP

    torch.set_num_threads(1)
    cfg = GPTConfig.preset("bench", seq_len=SEQ_LEN)
    compressor = PowerSGDCompressor(rank=RANK, warmup_steps=START_ITER)
    hooked, state = _torch_hooked(build_gpt(cfg, seed=0))
    wrapped = {"ours": BucketedDDP(build_gpt(cfg, seed=0), bucket_mb=BUCKET_MB, compressor=compressor),
               "torch": hooked,
               "torch_uncompressed": torch.nn.parallel.DistributedDataParallel(build_gpt(cfg, seed=0),
                                                                               bucket_cap_mb=BUCKET_MB)}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in wrapped.items()}
    g = torch.Generator(device="cpu").manual_seed(1000 + dist.get_rank())
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    tracer = trace.current()
    for step in range(warmup + steps):
        x = torch.randint(0, cfg.vocab_size, (LOCAL_BATCH, SEQ_LEN + 1), generator=g, device="cpu")
        before = state.total_numel_after_compression
        tracer.trace.comms.clear()
        for config in CONFIGS:
            seconds = _step(wrapped[config], optimizers[config], x, config == "ours")
            if step >= warmup:
                times[config].append(seconds)
    ours_logged = sum(c.nbytes for c in tracer.trace.comms if c.tag == "grad")  # last step: all all-reduces
    return {"times": times, "ours_bytes": compressor.last_bytes_sent, "ours_logged": ours_logged,
            "torch_bytes": 4 * (state.total_numel_after_compression - before),
            "uncompressed_bytes": compressor.history[-1].uncompressed}


def _slowest_rank_steps(results: list[dict[str, Any]], config: str) -> list[float]:
    per_rank = [r["times"][config] for r in results]
    return [max(t[i] for t in per_rank) for i in range(len(per_rank[0]))]


def powersgd_vs_torch_hook_row(quick: bool) -> dict[str, Any]:
    from harness import device_and_world  # beside this file (benchmarks/)

    from workbench import launch

    steps, warmup = (5, START_ITER + 2) if quick else (15, START_ITER + 3)
    device, world = device_and_world(WORLD_SIZE)
    results = launch(_rank, world, steps, warmup, device=device, timeout=300)
    per_step = {c: _slowest_rank_steps(results, c) for c in CONFIGS}
    median = {c: statistics.median(v) for c, v in per_step.items()}
    ours, ref = median["ours"], median["torch"]
    first = results[0]
    return {
        "benchmark": "powersgd_vs_torch_hook",
        "ours": ours,
        "reference": ref,
        "ratio": ours / ref,
        "unit": "s/step",
        "config": {
            "lower_is_better": True,
            "model": "GPT bench (6 layers, d=384, 10.8 M params)",
            "world_size": world, "backend": "gloo", "per_rank_batch": LOCAL_BATCH, "seq_len": SEQ_LEN,
            "bucket_mb": BUCKET_MB, "powersgd_rank": RANK, "start_powerSGD_iter": START_ITER,
            "min_compression_rate": 1, "optimizer": "AdamW", "threads_per_rank": 1,
            "steps_measured": steps, "warmup": warmup, "statistic": "median of slowest rank per step",
            "spread_ours_s": [min(per_step["ours"]), max(per_step["ours"])],
            "spread_torch_s": [min(per_step["torch"]), max(per_step["torch"])],
            "torch_uncompressed_s": median["torch_uncompressed"],
            "bytes_per_step_ours": first["ours_bytes"], "bytes_per_step_torch": first["torch_bytes"],
            "bytes_logged_ours": first["ours_logged"], "bytes_uncompressed": first["uncompressed_bytes"],
            "compression_ratio": first["uncompressed_bytes"] / first["ours_bytes"],
        },
    }


def _slow_link_rank(steps: int, warmup: int) -> dict[str, Any]:
    """Every scheme's BucketedDDP (one bucket) in this rank, steps interleaved, the order rotated each step."""
    import torch
    import torch.distributed as dist

    from workbench import trace
    from workbench.models import GPTConfig, build_gpt
    from workbench.parallel.compression import make_compressor
    from workbench.parallel.ddp import BucketedDDP
    from workbench.theory.compression import step_bytes

    torch.set_num_threads(1)
    cfg = GPTConfig.preset("bench", seq_len=SEQ_LEN)
    compressors = {s: make_compressor(s, powersgd_rank=RANK, topk_ratio=TOPK_RATIO, warmup_steps=0) for s in SCHEMES}
    wrapped = {s: BucketedDDP(build_gpt(cfg, seed=0), bucket_mb=None, compressor=compressors[s]) for s in SCHEMES}
    optimizers = {s: torch.optim.AdamW(m.parameters(), lr=1e-4) for s, m in wrapped.items()}
    g = torch.Generator(device="cpu").manual_seed(1000 + dist.get_rank())
    times: dict[str, list[float]] = {s: [] for s in SCHEMES}
    link_s: dict[str, list[float]] = {s: [] for s in SCHEMES}
    comms = trace.current().trace.comms
    for step in range(warmup + steps):
        x = torch.randint(0, cfg.vocab_size, (LOCAL_BATCH, SEQ_LEN + 1), generator=g, device="cpu")
        shift = step % len(SCHEMES)
        for scheme in SCHEMES[shift:] + SCHEMES[:shift]:
            comms.clear()
            seconds = _step(wrapped[scheme], optimizers[scheme], x, ours=True)
            if step >= warmup:
                times[scheme].append(seconds)
                link_s[scheme].append(sum(c.modelled_s or 0.0 for c in comms if c.tag == "grad"))
    world = dist.get_world_size()
    units = wrapped["none"].reduction_units()
    per_scheme = {}
    for scheme, compressor in compressors.items():
        last = compressor.history[-1]
        theory = step_bytes(scheme, units, world, powersgd_rank=RANK, topk_ratio=TOPK_RATIO)
        per_scheme[scheme] = {"sent": last.sent, "uncompressed": last.uncompressed, "ratio": last.ratio,
                              "compressed": last.compressed, "theory_payload": theory["payload"],
                              "theory_bus": theory["bus"], "measured_bus": last.bus, "units": len(units)}
    return {"times": times, "link_s": link_s, "bytes": per_scheme}


def compression_over_slow_link_row(quick: bool) -> dict[str, Any]:
    from harness import device_and_world  # beside this file (benchmarks/)

    from workbench import launch

    steps, warmup = (6, 2) if quick else (15, 3)
    device, world = device_and_world(WORLD_SIZE)
    results = launch(_slow_link_rank, world, steps, warmup, device=device, nodes=SLOW_NODES, intra_link="nvlink",
                     inter_link=SLOW_LINK, timeout=300)
    per_step = {s: _slowest_rank_steps(results, s) for s in SCHEMES}
    median = {s: statistics.median(v) for s, v in per_step.items()}
    base = median["none"]
    best = min(SCHEMES[1:], key=median.__getitem__)
    first = results[0]
    schemes = {}
    for s in SCHEMES:
        link = statistics.median(max(r["link_s"][s][i] for r in results) for i in range(steps))
        b = first["bytes"][s]
        schemes[s] = {"step_s": round(median[s], 4), "spread_s": [round(min(per_step[s]), 4),
                                                                  round(max(per_step[s]), 4)],
                      "link_s_modelled": round(link, 4), "link_share": round(link / median[s], 3),
                      "ratio_vs_none": round(median[s] / base, 3),
                      "bytes_sent": b["sent"], "bytes_theory": b["theory_payload"],
                      "bytes_uncompressed": b["uncompressed"], "compression_ratio": round(b["ratio"], 1),
                      "bus_bytes": b["measured_bus"], "bus_bytes_theory": b["theory_bus"],
                      "compressed": b["compressed"]}
    return {
        "benchmark": "compression_over_slow_link",
        "ours": median[best],
        "reference": base,
        "ratio": median[best] / base,
        "unit": f"s/step emulated (best compressor, {best}, vs uncompressed; link time modelled, compute real)",
        "config": {
            "lower_is_better": True, "emulated_time": True,
            "link": f"{SLOW_NODES} emulated nodes x 1 rank, inter-node {SLOW_LINK} (GB/s, µs), time scale 1",
            "inter_link": SLOW_LINK, "nodes": SLOW_NODES,
            "model": "GPT bench (6 layers, d=384, 10.8 M params)", "ddp": "BucketedDDP, one bucket (bucket_mb=None)",
            "world_size": world, "backend": "gloo", "per_rank_batch": LOCAL_BATCH, "seq_len": SEQ_LEN,
            "powersgd_rank": RANK, "topk_ratio": TOPK_RATIO, "compressor_warmup_steps": 0,
            "optimizer": "AdamW", "threads_per_rank": 1, "steps_measured": steps, "warmup": warmup,
            "statistic": "median of slowest rank per step; steps interleaved, order rotated",
            "best_scheme": best, "schemes": schemes,
        },
    }


def rows(quick: bool) -> list[dict[str, Any]]:
    return [powersgd_vs_torch_hook_row(quick), compression_over_slow_link_row(quick)]


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(rows(quick="--full" not in sys.argv), indent=2))
