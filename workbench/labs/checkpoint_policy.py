"""Checker for lab 06: a selective-checkpoint policy (what to save, what to recompute).

Between recomputing nothing and recomputing a whole transformer block there is a choice per operation: keep its
output for backward, or recompute it there. PyTorch makes the choice an API (``torch.utils.checkpoint`` with
``context_fn=create_selective_checkpoint_contexts(policy)``, "selective activation checkpointing", SAC): inside a
non-reentrant checkpoint region, ``policy(ctx, op, *args, **kwargs)`` is called once per aten operation of the
forward, after it ran (its output is ``ctx.op_output``), and answers ``CheckpointPolicy.MUST_SAVE`` (keep the
output for backward) or ``PREFER_RECOMPUTE`` (run the op again in backward's recomputation). The common policy
(torchtitan's "op-level selective AC") saves the matmuls' and the attention kernel's outputs and recomputes the
pointwise rest: a transformer's FLOPs are in the matmuls, its pointwise ops cost only memory traffic.

The learner writes two things, checked on one real ``workbench.models.gpt.Block`` ("small" preset: d = 128, 4
heads, 128 tokens, batch 4) in fp32 on the CPU. Recomputation is a per-rank matter (each rank recomputes its own
activations), so the checks run in this process, no ranks needed:

* ``check_policy(policy)``: the "save matmuls, recompute pointwise" policy. It must keep exactly the outputs of
  the ops that do matmul FLOPs (``aten.mm``, ``aten.addmm``, ``aten.bmm``, the attention kernel) and nothing else:
  recomputed matmul FLOPs 0, and the activation bytes kept exactly those outputs' bytes.
* ``check_plan(plan)``: ``plan(ops, budget) -> set of op indices`` to save, under a budget of bytes, that
  recomputes the fewest FLOPs (a 0/1 knapsack over the few ops that have FLOPs). Checked at three budgets against
  the optimum found by trying every subset of those ops.

What is measured, for real, in every run (``measure``):

* **bytes kept for backward**: every storage an aten op of the block's forward creates is recorded by a dispatch
  mode with a weak reference; after forward (the block's output dropped, only the loss kept), the ones still
  alive are what backward will need, held by autograd's saved tensors or by the checkpoint's cache. Views of an
  existing storage (the weights' transposes, reshapes) create none and count nothing.
* **recomputed FLOPs**: the matmul FLOPs of backward (``torch.utils.flop_counter.flop_registry``'s formulas,
  plus 4·b·h·s·t·d for the CPU attention kernel, which the registry lacks) minus those of the same backward
  without recomputation. Early stop is off (``set_checkpoint_early_stop(False)``) so that the recomputation runs
  the whole region and the count is exactly the forward FLOPs of the ops not saved.
* **gradients**: the input's and every parameter's, compared with ``torch.equal`` to the run without
  recomputation. Bit-exact is the right bar: recomputation replays the same aten ops on the same inputs in the
  same order (no dropout in this block), so every recomputed value is the very same float.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)
from torch.utils.flop_counter import flop_registry

from workbench.labs import LabCheckFailed, show_hint
from workbench.models.gpt import Block, GPTConfig

PRESET, BATCH, SEED = "small", 4, 6
# check_plan's budgets, as fractions of the bytes of every output with FLOPs (2,568 KiB): at 0.75 picking by FLOPs per
# byte with ties in op order keeps 1,544 KiB and recomputes 67.1 MFLOP where the best fill (1,800 KiB) leaves 50.3
BUDGET_FRACTIONS = (0.0, 0.5, 0.75)
MORE = " (more help: hint(1), hint(2), hint(3))"
_CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
              torch.ops.aten._scaled_dot_product_flash_attention,
              torch.ops.aten._scaled_dot_product_efficient_attention,
              torch.ops.aten._scaled_dot_product_cudnn_attention}

HINTS = {
    1: "A transformer block's FLOPs are in its matmuls (the Linears' addmm, the attention kernel); layer norm, GELU "
       "and the residual adds cost almost no FLOPs, only memory. So keep what is expensive to redo and cheap to "
       "keep. For the policy: decide from the op alone. For the plan: each op with FLOPs is an item with a size "
       "(its new_bytes) and a value (its FLOPs, not recomputed if saved); fill the budget with the most value.",
    2: "Policy: op.overloadpacket is e.g. torch.ops.aten.addmm; return CheckpointPolicy.MUST_SAVE for aten.mm, "
       "aten.addmm, aten.bmm and the attention kernel (its name contains 'scaled_dot_product'), "
       "CheckpointPolicy.PREFER_RECOMPUTE for every other op. Plan: only ops with flops > 0 are worth saving, and "
       "there are 7 of them: try every subset whose new_bytes fit the budget (2**7 = 128 subsets) and keep the one "
       "with the most FLOPs. Sorting by FLOPs per byte (greedy) is not always optimal.",
    3: "def policy(ctx, op, *args, **kwargs):\n"
       "    keep = op.overloadpacket in (aten.mm, aten.addmm, aten.bmm) or 'scaled_dot_product' in str(op)\n"
       "    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE\n\n"
       "def plan(ops, budget):\n"
       "    items = [op for op in ops if op.flops > 0]\n"
       "    subsets = (s for n in range(len(items) + 1) for s in itertools.combinations(items, n))\n"
       "    fits = [s for s in subsets if sum(op.new_bytes for op in s) <= budget]\n"
       "    return {op.index for op in max(fits, key=lambda s: sum(op.flops for op in s))}",
}


def hint(level: int = 1) -> str:
    """Print (and return) hint ``level``: 1 the idea, 2 the ops and the search, 3 nearly the code."""
    return show_hint(HINTS, level)


# -- what the learner is given ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    """One aten operation of the block's forward, in the order SAC's policy sees them."""

    index: int
    name: str  # e.g. "aten.addmm"
    kind: str  # "matmul", "attention", "view" (aliases an input: no new memory) or "other" (pointwise, norms)
    shape: tuple[int, ...]  # the first output's shape
    new_bytes: int  # bytes of the storages this op creates (what saving its output keeps alive)
    flops: int  # matmul FLOPs (flop_counter's convention: 2 per multiply-add; 0 for pointwise ops)


@dataclass(frozen=True)
class Measurement:
    """One forward + backward of the block, measured (the module docstring says how)."""

    kept_bytes: int
    recomputed_flops: int
    backward_flops: int
    grads: tuple[torch.Tensor, ...]  # the input's, then every parameter's
    seconds: float


def make_block(seed: int = SEED) -> tuple[Block, torch.Tensor, torch.Tensor]:
    """The lab's block ("small" preset, seeded), an input [BATCH, seq, d] and a probe the loss is weighted by."""
    cfg = GPTConfig.preset(PRESET)
    torch.manual_seed(seed)
    block = Block(cfg)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    x = torch.randn(BATCH, cfg.seq_len, cfg.d_model, generator=g, device="cpu")
    probe = torch.randn(BATCH, cfg.seq_len, cfg.d_model, generator=g, device="cpu")
    return block, x, probe


