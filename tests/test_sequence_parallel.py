"""Sequence parallelism (Korthikanti et al. 2022, §4.2.2): g and ḡ against the unsplit computation, one
SP block against the plain block, the tp=2 tiny GPT through the composer against one process (gradients and
3 AdamW steps), its comm log against ``theory.comm.sp_*``, the ledger's activation bytes against
``theory.memory.gpt_*activation_bytes``, the bad-input errors, and the old import path
(``workbench.parallel.sequence``) as an alias of ``workbench.parallel.tensor.sequence``.

All the multi-rank work runs in one 2-rank launch (a module fixture), to keep the file fast on 2 cores.

Tolerances, all fp32 (tests/equivalence.py, the reasoning of tests/test_tensor_parallel.py; any CPU):
* one forward/backward (g, ḡ, the SP layers and block, the GPT's loss and gradients): gathers and
  reduce-scatters sum the same products in another order, so results agree within ROUNDOFF_K eps of their
  scale (a pair's own, or a model's or block's largest gradient for its gradients). Measured: loss within
  4.8e-7, gradients within 6.9e-8 of one process; the layer/block checks of (a) within 2.9e-6 (absolute, on
  outputs of order 1).
* after 3 AdamW steps (lr 1e-3): ``assert_adam_params_close`` (tight where the step-0 gradient carries signal,
  up to Adam's reach where it is rounding noise). Measured: max 3.1e-6 on the signal elements, 4.1e-5 on the
  noise-driven ones (the same as TP at tp=2).
* bytes (comm log, activations) are counts: theory must match them exactly (tolerance 0 bytes).
"""

from __future__ import annotations

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
from workbench.parallel import ParallelConfig, parallelize
from workbench.parallel.tensor import (
    BLOCK_PLAN,
    LOSS_TAG,
    apply_plan,
    apply_tensor_parallel,
    full_gradients,
    tp_group_of,
)
from workbench.parallel.tensor.sequence import (
    SP_GRAD_TAG,
    SP_TAG,
    SP_VOCAB_TAG,
    SequenceParallelStyles,
    all_reduce_sequence_parallel_grads,
    apply_sequence_parallel,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    sequence_parallel_parameters,
)
from workbench.theory.comm import (
    bus_bytes,
    sp_block_collectives,
    sp_block_volume,
    sp_grad_collectives,
    sp_vocab_collectives,
    tp_block_collectives,
    tp_block_volume,
)
from workbench.theory.memory import activation_bytes, gpt_activation_bytes, gpt_block_activation_bytes

pytestmark = pytest.mark.numerics  # sums in another order: .ci/run's portable-ISA lane

TP = 2
STEPS = 3
BATCH = 4
SEQ = 16
TINY = GPTConfig.preset("tiny", seq_len=SEQ, n_head=4)  # 2 heads per tp rank
LR = 1e-3
TIMEOUT = 60
# AdamW's defaults, which reference_train uses.
ADAMW = dict(lr=LR, weight_decay=0.01, betas=(0.9, 0.999))


def _pairs_close(pairs: dict, family: bool = False) -> None:
    """Each pair within ROUNDOFF_K eps of its own scale, or (``family``) of the largest of all: gradients whose
    terms cancel (attn.k.bias's) round at the scale of their terms, not at their own."""
    scale = scale_of(want for _, want in pairs.values()) if family else None
    for name, (got, want) in pairs.items():
        assert_close_to_scale(got, want, scale=scale, msg=name)


