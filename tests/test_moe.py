"""The mixture-of-experts model on one process (``workbench.models.moe``, Switch/GShard/Mixtral): the top-k
router's weights, the capacity rule and its position-major drops on hand-built choices, Switch's load-balancing
loss by hand, the dense GPT unchanged bit for bit when MoE is off, a one-expert MoE equal to the dense MLP bit for
bit, parameter counts, seeded weights, a MoE GPT that learns, ``theory.expert`` by hand, and bad inputs.

Everything here is exact (integers, or the very same float operations) except the learning test (the loss must
fall by a margin) and the router weights, compared with ``torch.testing.assert_close``'s fp32 defaults: the same
softmax, renormalised by one division.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from equivalence import gpt_batch
from torch import nn

from workbench.models import GPT, GPTConfig, build_gpt
from workbench.models.moe import (
    MoEConfig,
    MoEMLP,
    TopKRouter,
    capacity_plan,
    is_expert_param,
    load_balancing_loss,
    run_experts,
    take_moe_stats,
)
from workbench.theory.expert import (
    all_to_all_bytes,
    all_to_all_vs_compute,
    check_ep,
    dropped_assignments,
    expected_dropped_fraction,
    expert_capacity,
    expert_data_groups,
    expert_memory_per_rank,
    expert_parallel_groups,
    experts_of_rank,
    kept_counts,
    measured_all_to_all_bytes,
    rows_to_ranks,
)

SMALL = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16)


def _router(experts: int, top_k: int, logits: torch.Tensor) -> TopKRouter:
    """A router whose gate is the identity (d_model = E), so its logits are its inputs."""
    router = TopKRouter(experts, experts, top_k)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(experts))
    return router


# -- router, capacity, aux loss ---------------------------------------------------------------------------------

def test_router_takes_the_top_k_and_renormalises_for_k_above_one():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 0.5, 2.5]])
    probs = F.softmax(logits, -1)
    two = _router(4, 2, logits)(logits)
    assert two.experts.tolist() == [[0, 1], [1, 3]]
    torch.testing.assert_close(two.probs, probs)
    top = probs.gather(1, two.experts)
    torch.testing.assert_close(two.weights, top / top.sum(-1, keepdim=True))  # Mixtral: softmax over the top k
    torch.testing.assert_close(two.weights, F.softmax(logits.gather(1, two.experts), -1))
    one = _router(4, 1, logits)(logits)  # Switch: top-1 keeps the raw probability (the router's gradient path)
    assert one.experts.tolist() == [[0], [1]]
    torch.testing.assert_close(one.weights, probs.gather(1, one.experts))


def test_capacity_keeps_position_major_and_drops_what_the_rule_says():
    # 4 tokens, k = 2, E = 3: expert 0 is chosen 4 times, 1 three times, 2 once.
    chosen = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    weights = torch.arange(8, dtype=torch.float32).view(4, 2)
    capacity = expert_capacity(4, 3, 2, 0.75)
    assert capacity == 2  # ceil(0.75 * 4 * 2 / 3)
    plan = capacity_plan(chosen, weights, 3, capacity)
    assert plan.chosen.tolist() == [4, 3, 1] and plan.counts.tolist() == kept_counts([4, 3, 1], 2) == [2, 2, 1]
    # Kept, expert-major: expert 0 keeps tokens 0, 1 (token 2's first choice and token 3's second are late);
    # expert 1 keeps tokens 0, 2 (token 3's first choice is third); expert 2 keeps token 1.
    assert plan.token.tolist() == [0, 1, 0, 2, 1]
    assert plan.weight.tolist() == [0.0, 2.0, 1.0, 5.0, 3.0]
    assert int(plan.chosen.sum() - plan.counts.sum()) == dropped_assignments([4, 3, 1], 2) == 3
    free = capacity_plan(chosen, weights, 3, None)
    assert free.counts.tolist() == [4, 3, 1] and free.token.tolist() == [0, 1, 2, 3, 0, 2, 3, 1]


def test_the_layer_drops_per_call_by_the_rule():
    cfg = replace(SMALL, moe_experts=4, moe_top_k=1, moe_capacity_factor=1.0)
    model = build_gpt(cfg, seed=0)
    x, y = gpt_batch(0, 4, seq_len=16)
    take_moe_stats()
    model(x, y)
    stats = take_moe_stats()
    assert len(stats["calls"]) == cfg.n_layer
    for call in stats["calls"]:
        assert call["tokens"] == 64 and call["capacity"] == expert_capacity(64, 4, 1, 1.0) == 16
        assert call["kept"] == kept_counts(call["chosen"], 16)
        assert call["dropped"] == dropped_assignments(call["chosen"], 16)
    assert stats["dropped"] == sum(c["dropped"] for c in stats["calls"]) > 0  # this seed overloads an expert
    assert take_moe_stats()["calls"] == []


def test_load_balancing_loss_by_hand():
    e = 4
    even = torch.full((1, 4, e), 0.25)
    assert load_balancing_loss(even, torch.tensor([[[0], [1], [2], [3]]]), e).item() == pytest.approx(1.0)
    peaked = F.one_hot(torch.zeros(1, 4, dtype=torch.long), e).float()
    assert load_balancing_loss(peaked, torch.zeros(1, 4, 1, dtype=torch.long), e).item() == pytest.approx(e)
    # One sequence of 2 tokens, k = 2: f = (2, 1, 1, 0)/4, P = mean of the two rows; then a batch of two averages.
    probs = torch.tensor([[[0.5, 0.3, 0.1, 0.1], [0.4, 0.1, 0.4, 0.1]]])
    chosen = torch.tensor([[[0, 1], [0, 2]]])
    hand = 4 * (0.5 * 0.45 + 0.25 * 0.2 + 0.25 * 0.25 + 0.0 * 0.1)
    assert load_balancing_loss(probs, chosen, e).item() == pytest.approx(hand, rel=1e-6)
    both = load_balancing_loss(torch.cat([probs, even[:, :2]]), torch.cat([chosen, chosen]), e)
    assert both.item() == pytest.approx((hand + 4 * (0.5 + 0.25 + 0.25) * 0.25) / 2, rel=1e-6)


def test_the_gradient_of_the_aux_loss_flows_through_the_probabilities_only():
    logits = torch.randn(1, 6, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    probs = F.softmax(logits, -1)
    chosen = probs.topk(1, -1).indices
    load_balancing_loss(probs, chosen, 3).backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


# -- the GPT -----------------------------------------------------------------------------------------------------

def _pre_moe_gpt(cfg: GPTConfig, seed: int) -> dict[str, torch.Tensor]:
    """The dense GPT's weights as the code before MoE drew them: the same modules constructed in the same order
    (each constructor draws its default init), then GPT-2's init in registration order."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        d, h = cfg.d_model, cfg.mlp_ratio * cfg.d_model
        named = [("wte", nn.Embedding(cfg.vocab_size, d)), ("wpe", nn.Embedding(cfg.seq_len, d))]
        for i in range(cfg.n_layer):
            p = f"blocks.{i}."
            named += [(p + "ln1", nn.LayerNorm(d)), *((p + f"attn.{n}", nn.Linear(d, d)) for n in "qkv"),
                      (p + "attn.proj", nn.Linear(d, d)), (p + "ln2", nn.LayerNorm(d)),
                      (p + "mlp.fc", nn.Linear(d, h)), (p + "mlp.proj", nn.Linear(h, d))]
        named += [("ln_f", nn.LayerNorm(d)), ("lm_head", nn.Linear(d, cfg.vocab_size, bias=False))]
        for name, m in named:
            if isinstance(m, (nn.Linear, nn.Embedding)):
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("attn.proj", "mlp.proj")) else 0.02
                nn.init.normal_(m.weight, 0.0, std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        state = {f"{n}.{k}": v for n, m in named for k, v in m.state_dict().items()}
    state["wte.weight"] = state["lm_head.weight"]  # tied: one matrix, drawn last as the head's
    return state


def test_dense_gpt_is_unchanged_bit_for_bit_when_moe_is_off():
    cfg = GPTConfig.preset("tiny")
    assert cfg.moe is None and cfg.moe_experts == 0
    model = build_gpt(cfg, seed=3)
    want = _pre_moe_gpt(cfg, seed=3)
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    x, y = gpt_batch(0, 2, seq_len=cfg.seq_len)
    logits = model(x)
    assert torch.equal(model(x, y), F.cross_entropy(logits.flatten(0, 1), y.flatten()))  # no aux term


def test_one_expert_is_the_dense_mlp_bit_for_bit():
    """E = k = 1: the router's softmax is exactly 1, so the layer is its expert, which has the MLP's shape."""
    dense = build_gpt(SMALL, seed=0)
    moe = build_gpt(replace(SMALL, moe_experts=1, moe_top_k=1), seed=0)
    state = {k.replace("mlp.experts.0.", "mlp."): v for k, v in moe.state_dict().items() if "router" not in k}
    dense.load_state_dict(state)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    for b_dense, b_moe in zip(dense.blocks, moe.blocks, strict=True):
        assert torch.equal(b_moe.mlp(x), b_dense.mlp(x))


@pytest.mark.parametrize("experts,top_k", [(4, 2), (3, 1)])
def test_moe_gpt_params_seeded_counted_and_named(experts, top_k):
    cfg = replace(SMALL, moe_experts=experts, moe_top_k=top_k)
    a, b, c = build_gpt(cfg, seed=0), build_gpt(cfg, seed=0), build_gpt(cfg, seed=1)
    assert cfg.num_params() == sum(p.numel() for p in a.parameters())
    for (name, p), q, r in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
        assert "router" in name or "bias" in name or "ln" in name or not torch.equal(p, r), name
    names = [n for n, _ in a.named_parameters()]
    assert "blocks.0.mlp.router.gate.weight" in names and f"blocks.1.mlp.experts.{experts - 1}.proj.bias" in names
    assert not is_expert_param("blocks.0.mlp.router.gate.weight") and is_expert_param("blocks.0.mlp.experts.2.fc.bias")
    proj = a.blocks[0].mlp.experts["0"].proj.weight
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * cfg.n_layer), rel=0.15)  # a residual projection


