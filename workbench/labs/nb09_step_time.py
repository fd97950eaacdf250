"""Notebook 09's exercise: a layout's estimated step time, composed from its parts.

``theory.step_time`` ranks 3D layouts by one formula (Narayanan et al. 2021 price layouts the same way, §3):

    step = (compute × recompute factor + tp + pp) / (1 − bubble) + exposed dp

The learner writes ``estimate_step_time(problem) -> seconds`` from a ``StepProblem``: the step's FLOPs per GPU
and the throughput assumed, the recomputation mode, the mesh's group sizes, the two links of a node-based cluster,
and the traffic of each axis as (op, bytes, times per step) triples. The learner decides which link each axis
crosses (tp varies fastest in the rank order, so tp is the last axis to leave a node), prices the traffic with
``Link.collective_time``, applies the recomputation factor, stretches the busy time by the pipeline bubble and
hides data-parallel traffic behind compute where there is no pipeline.

``check_step_time(fn)`` grades it against ``theory.step_time.step_time`` on layouts of *another* model and
cluster than the notebook prints (Llama-2-13B's shape on 4 nodes of 8 H100 with 200 Gb/s NICs): TP inside a node,
FSDP with full recomputation, HSDP, a pipeline across nodes. Each classic mistake (recomputation forgotten, TP
priced on the slow link, overlap ignored, the bubble forgotten or added instead of stretched, ...) gets its own
message. ``step_problem`` builds the problem of any ``Candidate``, so the notebook can rank its own layouts with
the learner's function. The reference solution is ``labs/solutions/nb09_step_time.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from workbench.labs import LabCheckFailed, show_hint
from workbench.theory.comm import Link, dp_step_collectives
from workbench.theory.models import resolve_preset
from workbench.theory.parallelism import INFINIBAND, NVLINK, Layout, layout_comm, stage_params
from workbench.theory.step_time import (
    DEFAULT_MFU,
    H100_BF16_PEAK,
    Candidate,
    node_links,
    recompute_factor,
    step_time,
)

MORE = " (more help: hint(1), hint(2), hint(3))"
MESH_ORDER = ("tp", "dp", "replicate", "pp")  # the rank order, fastest-varying first (cp = 1 in this exercise)
REL_TOL = 1e-6  # the same arithmetic in another order differs by rounding only (~1e-15)

# The checker's cluster: 4 nodes of 8 H100, NVLink inside a node, one 200 Gb/s NIC per GPU between nodes (half the
# notebook's 400 Gb/s), so the numbers are not the notebook's.
CHECK_MODEL, CHECK_GLOBAL_BATCH, CHECK_PER_NODE = "llama-13B", 64, 8
CHECK_INTER = Link(alpha=10e-6, bandwidth=25e9, name="InfiniBand 200 Gb/s (25 GB/s)")


@dataclass(frozen=True)
class StepProblem:
    """What one optimizer step of a layout costs, in the pieces ``estimate_step_time`` composes.

    ``sizes``: group size of each mesh axis, in the rank order "tp" (fastest), "dp" (ZeRO's shard group),
    "replicate" (HSDP's copies; 1 otherwise), "pp". ``traffic``: per axis, (op, S bytes, times per step) for the
    stage where that axis moves the most; recomputation's repeated collectives and FSDP's per-micro-batch
    gathers are already in the counts. Price each with ``link.collective_time(op, S, sizes[axis])``.
    """

    name: str
    flops: float  # the model's FLOPs per GPU per step without recomputation: 6·Ψ·tokens / GPUs
    flops_per_s: float  # the throughput assumed per GPU (peak × MFU): an assumption, not a measurement
    recompute: str  # "none", "selective" or "full"
    selective_factor: float  # what selective recomputation costs for this model: 1 + attention core / 3 passes
    sizes: Mapping[str, int]
    microbatches: int  # per pipeline and step; the schedule is 1F1B (or GPipe: the same bubble)
    gpus_per_node: int
    intra: Link  # the link inside a node (NVLink)
    inter: Link  # the link between nodes (InfiniBand)
    overlap: float  # the fraction of compute that data-parallel traffic can hide behind, where it can hide
    traffic: Mapping[str, tuple[tuple[str, float, int], ...]] = field(default_factory=dict)


HINTS = {
    1: "A step is (compute × the recomputation factor + tp + pp) / (1 − bubble) + the dp traffic compute does "
       "not hide. TP's and PP's messages sit between the matmuls, so they add to the busy time, which the bubble "
       "stretches. DP's (and HSDP's replicate) traffic hides behind compute when there is no pipeline (pp = 1); "
       "this package's pipeline reduces after the schedule, so with pp > 1 it is exposed whole. Each axis is "
       "priced on the link it crosses: an axis stays inside a node while its groups fit in one.",
    2: "factor: none 1, selective problem.selective_factor, full 4/3 (the forward, one of three passes, runs "
       "twice). compute = flops / flops_per_s × factor. Reach of each axis, in the rank order: tp, tp·dp, "
       "tp·dp·replicate, tp·dp·replicate·pp; intra if the reach ≤ gpus_per_node, else inter. An axis's seconds: "
       "sum of link.collective_time(op, S, sizes[axis]) × n over its traffic. bubble = (p−1)/(m+p−1). "
       "dp = dp's seconds + replicate's; exposed = dp if pp > 1 else max(0, dp − overlap × compute).",
    3: "def estimate_step_time(problem):\n"
       "    factor = {'none': 1.0, 'selective': problem.selective_factor, 'full': 4 / 3}[problem.recompute]\n"
       "    compute = problem.flops / problem.flops_per_s * factor\n"
       "    reach, link = 1, {}\n"
       "    for axis in ('tp', 'dp', 'replicate', 'pp'):\n"
       "        reach *= problem.sizes[axis]\n"
       "        link[axis] = problem.intra if reach <= problem.gpus_per_node else problem.inter\n"
       "    def seconds(axis):\n"
       "        return sum(link[axis].collective_time(op, s, problem.sizes[axis]) * n\n"
       "                   for op, s, n in problem.traffic[axis])\n"
       "    p, m = problem.sizes['pp'], problem.microbatches\n"
       "    busy = compute + seconds('tp') + seconds('pp')\n"
       "    dp = seconds('dp') + seconds('replicate')\n"
       "    exposed = ...  # whole with a pipeline, else what overlap × compute does not hide\n"
       "    return busy / (1 - (p - 1) / (m + p - 1)) + exposed",
}


def hint(level: int = 1) -> str:
    """Print (and return) hint ``level`` (1: the idea, 2: the pieces, 3: nearly the code)."""
    return show_hint(HINTS, level)


# -- building a problem from a Candidate -------------------------------------------------------------------------

def _merged(ops: list[tuple[str, float]], times: Callable[[str], int]) -> tuple[tuple[str, float, int], ...]:
    counted: dict[tuple[str, float], int] = {}
    for op, size in ops:
        counted[(op, size)] = counted.get((op, size), 0) + times(op)
    return tuple((op, size, n) for (op, size), n in counted.items() if n)


def _dp_traffic(params: float, candidate: Candidate, precision: str) -> dict[str, tuple[tuple[str, float, int], ...]]:
    """One stage's dp and replicate traffic per step, counted as ``theory.step_time`` counts it: ZeRO-3's gathers and
    reduce-scatter and ZeRO-2's reduce-scatter once per micro-batch (FSDP reshards between micro-batches), the rest
    once per step; HSDP's all-reduce of the gradient shard across the replicas once per micro-batch."""
    lay, p = candidate.layout, 4 if precision == "fp32" else 2
    m = lay.microbatches

    def times(op: str) -> int:
        return m if lay.zero_stage == 3 or (lay.zero_stage == 2 and op == "reduce_scatter") else 1

    dp = _merged(dp_step_collectives(params, p, lay.zero_stage), times) if lay.shard_group > 1 else ()
    replicate = (("all_reduce", params * p / lay.shard_group, m),) if candidate.replicate > 1 else ()
    return {"dp": dp, "replicate": replicate}


def _seconds(ops: tuple[tuple[str, float, int], ...], link: Link, world: int) -> float:
    return sum(link.collective_time(op, size, world) * n for op, size, n in ops)


def step_problem(model: str | dict, candidate: Candidate, global_batch: int, seq_len: int | None = None,
                 precision: str = "bf16-mixed", gpus_per_node: int = 8, intra: Link = NVLINK,
                 inter: Link = INFINIBAND, peak_flops: float = H100_BF16_PEAK, mfu: float = DEFAULT_MFU,
                 overlap: float = 1.0) -> StepProblem:
    """The ``StepProblem`` of ``candidate`` (no context parallelism, a 1F1B or GPipe schedule), from the same
    theory ``step_time`` uses: ``layout_comm`` for tp and pp on ``node_links``, ``dp_step_collectives`` for dp."""
    lay = candidate.layout
    if lay.cp != 1 or lay.virtual_stages != 1 or lay.schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"{candidate.name}: the exercise prices cp = 1 and a 1f1b or gpipe schedule without "
                         f"virtual stages; got cp={lay.cp}, schedule={lay.schedule!r}, "
                         f"virtual_stages={lay.virtual_stages}")
    shape = resolve_preset(model)
    s = seq_len or shape["seq_len"]
    links = node_links(candidate, gpus_per_node, intra, inter)
    step_time(shape, candidate, global_batch, s, precision, links, peak_flops, mfu, overlap)  # validates the inputs
    comm = layout_comm(shape, lay, precision, candidate.micro_batch, s, candidate.recompute, links)
    traffic = {axis: tuple((op, float(size), int(n)) for op, size, n in comm[axis]["ops"]) for axis in ("tp", "pp")}
    stages = [_dp_traffic(info["params"], candidate, precision)
              for info in stage_params(shape, lay.tp, lay.pp, lay.virtual_stages)]
    sizes = {"tp": lay.tp, "dp": lay.shard_group, "replicate": candidate.replicate, "pp": lay.pp}
    traffic.update(max(stages, key=lambda t: _seconds(t["dp"], links["dp"], sizes["dp"])
                       + _seconds(t["replicate"], links["replicate"], sizes["replicate"])))
    return StepProblem(name=candidate.name, flops=6 * shape["n_params"] * global_batch * s / candidate.nproc,
                       flops_per_s=peak_flops * mfu, recompute=candidate.recompute,
                       selective_factor=recompute_factor(shape, "selective", s), sizes=sizes,
                       microbatches=lay.microbatches, gpus_per_node=gpus_per_node, intra=intra, inter=inter,
                       overlap=overlap, traffic=traffic)


# -- the model, and its classic mistakes -------------------------------------------------------------------------

def _compose(pb: StepProblem, **wrong: bool) -> float:
    """The step time of ``pb``; each ``wrong`` flag plants one mistake (``MISTAKES`` names them)."""
    factor = {"none": 1.0, "selective": pb.selective_factor, "full": 2.0 if wrong.get("full_twice") else 4 / 3}
    compute = pb.flops / pb.flops_per_s * (1.0 if wrong.get("no_factor") else factor[pb.recompute])
    reach, link = 1, {}
    for axis in MESH_ORDER:
        reach *= pb.sizes[axis]
        link[axis] = pb.intra if reach <= pb.gpus_per_node else pb.inter
    if wrong.get("tp_slow"):
        link["tp"] = pb.inter
    if wrong.get("all_fast"):
        link = dict.fromkeys(MESH_ORDER, pb.intra)

    def seconds(axis: str) -> float:
        ops = pb.traffic.get(axis, ())
        if wrong.get("once"):
            ops = tuple((op, size, 1) for op, size, _ in ops)
        return _seconds(ops, link[axis], pb.sizes[axis])

    tp = seconds("tp") * (factor[pb.recompute] if wrong.get("tp_factor") else 1.0)
    busy = compute + tp + seconds("pp")
    dp = seconds("dp") + (0.0 if wrong.get("no_replicate") else seconds("replicate"))
    p, m = pb.sizes["pp"], pb.microbatches
    bubble = 0.0 if wrong.get("no_bubble") else (p - 1) / (m + p - 1)
    overlap = 1.0 if wrong.get("full_overlap") else pb.overlap
    hides = p == 1 or wrong.get("hidden_under_pp")
    exposed = dp if wrong.get("no_overlap") or not hides else max(0.0, dp - overlap * compute)
    if wrong.get("bubble_added"):
        return busy * (1 + bubble) + exposed
    if wrong.get("dp_stretched"):
        return (busy + exposed) / (1 - bubble)
    return busy / (1 - bubble) + exposed


MISTAKES = {  # flag: the message (the checker tries them in this order)
    "no_factor": "the recomputation factor is missing: under recomputation the step runs more than its 6·Ψ·tokens "
                 "FLOPs (full: × 4/3; selective: × problem.selective_factor)",
    "full_twice": "full recomputation priced at 2×: it reruns the forward only, one of the three passes "
                  "(forward F, backward 2F), so 4F/3F = 4/3",
    "tp_factor": "TP's traffic multiplied by the recomputation factor: the factor is compute's; problem.traffic "
                 "already counts the collectives recomputation repeats (the forward's twice under full)",
    "tp_slow": "TP priced on the slow link: tp varies fastest in the rank order, so a tp group of up to "
               "gpus_per_node ranks sits inside a node, on problem.intra",
    "all_fast": "every axis priced on the fast link: an axis whose groups reach past gpus_per_node ranks "
                "(tp·dp·... in the rank order) crosses nodes, on problem.inter",
    "once": "each collective counted once: the third number of a traffic entry is how many times per step it "
            "runs (per layer and micro-batch for TP; per micro-batch for FSDP's gathers)",
    "no_replicate": "HSDP's replicate traffic is missing: the gradient shard is all-reduced across the replicas "
                    "(traffic['replicate'], on the link the replicate axis crosses), with the dp traffic",
    "no_overlap": "the overlap is ignored: without a pipeline, dp traffic runs during backward and forward, and "
                  "only what exceeds overlap × compute is exposed",
    "full_overlap": "problem.overlap is ignored: only that fraction of the compute can hide dp traffic",
    "hidden_under_pp": "dp traffic hidden behind compute under a pipeline: this package's pipeline reduces after "
                       "the schedule, so with pp > 1 the dp traffic is exposed whole",
    "no_bubble": "the pipeline bubble is missing: with p stages and m micro-batches each rank idles "
                 "(p−1)/(m+p−1) of the step",
    "bubble_added": "the bubble added as a fraction of the busy time: it is a fraction of the step, so the step "
                    "is busy / (1 − bubble), not busy × (1 + bubble)",
    "dp_stretched": "the exposed dp traffic stretched by the bubble: it runs after the schedule, once, and adds "
                    "to the step as it is",
}


def _cases() -> list[tuple[str, Candidate, float]]:
    """The checker's layouts (description, candidate, overlap), on Llama-2-13B's shape: 40 layers, d = 5120."""
    L = Layout
    return [
        ("TP inside a node", Candidate("TP=8 in a node, ZeRO-1, selective recompute",
                                       L(dp=4, tp=8, zero_stage=1, microbatches=16), 1, "selective"), 1.0),
        ("FSDP + full recompute", Candidate("ZeRO-3 over 32, full recompute",
                                            L(dp=32, zero_stage=3, microbatches=2), 1, "full"), 0.6),
        ("HSDP", Candidate("HSDP shard 8 x 4 replicas, full recompute", L(dp=8, zero_stage=3, microbatches=2),
                           1, "full", replicate=4), 0.25),
        ("PP across nodes", Candidate("TP=8 in a node, DP=2 and PP=2 across nodes, full recompute",
                                      L(dp=2, tp=8, pp=2, zero_stage=1, microbatches=8), 4, "full"), 1.0),
    ]


def check_problems() -> list[tuple[str, StepProblem, float]]:
    """(what, problem, ``theory.step_time``'s total seconds) of each layout the checker grades."""
    out = []
    for what, c, overlap in _cases():
        kwargs = {"gpus_per_node": CHECK_PER_NODE, "inter": CHECK_INTER, "overlap": overlap}
        problem = step_problem(CHECK_MODEL, c, CHECK_GLOBAL_BATCH, **kwargs)
        links = node_links(c, CHECK_PER_NODE, NVLINK, CHECK_INTER)
        want = step_time(CHECK_MODEL, c, CHECK_GLOBAL_BATCH, links=links, overlap=overlap)["total_s"]
        out.append((what, problem, want))
    return out


def _as_seconds(out: Any, what: str) -> float:
    if isinstance(out, bool) or not isinstance(out, int | float) or not math.isfinite(out):
        raise LabCheckFailed(f"on {what}: return the step's seconds as one number, got {out!r}" + MORE)
    return float(out)


def _call(fn: Callable[[StepProblem], float], what: str, problem: StepProblem) -> float:
    try:
        out = fn(problem)
    except NotImplementedError as error:
        raise LabCheckFailed(f"estimate_step_time is still the stub ({error}): write it, then run this cell "
                             "again" + MORE) from None
    except Exception as error:  # noqa: BLE001 -- explained to the learner
        raise LabCheckFailed(f"estimate_step_time raised {type(error).__name__}: {error} (on {what}, "
                             f"{problem.name})" + MORE) from None
    return _as_seconds(out, what)


def _diagnose(got: list[float], cases: list[tuple[str, StepProblem, float]]) -> str:
    """The planted mistake that gives the learner's number on *every* layout (one layout alone can leave several
    mistakes at the same number: with dp fully hidden, forgetting any of its terms changes nothing), named on the
    first layout where it shows; else what the first wrong layout was."""
    wrong = [(g, c) for g, c in zip(got, cases, strict=True) if not math.isclose(g, c[2], rel_tol=REL_TOL)]
    first_got, (what, problem, want) = wrong[0]
    if all(math.isclose(g, 1e3 * c[2], rel_tol=REL_TOL) for g, c in wrong):
        return f"on {what}: returned milliseconds: return seconds"
    for flag, message in MISTAKES.items():
        planted = [_compose(pb, **{flag: True}) for _, pb, _ in cases]
        if all(math.isclose(g, p, rel_tol=REL_TOL) for g, p in zip(got, planted, strict=True)):
            return f"on {what} ({problem.name}): {message}."
    return (f"on {what} ({problem.name}: sizes {dict(problem.sizes)}, {problem.microbatches} micro-batches, "
            f"{problem.recompute} recompute, overlap {problem.overlap}) you returned {first_got:.6g} s; the model "
            "gives another number")


def check_step_time(fn: Callable[[StepProblem], float]) -> dict[str, float]:
    """Raise ``LabCheckFailed`` naming the mistake, or print the checker's layouts ranked by your estimate and
    return {layout name: seconds}."""
    if not callable(fn):
        raise LabCheckFailed(f"check_step_time wants your function estimate_step_time, got {fn!r}")
    cases = check_problems()
    got = [_call(fn, what, problem) for what, problem, _ in cases]
    if not all(math.isclose(g, want, rel_tol=REL_TOL) for g, (_, _, want) in zip(got, cases, strict=True)):
        raise LabCheckFailed(_diagnose(got, cases) + MORE)
    rows = sorted(((problem.name, g) for g, (_, problem, _) in zip(got, cases, strict=True)), key=lambda r: r[1])
    print(f"✓ your estimate is theory.step_time's on {len(rows)} layouts of {CHECK_MODEL} (Llama-2-13B's shape), "
          f"{CHECK_GLOBAL_BATCH} sequences of 4096 tokens on 4 nodes of 8 H100, {CHECK_INTER.name} between "
          "nodes. Fastest first:\n  " + "\n  ".join(f"{name:60s} {s:6.2f} s" for name, s in rows))
    return dict(rows)


__all__ = ["CHECK_MODEL", "HINTS", "MISTAKES", "StepProblem", "check_problems", "check_step_time", "hint",
           "step_problem"]
