"""Lab 09: choose a (dp, tp, pp) layout for a model on a cluster, and defend it.

The learner writes ``choose_configuration(model, cluster, global_batch) -> (layout, defence)``:

- ``model``: a preset of ``workbench.theory.models`` (a dict: n_params, n_layer, d_model, n_head, vocab_size,
  seq_len, arch; plus "name");
- ``cluster``: a ``Cluster`` (nodes, GPUs per node, GPU memory in GiB, the intra- and inter-node links);
- ``global_batch``: sequences of ``model["seq_len"]`` tokens per optimizer step, fixed by the optimizer;
- ``layout``: {"dp", "tp", "pp", "zero", "sp", "schedule", "microbatches"} ("virtual_stages" optional), the
  flags of ``workbench run``. ``microbatches`` are per dp replica per step (with pp = 1, gradient accumulation),
  so one micro-batch holds global_batch / (dp · microbatches) sequences;
- ``defence``: {"dp": why, "tp": why, "pp": why}, one sentence per axis (other keys welcome).

Training is fixed: bf16 mixed precision, AdamW, selective activation recomputation (Korthikanti et al. 2022 §5;
what FlashAttention gives for free). ``evaluate`` prices a layout with ``theory.parallelism.analyze_layout``:
memory of the worst pipeline rank, the schedule's bubble and an α-β time of each axis's traffic on the link the
axis really uses (Megatron's rank order, tp fastest: an axis stays on NVLink while its groups fit in a node).

``check(fn)`` runs the scenarios in ``SCENARIOS`` and fails, with a message pointed at the mistake, when a
layout does not use every GPU, splits heads unevenly, stretches tp across nodes (it says what that costs per
layer), does not fit in memory (by how much, which category dominates), leaves a bubble above the bound (how
many micro-batches would do), splits a model that plain DDP trains (the DDP figure), or is not defended on every
axis. ``check_on_ranks(layout)`` runs a small layout of the tiny GPT on ≤ 4 gloo ranks against one process.
``hint(1)``, ``hint(2)``, ``hint(3)``: more detail at each tier.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from workbench.labs import LabCheckFailed, show_hint
from workbench.theory.comm import sp_block_collectives, tp_block_collectives
from workbench.theory.memory import to_unit
from workbench.theory.models import MODEL_PRESETS, gpt_param_count
from workbench.theory.parallelism import INFINIBAND, NVLINK, Layout, Link, analyze_layout, micro_batch_size
from workbench.theory.pipeline import bubble_fraction

PRECISION = "bf16-mixed"
OPTIMIZER = "adamw"
RECOMPUTE = "selective"
#: The largest idle share of a pipeline accepted: beyond it, more micro-batches (or fewer stages) are cheaper.
MAX_BUBBLE = 0.10
#: Loss of the same global batch, one process vs N ranks (tests/test_train_cli.py's bound). Relative to the loss,
#: so it holds on any CPU: the ranks add the same terms in another order (and so does another SIMD width), and a
#: few AdamW steps carry that float32 rounding (eps ≈ 1.2e-7) nowhere near 2e-4 of the loss, while a mistake (a
#: batch shard left out, a stage or shard never updated) moves it by far more.
LOSS_RTOL = 2e-4
MAX_SMALL_RANKS = 4
LAYOUT_KEYS = ("dp", "tp", "pp", "zero", "sp", "schedule", "microbatches")
AXES = ("dp", "tp", "pp")
MIN_REASON_WORDS = 4


@dataclass(frozen=True)
class Cluster:
    """``nodes`` × ``gpus_per_node`` GPUs of ``gpu_gb`` GiB; ``intra_node`` links GPUs of a node (NVLink),
    ``inter_node`` the nodes (one InfiniBand NIC per GPU)."""

    nodes: int
    gpus_per_node: int
    gpu_gb: float
    intra_node: Link = NVLINK
    inter_node: Link = INFINIBAND

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not (isinstance(self.gpu_gb, int | float) and self.gpu_gb > 0):
            raise ValueError(f"gpu_gb must be > 0 GiB, got {self.gpu_gb!r}")

    @property
    def nproc(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return f"{self.nodes} node(s) x {self.gpus_per_node} GPUs of {self.gpu_gb:g} GiB"


def _gpt(name: str, n_layer: int, d_model: int, n_head: int, vocab_size: int, seq_len: int) -> dict:
    """A GPT-shaped preset (our block: LayerNorm, biases, learned positions, tied head) of any size."""
    return {"name": name, "n_layer": n_layer, "d_model": d_model, "n_head": n_head, "vocab_size": vocab_size,
            "seq_len": seq_len, "dropout": False, "exact": True, "arch": "gpt",
            "n_params": gpt_param_count(n_layer, d_model, vocab_size, seq_len)}


def preset(name: str) -> dict:
    """A model of ``theory.models.MODEL_PRESETS`` as the dict ``choose_configuration`` receives (with "name")."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(sorted(MODEL_PRESETS))}")
    return {"name": name, **MODEL_PRESETS[name]}


