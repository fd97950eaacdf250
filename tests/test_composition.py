"""One table of what composes (workbench.theory.composition): each refused combination has its reason, and
RunConfig (before ranks start) and workbench calc's Layout refuse exactly what the table refuses."""

from __future__ import annotations

import pytest

from workbench.cli import main
from workbench.theory.composition import RULES, Combination, check_composition, refusals
from workbench.theory.parallelism import Layout
from workbench.train import RunConfig

REFUSED = [
    (Combination(sp=True), "sp (sequence parallelism) needs tp > 1"),
    (Combination(pp=2, zero=2), "pipeline parallelism composes with"),
    (Combination(pp=2, zero=3), "pipeline parallelism composes with"),
    (Combination(pp=2, grad_accum=2), "grad_accum=2"),
    (Combination(zero=1, zero3_replicate=("*norm",)), "needs zero=3 without a pipeline"),
    (Combination(zero=3, pp=2, zero3_replicate=("*norm",)), "needs zero=3 without a pipeline"),
    (Combination(reduce_dtype="bf16", zero=2), "reduce_dtype='bf16' needs zero=3"),
    (Combination(offload=True), "offload needs a ZeRO stage"),
    (Combination(cp=2, tp=2), "context parallelism (cp=2) composes with"),
    (Combination(cp=2, pp=2), "context parallelism (cp=2) composes with"),
    (Combination(cp=2, recompute="selective"), "ring attention already keeps only q, k, v"),
    (Combination(grad_compression="powersgd", zero=2), "ZeRO-2/3 reduce-scatter gradient shards"),
    (Combination(grad_compression="sign", pp=2), "the pipeline's stage gradients"),
    (Combination(local_steps=4, zero=1), "local_steps=4 (local SGD / DiLoCo)"),
    (Combination(local_steps=4, tp=2), "local_steps=4 (local SGD / DiLoCo)"),
    (Combination(ps_servers=1, zero=1), "ps_servers=1 (a parameter server)"),
    (Combination(ps_servers=1, tp=2), "ps_servers=1 (a parameter server)"),
    (Combination(ep=2), "it needs moe_experts > 0"),
    (Combination(moe_experts=4, tp=2), "a mixture of experts (moe_experts=4) composes with"),
    (Combination(moe_experts=4, pp=2), "a mixture of experts (moe_experts=4) composes with"),
    (Combination(moe_experts=4, cp=2), "a mixture of experts (moe_experts=4) composes with"),
    (Combination(moe_experts=4, recompute="full"), "recompute='full'"),
    (Combination(moe_experts=4, ps_servers=1), "a mixture of experts (moe_experts=4) composes with"),
    (Combination(moe_experts=4, ep=2, zero=2), "expert parallelism (ep=2) composes with"),
    (Combination(moe_experts=4, ep=2, zero=3), "expert parallelism (ep=2) composes with"),
    (Combination(moe_experts=4, ep=2, grad_compression="powersgd"), "expert parallelism (ep=2) composes with"),
    (Combination(moe_experts=4, ep=2, local_steps=4), "expert parallelism (ep=2) composes with"),
]
COMPOSES = [Combination(), Combination(tp=2, sp=True), Combination(pp=2, zero=1, tp=2, sp=True),
            Combination(zero=3, reduce_dtype="bf16", zero3_replicate=("*norm",), offload=True)]
COMPOSES += [Combination(tp=2, zero=z) for z in range(4)] + [Combination(cp=2, zero=z) for z in range(4)]
COMPOSES += [Combination(cp=4, grad_accum=2, recompute="full"), Combination(grad_compression="topk", zero=1, tp=2),
             Combination(grad_compression="powersgd", cp=2), Combination(local_steps=8), Combination(ps_servers=2)]
COMPOSES += [Combination(moe_experts=4, zero=z) for z in range(4)] + [Combination(moe_experts=4, ep=2, zero=z)
                                                                     for z in (0, 1)]
COMPOSES += [Combination(moe_experts=4, ep=2, grad_accum=2, recompute="selective"),
             Combination(moe_experts=4, local_steps=4), Combination(moe_experts=4, grad_compression="topk")]


@pytest.mark.parametrize("combination, reason", REFUSED)
def test_each_refused_combination_says_why(combination: Combination, reason: str) -> None:
    assert any(reason in why for why in refusals(combination)), refusals(combination)
    with pytest.raises(ValueError) as info:
        check_composition(combination)
    assert str(info.value) == refusals(combination)[0]  # the first reason, in the table's order


@pytest.mark.parametrize("combination", COMPOSES)
def test_what_composes_passes(combination: Combination) -> None:
    assert refusals(combination) == []


def test_every_rule_is_exercised() -> None:
    hit = {rule.name for c, _ in REFUSED for rule in RULES if rule.refuses(c)}
    assert hit == {rule.name for rule in RULES}


def _run_config(c: Combination) -> dict:
    nproc = c.tp * c.pp * c.cp * (2 if c.zero or c.ep > 1 else 1) + (c.ps_servers or 0)
    return dict(nproc=nproc, moe_experts=c.moe_experts, ep=c.ep,
                tp=c.tp, pp=c.pp, sp=c.sp, cp=c.cp, recompute=c.recompute, zero=c.zero,
                grad_compression=c.grad_compression, local_steps=c.local_steps, ps_servers=c.ps_servers,
                grad_accum=c.grad_accum,
                zero3_replicate=list(c.zero3_replicate), reduce_dtype=c.reduce_dtype, offload=c.offload,
                precision="fp32" if c.reduce_dtype == "fp32" else c.reduce_dtype, batch_size=16)


@pytest.mark.parametrize("combination, reason", REFUSED)
def test_run_config_refuses_what_the_table_refuses(combination: Combination, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        RunConfig(**_run_config(combination))
    assert str(info.value) == refusals(combination)[0]


CALC_EXPRESSIBLE = [(c, r) for c, r in REFUSED if c.grad_accum == 1 and not c.zero3_replicate
                    and c.reduce_dtype == "fp32" and c.recompute == "none" and c.grad_compression == "none"
                    and c.local_steps is None and c.ps_servers is None and c.moe_experts == 0 and c.ep == 1]


@pytest.mark.parametrize("combination, reason", CALC_EXPRESSIBLE)
def test_calc_refuses_what_the_table_refuses(combination: Combination, reason: str, capsys) -> None:
    flags = ["calc", "--model", "llama-7B", "--tp", str(combination.tp), "--pp", str(combination.pp),
             "--zero", str(combination.zero), "--dp", "2", "--cp", str(combination.cp)]
    flags += ["--sp"] * combination.sp + ["--offload"] * combination.offload
    with pytest.raises(SystemExit):
        main(flags)
    assert refusals(combination)[0] in capsys.readouterr().err


@pytest.mark.parametrize("combination, reason", CALC_EXPRESSIBLE)
def test_theory_prices_what_run_refuses_by_design_but_not_a_meaningless_layout(combination: Combination,
                                                                                reason: str) -> None:
    """The memory calculator compares every ZeRO stage under a pipeline (why ZeRO-3 with pp costs m x the
    gathers): theory prices it; sp without tp or offload without ZeRO means nothing, and theory refuses it too."""
    layout = Layout(dp=2, tp=combination.tp, pp=combination.pp, sp=combination.sp, zero_stage=combination.zero,
                    offload=combination.offload, microbatches=2 * combination.pp if combination.pp > 1 else 1)
    meaningless = refusals(combination, meaningless_only=True)
    if meaningless:
        with pytest.raises(ValueError, match="needs"):
            layout.validate("llama-7B")
    else:
        layout.validate("llama-7B")