def op_flops(op: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Matmul FLOPs of one aten op: flop_counter's registry, plus 4·b·h·s·t·d for the CPU attention kernel (two
    batched matmuls, QKᵀ and PV, 2 FLOPs per multiply-add; the registry has only the GPU kernels, and counts them
    as if not causal, as this does)."""
    if op == _CPU_ATTENTION:
        q, k = args[0], args[1]
        b, h, s, d = q.shape
        return 4 * b * h * s * k.shape[-2] * d
    formula = flop_registry.get(op.overloadpacket)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _new_storages(args: tuple, kwargs: dict, out: Any) -> list[torch.UntypedStorage]:
    """The output storages that are not an input's (a view creates none), each once."""
    inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
    fresh: dict[int, torch.UntypedStorage] = {}
    for t in _tensors(out):
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs and storage.nbytes() > 0:
            fresh[storage.data_ptr()] = storage
    return list(fresh.values())


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the block is small, and on a shared CPU a second thread's waits cost more than it
    computes (7x slower measured under load). Every run compared uses the same setting, so results still match."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _kind(op: Any, new_bytes: int, flops: int) -> str:
    if op.overloadpacket in _ATTENTION:
        return "attention"
    if flops > 0:
        return "matmul"
    return "view" if new_bytes == 0 else "other"


