"""Gradient compression (workbench/parallel/compression.py, workbench/theory/compression.py): error feedback loses
nothing, full-rank PowerSGD is an all-reduce, the comm log's bytes are theory's, ``none`` is plain DDP bit for bit,
every compressor through every DDP kind, a short training run per compressor, state round trips, bad inputs.

All multi-rank work runs in one 2-rank launch (a module fixture) to keep the file fast on 2 cores.

Tolerances, fp32 (tests/equivalence.py's reasoning):
* error feedback: in exact arithmetic sum_t applied_t + mean_w e_w = mean_w sum_t g_w,t. In fp32 each step rounds
  p = g + e, e' = p - sent, and the average of N = 2 contributions (N - 1 additions, a division): at most N + 2
  roundings of half an ulp at the step's scale S = max|g| + max|e| + max|applied|. Over T steps the bound is
  T (N + 2) eps S (a factor 2 over the half ulps); the sums themselves are taken in fp64. Measured: at most
  0.01 of the bound (all three), while what was dropped and carried is 6e4 times the bound.
* full-rank PowerSGD: P_hat P_hat^T M is M up to the rounding of a QR and two products of length <= 24, amplified
  by the condition number of P = M Q: within ROUNDOFF_K eps of the gradients' scale, the bound for one
  collective. Measured: 2.7 eps.
* a DDP kind's step-0 gradients against one reference compression of per-tensor units: the same arithmetic on the
  same numbers, except PowerSGD's products and sign's means over views at other offsets (another summation order
  at most): ROUNDOFF_K eps of the family's scale. Measured: 0 (bit for bit) for every kind and compressor.
* bytes are counts: the comm log must equal theory exactly (0 bytes tolerance).
* convergence (a band, not a bound: compression is lossy by design): the toy MLP, SGD lr 0.05, global batch 16,
  40 steps from loss 0.83; uncompressed reaches 0.209 (mean of the last 5 steps). Measured final / uncompressed:
  bf16 1.000, powersgd (rank 4) 1.007, sign 1.014, top-k (1%) 1.18. Band: <= BAND (1.35), and every compressor
  must at least have halved the starting loss.
"""

from __future__ import annotations

import math

import pytest
import torch
from equivalence import ROUNDOFF_K, assert_all_close_to_scale, assert_close_to_scale, eps, mlp_batch, shard

from workbench import launch, trace
from workbench.dist import comm
from workbench.models import build_mlp
from workbench.parallel.compression import (
    COMPRESSIONS,
    Compressor,
    PowerSGDCompressor,
    SignCompressor,
    TopKCompressor,
    make_compressor,
)
from workbench.parallel.ddp import DDP_KINDS, make_ddp
from workbench.theory.compression import per_tensor_units, powersgd_plan, step_bytes, step_collectives, topk_k

pytestmark = [pytest.mark.numerics, pytest.mark.timeout(120)]

WORLD = 2
EF_SCHEMES = ("powersgd", "topk", "sign")
# A unit as flat/bucketed DDP hands it over: matrices PowerSGD compresses (rank 2), a vector it does not, a 3-D
# tensor it views as 8 x 12; sizes not multiples of 8, so packed signs need padding.
UNIT = [(24, 16), (16,), (8, 3, 4), (5, 7)]
EF_STEPS = 6
DDP_STEPS = 3
MLP_BUCKET_MB = 0.004  # several buckets for the toy MLP (as tests/test_ddp.py)
TRAIN_STEPS, TRAIN_BATCH, TRAIN_LR = 40, 16, 0.05
BAND = 1.35


def _compressor(name: str, **kwargs) -> Compressor:
    if name == "powersgd":
        return PowerSGDCompressor(rank=kwargs.pop("rank", 2), **kwargs)
    return make_compressor(name, topk_ratio=0.1, **kwargs) if name == "topk" else make_compressor(name, **kwargs)


def _grads(rank: int, step: int, shapes=UNIT) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(1000 * rank + step)
    parts = [torch.randn(math.prod(s), generator=g, device="cpu") * (1 + i) for i, s in enumerate(shapes)]
    return torch.cat(parts)


def _reduce(comp: Compressor, flat: torch.Tensor, shapes=UNIT) -> torch.Tensor:
    out = flat.clone()
    comp.reduce(out, None, shapes=shapes, key=0).wait()
    comp.end_step()
    return out


# -- rank side -------------------------------------------------------------------------------------------------

