"""Reference solution of lab 09 (labs/09_choose_a_configuration.ipynb): choose a 3D layout and defend it.

The decision guide, cheapest first (Narayanan et al. 2021 §3.3 "Takeaways"; Rajbhandari et al. 2020 for ZeRO):

1. plain DDP if a full replica fits: no model-parallel traffic at all;
2. else ZeRO over the same replicas (stage 1, 2, then 3): shards model states, stage 3 for 1.5x DP's bytes;
3. else tensor parallelism inside a node, with sequence parallelism and ZeRO-1: splits weights *and*
   activations, but all-reduces in every layer, so it stays on NVLink (tp <= GPUs per node);
4. else pipeline stages across nodes, tp = a whole node: one activation per micro-batch crosses the slow link;
   ZeRO-1 at most (ZeRO-2/3 would move gradients or parameters once per micro-batch);
5. last, ZeRO-3 under tensor parallelism (FSDP + TP): it gathers every parameter twice a step across nodes.

One sequence per micro-batch (microbatches = global_batch / dp) keeps activations smallest and, with a
pipeline, the bubble (p−1)/(m+p−1) smallest. The defence quotes the numbers that decided.
"""

from __future__ import annotations

from typing import Any

from workbench.labs.choose_configuration import Cluster, ddp_baseline, evaluate

#: A layout of the tiny GPT (2 layers, 2 heads) for 4 gloo ranks: one tensor-parallel pair per pipeline stage.
SMALL_LAYOUT = {"dp": 1, "tp": 2, "pp": 2, "zero": 0, "sp": False, "schedule": "1f1b", "microbatches": 2}


def _candidates(model: dict, cluster: Cluster) -> list[dict[str, Any]]:
    n, gpn = cluster.nproc, cluster.gpus_per_node
    tps = [t for t in (2, 4, 8, 16, 32, 64) if t <= gpn and model["n_head"] % t == 0 and n % t == 0]
    out = [dict(tp=1, pp=1, zero=z, sp=False) for z in (0, 1, 2, 3)]
    out += [dict(tp=t, pp=1, zero=1, sp=True) for t in tps]
    if tps:  # a whole node of tp, stages across nodes
        out += [dict(tp=tps[-1], pp=p, zero=1, sp=True) for p in (2, 4, 8, 16, 32)
                if n % (tps[-1] * p) == 0 and p <= model["n_layer"]]
    out += [dict(tp=t, pp=1, zero=3, sp=True) for t in tps]  # last: 1.5x DP's bytes, every step, across nodes
    return out


def _layout(candidate: dict[str, Any], n: int, global_batch: int) -> dict[str, Any] | None:
    dp = n // (candidate["tp"] * candidate["pp"])
    if global_batch % dp or (dp == 1 and candidate["zero"] > 0):
        return None  # the batch does not split over the replicas; ZeRO needs replicas to shard over
    m = global_batch // dp
    if m < candidate["pp"]:
        return None
    return dict(candidate, dp=dp, schedule="1f1b", microbatches=m)


def choose_configuration(model: dict, cluster: Cluster, global_batch: int) -> tuple[dict, dict[str, str]]:
    """The first layout of the decision guide that fits, with one reason per axis."""
    for candidate in _candidates(model, cluster):
        layout = _layout(candidate, cluster.nproc, global_batch)
        if layout is None:
            continue
        result = evaluate(model, cluster, global_batch, layout)
        if result["fits"]:
            return layout, _defence(model, cluster, global_batch, layout, result)
    raise ValueError(f"no layout of the decision guide fits {model['name']} on {cluster.describe()}")


def _defence(model: dict, cluster: Cluster, global_batch: int, layout: dict, result: dict) -> dict[str, str]:
    ddp = ddp_baseline(model, cluster, global_batch)
    ddp_gib = f"{ddp['total_gib']:.0f} GiB" if ddp else "more than a GPU holds"
    gib, cap = result["total_gib"], cluster.gpu_gb
    dp, tp, pp, zero = layout["dp"], layout["tp"], layout["pp"], layout["zero"]
    if tp == pp == 1 and zero == 0:
        why_dp = f"dp={dp}: every GPU is a full replica; plain DDP needs {gib:.1f} GiB of {cap:g}, so nothing is split"
    elif tp == pp == 1:
        why_dp = (f"dp={dp} with ZeRO-{zero}: DDP would need {ddp_gib} per GPU; sharding the model states over "
                  f"{dp} replicas brings it to {gib:.1f} GiB of {cap:g} without splitting a layer")
    else:
        dp_comm = result["comm"]["dp"]
        why_dp = (f"dp={dp} replicas with ZeRO-{zero} use the GPUs that tp x pp = {tp * pp} leave; data parallelism "
                  f"moves gradients once per step ({dp_comm['time_s']:.2f} s on {dp_comm['link']})")
    if tp == 1:
        why_tp = f"tp=1: the layers fit whole ({gib:.1f} GiB of {cap:g}), so no all-reduces in every layer"
    else:
        why_tp = (f"tp={tp} divides the {model['n_head']} heads and stays inside a node of {cluster.gpus_per_node}: "
                  f"its per-layer collectives ({result['comm']['tp']['time_s']:.2f} s per step) run on NVLink; with "
                  f"SP it also splits activations to {result['per_rank_gib'].get('activations', 0):.1f} GiB")
    if pp == 1:
        why_pp = "pp=1: memory fits without cutting the model into stages, so there is no pipeline bubble"
    else:
        why_pp = (f"pp={pp} stages across nodes only send one activation per micro-batch over InfiniBand; "
                  f"m={layout['microbatches']} micro-batches keep the bubble at {result['bubble']:.1%}")
    return {"dp": why_dp, "tp": why_tp, "pp": why_pp}