def _seeded(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _mine(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's positions of a [b, s, ...] tensor."""
    return t.chunk(world, dim=1)[rank]


# -- rank side: (a) g, ḡ, the SP layers and one block ------------------------------------------------------

def _g_and_g_bar(rank: int, world: int) -> dict:
    x, probe = _seeded(3, 8, 16, seed=1), _seeded(3, 8, 16, seed=2)
    shard = _mine(x, rank, world).clone().requires_grad_()
    gathered = gather_from_sequence_parallel_region(shard, None)
    (gathered * (rank + 1)).sum().backward()  # each rank's dL/dX differs: g's backward must sum them
    partial = (x * (rank + 1)).requires_grad_()  # a row layer's partial products
    scattered = reduce_scatter_to_sequence_parallel_region(partial, None)
    (scattered * _mine(probe, rank, world)).sum().backward()
    total = sum(range(1, world + 1))
    return {"g forward all-gathers": (gathered, x),
            "g backward reduce-scatters": (shard.grad, torch.full_like(shard, total)),
            "ḡ forward reduce-scatters": (scattered, _mine(x * total, rank, world)),
            "ḡ backward all-gathers": (partial.grad, probe)}


def _sp_mlp(rank: int, world: int) -> dict:
    """Column (stores the shard, re-gathers in backward) -> GeLU -> row ending in ḡ, against nn.Linear."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        fc, proj = nn.Linear(16, 32), nn.Linear(32, 16)
    x, probe = _seeded(3, 8, 16, seed=3), _seeded(3, 8, 16, seed=4)
    x_ref = x.clone().requires_grad_()
    want = proj(F.gelu(fc(x_ref)))
    (want * probe).sum().backward()
    styles = SequenceParallelStyles(tp_group_of(None))
    layers = nn.ModuleList([styles.column(fc, None), styles.row(proj, None)])
    x_sp = _mine(x, rank, world).clone().requires_grad_()
    got = layers[1](F.gelu(layers[0](x_sp)))
    (got * _mine(probe, rank, world)).sum().backward()
    all_reduce_sequence_parallel_grads(layers, None)  # the row bias was added to this rank's positions only
    cols = slice(rank * 32 // world, (rank + 1) * 32 // world)
    col, row = layers
    return {"mlp output": (got, _mine(want, rank, world)),
            "mlp input grad": (x_sp.grad, _mine(x_ref.grad, rank, world)),
            "column weight grad": (col.weight.grad, fc.weight.grad[cols]),
            "column bias grad": (col.bias.grad, fc.bias.grad[cols]),
            "row weight grad": (row.weight.grad, proj.weight.grad[:, cols]),
            "row bias grad (summed over tp)": (row.bias.grad, proj.bias.grad)}


def _saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """Run ``fn()`` under the active tracer's saved-tensor hooks; the activation bytes it saved."""
    tracer = trace.current()
    with tracer.activations():
        out = fn()
    saved = tracer.memory.current["activations"]
    tracer.release_activations()
    return out, saved


def _sp_block(rank: int, world: int) -> dict:
    """One GPT block by ``BLOCK_PLAN`` with SP's styles, on this rank's positions, against the plain block;
    the bytes it saves with TP and with TP+SP."""
    plain, tp_block, sp_block = (build_gpt(TINY, seed=0).blocks[0] for _ in range(3))
    apply_plan(tp_block, BLOCK_PLAN, None)
    apply_plan(sp_block, BLOCK_PLAN, None, styles=SequenceParallelStyles)
    x, probe = _seeded(BATCH, SEQ, TINY.d_model, seed=5), _seeded(BATCH, SEQ, TINY.d_model, seed=6)
    x_ref = x.clone().requires_grad_()
    want = plain(x_ref)
    (want * probe).sum().backward()
    # clone(): the block's input must not be a leaf, or the ledger would take LayerNorm's saved input for a parameter
    _, tp_saved = _saved_bytes(lambda: tp_block(x.clone().requires_grad_().clone()))
    x_sp = _mine(x, rank, world).clone().requires_grad_()
    got, sp_saved = _saved_bytes(lambda: sp_block(x_sp.clone()))
    (got * _mine(probe, rank, world)).sum().backward()
    all_reduce_sequence_parallel_grads(sp_block, None)
    grads = full_gradients(sp_block, None)
    pairs = {"block output": (got, _mine(want, rank, world)),
             "block input grad": (x_sp.grad, _mine(x_ref.grad, rank, world))}
    pairs.update({f"block grad {n}": (grads[n], p.grad) for n, p in plain.named_parameters()})
    return {"pairs": pairs, "tp_saved": tp_saved, "sp_saved": sp_saved}


# -- rank side: (b)-(d) the tiny GPT through the composer ---------------------------------------------------

def _log(start: int, stop: int | None = None) -> list[tuple[str, str, int, float]]:
    return [(c.tag, c.op, c.nbytes, c.bus_bytes) for c in trace.current().trace.comms[start:stop]]


def _gpt_steps() -> dict:
    mesh = Mesh(tp=TP)
    run = parallelize(build_gpt(TINY, seed=0), mesh, ParallelConfig(sp=True, **ADAMW))
    comms, out = trace.current().trace.comms, {"describe": run.describe}
    for step in range(STEPS):
        run.optimizer.zero_grad(set_to_none=True)
        marks = [len(comms)]
        loss, saved = _saved_bytes(lambda s=step: run.model(*gpt_batch(s, BATCH, seq_len=SEQ)))
        marks.append(len(comms))
        loss.backward()
        marks.append(len(comms))
        run.finish_grad_sync()
        marks.append(len(comms))
        if step == 0:
            out.update(loss=loss.detach(), activations=saved, forward=_log(marks[0], marks[1]),
                       backward=_log(marks[1], marks[2]), sync=_log(marks[2], marks[3]),
                       grads=full_gradients(run.model, mesh))
        run.optimizer.step()
    out["params"] = run.full_parameters()
    out["sp_params"] = [n for n, _ in sequence_parallel_parameters(run.model)]
    x, y = gpt_batch(0, BATCH, seq_len=SEQ - 1)  # 15 positions over 2 ranks
    try:
        run.model(x, y)
    except ValueError as e:
        out["odd_length_error"] = str(e)
    return out


def _tp_activations() -> int:
    model = apply_tensor_parallel(build_gpt(TINY, seed=0), Mesh(tp=TP))
    return _saved_bytes(lambda: model(*gpt_batch(0, BATCH, seq_len=SEQ)))[1]


def _rank() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = {**_g_and_g_bar(rank, world), **_sp_mlp(rank, world)}
    block = _sp_block(rank, world)
    pairs.update(block.pop("pairs"))
    return {"pairs": {k: (g.detach(), w.detach()) for k, (g, w) in pairs.items()}, **block,
            "gpt": _gpt_steps(), "tp_activations": _tp_activations()}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launch(_rank, TP, device="cpu", timeout=TIMEOUT)


# -- (a) ----------------------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_g_g_bar_layers_and_block_match_unsplit(ranks):
    for got in ranks:
        block_grads = {k: v for k, v in got["pairs"].items() if k.startswith("block grad ")}
        _pairs_close({k: v for k, v in got["pairs"].items() if k not in block_grads})
        _pairs_close(block_grads, family=True)


# -- (b) ----------------------------------------------------------------------------------------------------

def _reference_step0() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build_gpt(TINY, seed=0)
    loss = model(*gpt_batch(0, BATCH, seq_len=SEQ))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_sp_gpt_matches_single_process(ranks):
    want_loss, want_grads = _reference_step0()
    want_params = reference_train(lambda: build_gpt(TINY, seed=0), lambda s: gpt_batch(s, BATCH, seq_len=SEQ),
                                  steps=STEPS)
    for rank, got in enumerate(ranks):
        gpt = got["gpt"]
        assert gpt["describe"].startswith("TP=2 + SP + ")
        assert sorted(gpt["sp_params"]) == sorted(
            ["wpe.weight", "ln_f.weight", "ln_f.bias"] + [f"blocks.{i}.{n}" for i in range(TINY.n_layer) for n in (
                "ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn.proj.bias", "mlp.proj.bias")])
        assert_close_to_scale(gpt["loss"], want_loss, msg="loss")
        assert_all_close_to_scale(gpt["grads"], want_grads, msg=f"rank {rank} grad ")
        assert_adam_params_close(gpt["params"], want_params, want_grads, STEPS * LR, msg=f"rank {rank} param ")


# -- (c) ----------------------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_sp_comm_log_is_theory(ranks):
    d, layers = TINY.d_model, TINY.n_layer
    block, ends = sp_block_collectives(BATCH, SEQ, d), sp_vocab_collectives(BATCH, SEQ, d)
    for got in ranks:
        gpt = got["gpt"]
        for phase in ("forward", "backward"):
            log = gpt[phase]
            assert {tag for tag, *_ in log} <= {SP_TAG, SP_VOCAB_TAG, LOSS_TAG}, f"{phase}: unexpected collectives"
            # Inside the blocks: all-gathers and reduce-scatters only, in theory's order.
            assert [(op, n) for tag, op, n, _ in log if tag == SP_TAG] == block[phase] * layers, phase
            assert sorted((op, n) for tag, op, n, _ in log if tag != SP_TAG) == sorted(ends[phase]), phase
        assert [(op, n) for tag, op, n, _ in gpt["sync"]] == sp_grad_collectives(d, layers, SEQ)
        assert {tag for tag, *_ in gpt["sync"]} == {SP_GRAD_TAG}
        events = [e for p in ("forward", "backward") for e in gpt[p] if e[0] == SP_TAG]
        volume = sp_block_volume(BATCH, SEQ, d, TP)
        assert sum(n for _, _, n, _ in events) / layers == volume["tensor"] == 10 * BATCH * SEQ * d * 4
        assert sum(b for *_, b in events) / layers == pytest.approx(volume["ring_wire"])
        # Forward: g and ḡ put exactly TP's all-reduce bytes on the wire; backward adds the 2 re-gathers.
        forward_wire = sum(b for tag, _, _, b in gpt["forward"] if tag == SP_TAG) / layers
        size = BATCH * SEQ * d * 4
        assert forward_wire == pytest.approx(sum(bus_bytes(op, s, TP) for op, s in tp_block_collectives(
            BATCH, SEQ, d)["forward"]))
        assert volume["ring_wire"] - tp_block_volume(BATCH, SEQ, d, TP)["ring_wire"] == pytest.approx(
            2 * bus_bytes("all_gather", size, TP))


def test_sp_theory_hand_checked():
    b, s, h, a, t = 8, 16, 64, 4, 2
    x_bytes = b * s * h * 4
    assert sp_block_collectives(b, s, h, regather=False) == {
        "forward": [("all_gather", x_bytes), ("reduce_scatter", x_bytes)] * 2,
        "backward": [("all_gather", x_bytes), ("reduce_scatter", x_bytes)] * 2}
    # Without the re-gathers SP is TP's bytes exactly: an all-reduce is a reduce-scatter + an all-gather.
    for key in ("logical", "ring_wire"):
        assert sp_block_volume(b, s, h, t, regather=False)[key] == tp_block_volume(b, s, h, t)[key]
    assert sp_block_volume(b, s, h, 4)["ring_wire"] == pytest.approx(10 * 0.75 * x_bytes)
    assert sp_grad_collectives(h, 2, s) == [("all_reduce", (6 * 2 + 2 + s) * h * 4)]
    # The paper's 16-bit counts less its two 1-byte dropout masks: sbh(8 + 24/t) with TP, 32/t with SP.
    sbh, small = s * b * h, 16 * s * b + 4 * a * s * b
    assert gpt_block_activation_bytes(b, s, h, a, t, bytes_per_value=2) == sbh * (8 + 24 / t) + 16 * s * b + \
        4 * a * s * b / t
    assert gpt_block_activation_bytes(b, s, h, a, t, True, bytes_per_value=2) == (sbh * 32 + small) / t
    paper = activation_bytes(b, s, h, 1, a, 2, tp=t) - activation_bytes(b, s, h, 1, a, 2, tp=t, recompute="selective")
    assert paper == pytest.approx(5 * a * s * s * b / t)  # the as² term the fused attention kernel avoids


# -- (d) ----------------------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_sp_activation_bytes_are_theory(ranks):
    shape = dict(batch=BATCH, seq_len=SEQ, d_model=TINY.d_model, n_head=TINY.n_head, tp=TP)
    whole = dict(shape, n_layer=TINY.n_layer, vocab_size=TINY.vocab_size)
    tp_theory, sp_theory = gpt_activation_bytes(**whole), gpt_activation_bytes(**whole, sequence_parallel=True)
    for got in ranks:
        assert got["tp_saved"] == gpt_block_activation_bytes(**shape)  # 165,376 bytes per block
        assert got["sp_saved"] == gpt_block_activation_bytes(**shape, sequence_parallel=True)  # 132,096
        assert got["tp_activations"] == tp_theory["total"]  # 398,080 bytes per rank
        assert got["gpt"]["activations"] == sp_theory["total"]  # 314,880
        assert got["tp_activations"] - got["gpt"]["activations"] == tp_theory["total"] - sp_theory["total"] > 0


# -- (e) ----------------------------------------------------------------------------------------------------

def test_sp_without_tp_is_an_error():
    with pytest.raises(ValueError, match=r"sp \(sequence parallelism\) needs tp > 1"):
        parallelize(build_gpt(TINY), Mesh(), ParallelConfig(sp=True))


def test_seq_len_not_divisible_is_an_error(ranks):
    model = build_gpt(GPTConfig.preset("tiny", seq_len=15, n_head=4))
    message = (r"sequence parallel tp=2 must divide the GPT's seq_len=15 \(each rank keeps seq_len/tp "
               r"positions\); valid tp values for this seq_len: 1, 3, 5, 15")
    with pytest.raises(ValueError, match=message):
        apply_sequence_parallel(model, Mesh(tp=2))  # a planning mesh: raised before any group is needed
    with pytest.raises(ValueError, match=message):
        parallelize(model, Mesh(tp=2), ParallelConfig(sp=True))
    assert type(model.blocks[0].attn.q) is nn.Linear, "nothing was split before the error"
    for got in ranks:  # a batch of 15 positions on a 16-position model: refused before any collective
        assert "sequence length 15 is not divisible by tp=2" in got["gpt"]["odd_length_error"]


# -- (f) ----------------------------------------------------------------------------------------------------

def test_old_path_is_the_same_module():
    """Sequence parallelism lives in the tensor-parallel strategy (issue 19); its old path is an alias of that
    module, not a copy: one set of classes, tags and functions, whichever path a learner imports."""
    import workbench.parallel.sequence as old
    import workbench.parallel.tensor as tensor
    import workbench.parallel.tensor.sequence as new

    assert old is new and tensor.sequence is new
    assert old.SequenceParallelStyles is SequenceParallelStyles and issubclass(new.SequenceParallelStyles,
                                                                               tensor.TensorParallelStyles)
    from workbench.parallel.sequence import apply_sequence_parallel as via_old_path
    assert via_old_path is apply_sequence_parallel is tensor.apply_sequence_parallel