#: GPT-3 XL's shape (Brown et al. 2020, Table 2.1): 24 layers, d = 2048, 16 heads, 2048 tokens; 1.3B parameters.
GPT_1_3B = _gpt("gpt-1.3B", 24, 2048, 16, 50304, 2048)


@dataclass(frozen=True)
class Scenario:
    name: str
    model: dict
    cluster: Cluster
    global_batch: int
    max_bubble: float = MAX_BUBBLE
    notes: str = field(default="", compare=False)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("gpt-1.3B on one node", GPT_1_3B, Cluster(1, 8, 80), 64, notes="a model that fits"),
    Scenario("llama-13B on one node of 40 GiB GPUs", preset("llama-13B"), Cluster(1, 8, 40), 64,
             notes="memory-tight"),
    Scenario("llama-13B on 8 nodes", preset("llama-13B"), Cluster(8, 8, 80), 512),
    Scenario("llama-70B on 8 nodes", preset("llama-70B"), Cluster(8, 8, 80), 512),
)

HINTS = {
    1: "Walk the decision guide, cheapest first: does plain DDP fit (every GPU a full replica)? Then DDP. If "
       "not, ZeRO shards the model states over the replicas (stages 1, 2, 3: more memory saved, stage 3 for 1.5x "
       "the traffic). If even that does not fit, split the layers with tensor parallelism inside a node (its "
       "all-reduces run in every layer, so they need NVLink), and if that is still not enough, cut the model "
       "into pipeline stages across nodes (one activation per micro-batch crosses the slow link). "
       "evaluate(model, cluster, global_batch, layout) prices any candidate: use it to try them in that order.",
    2: "Generate candidates in the guide's order and return the first that evaluate() says fits: (1) tp=pp=1, "
       "zero 0, 1, 2, 3; (2) tp in 2, 4, ... up to gpus_per_node (dividing n_head), sp=True, zero 1; (3) tp = "
       "gpus_per_node, pp in 2, 4, ... (dividing nproc / tp), sp=True, zero 1 (ZeRO-2/3 do not compose with pp); "
       "(4) last, tp with ZeRO-3. dp is always nproc / (tp * pp), and ZeRO needs dp > 1. Use one sequence per "
       "micro-batch, microbatches = global_batch // dp: the least activation memory and, with pp > 1, the "
       "smallest bubble (p-1)/(m+p-1). Write each reason from the numbers evaluate() returns (memory, the DDP "
       "figure from ddp_baseline(), the bubble, the traffic and its link).",
    3: "def choose_configuration(model, cluster, global_batch):\n"
       "    n, gpn = cluster.nproc, cluster.gpus_per_node\n"
       "    tps = [t for t in (2, 4, 8, 16) if t <= gpn and model['n_head'] % t == 0]\n"
       "    cands = [dict(tp=1, pp=1, zero=z, sp=False) for z in (0, 1, 2, 3)]\n"
       "    cands += [dict(tp=t, pp=1, zero=1, sp=True) for t in tps]\n"
       "    cands += [dict(tp=tps[-1], pp=p, zero=1, sp=True) for p in (2, 4, 8) if n % (tps[-1] * p) == 0]\n"
       "    cands += [dict(tp=t, pp=1, zero=3, sp=True) for t in tps]\n"
       "    for c in cands:\n"
       "        dp = n // (c['tp'] * c['pp'])\n"
       "        layout = dict(c, dp=dp, zero=c['zero'] if dp > 1 else 0, schedule='1f1b',\n"
       "                      microbatches=global_batch // dp)\n"
       "        result = evaluate(model, cluster, global_batch, layout)\n"
       "        if result['fits']:\n"
       "            return layout, {'dp': ..., 'tp': ..., 'pp': ...}  # a sentence each, with the numbers",
}


