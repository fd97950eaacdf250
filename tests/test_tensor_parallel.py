"""Tensor parallelism: f/g and the split layers against unsplit ones, the vocab-parallel loss against
F.cross_entropy, the tp=2/4 tiny GPT against one process (gradients and 3 AdamW steps), against PyTorch's
DTensor ``parallelize_module``, the comm log against theory, and the divisibility errors.

Tolerances, all fp32 (tests/equivalence.py; they hold on any CPU, whatever order its SIMD width sums in):
* one forward/backward (layers, f/g, loss, the GPT's loss and gradients): split matmuls and all-reduces sum
  the same products in another order, so results agree within ROUNDOFF_K eps of their scale: a pair's own
  largest element, or for a model's gradients the largest gradient (attn.k.bias's true gradient is 0: softmax
  ignores a shift shared by all keys, so its computed one is the rounding of its terms).
  Measured: loss within 4.8e-7, gradients within 6.7e-8.
* after 3 AdamW steps (lr 1e-3): Adam divides by sqrt(v), so where a gradient element is rounding noise its
  update, up to ±lr, is decided by fp32 rounding: ``assert_adam_params_close``. Measured: max 3.2e-6 (tp=2)
  and 1.5e-5 (tp=4) on elements with signal; 4.1e-5 (tp=2) and 1.9e-4 (tp=4, an element of
  blocks.0.mlp.proj.weight whose step-0 gradient is 3.9e-9) on the noise-driven ones.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from equivalence import (
    assert_adam_params_close,
    assert_all_close_to_scale,
    assert_close_to_scale,
    gpt_batch,
    reference_train,
    scale_of,
)
from torch import nn

from workbench import launch, trace
from workbench.mesh import Mesh
from workbench.models import GPTConfig, build_gpt
from workbench.parallel.tensor import (
    BLOCK_PLAN,
    LOSS_TAG,
    TP_TAG,
    VOCAB_TAG,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_plan,
    apply_tensor_parallel,
    copy_to_tp_region,
    full_gradients,
    full_parameters,
    reduce_from_tp_region,
    vocab_parallel_cross_entropy,
)
from workbench.theory.comm import tp_block_collectives, tp_block_volume, tp_vocab_collectives

pytestmark = pytest.mark.numerics  # sums in another order: .ci/run's portable-ISA lane

STEPS = 3
BATCH = 4
SEQ = 16
# n_head=4 (the tiny preset has 2) so that tp=4 has a whole head per rank and tp=2 two.
TINY = GPTConfig.preset("tiny", seq_len=SEQ, n_head=4)
LR = 1e-3  # AdamW's default, as in reference_train
TIMEOUT = 60


def _pairs_close(pairs: dict, family: bool = False) -> None:
    """Each pair within ROUNDOFF_K eps of its own scale, or (``family``) of the largest of all: gradients whose
    terms cancel (attn.k.bias's) round at the scale of their terms, not at their own."""
    scale = scale_of(want for _, want in pairs.values()) if family else None
    for name, (got, want) in pairs.items():
        assert_close_to_scale(got, want, scale=scale, msg=name)


# -- (a) f, g and the column/row layers; (b) the vocab-parallel cross-entropy ------------------------------

def _seeded(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _f_and_g(rank: int, world: int) -> dict:
    x = _seeded(3, 5, 16, seed=1)
    a = x.clone().requires_grad_()
    out = copy_to_tp_region(a, None)
    (out * (rank + 1)).sum().backward()  # each rank's gradient differs: f's backward must sum them
    b = (x * (rank + 1)).requires_grad_()
    summed = reduce_from_tp_region(b, None)
    probe = _seeded(3, 5, 16, seed=2)
    (summed * probe).sum().backward()
    total = sum(range(1, world + 1))
    return {"f forward is the identity": (out, x), "f backward all-reduces": (a.grad, torch.full_like(x, total)),
            "g forward all-reduces": (summed, x * total), "g backward is the identity": (b.grad, probe)}


def _column_then_row(rank: int, world: int) -> dict:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        fc, proj = nn.Linear(16, 32), nn.Linear(32, 16)
    x, probe = _seeded(3, 5, 16, seed=3), _seeded(3, 5, 16, seed=4)
    x_ref = x.clone().requires_grad_()
    want = proj(F.gelu(fc(x_ref)))
    (want * probe).sum().backward()
    col, row = ColumnParallelLinear.from_linear(fc, None), RowParallelLinear.from_linear(proj, None)
    x_tp = x.clone().requires_grad_()
    got = row(F.gelu(col(x_tp)))
    (got * probe).sum().backward()
    mine = slice(rank * 32 // world, (rank + 1) * 32 // world)
    return {"output": (got, want), "input grad": (x_tp.grad, x_ref.grad),
            "column weight": (col.weight, fc.weight[mine]),
            "column weight grad": (col.weight.grad, fc.weight.grad[mine]),
            "column bias grad": (col.bias.grad, fc.bias.grad[mine]),
            "row weight grad": (row.weight.grad, proj.weight.grad[:, mine]),
            "row bias grad": (row.bias.grad, proj.bias.grad)}


def _embedding(rank: int, world: int) -> dict:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        full = nn.Embedding(32, 8)
    idx = torch.randint(0, 32, (3, 5), generator=torch.Generator().manual_seed(5))
    probe = _seeded(3, 5, 8, seed=6)
    want = full(idx)
    (want * probe).sum().backward()
    emb = VocabParallelEmbedding.from_embedding(full, None)
    got = emb(idx)
    (got * probe).sum().backward()
    mine = slice(rank * 32 // world, (rank + 1) * 32 // world)
    return {"embedding output": (got, want), "embedding grad": (emb.weight.grad, full.weight.grad[mine])}


def _cross_entropy(rank: int, world: int, scale: float) -> dict:
    logits, probe = _seeded(3, 7, 32, seed=7) * scale, _seeded(3, 7, seed=8)
    targets = torch.randint(0, 32, (3, 7), generator=torch.Generator().manual_seed(9))
    out = {}
    for reduction in ("mean", "sum", "none"):
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full.flatten(0, 1), targets.flatten(), reduction=reduction)
        want = want.view(3, 7) if reduction == "none" else want
        local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(local, targets, None, reduction=reduction)
        weights = probe if reduction == "none" else 1.0
        (want * weights).sum().backward()
        (got * weights).sum().backward()
        out[f"loss {reduction} x{scale}"] = (got, want)
        out[f"logit grad {reduction} x{scale}"] = (local.grad, full.grad.chunk(world, dim=-1)[rank])
    return out


def _layers_rank() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = {**_f_and_g(rank, world), **_column_then_row(rank, world), **_embedding(rank, world)}
    log = trace.current().trace.comms
    log.clear()
    for scale in (1.0, 1000.0):  # x1000: logits in the thousands, where an unshifted exp would overflow
        pairs.update(_cross_entropy(rank, world, scale))
    loss_bytes = {c.nbytes for c in log if c.tag == LOSS_TAG}
    return {"pairs": {k: (g.detach(), w.detach()) for k, (g, w) in pairs.items()}, "loss_bytes": loss_bytes,
            "loss_ops": {c.op for c in log}}


@pytest.mark.timeout(120)
def test_f_g_layers_and_vocab_parallel_loss_match_unsplit():
    for got in launch(_layers_rank, 2, device="cpu", timeout=TIMEOUT):
        _pairs_close(got["pairs"])
        # Never the logits: only per-token numbers cross ranks (21 tokens x 4 bytes of fp32).
        assert got["loss_bytes"] == {21 * 4} and got["loss_ops"] == {"all_reduce"}


# -- (c) the tiny GPT against one process; (e) its comm log against theory ---------------------------------

def _log_since(start: int) -> list[tuple[str, str, int, float]]:
    return [(c.tag, c.op, c.nbytes, c.bus_bytes) for c in trace.current().trace.comms[start:]]


def _gpt_rank(tp: int) -> dict:
    mesh = Mesh(tp=tp)
    model = apply_tensor_parallel(build_gpt(TINY, seed=0), mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    comms = trace.current().trace.comms
    out: dict = {}
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        start = len(comms)
        loss = model(*gpt_batch(step, BATCH, seq_len=SEQ))  # every tp rank sees the whole batch
        middle = len(comms)
        loss.backward()
        if step == 0:
            out.update(loss=loss.detach(), forward=_log_since(start)[: middle - start], backward=_log_since(middle))
            out["grads"] = full_gradients(model, mesh)
        optimizer.step()
    out["params"] = full_parameters(model, mesh)
    out["local_shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return out


def _reference_step0() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build_gpt(TINY, seed=0)
    loss = model(*gpt_batch(0, BATCH, seq_len=SEQ))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_comm_log_is_theory(got: dict, tp: int) -> None:
    d, layers = TINY.d_model, TINY.n_layer
    block, vocab = tp_block_collectives(BATCH, SEQ, d), tp_vocab_collectives(BATCH, SEQ, d)
    for phase in ("forward", "backward"):
        log = got[phase]
        assert {tag for tag, *_ in log} <= {TP_TAG, VOCAB_TAG, LOSS_TAG}, f"{phase}: unexpected collectives"
        assert [(op, n) for tag, op, n, _ in log if tag == TP_TAG] == block[phase] * layers, phase
        assert sorted((op, n) for tag, op, n, _ in log if tag != TP_TAG) == sorted(vocab[phase]), phase
    per_block = [sum(n for tag, _, n, _ in got[p] if tag == TP_TAG) for p in ("forward", "backward")]
    wire = sum(b for p in ("forward", "backward") for tag, _, _, b in got[p] if tag == TP_TAG)
    volume = tp_block_volume(BATCH, SEQ, d, tp)
    assert sum(per_block) / layers == volume["tensor"] == 4 * BATCH * SEQ * d * 4
    assert wire / layers == pytest.approx(volume["ring_wire"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_gpt_matches_single_process_and_theory(tp):
    results = launch(_gpt_rank, tp, tp, device="cpu", timeout=TIMEOUT)
    want_loss, want_grads = _reference_step0()
    want_params = reference_train(lambda: build_gpt(TINY, seed=0), lambda s: gpt_batch(s, BATCH, seq_len=SEQ),
                                  steps=STEPS)
    for rank, got in enumerate(results):
        assert got["local_shapes"]["blocks.0.attn.q.weight"] == (TINY.d_model // tp, TINY.d_model)
        assert got["local_shapes"]["wte.weight"] == (TINY.vocab_size // tp, TINY.d_model)
        assert_close_to_scale(got["loss"], want_loss, msg="loss")
        assert_all_close_to_scale(got["grads"], want_grads, msg=f"rank {rank} grad ")
        assert_adam_params_close(got["params"], want_params, want_grads, STEPS * LR, msg=f"rank {rank} param ")
        _assert_comm_log_is_theory(got, tp)


def test_tp1_is_the_plain_model_and_names_survive():
    want_loss, want_grads = _reference_step0()
    model = apply_tensor_parallel(build_gpt(TINY, seed=0), Mesh())
    loss = model(*gpt_batch(0, BATCH, seq_len=SEQ))
    loss.backward()
    assert_close_to_scale(loss, want_loss, msg="loss")
    assert_all_close_to_scale(full_gradients(model, Mesh()), want_grads)
    assert model.lm_head.weight is model.wte.weight, "the tie survives as one Parameter"
    assert model(gpt_batch(0, BATCH, seq_len=SEQ)[0]).shape == (BATCH, SEQ, TINY.vocab_size)


# -- (d) against torch.distributed.tensor.parallel on the same weights -------------------------------------

def _dtensor_rank() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    ours = build_gpt(TINY, seed=0).blocks[0]  # one block: attention (heads split) and MLP
    theirs = copy.deepcopy(ours)
    apply_plan(ours, BLOCK_PLAN, None)
    styles = {"column": ColwiseParallel, "row": RowwiseParallel}
    parallelize_module(theirs, init_device_mesh("cpu", (dist.get_world_size(),)),
                       {name: styles[style]() for name, style in BLOCK_PLAN.items() if style in styles})
    x, probe = _seeded(BATCH, SEQ, TINY.d_model, seed=10), _seeded(BATCH, SEQ, TINY.d_model, seed=11)
    out = {}
    for key, block in (("ours", ours), ("torch", theirs)):
        xi = x.clone().requires_grad_()
        y = block(xi)
        (y * probe).sum().backward()
        local = {n: getattr(p.grad, "to_local", lambda g=p.grad: g)() for n, p in block.named_parameters()}
        out[key] = {"output": y.detach(), "input grad": xi.grad, **local}
    return out


@pytest.mark.timeout(120)
def test_block_matches_dtensor_colwise_rowwise():
    for got in launch(_dtensor_rank, 2, device="cpu", timeout=TIMEOUT):
        assert list(got["ours"]) == list(got["torch"])
        _pairs_close({k: (got["ours"][k], got["torch"][k]) for k in got["ours"]}, family=True)


# -- (f) bad input: a clear error before anything is split or communicated ---------------------------------

@pytest.mark.parametrize("overrides, tp, message", [
    ({"n_head": 2}, 4, r"tp=4 must divide the GPT's n_head=2.*not divisible: n_head=2\. Valid tp values "
                       r"for this model: 1, 2$"),
    ({"n_head": 4}, 3, r"not divisible: n_head=4, mlp hidden=256, vocab_size=256\. Valid tp values .*: 1, 2, 4$"),
    ({"n_head": 4, "vocab_size": 254}, 4, r"not divisible: vocab_size=254\. Valid tp values .*: 1, 2$"),
])
def test_sizes_tp_does_not_divide_are_a_clear_error(overrides, tp, message):
    model = build_gpt(GPTConfig.preset("tiny", seq_len=SEQ, **overrides))
    with pytest.raises(ValueError, match=message):
        apply_tensor_parallel(model, Mesh(tp=tp))  # a planning mesh: no process group, no collective
    assert type(model.blocks[0].attn.q) is nn.Linear, "nothing was split before the error"


def test_layer_and_plan_errors_name_the_fix():
    with pytest.raises(ValueError, match="out_features=10 is not divisible by tp=4; valid tp values: 1, 2, 5, 10"):
        ColumnParallelLinear.from_linear(nn.Linear(8, 10), Mesh(tp=4))
    with pytest.raises(ValueError, match="in_features=6 is not divisible by tp=4"):
        RowParallelLinear.from_linear(nn.Linear(6, 8), Mesh(tp=4))
    model = build_gpt(TINY)
    with pytest.raises(ValueError, match="unknown style 'diagonal'"):
        apply_plan(model, {"blocks.0.mlp.fc": "diagonal"}, Mesh(tp=2))
    with pytest.raises(ValueError, match="no module 'blocks.9.mlp'"):
        apply_plan(model, {"blocks.9.mlp": "copy_input"}, Mesh(tp=2))
    with pytest.raises(ValueError, match="'blocks.0.ln1' is a LayerNorm; style 'column' needs nn.Linear"):
        apply_plan(model, {"blocks.0.ln1": "column"}, Mesh(tp=2))
    with pytest.raises(ValueError, match=r"wte.weight and lm_head.weight are tied but would be split differently"):
        apply_plan(model, {"wte": "vocab_embedding"}, Mesh(tp=2))
    # A mesh made outside launch plans a layout; running it would make every collective a silent no-op.
    with pytest.raises(ValueError, match=r"tp=2 but the tp process group has 1 rank\(s\); run this inside "
                                         r"workbench.launch\(fn, 2\)"):
        apply_tensor_parallel(model, Mesh(tp=2))
    assert type(model.wte) is nn.Embedding, "nothing was split before the errors"