def test_moe_gpt_loss_adds_the_aux_loss_and_learns():
    cfg = replace(SMALL, moe_experts=4, moe_top_k=2, moe_capacity_factor=1.25)
    model = build_gpt(cfg, seed=0)
    x, y = gpt_batch(0, 4, seq_len=16)
    loss = model(x, y)
    aux = sum(b.mlp.aux_loss for b in model.blocks)
    ce = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    torch.testing.assert_close(loss, ce + 0.01 * aux)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(12):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        first = loss.item() if first is None else first
        opt.step()
    assert loss.item() < first - 1.0, (first, loss.item())  # memorising one batch: well below ln(256) = 5.5
    assert all(p.grad is not None for p in model.parameters())  # every expert ran (on zero rows if unused)


# -- theory ------------------------------------------------------------------------------------------------------

def test_theory_hand_checked():
    assert expert_capacity(64, 4, 2, 1.0) == 32 and expert_capacity(64, 4, 2, 1.25) == 40
    assert expert_capacity(10, 3, 1, 1.0) == 4 and expert_capacity(64, 4, 2, None) is None
    assert expert_capacity(100, 8, 1, 1.1) == 14  # ceil(13.75), with 1.1's binary value
    assert dropped_assignments([5, 1, 2], 2) == 3 and dropped_assignments([5, 1], None) == 0
    assert rows_to_ranks([1, 2, 3, 4], 2) == [3, 7] and rows_to_ranks([1, 2, 3, 4], 4) == [1, 2, 3, 4]
    assert expert_parallel_groups(4, 2) == [[0, 1], [2, 3]] and expert_data_groups(4, 2) == [[0, 2], [1, 3]]
    assert expert_data_groups(4, 4) == [[0], [1], [2], [3]] and list(experts_of_rank(8, 4, 3)) == [6, 7]
    even = all_to_all_bytes(tokens=1024, d_model=512, top_k=2, experts=8, ep=4, bytes_per_value=2)
    one = 1024 * 2 * 512 * 2 * 3 / 4
    assert even == {"dispatch": one, "combine": one, "dispatch_backward": one, "combine_backward": one,
                    "counts": 8 * 8 * 3 / 4, "total": 4 * one + 48}
    assert all_to_all_bytes(1024, 512, 2, 8, 1)["total"] == 0
    measured = measured_all_to_all_bytes([3, 5], [4, 6], 0, d_model=8, experts=4)
    assert measured == {"dispatch": 5 * 32, "combine": 6 * 32, "dispatch_backward": 6 * 32,
                        "combine_backward": 5 * 32, "counts": 16, "total": 2 * 11 * 32 + 16}
    mem = expert_memory_per_rank(n_layer=2, d_model=32, hidden=128, experts=4, ep=2)
    per_expert = 32 * 128 * 2 + 128 + 32
    assert mem == {"experts": 2 * 2 * per_expert * 4, "router": 2 * 32 * 4 * 4,
                   "total": 16 * per_expert + 1024, "experts_unsplit": 32 * per_expert}
    cfg = replace(SMALL, moe_experts=4)
    assert cfg.num_params() - SMALL.num_params() == 2 * (3 * per_expert + 32 * 4)