def hint(level: int = 1) -> str:
    """Print (and return) the hint of tier ``level``: 1 the idea, 2 the shape, 3 nearly the code."""
    return show_hint(HINTS, level)


# ---------------------------------------------------------------------------------------------------------
# Pricing a layout.


def as_layout(layout: Any) -> Layout:
    """The learner's dict (or a ``theory.parallelism.Layout``) as a Layout; LabCheckFailed naming what is missing."""
    if isinstance(layout, Layout):
        return layout
    if not isinstance(layout, Mapping):
        raise LabCheckFailed(f"the layout should be a dict with keys {', '.join(LAYOUT_KEYS)}; got a "
                             f"{type(layout).__name__}: {layout!r}")
    missing = [k for k in LAYOUT_KEYS if k not in layout]
    if missing:
        raise LabCheckFailed(f"the layout {dict(layout)} lacks {', '.join(map(repr, missing))}: give all of "
                             f"{', '.join(LAYOUT_KEYS)} (pp = 1 still needs schedule '1f1b' and microbatches, the "
                             "gradient-accumulation steps)")
    unknown = sorted(set(layout) - set(LAYOUT_KEYS) - {"virtual_stages"})
    if unknown:
        raise LabCheckFailed(f"the layout has unknown key(s) {unknown}; valid: {', '.join(LAYOUT_KEYS)}, "
                             "virtual_stages")
    return Layout(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], sp=layout["sp"], zero_stage=layout["zero"],
                  schedule=layout["schedule"], microbatches=layout["microbatches"],
                  virtual_stages=layout.get("virtual_stages", 1))


def axis_groups(layout: Layout, axis: str) -> list[list[int]]:
    """The global ranks of every group of ``axis`` under Megatron's rank order (``workbench.mesh``):
    rank = (pp_index · dp + dp_index) · tp + tp_index, tp varying fastest."""
    sizes = {"pp": layout.pp, "dp": layout.dp, "tp": layout.tp}
    if axis not in sizes:
        raise ValueError(f"unknown axis {axis!r}; valid: {', '.join(AXES)}")
    others = [a for a in ("pp", "dp", "tp") if a != axis]
    groups = []
    for i in range(sizes[others[0]]):
        for j in range(sizes[others[1]]):
            fixed = {others[0]: i, others[1]: j}
            groups.append([((c["pp"] * layout.dp + c["dp"]) * layout.tp + c["tp"])
                           for c in ({**fixed, axis: k} for k in range(sizes[axis]))])
    return groups


