"""Expert parallelism (``workbench.parallel.expert``; GShard's dispatch/combine, DeepSpeed-MoE's EP borrowing DP):
a MoE GPT with its experts split over ep ranks against one process holding every expert with the same router.

* no token dropped (capacity None): EP = one process on the global batch: loss, each rank's logits, and every
  gradient after ``reduce_expert_parallel_grads`` (dense averaged over the world, experts summed over the ranks
  holding the same shard and divided by the world), for ep = world = 2, ep = world = 4, and EP x DP (4 ranks,
  ep = 2: two copies of each expert shard);
* with a capacity factor: each rank's dropped counts are the capacity rule's on its own tokens, and equal one
  process's on the same tokens; loss and gradients equal one process's accumulated over the shards;
* every all-to-all's bytes in the comm log equal ``theory.expert.measured_all_to_all_bytes`` exactly (counts,
  dispatch, combine, and both backward ones), and the variable-split ``comm.all_to_all`` logs what it sends;
* EP x ZeRO-1 (4 ranks, ep = 2: dense parameters' optimizer state sharded over the 4 ranks, each expert's over
  its 2 holders) after 3 AdamW steps = one process's AdamW on the global batch;
* one rank is the plain model bit for bit; bad inputs are ValueErrors.

All the multi-rank work runs in two launches (2 and 4 ranks, module fixtures).

Tolerances, fp32 (tests/equivalence.py): EP moves rows between ranks without arithmetic, so the only differences
are GEMMs over other row counts (an expert runs on the rows its rank received, not on all of them at once), the
gradient sums over ranks, and the average of the per-rank losses: another order of the same sums, ROUNDOFF_K eps
of the quantity's scale (the loss; the largest logit; the largest gradient for all gradients, as a family).
Measured (x86 CPU, default ISA), worst over ep = 2, 4 and EP x DP: loss 1.4 eps, logits 0 eps (the same rows
through the same weights: bit-identical here), gradients 0.92 eps of the largest; with capacity 1.0 against one
process on each shard: loss 0 eps, gradients 0.62 eps. Adam's parameters after 3 steps
(``assert_adam_params_close``): at most 2.9e-4 of the learning rates' sum apart, against its bound of 1/32.
Bytes and counts are integers: exact.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from equivalence import (
    ROUNDOFF_K,
    assert_adam_params_close,
    assert_close_to_scale,
    eps,
    gpt_batch,
    reference_grads,
    reference_train,
    scale_of,
    shard,
)

from workbench import launch, trace
from workbench.dist import comm
from workbench.models import GPTConfig, build_gpt
from workbench.models.moe import take_moe_stats
from workbench.parallel.expert import (
    EP_COMBINE_TAG,
    EP_COUNTS_TAG,
    EP_DISPATCH_TAG,
    GRAD_SUFFIX,
    apply_expert_parallel,
    expert_process_groups,
    reduce_expert_parallel_grads,
    split_expert_params,
)
from workbench.parallel.zero import ZeroOptimizer
from workbench.theory.expert import (
    dropped_assignments,
    expert_capacity,
    expert_parallel_groups,
    experts_of_rank,
    kept_counts,
    measured_all_to_all_bytes,
    rows_to_ranks,
)

pytestmark = [pytest.mark.numerics, pytest.mark.timeout(180)]

MOE = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, moe_experts=4, moe_top_k=2)
DROPPING = replace(MOE, moe_top_k=1, moe_capacity_factor=1.0)
BATCH, SEQ, LR, STEPS = 8, 16, 1e-3, 3
EPS_FOR = {2: [2], 4: [2, 4]}
TIMEOUT = 90


def _batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return gpt_batch(step, BATCH, seq_len=SEQ)


def _log(start: int, stop: int | None = None) -> list[tuple]:
    return [(c.tag, c.op, c.nbytes, c.bus_bytes) for c in trace.current().trace.comms[start:stop]]


# -- rank side -------------------------------------------------------------------------------------------------

def _variable_all_to_all(rank: int, world: int) -> dict:
    """Rank r sends (r + i) % world + 1 rows of 3 floats to rank i."""
    sends = [(rank + i) % world + 1 for i in range(world)]
    recvs = [(j + rank) % world + 1 for j in range(world)]
    x = torch.arange(sum(sends) * 3, dtype=torch.float32).view(-1, 3) + 1000 * rank
    out = x.new_empty(sum(recvs), 3)
    c0 = len(trace.current().trace.comms)
    comm.all_to_all(out, x, tag="a2a", output_split_sizes=recvs, input_split_sizes=sends)
    return {"sends": sends, "out": out, "log": _log(c0)}


def _step(model, cfg: GPTConfig, x, y, data_group) -> dict:
    comms = trace.current().trace.comms
    take_moe_stats()
    c0 = len(comms)
    loss = model(x, y)
    c1 = len(comms)
    stats = take_moe_stats()
    loss.backward()
    c2 = len(comms)
    reduce_expert_parallel_grads(model, None, data_group)
    with torch.no_grad():
        logits = model(x)
    take_moe_stats()
    mean = loss.detach().clone()
    comm.all_reduce(mean, "avg")
    return {"loss": mean, "local_loss": loss.detach(), "logits": logits, "stats": stats,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "forward": _log(c0, c1), "backward": _log(c1, c2)}


def _ep_case(rank: int, world: int, cfg: GPTConfig, ep: int) -> dict:
    ep_group, data_group = expert_process_groups(ep)
    model = apply_expert_parallel(build_gpt(cfg, seed=0), ep_group)
    x, y = shard(_batch(), rank, world)
    return _step(model, cfg, x, y, data_group)


def _zero1_case(rank: int, world: int, ep: int) -> dict[str, torch.Tensor]:
    ep_group, data_group = expert_process_groups(ep)
    model = apply_expert_parallel(build_gpt(MOE, seed=0), ep_group)
    dense, expert = split_expert_params(model)
    optimizers = [ZeroOptimizer(list(dense.values()), torch.optim.AdamW, group=None, stage=1, lr=LR),
                  ZeroOptimizer(list(expert.values()), torch.optim.AdamW, group=data_group, stage=1, lr=LR)]
    for step in range(STEPS):
        for p in model.parameters():
            p.grad = None
        model(*shard(_batch(step), rank, world)).backward()
        reduce_expert_parallel_grads(model, None, data_group)  # averaged, as ZeRO-1 wants them (torch's ZeRO too)
        for opt in optimizers:
            opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _rank() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"a2a": _variable_all_to_all(rank, world),
           "equiv": {ep: _ep_case(rank, world, MOE, ep) for ep in EPS_FOR[world]}}
    if world == 2:
        out["dropping"] = _ep_case(rank, world, DROPPING, 2)
    else:
        out["zero1"] = _zero1_case(rank, world, 2)
    return out


@pytest.fixture(scope="module")
def ranks2() -> list[dict]:
    return launch(_rank, 2, device="cpu", timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ranks4() -> list[dict]:
    return launch(_rank, 4, device="cpu", timeout=TIMEOUT)


# The 4-rank launch (ep 4, and ep 2 x dp 2 with ZeRO-1) runs in the extended lane: the test command checks the same
# layouts end to end in tests/test_moe_run.py (ep 4, ep 2, ep 2 + ZeRO-1 against one process, through the trainer).
@pytest.fixture(params=[2, pytest.param(4, marks=pytest.mark.extended)], ids=["world2", "world4"])
def ranks(request) -> list[dict]:
    return request.getfixturevalue(f"ranks{request.param}")


def _cases(ranks: list[dict]) -> list[tuple[int, list[dict]]]:
    return [(ep, [r["equiv"][ep] for r in ranks]) for ep in EPS_FOR[len(ranks)]]


# -- reference -------------------------------------------------------------------------------------------------

def _reference(cfg: GPTConfig, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
    model = build_gpt(cfg, seed=0)
    take_moe_stats()
    loss = model(*batch)
    stats = take_moe_stats()
    loss.backward()
    with torch.no_grad():
        logits = model(batch[0])
    take_moe_stats()
    return {"loss": loss.detach(), "logits": logits, "stats": stats,
            "grads": {n: p.grad for n, p in model.named_parameters()}}


def _units(got: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    return float((got - want).abs().max()) / (eps() * scale)


def _assert_grads(got: dict, want: dict, msg: str) -> None:
    """Every gradient this rank holds, within ROUNDOFF_K eps of the model's largest gradient (one family)."""
    scale = scale_of(want.values())
    for name, g in got.items():
        assert_close_to_scale(g, want[name], scale=scale, msg=f"{msg} {name}")


