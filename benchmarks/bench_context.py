"""Context parallelism (workbench.parallel.context): ring attention against the plain all-gather of K/V, the zigzag
layout's balance, and torch's own ``context_parallel``, all on gloo CPU ranks, both sides in one run.

Rows (one attention call, forward + backward, B x H x S x hd fp32, causal, ``torch.set_num_threads(1)`` per rank):

* ``ring_attention_vs_allgather_kv`` (cp=2) and ``..._cp4``: ``ring_attention`` (zigzag layout) against the
  baseline most people write first: all-gather K and V over the cp group (``comm.all_gather``, one message of K and
  V stacked), then this rank's queries against the whole K/V with ``F.scaled_dot_product_attention`` and the causal
  mask built from global positions; the gather's backward is a ``comm.reduce_scatter`` (sum) of dK/dV. Both sides
  get the same shards and the same output gradient, and are checked against each other (``max_abs_difference``).
  ``ratio`` = ring / all-gather, the slowest rank's time per rep, median after warm-up; goal <= 1.0. The memory
  win is in the config: K/V bytes a rank holds beyond its own shard (ring: 2 blocks in flight, the block in hand
  and the one arriving; all-gather: the whole sequence), and the bytes autograd saves for backward, *measured*
  with ``torch.autograd.graph.saved_tensors_hooks`` (unique storages).
* ``cp_zigzag_balance`` (cp=2) and ``..._cp4``: per-rank compute of causal ring attention, max/min over the ranks,
  zigzag (``ours``, goal <= 1.2) against contiguous (``reference``, expected ~cp). A rank's compute is the wall time
  inside its ring-attention block spans (``trace.span(BLOCK_SPAN, "forward"/"backward")``, summed per call through
  the tracer's ``take_compute_s``), so the time a rank waits for its neighbours' blocks is not counted; median over
  reps per rank. Beside it: the same with the main thread's CPU time around the call (``time.thread_time``, immune
  to ranks sharing a core), the theory's ``computed_pairs`` max/min, and each layout's call time (slowest rank).
* ``cp_vs_torch_context_parallel``: ``torch.distributed.tensor.experimental.context_parallel`` over a 1-D
  ``DeviceMesh`` on the same attention (SDPA, causal). If torch cannot run it on CPU/gloo, the row is
  ``"status": "unsupported"`` with the exception, never numbers; if it runs, ours / theirs.

Reps of the two (three) sides are interleaved in the same processes, each after a barrier, so machine noise hits
all of them. On 2 shared cores, cp=4 puts 2 ranks on each core: absolute times there include time-slicing.

    python benchmarks/bench_context.py [--full]          # quick by default
    python benchmarks/run.py --only context [--quick]
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

DEVICES = ("cpu",)
BATCH, HEADS, HEAD_DIM = 1, 4, 64
SEQ_LEN = {True: 2048, False: 4096}  # quick, full
CPS = (2, 4)
SIDES = ("ring", "allgather", "ring_contiguous")
LAUNCH_TIMEOUT_S = 300


# -- the baseline: all-gather K/V, local attention, reduce-scatter dK/dV -------------------------------------------

def _gather_kv_function() -> Any:
    from workbench.dist import comm

    class GatherKV(torch.autograd.Function):
        """[2, B, H, T, hd] (K and V stacked) -> [2·cp, B, H, T, hd], every rank's in rank order; backward sums the
        gradient's chunks over the ranks back to their owner (reduce-scatter)."""

        @staticmethod
        def forward(ctx, kv, group):
            ctx.group = group
            out = kv.new_empty((comm.group_size(group) * kv.shape[0], *kv.shape[1:]))
            comm.all_gather(out, kv.contiguous(), group)
            return out

        @staticmethod
        def backward(ctx, grad):
            mine = grad.new_empty((grad.shape[0] // comm.group_size(ctx.group), *grad.shape[1:]))
            comm.reduce_scatter(mine, grad.contiguous(), "sum", ctx.group)
            return mine, None

    return GatherKV


def allgather_attention(q: Any, k: Any, v: Any, k_positions: Any, q_positions: Any, gather: Any,
                        group: Any = None) -> Any:
    """This rank's queries against the whole gathered K/V; ``k_positions``: the global positions of the gathered
    keys in gathered order, ``q_positions`` those of this rank's queries."""
    cp = len(k_positions) // q.shape[-2]
    b, h, t, d = k.shape
    full = gather.apply(torch.stack([k, v]), group).view(cp, 2, b, h, t, d).permute(1, 2, 3, 0, 4, 5)
    full = full.reshape(2, b, h, cp * t, d)
    mask = q_positions[:, None] >= k_positions[None, :]
    return F.scaled_dot_product_attention(q, full[0], full[1], attn_mask=mask)


# -- per rank ----------------------------------------------------------------------------------------------------

def _saved_bytes(fn: Any) -> tuple[Any, int]:
    """Run ``fn()``; the bytes of the unique storages autograd saved for backward while it ran."""
    storages: dict[int, int] = {}

    def pack(t: Any) -> Any:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def _rank(seq_len: int, warmup: int, reps: int) -> dict[str, Any]:
    from workbench import trace
    from workbench.dist import comm
    from workbench.parallel.context import chunk_positions, ring_attention, shard_sequence

    torch.set_num_threads(1)
    tracer = trace.current()
    tracer.enabled = False  # keep counting compute seconds and bytes, without storing every span and message
    cp, rank = comm.group_size(), comm.group_rank()
    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    full = [torch.randn(BATCH, HEADS, seq_len, HEAD_DIM, generator=g) for _ in range(4)]  # q, k, v, dout
    shards = {layout: [shard_sequence(t, cp, rank, layout, dim=2) for t in full] for layout in ("zigzag", "contiguous")}
    q_pos = chunk_positions(seq_len, cp, rank, "zigzag", "cpu")
    k_pos = torch.cat([chunk_positions(seq_len, cp, r, "zigzag", "cpu") for r in range(cp)])
    gather = _gather_kv_function()

    def run(side: str) -> tuple[list[Any], int]:
        layout = "contiguous" if side == "ring_contiguous" else "zigzag"
        q, k, v, dout = shards[layout]
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        if side == "allgather":
            out, saved = _saved_bytes(lambda: allgather_attention(q, k, v, k_pos, q_pos, gather))
        else:
            out, saved = _saved_bytes(lambda: ring_attention(q, k, v, causal=True, layout=layout))
        out.backward(dout)
        return [out.detach(), q.grad, k.grad, v.grad], saved

    times: dict[str, dict[str, list[float]]] = {s: {"wall": [], "cpu": [], "compute": []} for s in SIDES}
    saved: dict[str, int] = {}
    sent: dict[str, dict[str, int]] = {}
    difference = 0.0
    for rep in range(warmup + reps):
        results = {}
        for side in SIDES:
            comm.barrier()
            tracer.take_compute_s()
            tracer.take_comm_totals()
            t0, c0 = time.perf_counter(), time.thread_time()
            results[side], saved[side] = run(side)
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            compute = tracer.take_compute_s()
            sent[side] = tracer.take_comm_totals()
            if rep >= warmup:
                for key, value in (("wall", wall), ("cpu", cpu), ("compute", compute)):
                    times[side][key].append(value)
        if rep == 0:  # same shards, same output gradient: the two zigzag sides must agree
            difference = max(float((a - b).abs().max()) for a, b in zip(results["ring"], results["allgather"],
                                                                          strict=True))
    return {"times": times, "saved_bytes": saved, "logged_bytes": sent, "max_abs_difference": difference}


# -- rows --------------------------------------------------------------------------------------------------------

def _median_slowest(per_rank: list[dict[str, Any]], side: str, key: str = "wall") -> tuple[float, list[float]]:
    """Median over reps of the slowest rank's time, and its spread [min, max]."""
    reps = len(per_rank[0]["times"][side][key])
    slowest = [max(r["times"][side][key][i] for r in per_rank) for i in range(reps)]
    return statistics.median(slowest), [min(slowest), max(slowest)]


def _per_rank_medians(per_rank: list[dict[str, Any]], side: str, key: str) -> list[float]:
    return [statistics.median(r["times"][side][key]) for r in per_rank]


def _imbalance(values: list[float]) -> float:
    return max(values) / min(values) if min(values) > 0 else float("inf")


def _suffix(cp: int) -> str:
    return "" if cp == 2 else f"_cp{cp}"


def _common_config(cp: int, seq_len: int, warmup: int, reps: int) -> dict[str, Any]:
    return {"cp": cp, "world_size": cp, "backend": "gloo", "batch": BATCH, "heads": HEADS, "seq_len": seq_len,
            "head_dim": HEAD_DIM, "dtype": "float32", "causal": True, "threads_per_rank": 1, "warmup": warmup,
            "reps": reps, "pass": "forward + backward of one attention call"}


def allgather_row(per_rank: list[dict[str, Any]], cp: int, seq_len: int, warmup: int, reps: int) -> dict[str, Any]:
    from workbench.theory.context import activation_memory_per_rank, ring_kv_bytes

    ring, ring_spread = _median_slowest(per_rank, "ring")
    gathered, gathered_spread = _median_slowest(per_rank, "allgather")
    ring_compute = max(_per_rank_medians(per_rank, "ring", "compute"))
    theory = ring_kv_bytes(BATCH, HEADS, seq_len, HEAD_DIM, cp)
    block = theory["kv_message"]  # K and V of one rank's S/cp tokens
    memory = activation_memory_per_rank(BATCH, HEADS, seq_len, HEAD_DIM, cp)
    logged = per_rank[0]["logged_bytes"]
    saved = {side: max(r["saved_bytes"][side] for r in per_rank) for side in ("ring", "allgather")}
    return {
        "benchmark": f"ring_attention_vs_allgather_kv{_suffix(cp)}", "ours": ring, "reference": gathered,
        "ratio": ring / gathered, "unit": "s per forward+backward (ring vs all-gather K/V, slowest rank)",
        "config": {
            **_common_config(cp, seq_len, warmup, reps),
            "lower_is_better": True, "goal": "ratio <= 1.0",
            "layout": "zigzag (both sides hold the same shards)",
            "reference_impl": "comm.all_gather of stacked K/V + F.scaled_dot_product_attention(attn_mask from global "
                              "positions); backward: comm.reduce_scatter(sum) of dK/dV",
            "statistic": "median over reps of the slowest rank; spread = [min, max] of that",
            "spread_ring_s": ring_spread, "spread_allgather_s": gathered_spread,
            "ring_compute_share": round(ring_compute / ring, 3),  # block compute / call time: the rest is comm+waits
            "max_abs_difference": max(r["max_abs_difference"] for r in per_rank),
            "kv_bytes_held_beyond_own_shard": {
                "ring_forward": memory["forward_buffers"],  # 2 blocks: in hand + arriving
                "ring_backward": memory["ring_buffers"],  # + the dK/dV accumulator going out and the one arriving
                "allgather_forward": cp * block,  # the whole sequence's K/V
                "allgather_backward": 2 * cp * block,  # the gathered K/V and its gradient
                "block_bytes": block,
                "ring_over_allgather_forward": round(memory["forward_buffers"] / (cp * block), 3),  # 2/cp
            },
            "saved_for_backward_bytes_measured": saved,  # max over ranks; q, k, v, out of the own shard included
            "saved_ring_over_allgather": round(saved["ring"] / saved["allgather"], 3),
            "logged_bytes_rank0": {side: logged[side] for side in ("ring", "allgather")},
            "ring_kv_bytes_theory": theory,
        },
    }


def balance_row(per_rank: list[dict[str, Any]], cp: int, seq_len: int, warmup: int, reps: int) -> dict[str, Any]:
    from workbench.theory.context import computed_pairs

    layouts = {"zigzag": "ring", "contiguous": "ring_contiguous"}
    compute = {name: _per_rank_medians(per_rank, side, "compute") for name, side in layouts.items()}
    cpu = {name: _per_rank_medians(per_rank, side, "cpu") for name, side in layouts.items()}
    pairs = {name: computed_pairs(seq_len, cp, name) for name in layouts}
    calls = {name: _median_slowest(per_rank, side)[0] for name, side in layouts.items()}
    zigzag, contiguous = _imbalance(compute["zigzag"]), _imbalance(compute["contiguous"])
    return {
        "benchmark": f"cp_zigzag_balance{_suffix(cp)}", "ours": zigzag, "reference": contiguous,
        "ratio": zigzag / contiguous, "unit": "max/min per-rank compute time (zigzag vs contiguous)",
        "config": {
            **_common_config(cp, seq_len, warmup, reps),
            "lower_is_better": True, "goal": f"zigzag max/min <= 1.2; contiguous expected ~cp={cp}",
            "measured_as": "per rank: wall seconds inside ring-attention block spans (forward and backward) per call, "
                           "median over reps; waits for the neighbours' blocks excluded",
            "per_rank_compute_s": {k: [round(x, 4) for x in v] for k, v in compute.items()},
            "cpu_time_max_min": {k: round(_imbalance(v), 3) for k, v in cpu.items()},
            "per_rank_cpu_s": {k: [round(x, 4) for x in v] for k, v in cpu.items()},
            "computed_pairs_max_min": {k: round(_imbalance(v), 3) for k, v in pairs.items()},
            "computed_pairs": pairs,
            "call_s_slowest_rank": {k: round(v, 4) for k, v in calls.items()},
            "contiguous_over_zigzag_call": round(calls["contiguous"] / calls["zigzag"], 3),
            "cores_note": "more ranks than cores: ranks time-slice, compute spans include that" if cp > 2 else "",
        },
    }


# -- torch's context_parallel --------------------------------------------------------------------------------------

def _torch_cp_rank(seq_len: int, warmup: int, reps: int) -> dict[str, Any]:
    from harness import error_reason  # beside this file (benchmarks/)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from workbench.dist import comm
    from workbench.parallel.context import ring_attention, shard_sequence

    torch.set_num_threads(1)
    cp, rank = comm.group_size(), comm.group_rank()
    mesh = init_device_mesh("cpu", (cp,))
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(BATCH, HEADS, seq_len, HEAD_DIM, generator=g) for _ in range(4)]  # q, k, v, dout

    def theirs() -> None:
        q, k, v, dout = (t.clone() for t in full)
        with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2],
                              no_restore_buffers={q, k, v, dout}):
            leaves = [t.requires_grad_() for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
            out.backward(dout)

    def ours() -> None:
        q, k, v, dout = (shard_sequence(t, cp, rank, "zigzag", dim=2) for t in full)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        ring_attention(*leaves, causal=True, layout="zigzag").backward(dout)

    attempts: dict[str, str] = {}
    try:
        theirs()
    except Exception as exc:  # noqa: BLE001 - the reason is the row
        attempts["default SDPA backend"] = error_reason(exc)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:  # the math backend decomposes SDPA into plain ops: does DTensor take those?
            with sdpa_kernel(SDPBackend.MATH):
                theirs()
        except Exception as exc2:  # noqa: BLE001
            attempts["SDPBackend.MATH"] = error_reason(exc2)
            return {"unsupported": attempts, "torch": torch.__version__}
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for rep in range(warmup + reps):
        for side, fn in (("ours", ours), ("theirs", theirs)):
            comm.barrier()
            t0 = time.perf_counter()
            fn()  # theirs: the time includes context_parallel's sharding of the buffers on entry
            if rep >= warmup:
                times[side].append(time.perf_counter() - t0)
    return {"times": times, "attempts": attempts, "torch": torch.__version__}


def torch_cp_row(quick: bool, seq_len: int, warmup: int, reps: int) -> dict[str, Any]:
    from workbench import launch

    cp = 2
    per_rank = list(launch(_torch_cp_rank, cp, seq_len, warmup, reps, device="cpu", timeout=LAUNCH_TIMEOUT_S))
    config = {**_common_config(cp, seq_len, warmup, reps),
              "reference_impl": "torch.distributed.tensor.experimental.context_parallel(DeviceMesh('cpu', (2,))) + "
                                "F.scaled_dot_product_attention(is_causal=True)", "torch": per_rank[0]["torch"]}
    if "unsupported" in per_rank[0]:
        reasons = per_rank[0]["unsupported"]
        return {"benchmark": "cp_vs_torch_context_parallel", "status": "unsupported",
                "reason": f"torch {per_rank[0]['torch']} context_parallel on CPU/gloo: "
                          f"{reasons['default SDPA backend']}",
                "ours": None, "reference": None, "ratio": None, "unit": None,
                "config": {**config, "attempts": reasons}}
    slowest = {s: [max(r["times"][s][i] for r in per_rank) for i in range(reps)] for s in ("ours", "theirs")}
    ours, theirs = statistics.median(slowest["ours"]), statistics.median(slowest["theirs"])
    return {"benchmark": "cp_vs_torch_context_parallel", "ours": ours, "reference": theirs, "ratio": ours / theirs,
            "unit": "s per forward+backward (ring_attention vs torch context_parallel, slowest rank)",
            "config": {**config, "lower_is_better": True, "goal": "ratio <= 1.0", "attempts": per_rank[0]["attempts"],
                       "spread_ours_s": [min(slowest["ours"]), max(slowest["ours"])],
                       "spread_theirs_s": [min(slowest["theirs"]), max(slowest["theirs"])]}}


def rows(quick: bool) -> list[dict[str, Any]]:
    from workbench import launch

    seq_len = SEQ_LEN[quick]
    warmup, reps = (1, 7) if quick else (2, 9)
    out: list[dict[str, Any]] = []
    balance: list[dict[str, Any]] = []
    for cp in CPS:
        per_rank = list(launch(_rank, cp, seq_len, warmup, reps, device="cpu", timeout=LAUNCH_TIMEOUT_S))
        out.append(allgather_row(per_rank, cp, seq_len, warmup, reps))
        balance.append(balance_row(per_rank, cp, seq_len, warmup, reps))
    return out + balance + [torch_cp_row(quick, seq_len, warmup, reps)]


if __name__ == "__main__":
    import json

    t_start = time.time()
    print(json.dumps(rows(quick="--full" not in sys.argv), indent=2, default=str))
    print(f"({time.time() - t_start:.1f} s)", file=sys.stderr)