def _error_feedback(rank: int) -> dict:
    out = {}
    for name in EF_SCHEMES:
        comp = _compressor(name)
        sum_g = sum_applied = 0
        scale = 0.0
        for step in range(EF_STEPS):
            g = _grads(rank, step)
            applied = _reduce(comp, g)
            e = comp.residuals()[0]
            sum_g, sum_applied = sum_g + g.double(), sum_applied + applied.double()
            scale = max(scale, float(g.abs().max() + e.abs().max() + applied.abs().max()))
        plain = sum(_grads(r, s) for r in range(WORLD) for s in range(EF_STEPS)).double() / WORLD
        out[name] = {"sum_g": sum_g, "sum_applied": sum_applied, "residual": comp.residuals()[0].double(),
                     "scale": scale, "lossy": float((sum_applied - plain).abs().max())}
    return out


def _full_rank(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    comp = PowerSGDCompressor(rank=64, min_compression_rate=0)  # every matrix compressed, at rank min(n, m)
    pairs = []
    for step in range(3):
        g = _grads(rank, step)
        plain = g.clone()
        comm.all_reduce(plain, "avg")
        pairs.append((_reduce(comp, g), plain))
    return pairs


def _state_round_trip(rank: int) -> dict:
    out = {}
    for name in EF_SCHEMES:
        first = _compressor(name)
        for step in range(2):
            _reduce(first, _grads(rank, step))
        second = _compressor(name)
        second.load_state_dict(first.state_dict())
        a, b = _reduce(first, _grads(rank, 2)), _reduce(second, _grads(rank, 2))
        out[name] = torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(
            first.residuals().values(), second.residuals().values(), strict=True)) and second.step == 3
    return out


def _local_grads(rank: int, seed: int = 0) -> list[torch.Tensor]:
    """This rank's step-0 gradients of the toy MLP, without any wrapper."""
    model = build_mlp(seed=seed)
    model(*shard(mlp_batch(0, 8), rank, WORLD)).backward()
    return [p.grad for p in model.parameters() if p.requires_grad]


def _reference_step0(name: str, rank: int) -> list[torch.Tensor]:
    """Step 0 compressed one gradient at a time (naive DDP's units): the reference every kind must match."""
    comp, grads = _compressor(name), _local_grads(rank)
    for i, g in enumerate(grads):
        comp.reduce(g, None, key=i).wait()
    return grads


def _train_ddp(kind: str, name: str | None, rank: int) -> dict:
    comp = None if name is None else _compressor(name)
    ddp = make_ddp(build_mlp(seed=0), kind, bucket_mb=MLP_BUCKET_MB, compressor=comp)
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=TRAIN_LR)
    tracer = trace.current()
    tracer.trace.comms.clear()
    step0 = None
    for step in range(DDP_STEPS):
        opt.zero_grad()
        ddp(*shard(mlp_batch(step, 8), rank, WORLD)).backward()
        ddp.finish_gradient_synchronization()
        step0 = step0 or [p.grad.clone() for p in ddp.parameters() if p.requires_grad]
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in ddp.named_parameters()}, "step0": step0,
            "ops": sorted((c.op, c.nbytes) for c in tracer.trace.comms if c.tag == "grad"),
            "units": [[tuple(s) for s in unit] for unit in ddp.reduction_units()],
            "history": None if comp is None else comp.history}


def _kinds(rank: int) -> dict:
    out = {(kind, name): _train_ddp(kind, name, rank) for kind in DDP_KINDS for name in (None, *COMPRESSIONS)}
    out["reference"] = {name: _reference_step0(name, rank) for name in COMPRESSIONS}
    comp = PowerSGDCompressor(rank=2, warmup_steps=2)
    ddp = make_ddp(build_mlp(seed=0), "bucketed", bucket_mb=MLP_BUCKET_MB, compressor=comp)
    for step in range(3):
        ddp(*shard(mlp_batch(step, 8), rank, WORLD)).backward()
        ddp.finish_gradient_synchronization()
    out["warmup"] = comp.history
    return out


def _converge(rank: int) -> dict[str, list[float]]:
    out = {}
    for name in COMPRESSIONS:
        ddp = make_ddp(build_mlp(seed=0), "bucketed", bucket_mb=MLP_BUCKET_MB, compressor=name)
        opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=TRAIN_LR)
        losses = []
        for step in range(TRAIN_STEPS):
            opt.zero_grad()
            loss = ddp(*shard(mlp_batch(step, TRAIN_BATCH), rank, WORLD))
            loss.backward()
            ddp.finish_gradient_synchronization()
            opt.step()
            losses.append(loss.item())
        out[name] = losses
    return out