def test_expected_drops_by_hand_and_against_sampling():
    # 4 tokens, 2 experts, top-1, C = 1: capacity 2, one expert's count X ~ Binomial(4, 1/2) drops X - 2 when
    # above: E = 1·P(3) + 2·P(4) = 4/16 + 2/16; two experts, 4 assignments
    assert expected_dropped_fraction(4, 2, 1, 1.0) == pytest.approx(2 * (6 / 16) / 4, rel=1e-12)
    assert expected_dropped_fraction(4, 2, 2, 0.5) == 0.5  # k = E: every expert gets every token, keeps 2 of 4
    assert expected_dropped_fraction(512, 8, 2, None) == 0.0 and expected_dropped_fraction(512, 8, 2, 8.0) == 0.0
    # sampled: uniformly random distinct top-2 of 8 for 512 tokens, 200 calls; the mean's standard error is ~0.1 points
    g = torch.Generator(device="cpu").manual_seed(0)
    capacity = expert_capacity(512, 8, 2, 1.0)
    drops = [dropped_assignments(torch.bincount(torch.rand(512, 8, generator=g, device="cpu").topk(2, -1).indices
                                                .reshape(-1), minlength=8).tolist(), capacity) / 1024
             for _ in range(200)]
    assert sum(drops) / len(drops) == pytest.approx(expected_dropped_fraction(512, 8, 2, 1.0), abs=0.004)