def profile_block(block: Block | None = None, x: torch.Tensor | None = None) -> list[Op]:
    """Every aten op of ``block``'s forward on ``x`` (default: ``make_block()``'s), in SAC's order: run under a
    selective checkpoint whose policy records each op and saves nothing."""
    if block is None or x is None:
        block, x, _ = make_block()
    ops: list[Op] = []

    def record(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        out = ctx.op_output
        new_bytes = sum(s.nbytes() for s in _new_storages(args, kwargs, out))
        flops = op_flops(op, args, kwargs, out)
        first = _tensors(out)[0] if _tensors(out) else None
        ops.append(Op(len(ops), str(op.overloadpacket), _kind(op, new_bytes, flops),
                      tuple(first.shape) if first is not None else (), new_bytes, flops))
        return CheckpointPolicy.PREFER_RECOMPUTE

    with _one_thread():
        checkpoint(block, x.detach().requires_grad_(), use_reentrant=False,
                   context_fn=lambda: create_selective_checkpoint_contexts(record))
    return ops


def show_ops(ops: Iterable[Op]) -> None:
    """Print the op table: index, name, kind, output shape, new bytes, FLOPs."""
    print(f"{'#':>3}  {'op':<48} {'kind':<9} {'shape':<18} {'new KiB':>8} {'MFLOP':>7}")
    for op in ops:
        print(f"{op.index:>3}  {op.name:<48} {op.kind:<9} {str(op.shape):<18} {op.new_bytes / 1024:>8.1f} "
              f"{op.flops / 1e6:>7.2f}")


def plan_policy(saved: Iterable[int]) -> Callable[..., CheckpointPolicy]:
    """A SAC policy that saves the outputs of the ops whose indices (``profile_block``'s) are in ``saved`` and
    recomputes every other op. Counts the ops it is called for, so use a fresh one per checkpoint call."""
    keep, counter = frozenset(saved), itertools.count()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if next(counter) in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _Fresh(TorchDispatchMode):
    """Records a weak reference to every storage an op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[tuple[weakref.ref, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.storages += [(weakref.ref(s), s.nbytes()) for s in _new_storages(args, kwargs, out)]
        return out

    def alive_bytes(self) -> int:
        gc.collect(0)  # young objects only: a full collection takes a second and finds nothing here
        alive = {}
        for ref, nbytes in self.storages:
            storage = ref()
            if storage is not None:
                alive[storage.data_ptr()] = nbytes
        return sum(alive.values())


class _Flops(TorchDispatchMode):
    """Sums ``op_flops`` over every op run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.flops += op_flops(func, args, kwargs, out)
        return out


def _run(block: Block, x: torch.Tensor, probe: torch.Tensor, mode: str,
         context_fn: Callable[[], Any] | None) -> tuple[int, int, tuple[torch.Tensor, ...]]:
    with _one_thread():
        return _run_once(block, x, probe, mode, context_fn)


def _run_once(block: Block, x: torch.Tensor, probe: torch.Tensor, mode: str,
              context_fn: Callable[[], Any] | None) -> tuple[int, int, tuple[torch.Tensor, ...]]:
    x = x.detach().clone().requires_grad_()
    for p in block.parameters():
        p.grad = None
    fresh = _Fresh()
    with fresh:
        if mode == "none":
            out = block(x)
        else:
            kwargs = {} if context_fn is None else {"context_fn": context_fn}
            with set_checkpoint_early_stop(False):
                out = checkpoint(block, x, use_reentrant=False, **kwargs)
    loss = (out * probe).sum()
    del out  # only the loss is held: what stays alive now is what backward needs
    kept = fresh.alive_bytes()
    flops = _Flops()
    with flops:
        loss.backward()
    return kept, flops.flops, (x.grad, *(p.grad for p in block.parameters()))


def measure(mode: str = "none", context_fn: Callable[[], Any] | None = None,
            block_and_inputs: tuple[Block, torch.Tensor, torch.Tensor] | None = None,
            baseline: Measurement | None = None) -> Measurement:
    """One forward + backward of the lab's block: ``mode`` "none" (no checkpoint) or "checkpoint" (the whole block
    under ``torch.utils.checkpoint``, with ``context_fn`` if given: a selective checkpoint). Measures the bytes kept
    for backward, the recomputed FLOPs (against "none": ``baseline``'s if given, else measured here), the gradients
    and the wall time."""
    if mode not in ("none", "checkpoint"):
        raise ValueError(f"measure: mode {mode!r}; valid: 'none', 'checkpoint'")
    block, x, probe = block_and_inputs or make_block()
    base_flops = None
    if mode == "checkpoint":
        base_flops = baseline.backward_flops if baseline else _run(block, x, probe, "none", None)[1]
    start = time.perf_counter()
    kept, flops, grads = _run(block, x, probe, mode, context_fn)
    seconds = time.perf_counter() - start
    return Measurement(kept, 0 if base_flops is None else flops - base_flops, flops, grads, seconds)


# -- checking -------------------------------------------------------------------------------------------------------

def _call(fn: Callable, args: tuple, name: str, kwargs: dict | None = None) -> Any:
    try:
        return fn(*args, **(kwargs or {}))
    except NotImplementedError as error:
        raise LabCheckFailed(f"your {name} is still the stub (NotImplementedError: {error}). Replace its "
                             "body.") from None
    except LabCheckFailed:
        raise
    except Exception as error:  # the learner's code: any error is theirs to see
        raise LabCheckFailed(f"your {name} raised {type(error).__name__}: {error}") from None


def _grads_equal(got: Measurement, want: Measurement, what: str) -> None:
    names = ["the input"] + [f"parameter {n}" for n, _ in make_block()[0].named_parameters()]
    for name, g, w in zip(names, got.grads, want.grads, strict=True):
        if g is None or not torch.equal(g, w):
            raise LabCheckFailed(f"{what}: the gradient of {name} differs from the run without recomputation. "
                                 "Recomputation replays the same ops on the same inputs, so it must be bit-exact: "
                                 "did the policy change what the forward computes, or keep state between calls?")


def _recording(policy: Callable) -> tuple[Callable[[], Any], list[tuple[int, Any]]]:
    """A context_fn for ``policy`` and the list of (op index, its answer) it fills, for naming mistakes."""
    answers: list[tuple[int, Any]] = []

    def context_fn() -> Any:
        answers.clear()

        def wrapped(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            answer = _call(policy, (ctx, op, *args), "policy", kwargs)
            if isinstance(answer, bool):
                answer = CheckpointPolicy.MUST_SAVE if answer else CheckpointPolicy.PREFER_RECOMPUTE
            if not isinstance(answer, CheckpointPolicy):
                raise LabCheckFailed(f"your policy returned {answer!r} for {op}: return a "
                                     "torch.utils.checkpoint.CheckpointPolicy (MUST_SAVE or PREFER_RECOMPUTE)")
            answers.append((len(answers), answer))
            return answer

        return create_selective_checkpoint_contexts(wrapped)

    return context_fn, answers


def _saves(answer: CheckpointPolicy) -> bool:
    return answer in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def _policy_mistakes(ops: list[Op], answers: list[tuple[int, Any]]) -> str:
    recomputed = [ops[i] for i, a in answers if ops[i].flops > 0 and not _saves(a)]
    extra = [ops[i] for i, a in answers if ops[i].flops == 0 and _saves(a) and ops[i].new_bytes > 0]
    views = [ops[i] for i, a in answers if ops[i].kind == "view" and _saves(a)]
    parts = []
    if recomputed:
        parts.append("recomputes ops that do matmul FLOPs: " + ", ".join(f"#{o.index} {o.name}" for o in recomputed))
    if extra:
        kib = sum(o.new_bytes for o in extra) / 1024
        parts.append(f"saves {len(extra)} ops without FLOPs ({kib:.0f} KiB that backward could recompute for free), "
                     "e.g. " + ", ".join(f"#{o.index} {o.name}" for o in extra[:4]))
    if views:
        parts.append(f"saves {len(views)} views (e.g. #{views[0].index} {views[0].name}): a saved view keeps alive "
                     "the whole storage it views, which may be an output you meant to recompute")
    return "; ".join(parts)


def check_policy(policy: Callable[..., Any]) -> None:
    """Check a SAC ``policy(ctx, op, *args, **kwargs)`` that saves the matmuls' outputs and recomputes the rest,
    on the lab's block; print a summary or raise ``LabCheckFailed`` naming the mistake."""
    try:
        if not callable(policy):
            raise LabCheckFailed("pass your policy function itself: check_policy(policy)")
        ops = profile_block()
        want_bytes = sum(o.new_bytes for o in ops if o.flops > 0)
        none = measure("none")
        context_fn, answers = _recording(policy)
        got = measure("checkpoint", context_fn, baseline=none)
        if len(answers) != len(ops):
            raise LabCheckFailed(f"your policy was asked about {len(answers)} ops, the block's forward has {len(ops)}")
        _grads_equal(got, none, "with your policy")
        mistakes = _policy_mistakes(ops, answers)
        if got.recomputed_flops != 0 or got.kept_bytes != want_bytes:  # judged on what was measured
            raise LabCheckFailed(f"with your policy backward recomputes {got.recomputed_flops / 1e6:.1f} MFLOP and "
                                 f"forward keeps {got.kept_bytes / 1024:.0f} KiB; saving exactly the matmuls' and "
                                 f"the attention kernel's outputs recomputes 0 and keeps {want_bytes / 1024:.0f} "
                                 f"KiB. Your policy {mistakes or 'keeps other tensors alive'}")
    except LabCheckFailed as error:
        raise LabCheckFailed(f"{error}{MORE}") from None
    print(f"Correct: your policy saves the {sum(o.flops > 0 for o in ops)} matmul and attention outputs and "
          f"recomputes the other {len(ops) - sum(o.flops > 0 for o in ops)} ops: forward keeps "
          f"{got.kept_bytes / 1024:.0f} KiB instead of {none.kept_bytes / 1024:.0f} KiB "
          f"({1 - got.kept_bytes / none.kept_bytes:.0%} less), backward recomputes 0 matmul FLOPs, and every "
          f"gradient equals the run without recomputation bit for bit.")


def optimal_recompute(ops: list[Op], budget: int) -> int:
    """The fewest FLOPs any choice of saved outputs within ``budget`` bytes leaves to recompute (every subset of
    the ops with FLOPs tried: only those are worth saving)."""
    items = [o for o in ops if o.flops > 0]
    total = sum(o.flops for o in items)
    best = 0
    for n in range(len(items) + 1):
        for subset in itertools.combinations(items, n):
            if sum(o.new_bytes for o in subset) <= budget:
                best = max(best, sum(o.flops for o in subset))
    return total - best


def budgets(ops: list[Op]) -> list[int]:
    """check_plan's budgets: ``BUDGET_FRACTIONS`` of the bytes of every output with FLOPs."""
    full = sum(o.new_bytes for o in ops if o.flops > 0)
    return [int(f * full) for f in BUDGET_FRACTIONS]


def _check_one_plan(plan: Callable, ops: list[Op], budget: int, none: Measurement) -> tuple[int, int]:
    where = f"budget {budget / 1024:.0f} KiB"
    saved = _call(plan, (list(ops), budget), "plan")
    try:
        saved = {int(i) for i in saved}
    except (TypeError, ValueError):
        raise LabCheckFailed(f"{where}: plan must return a set of op indices (ints), got {saved!r}") from None
    if not saved <= set(range(len(ops))):
        raise LabCheckFailed(f"{where}: plan returned indices {sorted(saved - set(range(len(ops))))} that are not "
                             f"ops of the block (0 … {len(ops) - 1})")
    got = measure("checkpoint", lambda: create_selective_checkpoint_contexts(plan_policy(saved)), baseline=none)
    _grads_equal(got, none, where)
    if got.kept_bytes > budget:
        raise LabCheckFailed(f"{where}: your plan keeps {got.kept_bytes / 1024:.0f} KiB, over the budget. Count each "
                             "saved op's new_bytes (a view saved keeps the storage it views)")
    best = optimal_recompute(ops, budget)
    if got.recomputed_flops > best:
        raise LabCheckFailed(f"{where}: your plan fits ({got.kept_bytes / 1024:.0f} KiB) but leaves "
                             f"{got.recomputed_flops / 1e6:.2f} MFLOP to recompute, where the best choice within "
                             f"the budget leaves {best / 1e6:.2f} MFLOP. Only the ops with FLOPs are worth saving, "
                             "and picking by FLOPs per byte is not always the best fill")
    return got.kept_bytes, got.recomputed_flops


def check_plan(plan: Callable[[list[Op], int], Iterable[int]]) -> None:
    """Check ``plan(ops, budget) -> indices to save`` at ``BUDGET_FRACTIONS`` of the matmul outputs' bytes; print
    a summary or raise ``LabCheckFailed`` naming the budget and the mistake."""
    try:
        if not callable(plan):
            raise LabCheckFailed("pass your plan function itself: check_plan(plan)")
        ops, none = profile_block(), measure("none")
        rows = [(b, *_check_one_plan(plan, ops, b, none)) for b in budgets(ops)]
    except LabCheckFailed as error:
        raise LabCheckFailed(f"{error}{MORE}") from None
    table = "; ".join(f"{b / 1024:.0f} KiB → keeps {k / 1024:.0f} KiB, recomputes {f / 1e6:.1f} MFLOP"
                      for b, k, f in rows)
    print(f"Correct: at every budget your plan fits and recomputes the fewest FLOPs possible ({table}); every "
          f"gradient equals the run without recomputation bit for bit (no recomputation keeps "
          f"{none.kept_bytes / 1024:.0f} KiB).")


__all__ = ["HINTS", "Measurement", "Op", "budgets", "check_plan", "check_policy", "hint", "make_block", "measure",
           "op_flops", "optimal_recompute", "plan_policy", "profile_block", "show_ops"]