def _rank() -> dict:
    rank = torch.distributed.get_rank()
    return {"ef": _error_feedback(rank), "full_rank": _full_rank(rank), "round_trip": _state_round_trip(rank),
            "kinds": _kinds(rank), "converge": _converge(rank)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launch(_rank, WORLD, device="cpu", timeout=90)


# -- multi-rank checks -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", EF_SCHEMES)
def test_error_feedback_loses_nothing(ranks, name):
    got = [r["ef"][name] for r in ranks]
    applied = got[0]["sum_applied"]
    assert all(torch.equal(g["sum_applied"], applied) for g in got), "every rank applies the same update"
    lhs = applied + sum(g["residual"] for g in got) / WORLD
    rhs = sum(g["sum_g"] for g in got) / WORLD
    bound = EF_STEPS * (WORLD + 2) * eps() * max(g["scale"] for g in got)
    torch.testing.assert_close(lhs, rhs, rtol=0, atol=bound)
    # not vacuous: the compressor really dropped something, which the residual carried
    assert got[0]["lossy"] > 1e3 * bound
    assert max(float(g["residual"].abs().max()) for g in got) > 1e3 * bound


def test_full_rank_powersgd_is_an_all_reduce(ranks):
    for got in ranks:
        for compressed, plain in got["full_rank"]:
            assert_close_to_scale(compressed, plain, k=ROUNDOFF_K)


@pytest.mark.parametrize("name", EF_SCHEMES)
def test_state_dict_round_trip_continues_identically(ranks, name):
    assert all(r["round_trip"][name] for r in ranks)


def test_none_is_plain_ddp_bit_for_bit(ranks):
    for got in ranks:
        for kind in DDP_KINDS:
            plain, none = got["kinds"][(kind, None)], got["kinds"][(kind, "none")]
            for n, p in plain["params"].items():
                assert torch.equal(none["params"][n], p), f"{kind} {n}"
            assert none["ops"] == plain["ops"]


@pytest.mark.parametrize("kind", DDP_KINDS)
@pytest.mark.parametrize("name", COMPRESSIONS)
def test_every_compressor_through_every_ddp_kind(ranks, kind, name):
    runs = [r["kinds"][(kind, name)] for r in ranks]
    for n, p in runs[0]["params"].items():  # replicas stay identical, bit for bit
        assert torch.equal(runs[1]["params"][n], p), n
    for rank, run in enumerate(runs):  # the kind fed the compressor the right tensors and wrote back the result
        want = ranks[rank]["kinds"]["reference"][name]
        assert_all_close_to_scale(dict(enumerate(run["step0"])), dict(enumerate(want)), msg=f"{kind} {name} ")


@pytest.mark.parametrize("kind", DDP_KINDS)
@pytest.mark.parametrize("name", COMPRESSIONS)
def test_comm_log_bytes_equal_theory(ranks, kind, name):
    options = {"powersgd_rank": 2, "topk_ratio": 0.1}
    for got in ranks:
        run = got["kinds"][(kind, name)]
        want = step_collectives(name, run["units"], WORLD, **options)
        assert run["ops"] == sorted(want * DDP_STEPS)  # every collective, with its logged size
        theory = step_bytes(name, run["units"], WORLD, **options)
        for record in run["history"]:
            assert (record.sent, record.bus, record.uncompressed) == (
                theory["payload"], theory["bus"], theory["uncompressed"])
            assert record.ratio == pytest.approx(theory["compression_ratio"])


def test_warmup_steps_are_plain_all_reduce(ranks):
    for got in ranks:
        history = got["kinds"]["warmup"]
        assert [h.compressed for h in history] == [False, False, True]
        assert history[0].sent == history[0].uncompressed == history[2].uncompressed
        assert history[2].sent < history[2].uncompressed / 2


def test_short_training_converges_within_a_band_of_uncompressed(ranks):
    def final(name: str) -> float:  # the global batch's loss (mean of the ranks' shards), last 5 steps
        return sum(sum(r["converge"][name][-5:]) for r in ranks) / (5 * WORLD)

    start = sum(r["converge"]["none"][0] for r in ranks) / WORLD
    baseline = final("none")
    assert baseline < start / 3
    for name in COMPRESSIONS:
        assert final(name) <= BAND * baseline, f"{name}: {final(name):.4f} vs uncompressed {baseline:.4f}"
        assert final(name) < start / 2, name


# -- one process ---------------------------------------------------------------------------------------------

def test_in_a_group_of_one_each_compressor_applies_its_own_decompression():
    g = _grads(0, 0)
    pieces = g.split([math.prod(s) for s in UNIT])
    sign = _reduce(SignCompressor(), g)
    want = torch.cat([torch.where(p >= 0, p.abs().mean(), -p.abs().mean()) for p in pieces])
    assert torch.equal(sign, want)  # packing (with padding) and unpacking lose no bit
    topk = _reduce(TopKCompressor(ratio=0.1), g)
    for p, t in zip(pieces, topk.split([p.numel() for p in pieces]), strict=True):
        kept = torch.topk(p.abs(), topk_k(p.numel(), 0.1)).indices
        assert torch.equal(t[kept], p[kept]) and int((t != 0).sum()) == kept.numel()
    low = _reduce(PowerSGDCompressor(rank=2), g)
    for p, t, shape in zip(pieces, low.split([p.numel() for p in pieces]), UNIT, strict=True):
        rank = torch.linalg.matrix_rank(t.view(shape[0], -1)) if powersgd_plan(shape, 2) else None
        assert rank == 2 if rank is not None else torch.equal(t, p)
    assert torch.equal(_reduce(make_compressor("none"), g), g)
    assert torch.equal(_reduce(make_compressor("bf16"), g), g.bfloat16().float())


def test_theory_counts_by_hand():
    units = [[(64, 32), (32,)], [(100,)]]
    # PowerSGD rank 4: (64, 32) sends 4 x (64 + 32) = 384 values; the two vectors go plain, one all-reduce each unit
    assert step_collectives("powersgd", units, 2) == [("all_reduce", 32 * 4), ("all_reduce", 64 * 4 * 4),
                                                      ("all_reduce", 32 * 4 * 4), ("all_reduce", 100 * 4)]
    # top-k 1%: ceil(20.48) + ceil(0.32) = 22 kept in the first unit, 1 in the second; 8 bytes each, 4 ranks
    assert step_collectives("topk", units, 4) == [("all_gather", 4 * 22 * 8), ("all_gather", 4 * 1 * 8)]
    assert topk_k(300, 0.01) == 3 and topk_k(1, 0.01) == 1 and topk_k(5, 1.0) == 5
    # sign: ceil(2048/8) + ceil(32/8) bytes and two scales; ceil(100/8) = 13 bytes and one scale
    assert step_collectives("sign", units, 2) == [("all_gather", 2 * (256 + 4 + 8)), ("all_gather", 2 * 17)]
    got = step_bytes("sign", units, 2)
    assert got["uncompressed"] == (2048 + 32 + 100) * 4 and got["payload"] == 268 + 17
    assert got["compression_ratio"] == pytest.approx(8720 / 285)
    # all-gather: each rank receives N - 1 messages, so the wire saving shrinks as N grows (2 ratio / N)
    wide = step_bytes("sign", per_tensor_units([(4096, 4096)]), 64)
    assert wide["wire_ratio"] == pytest.approx(wide["compression_ratio"] * 2 / 64, rel=1e-3)
    assert step_bytes("powersgd", [[(64, 32)]], 64)["wire_ratio"] == pytest.approx(64 * 32 / (4 * 96))


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="unknown compression 'zip'; valid: none, bf16, powersgd, topk, sign"):
        make_compressor("zip")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="powersgd_rank must be a positive int"):
            make_compressor("powersgd", powersgd_rank=bad)
    for bad in (0, -0.1, 1.01, "0.1"):
        with pytest.raises(ValueError, match=r"topk_ratio must be a number in \(0, 1\]"):
            make_compressor("topk", topk_ratio=bad)
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0"):
        make_compressor("sign", warmup_steps=-1)
    with pytest.raises(ValueError, match="min_compression_rate"):
        PowerSGDCompressor(min_compression_rate=-1)
    with pytest.raises(ValueError, match="unknown compression 'fp8'"):
        make_ddp(build_mlp(), "naive", compressor="fp8")
    with pytest.raises(ValueError, match="compressor must be None, a name"):
        make_ddp(build_mlp(), "flat", compressor=4)
    comp = make_compressor("topk")
    with pytest.raises(ValueError, match="shapes \\[\\(3,\\)\\] hold 3 elements but the tensor has 4"):
        comp.reduce(torch.zeros(4, device="cpu"), shapes=[(3,)])
    comp.reduce(torch.zeros(4, device="cpu"), key="a").wait()
    with pytest.raises(ValueError, match="unit 'a' had shapes \\[\\(4,\\)\\], now \\[\\(2, 3\\)\\]"):
        comp.reduce(torch.zeros(2, 3, device="cpu"), key="a")
    with pytest.raises(ValueError, match="state of a 'topk' compressor cannot be loaded into a 'sign' one"):
        make_compressor("sign").load_state_dict(comp.state_dict())
    with pytest.raises(ValueError, match="unknown compression"):
        step_bytes("gzip", [[(4,)]], 2)