def test_all_to_all_vs_compute():
    r = all_to_all_vs_compute(4096, 4096, 14336, 8, 2, 8, bandwidth=50e9, flops=400e12)
    assert r["dispatch_bytes"] == all_to_all_bytes(4096, 4096, 2, 8, 8, 2)["dispatch"]
    assert r["compute_s"] == pytest.approx(4096 * 2 * 6 * 4096 * 14336 / 400e12)
    assert r["transfer_s"] == pytest.approx(2 * r["dispatch_bytes"] / 50e9)
    # with no latency the ratio is m·h·B / ((ep - 1)/ep · F · bytes): no tokens, no d
    assert r["compute_over_transfer"] == pytest.approx(3 * 14336 * 50e9 / (7 / 8 * 400e12 * 2))
    other = all_to_all_vs_compute(512, 1024, 14336, 8, 2, 8, bandwidth=50e9, flops=400e12)
    assert other["compute_over_transfer"] == pytest.approx(r["compute_over_transfer"])
    assert all_to_all_vs_compute(64, 64, 256, 8, 2, 1, 50e9, 1e12)["compute_over_transfer"] == math.inf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_rows_travel_and_return_in_16_bit(dtype):
    """Rows cast to autocast's dtype before they go to the experts (as their first matmul would), the output in
    that dtype as a dense MLP's is; tokens routed alike agree with fp32 to 16-bit rounding."""
    torch.manual_seed(0)
    layer = MoEMLP(32, 64, MoEConfig(4, 2, None))
    x = torch.randn(2, 8, 32, device="cpu")
    want = layer(x)
    seen = []

    def runner(rows, counts, experts):
        seen.append(rows.dtype)
        return run_experts(rows, counts.tolist(), experts)
    layer.run_experts = runner
    with torch.autocast("cpu", dtype=dtype):
        got = layer(x)
        routed_16 = layer.router(x.reshape(16, 32)).experts
    routed_32 = layer.router(x.reshape(16, 32)).experts
    assert seen == [dtype] and got.dtype == dtype
    alike = (routed_16.sort(-1).values == routed_32.sort(-1).values).all(-1).view(2, 8)
    assert alike.sum() >= 12  # a near tie may flip a token's experts in 16 bits; most stay
    # 16-bit matmuls of width 32/64 and a weighted sum: errors of a few eps(16-bit) x the output's scale
    eps = torch.finfo(dtype).eps
    assert (got.float() - want).abs()[alike].max() <= 16 * eps * want.abs().max()
    got.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters() if p.grad is not None)