def axis_spans(layout: Layout, gpus_per_node: int) -> dict[str, bool]:
    """Whether any group of each axis holds GPUs of two nodes (rank // gpus_per_node), so that its traffic
    crosses the inter-node link: with tp fastest, tp stays inside a node while it divides the node."""
    return {axis: any(len({r // gpus_per_node for r in g}) > 1 for g in axis_groups(layout, axis)) for axis in AXES}


def axis_links(layout: Layout, cluster: Cluster) -> dict[str, Link]:
    """The link each axis's traffic runs on: inter-node if its groups span nodes, else intra-node."""
    spans = axis_spans(layout, cluster.gpus_per_node)
    return {axis: cluster.inter_node if spans[axis] else cluster.intra_node for axis in AXES}


def evaluate(model: Mapping[str, Any], cluster: Cluster, global_batch: int, layout: Any) -> dict[str, Any]:
    """Theory's price of a layout: memory of the worst pipeline rank, bubble, traffic per axis on its link.

    Returns layout (a ``Layout``), micro_batch (sequences), total_gib, per_rank_gib {category: GiB}, worst_stage,
    fits, bubble, comm {axis: {time_s, tensor_bytes, link, crosses_nodes}}, and analysis (the whole
    ``analyze_layout`` result). ValueError for a layout the model cannot take (the message says why).
    """
    lay = as_layout(layout)
    b = micro_batch_size(global_batch, lay.dp, lay.microbatches)
    links = axis_links(lay, cluster)
    result = analyze_layout(dict(model), lay, PRECISION, OPTIMIZER, b, model["seq_len"], RECOMPUTE, links)
    memory = result["memory"]
    spans = axis_spans(lay, cluster.gpus_per_node)
    comm = {a: {"time_s": result["comm"][a]["time_s"], "tensor_bytes": result["comm"][a]["tensor_bytes"],
                "link": links[a].name, "crosses_nodes": spans[a]} for a in AXES}
    total = to_unit(memory["total"], "GiB")
    return {"layout": lay, "micro_batch": b, "total_gib": total, "worst_stage": memory["worst"],
            "per_rank_gib": {k: to_unit(v, "GiB") for k, v in memory["per_rank"].items()},
            "fits": total <= cluster.gpu_gb, "bubble": result["bubble"], "comm": comm, "analysis": result}


def ddp_baseline(model: Mapping[str, Any], cluster: Cluster, global_batch: int) -> dict[str, Any] | None:
    """Plain DDP with one sequence per micro-batch: every GPU a full replica. None when the batch cannot be
    split over every GPU."""
    n = cluster.nproc
    if global_batch % n:
        return None
    return evaluate(model, cluster, global_batch, Layout(dp=n, microbatches=global_batch // n))


def describe(layout: Layout) -> str:
    parts = [f"dp={layout.dp}", f"tp={layout.tp}", f"pp={layout.pp}", f"ZeRO-{layout.zero_stage}"]
    parts += ["SP"] if layout.sp else []
    parts += [f"{layout.schedule} m={layout.microbatches}" if layout.pp > 1 else f"m={layout.microbatches}"]
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------------------
# The checker.


def check(fn: Callable[..., Any], scenarios: tuple[Scenario, ...] = SCENARIOS) -> list[dict[str, Any]]:
    """Call ``fn(model, cluster, global_batch)`` for every scenario, check each layout and its defence; raise
    ``LabCheckFailed`` at the first mistake, else print each choice with its numbers and return them."""
    if not callable(fn):
        raise LabCheckFailed(f"check() wants your function choose_configuration(model, cluster, global_batch), "
                             f"got {fn!r}")
    chosen = []
    for scenario in scenarios:
        layout, defence = _call(fn, scenario)
        result = check_layout(scenario, layout)
        check_defence(scenario, result["layout"], defence)
        chosen.append({"scenario": scenario.name, **result, "defence": dict(defence)})
        print(f"✓ {scenario.name} ({scenario.cluster.describe()}, global batch {scenario.global_batch}): "
              f"{describe(result['layout'])}, micro-batch {result['micro_batch']}: {result['total_gib']:.1f} GiB of "
              f"{scenario.cluster.gpu_gb:g}, bubble {result['bubble']:.1%}, traffic per step "
              + ", ".join(f"{a} {result['comm'][a]['time_s']:.2f} s" for a in AXES))
    return chosen


def _call(fn: Callable[..., Any], scenario: Scenario) -> tuple[Any, Any]:
    try:
        out = fn(dict(scenario.model), scenario.cluster, scenario.global_batch)
    except NotImplementedError as e:
        raise LabCheckFailed(f"choose_configuration is still the stub ({e}). Write it, then check again; hint(1) "
                             "is a start.") from None
    except LabCheckFailed:
        raise
    except Exception as e:
        raise LabCheckFailed(f"{scenario.name}: choose_configuration raised {type(e).__name__}: {e}") from e
    if not (isinstance(out, tuple | list) and len(out) == 2):
        raise LabCheckFailed(f"{scenario.name}: choose_configuration returned {out!r}; return a pair "
                             "(layout, defence): a dict of the layout and a dict of one reason per axis")
    return out[0], out[1]


def check_layout(scenario: Scenario, layout: Any) -> dict[str, Any]:
    """Every rule a layout must satisfy in ``scenario``, the first broken one raised as LabCheckFailed."""
    model, cluster, name = scenario.model, scenario.cluster, scenario.name
    lay = as_layout(layout)
    _check_uses_every_gpu(name, lay, cluster)
    _check_heads(name, lay, model, cluster)
    try:
        lay.validate(dict(model), model["seq_len"])
    except ValueError as e:
        raise LabCheckFailed(f"{name}: {describe(lay)} cannot run: {e}") from None
    _check_composes(name, lay)
    _check_tp_in_node(name, lay, model, cluster, scenario.global_batch)
    try:
        result = evaluate(model, cluster, scenario.global_batch, lay)
    except ValueError as e:
        raise LabCheckFailed(f"{name}: {e}") from None
    _check_bubble(scenario, result)  # first: more micro-batches also shrink the activations a too-big layout holds
    _check_fits(name, result, cluster)
    _check_not_wasteful(scenario, result)
    return result


def _check_uses_every_gpu(name: str, lay: Layout, cluster: Cluster) -> None:
    for axis in ("dp", "tp", "pp", "microbatches"):
        value = getattr(lay, axis)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LabCheckFailed(f"{name}: {axis} must be a positive int, got {value!r}")
    if lay.nproc != cluster.nproc:
        tp_pp = lay.tp * lay.pp
        fix = (f"with tp={lay.tp} and pp={lay.pp}, dp = {cluster.nproc} / {tp_pp} = {cluster.nproc // tp_pp}"
               if cluster.nproc % tp_pp == 0 else f"tp x pp = {tp_pp} does not even divide {cluster.nproc}")
        raise LabCheckFailed(f"{name}: dp x tp x pp = {lay.dp} x {lay.tp} x {lay.pp} = {lay.nproc}, but the cluster "
                             f"has {cluster.describe()} = {cluster.nproc} GPUs. A mesh uses every GPU exactly once: "
                             f"{fix}.")


def _check_heads(name: str, lay: Layout, model: Mapping[str, Any], cluster: Cluster) -> None:
    heads = model["n_head"]
    if heads % lay.tp:
        valid = [t for t in range(1, cluster.gpus_per_node + 1) if heads % t == 0]
        raise LabCheckFailed(f"{name}: tp={lay.tp} does not divide the model's {heads} attention heads. Tensor "
                             f"parallelism gives each tp rank whole heads (Megatron-LM §3), so tp must divide "
                             f"n_head; within a node of {cluster.gpus_per_node}: tp in {valid}.")


def _check_composes(name: str, lay: Layout) -> None:
    if lay.pp > 1 and lay.zero_stage > 1:
        raise LabCheckFailed(f"{name}: ZeRO-{lay.zero_stage} with pp={lay.pp}: a pipeline runs one backward per "
                             f"micro-batch, so ZeRO-2 would reduce-scatter gradients and ZeRO-3 gather parameters "
                             f"m = {lay.microbatches} times per step instead of once. With pipelines use zero 0 or "
                             "1 (ZeRO-1 shards the optimizer state, which is touched once per step).")


def _tp_layer_time(model: Mapping[str, Any], lay: Layout, micro_batch: int, link: Link) -> float:
    """α-β time of one layer's tp collectives (forward and backward) for one micro-batch on ``link``."""
    block = (sp_block_collectives if lay.sp else tp_block_collectives)(micro_batch, model["seq_len"],
                                                                       model["d_model"], 2)
    ops = block["forward"] + block["backward"]
    return sum(link.collective_time(op, size, lay.tp) for op, size in ops)


def _check_tp_in_node(name: str, lay: Layout, model: Mapping[str, Any], cluster: Cluster, global_batch: int) -> None:
    gpn = cluster.gpus_per_node
    if not axis_spans(lay, gpn)["tp"]:
        return
    per, rem = divmod(global_batch, lay.dp * lay.microbatches)
    b = per if per and not rem else 1
    slow = _tp_layer_time(model, lay, b, cluster.inter_node)
    fast = _tp_layer_time(model, Layout(tp=gpn, sp=lay.sp and gpn > 1), b, cluster.intra_node)
    n_ops = "4 all-reduces" if not lay.sp else "all-gathers and reduce-scatters"
    size = b * model["seq_len"] * model["d_model"] * 2
    nodes = ("spans several nodes" if lay.tp > gpn else
             f"does not divide the {gpn} GPUs of a node, so some groups span two")
    raise LabCheckFailed(
        f"{name}: tp={lay.tp} {nodes} ({gpn} GPUs per node). Tensor parallelism runs {n_ops} of the "
        f"layer's activation ({size / 2**20:.0f} MiB at micro-batch {b}) in every layer, forward and backward: "
        f"{slow * 1e3:.1f} ms per layer per micro-batch over {cluster.inter_node.name}, against "
        f"{fast * 1e3:.2f} ms for tp={gpn} on {cluster.intra_node.name}, times {model['n_layer']} layers and every "
        f"micro-batch. Keep each tp group inside a node (tp dividing {gpn}) and put the rest of the model on pp "
        "across nodes.")


_FIXES = {
    "activations": "activations dominate: fewer sequences per micro-batch (more micro-batches), sequence "
                   "parallelism (sp=True shards what tp keeps whole), or a larger tp",
    "optimizer_state": "optimizer state dominates: ZeRO (zero=1 shards it over the dp replicas), or split the "
                       "model further with tp/pp",
    "master_weights": "fp32 master weights dominate: ZeRO-1 shards them with the optimizer state",
    "gradients": "gradients dominate: ZeRO-2 shards them (without pp), or split the model with tp/pp",
    "parameters": "parameters dominate: ZeRO-3 shards them (without pp), or split the model with tp/pp",
}


def _check_fits(name: str, result: dict[str, Any], cluster: Cluster) -> None:
    if result["fits"]:
        return
    per = result["per_rank_gib"]
    top = max(per, key=per.get)
    over = result["total_gib"] - cluster.gpu_gb
    lay = result["layout"]
    where = f" on pipeline rank {result['worst_stage']} (the worst stage)" if lay.pp > 1 else ""
    breakdown = ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
    raise LabCheckFailed(f"{name}: {describe(lay)} needs {result['total_gib']:.1f} GiB per GPU{where}, "
                         f"{over:.1f} GiB more than the {cluster.gpu_gb:g} GiB a GPU has ({breakdown} GiB; micro-batch "
                         f"{result['micro_batch']} sequence(s)). The largest is {top} ({per[top]:.1f} GiB): "
                         f"{_FIXES.get(top, 'split it further')}.")


def microbatches_for(schedule: str, p: int, bound: float, v: int = 1, limit: int = 100_000) -> int | None:
    """The fewest micro-batches whose bubble is at most ``bound`` (None if none up to ``limit``)."""
    m = max(p, 1)
    while m <= limit:
        if bubble_fraction(schedule, p, m, v) <= bound + 1e-12:
            return m
        m += 1
    return None


def _check_bubble(scenario: Scenario, result: dict[str, Any]) -> None:
    lay = result["layout"]
    if lay.pp == 1 or result["bubble"] <= scenario.max_bubble + 1e-12:
        return
    need = microbatches_for(lay.schedule, lay.pp, scenario.max_bubble, lay.virtual_stages)
    most = scenario.global_batch // lay.dp
    room = (f" The global batch allows up to {most} per replica ({scenario.global_batch} sequences / dp={lay.dp}), "
            "one sequence each." if need is not None and need <= most else
            f" The global batch allows only {most} per replica: use fewer stages (a smaller pp) instead.")
    raise LabCheckFailed(f"{scenario.name}: {describe(lay)} idles {result['bubble']:.1%} of the GPUs' time in the "
                         f"pipeline bubble, (p−1)/(m+p−1) for {lay.schedule}; the bound here is "
                         f"{scenario.max_bubble:.0%}. Use more micro-batches: m >= {need} brings it under the "
                         f"bound.{room}")


def _check_not_wasteful(scenario: Scenario, result: dict[str, Any]) -> None:
    lay = result["layout"]
    if lay.tp == 1 and lay.pp == 1:
        return
    ddp = ddp_baseline(scenario.model, scenario.cluster, scenario.global_batch)
    if ddp is None or not ddp["fits"]:
        return
    split = " and ".join(s for s, on in ((f"tp={lay.tp}", lay.tp > 1), (f"pp={lay.pp}", lay.pp > 1)) if on)
    costs = []
    if lay.tp > 1:
        costs.append(f"tp adds collectives in every layer ({result['comm']['tp']['time_s']:.2f} s of traffic per "
                     "step) and smaller, less efficient matmuls")
    if lay.pp > 1:
        costs.append(f"pp adds a {result['bubble']:.1%} bubble")
    raise LabCheckFailed(f"{scenario.name}: {split} splits a model that plain DDP trains: dp={scenario.cluster.nproc}, "
                         f"one sequence per micro-batch, needs {ddp['total_gib']:.1f} GiB per GPU of "
                         f"{scenario.cluster.gpu_gb:g}. Model parallelism is for what does not fit; here "
                         + "; ".join(costs) + ". Use dp = every GPU (ZeRO if you want headroom).")


def check_defence(scenario: Scenario, lay: Layout, defence: Any) -> None:
    """One reason per axis, in words: at least a short sentence each, not the same sentence pasted thrice."""
    if not isinstance(defence, Mapping):
        raise LabCheckFailed(f"{scenario.name}: the defence should be a dict {{'dp': why, 'tp': why, 'pp': why}}, "
                             f"got a {type(defence).__name__}: {defence!r}")
    for axis in AXES:
        size = getattr(lay, axis)
        reason = defence.get(axis)
        if not isinstance(reason, str) or len(reason.split()) < MIN_REASON_WORDS:
            got = "nothing" if reason is None else repr(reason)
            raise LabCheckFailed(f"{scenario.name}: the defence has {got} for {axis} (={size}). Say in a sentence "
                                 f"why {axis}={size} and not more or less: what it saves (memory, time) or costs "
                                 f"(traffic on which link, bubble), with a number from evaluate().")
    reasons = [defence[a].strip().lower() for a in AXES]
    if len(set(reasons)) < len(reasons):
        raise LabCheckFailed(f"{scenario.name}: the defence gives the same sentence for several axes; each axis has "
                             "its own reason (dp: replicas and memory; tp: heads and NVLink; pp: stages and bubble).")


# ---------------------------------------------------------------------------------------------------------
# A small layout on real ranks.


def check_on_ranks(layout: Any, steps: int = 3, timeout: float = 120.0) -> dict[str, Any]:
    """Train the tiny GPT with ``layout`` (≤ 4 gloo ranks; pp = 1: microbatches are gradient accumulation) and
    with one process on the same global batch; the losses must agree within ``LOSS_RTOL``."""
    from workbench.cli import run_training
    from workbench.dist.launch import RankError
    from workbench.training.config import RunConfig

    if layout is None:
        raise LabCheckFailed("SMALL_LAYOUT is still None: pick a layout of the tiny GPT (2 layers, 2 heads, global "
                             f"batch 8) for 2 to {MAX_SMALL_RANKS} ranks, e.g. two axes of 2, as a dict of "
                             f"{', '.join(LAYOUT_KEYS)}")
    lay = as_layout(layout)
    if not 2 <= lay.nproc <= MAX_SMALL_RANKS:
        raise LabCheckFailed(f"the small layout has dp x tp x pp = {lay.nproc} ranks; pick 2 to {MAX_SMALL_RANKS} "
                             "(this machine runs them as gloo processes on its CPU cores)")
    pipeline = {"schedule": lay.schedule, "microbatches": lay.microbatches, "virtual_stages": lay.virtual_stages}
    flags = dict(nproc=lay.nproc, dp=lay.dp, tp=lay.tp, pp=lay.pp, sp=lay.sp, zero=lay.zero_stage,
                 **(pipeline if lay.pp > 1 else {"grad_accum": lay.microbatches}))
    common = dict(model="tiny", steps=steps, batch_size=8, seq_len=32, timeout=timeout)
    try:
        cfg = RunConfig(**common, **flags)
    except ValueError as e:
        raise LabCheckFailed(f"the small layout {describe(lay)} cannot train the tiny GPT (2 layers, 2 heads, global "
                             f"batch 8): {e}") from None
    try:
        run = run_training(cfg, progress=False)
        one = run_training(RunConfig(**common), progress=False)
    except RankError as e:
        raise LabCheckFailed(f"the small layout {describe(lay)} failed on real ranks:\n{e}") from e
    worst = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], one["losses"], strict=True))
    if not worst <= LOSS_RTOL:
        raise LabCheckFailed(f"{describe(lay)} on {lay.nproc} ranks: losses {run['losses']} differ from one "
                             f"process's {one['losses']} by up to {worst:.1e} relative (bound {LOSS_RTOL:g})")
    print(f"✓ {run['strategy']} on {lay.nproc} gloo ranks: losses "
          + ", ".join(f"{x:.5f}" for x in run["losses"])
          + f" equal one process's within {worst:.1e} relative (bound {LOSS_RTOL:g})")
    return {"layout": lay, "losses": run["losses"], "reference": one["losses"], "max_rel_diff": worst,
            "strategy": run["strategy"]}


__all__ = [
    "AXES", "GPT_1_3B", "HINTS", "LAYOUT_KEYS", "MAX_BUBBLE", "SCENARIOS", "Cluster", "Scenario", "as_layout",
    "axis_groups", "axis_links", "axis_spans", "check", "check_defence", "check_layout", "check_on_ranks",
    "ddp_baseline", "describe", "evaluate", "hint", "microbatches_for", "preset",
]
