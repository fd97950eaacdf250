import math

import pytest
import torch
from equivalence import assert_close_to_scale
from torch import nn

from workbench.data import ShardedSampler, make_lm_data
from workbench.models import (
    GPT,
    PRESETS,
    GPTConfig,
    ToyMLP,
    build_gpt,
    build_mlp,
    build_model,
    regression_batch,
)


def unique_param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() already de-duplicates tied ones


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("build", [lambda s: build_gpt(GPTConfig.preset("tiny"), seed=s), build_mlp])
def test_deterministic_init_and_rng_untouched(build):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b, c = build(0), build(0), build(1)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert_same_state(a, b)
    pairs = zip(a.state_dict().values(), c.state_dict().values(), strict=True)
    assert any(not torch.equal(x, y) for x, y in pairs)


def test_gpt_tied_embeddings():
    model = build_gpt(GPTConfig.preset("tiny"))
    assert model.lm_head.weight is model.wte.weight
    untied = build_gpt(GPTConfig.preset("tiny", tie_embeddings=False))
    assert untied.lm_head.weight is not untied.wte.weight


def test_gpt_init_statistics():
    model = build_gpt(GPTConfig.preset("small"))
    block = model.blocks[0]
    assert torch.count_nonzero(block.attn.q.bias) == 0
    # sample statistics of the init draws: 10% is their sampling spread's room, rounding is 1e-7 of it
    assert block.mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert block.mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.1)


def test_gpt_forward_shapes_and_initial_loss():
    cfg = GPTConfig.preset("tiny")
    model = build_gpt(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    assert model(idx).shape == (3, cfg.seq_len, cfg.vocab_size)
    assert model(idx[:, :10]).shape == (3, 10, cfg.vocab_size)
    # Targets independent of the inputs: with tied embeddings, targets == inputs would be easier than chance.
    loss = model(idx, torch.randint(0, cfg.vocab_size, (3, cfg.seq_len)))
    assert loss.dim() == 0 and torch.isfinite(loss)
    # near-uniform predictions at init: 0.3 nats is the init's spread around chance, not a rounding bound
    assert loss.item() == pytest.approx(math.log(256), abs=0.3)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("tie", [True, False])
def test_num_params_matches_model(name, tie):
    cfg = GPTConfig.preset(name, tie_embeddings=tie)
    assert cfg.num_params() == unique_param_count(GPT(cfg))


def test_bench_preset_size():
    assert GPTConfig.preset("bench").num_params() == pytest.approx(10.8e6, rel=0.01)  # an int, named to 1%


def test_presets_and_overrides():
    cfg = GPTConfig.preset("small", seq_len=32)
    assert (cfg.n_layer, cfg.n_head, cfg.d_model, cfg.seq_len) == (4, 4, 128, 32)
    with pytest.raises(ValueError, match="tiny"):
        GPTConfig.preset("huge")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(d_model=64, n_head=3), "not divisible"),
        (dict(n_layer=0), "n_layer"),
        (dict(vocab_size=-1), "vocab_size"),
    ],
)
def test_invalid_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_invalid_head_count_suggests_divisors():
    with pytest.raises(ValueError, match=r"\[1, 2, 4, 8, 16, 32, 64\]"):
        GPTConfig(d_model=64, n_head=3)


def test_build_model_names():
    assert isinstance(build_model("mlp"), ToyMLP)
    assert isinstance(build_model("tiny", seq_len=16), GPT)
    with pytest.raises(ValueError, match="mlp"):
        build_model("resnet")


def test_gpt_loss_drops_on_corpus():
    cfg = GPTConfig.preset("tiny")
    model = build_gpt(cfg)
    data = make_lm_data(cfg.seq_len)
    sampler = ShardedSampler(len(data), global_batch=16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _, indices in zip(range(30), sampler, strict=False):
        loss = model(*data.get(indices))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0


def _column_shard(lin: nn.Linear, rows: slice) -> nn.Linear:
    out = nn.Linear(lin.in_features, rows.stop - rows.start)
    out.weight.data.copy_(lin.weight.data[rows])
    out.bias.data.copy_(lin.bias.data[rows])
    return out


def _row_shard(lin: nn.Linear, cols: slice, keep_bias: bool) -> nn.Linear:
    out = nn.Linear(cols.stop - cols.start, lin.out_features)
    out.weight.data.copy_(lin.weight.data[:, cols])
    out.bias.data.copy_(lin.bias.data if keep_bias else torch.zeros_like(lin.bias))
    return out


def test_attention_runs_with_column_sharded_heads():
    # Split each attention's heads in two halves, the way tensor parallelism does from outside; the two
    # partial outputs must sum to the unsharded output (the row-parallel proj's all-reduce).
    model = build_gpt(GPTConfig.preset("tiny", n_head=4))
    attn = model.blocks[0].attn
    x = torch.randn(2, 8, 64)
    full = attn(x)
    half = attn.head_dim * 2
    parts = []
    for r in range(2):
        shard = build_gpt(GPTConfig.preset("tiny", n_head=4)).blocks[0].attn
        cols = slice(r * half, (r + 1) * half)
        for name in ("q", "k", "v"):
            setattr(shard, name, _column_shard(getattr(attn, name), cols))
        shard.proj = _row_shard(attn.proj, cols, keep_bias=(r == 0))
        parts.append(shard(x))
    # the row-parallel proj's two partial matmuls sum the same products in another order
    assert_close_to_scale(parts[0] + parts[1], full, msg="sharded heads")


def test_toy_mlp_edge_cases():
    model = build_mlp()
    assert model.tied_a.weight is model.tied_b.weight
    assert not model.frozen_proj.weight.requires_grad
    assert "scale" in dict(model.named_buffers())
    assert isinstance(model.layers, nn.ModuleList) and len(model.layers) == 3
    names = [n for n, _ in model.named_parameters()]
    assert "tied_a.weight" in names and "tied_b.weight" not in names  # one Parameter, reported once
    x, y = regression_batch(8)
    assert model(x).shape == (8, 16)
    loss = model(x, y)
    loss.backward()
    assert model.frozen_proj.weight.grad is None and model.tied_a.weight.grad is not None


def test_regression_batch_deterministic_and_learnable():
    x0, y0 = regression_batch(4, seed=0, step=0)
    x1, y1 = regression_batch(4, seed=0, step=0)
    assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert not torch.equal(x0, regression_batch(4, seed=0, step=1)[0])
    assert not torch.equal(x0, regression_batch(4, seed=1, step=0)[0])
    model = build_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(150):
        loss = model(*regression_batch(32, step=step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10


def test_toy_mlp_invalid_size():
    with pytest.raises(ValueError, match="n_layers"):
        ToyMLP(n_layers=0)