def test_calculator_holds_e_over_ep_experts_per_rank():
    """workbench calc's memory table with expert parallelism: parameters and gradients hold the dense part and
    E/ep experts per layer; sharded states (ZeRO-1's optimizer and masters) come to the same per rank either way,
    experts/ep over dp/ep ranks being experts over dp."""
    from workbench.theory.calculator import calculator_table
    from workbench.theory.expert import preset_expert_params
    from workbench.theory.models import MODEL_PRESETS

    shape = MODEL_PRESETS["mixtral-8x7B"]
    per_expert = preset_expert_params(shape)
    assert per_expert == 3 * 4096 * 14336
    experts_total = shape["n_layer"] * 8 * per_expert
    one, eight = (calculator_table("mixtral-8x7B", dp=64, zero_stage=1, ep=ep)["per_rank"] for ep in (1, 8))
    assert one["parameters"] == 2 * shape["n_params"]  # bf16 weights, every expert on every rank
    assert eight["parameters"] == 2 * (shape["n_params"] - experts_total + experts_total // 8)
    assert eight["gradients"] == eight["parameters"]
    for sharded in ("optimizer_state", "master_weights"):
        assert eight[sharded] == pytest.approx(one[sharded], rel=1e-12)
    assert calculator_table("llama-7B", dp=8, zero_stage=1)["notes"] == \
        calculator_table("llama-7B", dp=8, zero_stage=1, ep=1)["notes"]  # a dense model: nothing changes
    with pytest.raises(ValueError, match="ep"):
        calculator_table("mixtral-8x7B", dp=64, zero_stage=1, ep=3)


def test_calculator_prices_expert_gradients_over_the_ranks_holding_the_same_experts():
    """calc's dp traffic with expert parallelism: the dense part reduces over dp, each rank's E/ep experts over the
    dp/ep ranks that hold the same ones (``expert_dp``, the trainer's ``expert_data`` traffic), not every expert over
    dp. ZeRO-1 in bf16 (classic): reduce-scatter and all-gather of 2-byte values, (N-1)/N of each on the wire."""
    from workbench.theory.calculator import calculator_table
    from workbench.theory.expert import preset_expert_params
    from workbench.theory.models import MODEL_PRESETS

    shape = MODEL_PRESETS["mixtral-8x7B"]
    experts_total = shape["n_layer"] * 8 * preset_expert_params(shape)
    comm = calculator_table("mixtral-8x7B", dp=8, zero_stage=1, ep=4)["comm"]
    dense, local = shape["n_params"] - experts_total, experts_total // 4
    assert (comm["dp"]["group_size"], comm["expert_dp"]["group_size"]) == (8, 2)
    assert comm["dp"]["wire_bytes"] == pytest.approx(2 * 2 * dense * 7 / 8, rel=1e-12)
    assert comm["expert_dp"]["wire_bytes"] == pytest.approx(2 * 2 * local * 1 / 2, rel=1e-12)
    parts = sum(comm[a]["time_s"] for a in ("dp", "expert_dp", "cp", "tp", "pp"))
    assert comm["total_time_s"] == pytest.approx(parts, rel=1e-12)
    assert "expert_dp" not in calculator_table("llama-7B", dp=8, zero_stage=1)["comm"]  # a dense model: one dp row


# -- bad input ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(moe_experts=4, moe_top_k=5), r"moe top_k must be an int in \[1, experts=4\].*got 5"),
    (dict(moe_experts=4, moe_top_k=0), r"moe top_k must be an int in \[1, experts=4\].*got 0"),
    (dict(moe_experts=4, moe_capacity_factor=0), r"capacity_factor must be a finite number > 0.*or None.*got 0"),
    (dict(moe_experts=4, moe_capacity_factor=-1.5), r"capacity_factor .*got -1.5"),
    (dict(moe_experts=4, moe_capacity_factor=float("inf")), r"capacity_factor .*got inf"),
    (dict(moe_experts=-1), r"moe_experts must be an int >= 0 \(0: a dense MLP\), got -1"),
    (dict(moe_experts=2, moe_aux_loss_coef=-0.1), r"aux_loss_coef must be a finite number >= 0 .*got -0.1"),
])
def test_bad_moe_config_is_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_bad_ep_and_capacity_are_value_errors():
    with pytest.raises(ValueError, match=r"ep=3 does not divide experts=8 .*ep values that do: \[1, 2, 4, 8\]"):
        check_ep(8, 3)
    with pytest.raises(ValueError, match=r"ep=4 does not divide the 6 data-parallel ranks .*: \[1, 2\]"):
        check_ep(8, 4, world=6)
    with pytest.raises(ValueError, match=r"ep must be a positive int, got 0"):
        check_ep(8, 0)
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(64, 4, 2, 0.0)
    with pytest.raises(ValueError, match=r"top_k"):
        MoEConfig(experts=2, top_k=3)
    with pytest.raises(ValueError, match=r"ep_rank must be an int in \[0, ep=2\)"):
        experts_of_rank(4, 2, 2)
    assert isinstance(GPT(replace(SMALL, moe_experts=2)).blocks[0].mlp, MoEMLP)
