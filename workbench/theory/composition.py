"""Which strategies compose, and which combinations are refused and why: one table.

``RunConfig`` (before any rank starts), ``parallel.parallelize`` (for a caller that builds a strategy by hand) and
``workbench calc`` (the same layout, priced) all ask ``check_composition``, so the three cannot disagree about what
runs. ``theory.parallelism.Layout`` asks only the rules that make a layout meaningless: the memory calculator and
lab 09 price layouts ``run`` does not compose (ZeRO-3 under a pipeline) to show why. Pure Python, on the lowest
floor, as the rest of ``theory/``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# No rule for TP x ZeRO: every stage composes with tensor parallelism. ZeRO-2's buckets are built per param
# group, so tp-sharded and replicated parameters (norm shares 1 and 1/tp) and sequence-parallel ones (partial
# gradients) never share a bucket; ZeRO-3's units flatten a whole block, so the shares and the partial sums go
# per segment of each shard (FSDP + TP, the "2D" layout of torchtitan).

#: What the pipeline composes with. Not ZeRO-2/3, by design (as DeepSpeed, which refuses them with its
#: pipeline engine): a schedule runs one backward per micro-batch, so stage 2 would reduce-scatter the
#: gradients m times per step (m× the traffic) or keep them whole until the last micro-batch (no saving
#: over stage 1, which reduces once after the schedule); stage 3 would all-gather each stage's parameters
#: for every micro-batch's forward and backward, 2m gathers per step instead of 2.
PP_COMPOSES_WITH = ("data parallelism (dp >= 1) with zero 0 or 1 (ZeRO-2/3 would communicate once per "
                    "micro-batch: m times the gradient or parameter traffic), and tensor parallelism (tp >= 1, "
                    "with or without sp); grad_accum=1 (the micro-batches are the accumulation)")

#: What context parallelism composes with. Its ranks hold the same parameters, so data parallelism and every ZeRO
#: stage fold cp into their group (dp x cp, Megatron's "data parallel group with context parallelism"). Not tp or
#: pp here: the vocabulary-parallel loss and the pipeline's micro-batches would each have to carry the split
#: sequence's positions and targets (Megatron-LM threads them through both; this workbench does not, yet).
CP_COMPOSES_WITH = ("data parallelism (dp >= 1) and every ZeRO stage (its group becomes dp x cp), gradient "
                    "accumulation, recomputation and mixed precision; not tp or pp (their loss and micro-batches do "
                    "not carry the split sequence's positions)")

#: What a mixture-of-experts model composes with (``models.moe``). Every rank holding every expert (ep = 1), its
#: experts are parameters like any other: data parallelism, every ZeRO stage, gradient compression and local SGD
#: treat them as a dense model's. Not tp (it splits the dense MLP's fc and proj, which the experts replace), pp (the
#: pipeline's last stage computes the loss from the logits alone, without the blocks' load-balancing losses), cp (the
#: balance loss is per sequence, and a cp rank holds part of each), full recomputation (the recomputed forward
#: routes and, with ep, dispatches again: a second all-to-all per layer and every token counted twice) or a
#: parameter server (its workers' loop records no expert load or drops, so far).
MOE_COMPOSES_WITH = ("data parallelism with every ZeRO stage, gradient accumulation, mixed precision, selective "
                     "recomputation, gradient compression and local SGD; not tp (it splits the dense MLP the "
                     "experts replace), pp (the last stage's loss leaves out the blocks' load-balancing losses), cp "
                     "(the balance loss is per sequence, a cp rank holds part of each), recompute='full' (the "
                     "recomputed forward routes and dispatches again) or a parameter server (its loop records no "
                     "expert load)")

#: What expert parallelism composes with. EP borrows its ranks from dp (DeepSpeed-MoE, torchtitan): the dense
#: parameters' gradients are averaged over dp, each expert's summed over the ranks holding the same shard (the
#: expert-data group). Whatever reduces or averages every parameter over one dp group would mix different experts.
EP_COMPOSES_WITH = ("data parallelism with zero 0 (dense gradients averaged over dp, experts' over their expert-data "
                    "group) or zero 1 (one sharded optimizer per group), gradient accumulation and mixed precision; "
                    "not ZeRO-2/3 (they reduce-scatter every gradient over all dp ranks, which would average "
                    "different experts), grad_compression (it compresses the DDP wrappers' all-reduce, which EP does "
                    "not use) or local SGD (it averages whole replicas' parameters over dp)")


@dataclass(frozen=True)
class Combination:
    """The settings the composition rules look at (``RunConfig``'s names; sizes of the mesh's axes)."""

    tp: int = 1
    pp: int = 1
    sp: bool = False
    zero: int = 0
    grad_accum: int = 1
    zero3_replicate: Sequence[str] = ()
    reduce_dtype: str = "fp32"
    offload: bool = False
    cp: int = 1
    recompute: str = "none"
    grad_compression: str = "none"
    local_steps: int | None = None
    ps_servers: int | None = None
    moe_experts: int = 0
    ep: int = 1


@dataclass(frozen=True)
class Rule:
    """A combination that is refused: ``refuses(c)`` says whether ``c`` is it, ``why(c)`` says why and what to do."""

    name: str
    refuses: Callable[[Combination], bool]
    why: Callable[[Combination], str]
    #: True: the layout means nothing (sp without tp), so even theory refuses to price it; False: a layout theory
    #: can price (the memory calculator compares every ZeRO stage side by side, pipelines included) but that
    #: ``workbench run`` does not compose, by design; ``workbench calc`` refuses both, as ``run`` would.
    meaningless: bool = False


RULES: tuple[Rule, ...] = (
    Rule("sp needs tp", lambda c: c.sp and c.tp == 1,
         lambda c: "sp (sequence parallelism) needs tp > 1: it shards what tensor parallelism leaves replicated "
                   "along the sequence over the tp ranks; set tp >= 2 or turn sp off", meaningless=True),
    Rule("pp x zero, grad_accum", lambda c: c.pp > 1 and (c.zero > 1 or c.grad_accum != 1),
         lambda c: f"pipeline parallelism composes with {PP_COMPOSES_WITH}; got zero={c.zero}, "
                   f"grad_accum={c.grad_accum}"),
    Rule("zero3_replicate needs zero 3", lambda c: bool(c.zero3_replicate) and (c.zero != 3 or c.pp > 1),
         lambda c: f"zero3_replicate={list(c.zero3_replicate)!r} needs zero=3 without a pipeline (it keeps the "
                   f"parameters it names out of ZeRO-3's shards); got zero={c.zero}, pp={c.pp}"),
    Rule("reduce_dtype needs zero 3", lambda c: c.reduce_dtype != "fp32" and (c.zero != 3 or c.pp > 1),
         lambda c: f"reduce_dtype={c.reduce_dtype!r} needs zero=3 (ZeRO-3 reduce-scatters gradients in its "
                   f"policy's reduce dtype); with zero={c.zero}, pp={c.pp} gradients are reduced in fp32 (autocast "
                   f"leaves fp32 .grad): use reduce_dtype='fp32'"),
    Rule("cp x tp, pp", lambda c: c.cp > 1 and (c.tp > 1 or c.pp > 1),
         lambda c: f"context parallelism (cp={c.cp}) composes with {CP_COMPOSES_WITH}; got tp={c.tp}, pp={c.pp}"),
    Rule("cp x selective recompute", lambda c: c.cp > 1 and c.recompute == "selective",
         lambda c: f"recompute='selective' with cp={c.cp}: ring attention already keeps only q, k, v, its output "
                   f"and log-sum-exp and recomputes each block's scores in backward, which is all selective "
                   f"recomputation would save; use recompute='none' or 'full'"),
    Rule("compression needs an all-reduce", lambda c: c.grad_compression != "none" and (c.zero > 1 or c.pp > 1),
         lambda c: f"grad_compression={c.grad_compression!r} compresses the DDP wrappers' gradient all-reduce (zero 0 "
                   f"or 1, with or without tp and cp); got zero={c.zero}, pp={c.pp}: ZeRO-2/3 reduce-scatter gradient "
                   f"shards, which a low-rank or sparse message does not split into, and the pipeline's stage "
                   f"gradients are averaged once after its schedule, outside the wrappers"),
    Rule("local sgd replaces the gradient sync", lambda c: c.local_steps is not None and (
        c.zero > 0 or c.tp > 1 or c.pp > 1 or c.cp > 1 or c.grad_compression != "none" or c.grad_accum != 1),
         lambda c: f"local_steps={c.local_steps} (local SGD / DiLoCo) trains whole replicas that average their "
                   f"parameters every {c.local_steps} steps instead of their gradients every step: it composes with "
                   f"data parallelism alone (zero 0, no tp, pp or cp, no grad_compression, grad_accum 1); got "
                   f"zero={c.zero}, tp={c.tp}, pp={c.pp}, cp={c.cp}, grad_compression={c.grad_compression!r}, "
                   f"grad_accum={c.grad_accum}"),
    Rule("a parameter server replaces the gradient sync", lambda c: c.ps_servers is not None and (
        c.zero > 0 or c.tp > 1 or c.pp > 1 or c.cp > 1 or c.grad_compression != "none" or c.local_steps is not None
        or c.grad_accum != 1 or c.offload),
         lambda c: f"ps_servers={c.ps_servers} (a parameter server) gathers whole gradients at server ranks that "
                   f"hold and step the parameters, in place of the all-reduce: it trains replicated workers alone "
                   f"(zero 0, no tp, pp or cp, no grad_compression or local_steps, grad_accum 1); got zero={c.zero}, "
                   f"tp={c.tp}, pp={c.pp}, cp={c.cp}, grad_compression={c.grad_compression!r}, "
                   f"local_steps={c.local_steps}, grad_accum={c.grad_accum}"),
    Rule("ep needs moe", lambda c: c.ep > 1 and c.moe_experts == 0,
         lambda c: f"ep={c.ep} (expert parallelism) splits a mixture of experts' experts over ranks: it needs "
                   f"moe_experts > 0 (--moe-experts E); got moe_experts={c.moe_experts}", meaningless=True),
    Rule("moe x tp, pp, cp, full recompute, ps", lambda c: c.moe_experts > 0 and (
        c.tp > 1 or c.pp > 1 or c.cp > 1 or c.recompute == "full" or c.ps_servers is not None),
         lambda c: f"a mixture of experts (moe_experts={c.moe_experts}) composes with {MOE_COMPOSES_WITH}; got "
                   f"tp={c.tp}, pp={c.pp}, cp={c.cp}, recompute={c.recompute!r}, ps_servers={c.ps_servers}"),
    Rule("ep x zero 2/3, compression, local sgd", lambda c: c.ep > 1 and (
        c.zero > 1 or c.grad_compression != "none" or c.local_steps is not None),
         lambda c: f"expert parallelism (ep={c.ep}) composes with {EP_COMPOSES_WITH}; got zero={c.zero}, "
                   f"grad_compression={c.grad_compression!r}, local_steps={c.local_steps}"),
    Rule("offload needs zero", lambda c: c.offload and c.zero == 0,
         lambda c: "offload needs a ZeRO stage (--zero 1, 2 or 3): stage 0 keeps everything replicated"),
)


def refusals(combination: Combination, meaningless_only: bool = False) -> list[str]:
    """Every reason ``combination`` is refused, in the table's order (empty: it composes); ``meaningless_only``:
    only the rules that make a layout meaningless (what theory refuses to price)."""
    return [rule.why(combination) for rule in RULES
            if rule.refuses(combination) and (rule.meaningless or not meaningless_only)]


def check_composition(combination: Combination, meaningless_only: bool = False) -> None:
    """``ValueError`` with the first reason ``combination`` is refused; nothing when it composes."""
    if problems := refusals(combination, meaningless_only):
        raise ValueError(problems[0])


__all__ = ["CP_COMPOSES_WITH", "EP_COMPOSES_WITH", "MOE_COMPOSES_WITH",
           "PP_COMPOSES_WITH", "RULES", "Combination", "Rule", "check_composition", "refusals"]
