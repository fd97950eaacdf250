"""Lab 06 checker: the measurements are right (bytes kept, recomputed FLOPs, bit-exact gradients against known
cases), the stub and each typical mistake in a selective-checkpoint policy or a budgeted plan get their pointed
message, and the reference solution passes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from workbench.labs import LabCheckFailed
from workbench.labs.checkpoint_policy import (
    budgets,
    check_plan,
    check_policy,
    measure,
    optimal_recompute,
    plan_policy,
    profile_block,
)

LABS = Path(__file__).resolve().parent.parent / "labs"
if str(LABS) not in sys.path:  # the reference solutions live beside the labs, outside the workbench package
    sys.path.insert(0, str(LABS))

from solutions.checkpoint_policy import plan, policy  # noqa: E402

pytestmark = pytest.mark.timeout(240)  # single-process checks; a few seconds each, more on a loaded CPU
aten = torch.ops.aten


@pytest.fixture(scope="module")
def ops():
    return profile_block()


def test_profile_sees_the_blocks_matmuls(ops):
    """The small block (d = 128, 4 heads, 4 × 128 tokens): q, k, v, proj, fc, proj and the attention kernel."""
    tokens, d = 4 * 128, 128
    heavy = [op for op in ops if op.flops > 0]
    assert [op.kind for op in heavy] == ["matmul"] * 3 + ["attention"] + ["matmul"] * 3
    linears = [2 * tokens * d * d] * 4 + [2 * tokens * d * 4 * d] * 2  # 2 FLOPs per multiply-add
    assert sorted(op.flops for op in heavy if op.kind == "matmul") == sorted(linears)
    assert [op.flops for op in heavy if op.kind == "attention"] == [4 * 4 * 4 * 128 * 128 * 32]  # 4·b·h·s·t·d
    assert all(op.new_bytes == 0 for op in ops if op.kind == "view")


def test_measure_none_full_and_a_plan_against_the_profile(ops):
    """Full recomputation keeps nothing made inside the block and recomputes every forward FLOP; saving a set of
    ops keeps exactly their bytes and recomputes exactly the others' FLOPs; gradients are bit-exact."""
    none = measure("none")
    full = measure("checkpoint", baseline=none)
    assert full.kept_bytes == 0 and full.recomputed_flops == sum(op.flops for op in ops)
    saved = {op.index for op in ops if op.kind == "attention" or op.shape[-1] == 512}  # attention kernel and fc
    part = measure("checkpoint", lambda: create_selective_checkpoint_contexts(plan_policy(saved)), baseline=none)
    assert part.kept_bytes == sum(ops[i].new_bytes for i in saved)
    assert part.recomputed_flops == sum(op.flops for op in ops if op.index not in saved)
    for got in (full, part):
        assert all(torch.equal(g, w) for g, w in zip(got.grads, none.grads, strict=True))
    assert none.kept_bytes > part.kept_bytes > 0


def test_measure_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="'selective'.*valid: 'none', 'checkpoint'"):
        measure("selective")


def test_optimum_beats_greedy_at_the_middle_budget(ops):
    """The 0.75 budget is chosen so that filling by FLOPs per byte (ties in op order) is not optimal: the check
    asks for the best plan, not a heuristic."""
    budget = budgets(ops)[2]
    left, saved = budget, 0
    for op in sorted((o for o in ops if o.flops > 0), key=lambda o: -o.flops / o.new_bytes):
        if op.new_bytes <= left:
            left, saved = left - op.new_bytes, saved + op.flops
    greedy = sum(op.flops for op in ops) - saved
    assert optimal_recompute(ops, budget) < greedy


def stub(*args, **kwargs):
    raise NotImplementedError("decide what to save")


def save_everything(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


def linears_only(ctx, op, *args, **kwargs):
    """Forgets the attention kernel: its FLOPs are recomputed."""
    keep = op.overloadpacket in (aten.mm, aten.addmm)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def returns_none(ctx, op, *args, **kwargs):
    return None


def matmuls_and_views(ctx, op, *args, **kwargs):
    """Saves views too: the first layer norm's output, viewed for q's matmul, stays alive."""
    keep = policy(ctx, op, *args, **kwargs) == CheckpointPolicy.MUST_SAVE or op.overloadpacket is aten.view
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("fn, expected", [
    (stub, "still the stub"),
    (save_everything, "saves 5 ops without FLOPs (2056 KiB"),  # 2 layer norms, 2 residual adds, GELU
    (linears_only, "recomputes ops that do matmul FLOPs: #19 aten._scaled_dot_product_flash_attention_for_cpu"),
    (returns_none, "your policy returned None"),
    (matmuls_and_views, "a saved view keeps alive the whole storage"),
], ids=["stub", "save-everything", "linears-only", "returns-none", "views"])
def test_policy_mistake_gets_pointed_message(fn, expected):
    with pytest.raises(LabCheckFailed, match="hint") as failure:
        check_policy(fn)
    assert expected in str(failure.value), str(failure.value)


def greedy(ops, budget):
    """Fills by FLOPs per byte, ties in op order: optimal at 0 and 0.5, not at 0.75."""
    chosen, left = set(), budget
    for op in sorted((o for o in ops if o.flops > 0), key=lambda o: -o.flops / o.new_bytes):
        if op.new_bytes <= left:
            chosen.add(op.index)
            left -= op.new_bytes
    return chosen


def ignores_budget(ops, budget):
    return {op.index for op in ops if op.flops > 0}


def returns_ops(ops, budget):
    return [op for op in ops if op.flops > 0 and op.new_bytes <= budget]


def out_of_range(ops, budget):
    return {len(ops)}


@pytest.mark.parametrize("fn, expected", [
    (stub, "still the stub"),
    (ignores_budget, "budget 0 KiB: your plan keeps 2568 KiB, over the budget"),
    (greedy, "budget 1926 KiB: your plan fits (1544 KiB) but leaves 67.11 MFLOP"),
    (returns_ops, "must return a set of op indices"),
    (out_of_range, "not ops of the block (0 … 37)"),
], ids=["stub", "ignores-budget", "greedy", "returns-ops", "out-of-range"])
def test_plan_mistake_gets_pointed_message(fn, expected):
    with pytest.raises(LabCheckFailed, match="hint") as failure:
        check_plan(fn)
    assert expected in str(failure.value), str(failure.value)


def test_solution_passes(capsys):
    check_policy(policy)
    check_plan(plan)
    out = capsys.readouterr().out
    assert out.count("Correct:") == 2 and "recomputes 0 matmul FLOPs" in out and "1800 KiB" in out, out