# -- EP = one process ------------------------------------------------------------------------------------------

def test_ep_matches_one_process_holding_every_expert(ranks):
    world = len(ranks)
    want = _reference(MOE, _batch())
    for ep, got in _cases(ranks):
        for rank, r in enumerate(got):
            held = {n for n in r["grads"] if ".experts." in n}
            assert held == {n for n in want["grads"] if any(f".experts.{e}." in n
                                                            for e in experts_of_rank(4, ep, rank % ep))}
            assert_close_to_scale(r["loss"], want["loss"], msg=f"ep={ep} loss")
            assert_close_to_scale(r["logits"], want["logits"].chunk(world)[rank], msg=f"ep={ep} rank {rank} logits")
            _assert_grads(r["grads"], want["grads"], f"ep={ep} rank {rank}")
            assert r["stats"]["dropped"] == 0


def test_ep_dispatch_counts_add_up_to_the_routing(ranks):
    world = len(ranks)
    want = _reference(MOE, _batch())["stats"]
    for _, got in _cases(ranks):
        for layer in range(MOE.n_layer):
            summed = [sum(r["stats"]["calls"][layer]["chosen"][e] for r in got) for e in range(4)]
            assert summed == want["calls"][layer]["chosen"]  # the same router, the tokens split over the ranks
            assert all(r["stats"]["calls"][layer]["tokens"] == BATCH * SEQ // world for r in got)


def _rows_from(got: list[dict], rank: int, ep: int, layer: int) -> list[int]:
    """Rows each member of this rank's ep group sends to its experts in ``layer``."""
    group = expert_parallel_groups(len(got), ep)[rank // ep]
    mine = experts_of_rank(4, ep, rank % ep)
    return [sum(got[src]["stats"]["calls"][layer]["kept"][e] for e in mine) for src in group]


def test_ep_comm_log_is_theory_exactly(ranks):
    for ep, got in _cases(ranks):
        for rank, r in enumerate(got):
            forward, backward = [], []
            for layer in range(MOE.n_layer):
                kept = r["stats"]["calls"][layer]["kept"]
                want = measured_all_to_all_bytes(rows_to_ranks(kept, ep), _rows_from(got, rank, ep, layer),
                                                 rank % ep, MOE.d_model, MOE.moe_experts)
                forward += [(EP_COUNTS_TAG, want["counts"]), (EP_DISPATCH_TAG, want["dispatch"]),
                            (EP_COMBINE_TAG, want["combine"])]
                backward = [(EP_COMBINE_TAG + GRAD_SUFFIX, want["combine_backward"]),
                            (EP_DISPATCH_TAG + GRAD_SUFFIX, want["dispatch_backward"])] + backward
                assert want["total"] > 0
            assert [(t, b) for t, op, _, b in r["forward"]] == forward, f"ep={ep} rank {rank}"
            assert [(t, b) for t, op, _, b in r["backward"]] == backward, f"ep={ep} rank {rank}"
            assert {op for _, op, *_ in r["forward"] + r["backward"]} == {"all_to_all"}


def test_variable_all_to_all_moves_and_logs_what_it_sends(ranks):
    world = len(ranks)
    for rank, r in enumerate(ranks):
        got = r["a2a"]
        pieces = []
        for src in range(world):
            sends = ranks[src]["a2a"]["sends"]
            start = sum(sends[:rank])
            rows = torch.arange(sum(sends) * 3, dtype=torch.float32).view(-1, 3)[start:start + sends[rank]]
            pieces.append(rows + 1000 * src)
        assert torch.equal(got["out"], torch.cat(pieces))
        sends = got["sends"]
        assert got["log"] == [("a2a", "all_to_all", sum(sends) * 12, float((sum(sends) - sends[rank]) * 12))]


# -- capacity ---------------------------------------------------------------------------------------------------

def test_ep_drops_what_the_capacity_rule_drops(ranks2):
    per_shard = [_reference(DROPPING, shard(_batch(), r, 2)) for r in range(2)]
    total = 0
    for rank, r in enumerate(ranks2):
        got, want = r["dropping"], per_shard[rank]
        capacity = expert_capacity(BATCH * SEQ // 2, 4, 1, 1.0)
        for call, ref in zip(got["stats"]["calls"], want["stats"]["calls"], strict=True):
            assert call == ref  # the same router on the same tokens: the same choices, kept and dropped
            assert call["capacity"] == capacity == 16
            assert call["kept"] == kept_counts(call["chosen"], capacity)
            assert call["dropped"] == dropped_assignments(call["chosen"], capacity)
        total += got["stats"]["dropped"]
        assert_close_to_scale(got["local_loss"], want["loss"], msg=f"rank {rank} loss with drops")
    assert total > 0  # the seed overloads some expert: the rule is exercised
    accumulated = {n: sum(s["grads"][n] for s in per_shard) / 2 for n in per_shard[0]["grads"]}
    for rank, r in enumerate(ranks2):
        _assert_grads(r["dropping"]["grads"], accumulated, f"capacity 1.0 rank {rank}")


# -- composition with ZeRO-1 ------------------------------------------------------------------------------------

@pytest.mark.extended
def test_ep_times_dp_with_zero1_matches_one_process_adamw(ranks4):
    build, batches = (lambda: build_gpt(MOE, seed=0)), _batch
    want = reference_train(build, batches, steps=STEPS, lr=LR)
    grads0 = reference_grads(build, batches)
    for rank, r in enumerate(ranks4):
        got = r["zero1"]
        assert_adam_params_close(got, {n: want[n] for n in got}, {n: grads0[n] for n in got}, STEPS * LR,
                                 msg=f"rank {rank} ")
        # The same expert shard on both of its holders (ranks r and r + 2), bit for bit.
        other = ranks4[(rank + 2) % 4]["zero1"]
        assert all(torch.equal(got[n], other[n]) for n in got)


# -- one rank, bad input ----------------------------------------------------------------------------------------

def test_one_rank_is_the_plain_model_bit_for_bit():
    model, plain = apply_expert_parallel(build_gpt(MOE, seed=0), None), build_gpt(MOE, seed=0)
    x, y = _batch()
    assert all(m.run_experts is None and len(m.experts) == 4 for m in (b.mlp for b in model.blocks))
    assert torch.equal(model(x, y), plain(x, y))
    ep_group, data_group = expert_process_groups(1)
    assert (ep_group, data_group) == (None, None)
    take_moe_stats()


def test_bad_inputs_are_errors():
    with pytest.raises(ValueError, match=r"ep=2 does not divide world=1"):
        expert_process_groups(2)
    with pytest.raises(ValueError, match="no MoE layer"):
        apply_expert_parallel(build_gpt(replace(MOE, moe_experts=0)), None)
    with pytest.raises(ValueError, match=r"input_split_sizes must be 1 non-negative row counts .* summing to dim 0 "
                                         r"\(4\), got \[3\]"):
        comm.all_to_all(torch.empty(4, 2), torch.empty(4, 2), input_split_sizes=[3], output_split_sizes=[4])
    out = torch.empty(4, 2)
    comm.all_to_all(out, torch.ones(4, 2), input_split_sizes=[4], output_split_sizes=[4])
    assert torch.equal(out, torch.ones(4, 2))
    assert ROUNDOFF_K == 64  # the docstring's tolerance unit
