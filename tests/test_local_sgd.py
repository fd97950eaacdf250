"""Local SGD and DiLoCo (workbench/parallel/local_sgd.py, workbench/theory/local_sgd.py): the equivalence ladder.

1. ``local_steps=1``, inner plain SGD, ``outer="avg"`` is DDP (FlatDDP) with the same SGD on the global batch;
2. ``outer="sgd", outer_lr=1`` is ``outer="avg"`` bit for bit;
3. H = 4: one all-reduce tagged "outer" per 4 inner steps, of exactly the trainable parameters' fp32 bytes (theory's
   count); replicas differ inside a round and are bit-identical right after an outer step;
4. the Nesterov outer step is a hand computation (one process, and over 2 ranks from the replicas' own θ_i);
5. a state_dict round trip in mid-round resumes bit-identically;
6. bad inputs raise, naming the fix.

All multi-rank work runs in one 2-rank launch (a module fixture), to keep the file fast on 2 cores.

Tolerances, fp32 (tests/equivalence.py's reasoning: a bound is a number of eps at the scale of the quantity):
* rung 1, parameters after T = 5 steps against FlatDDP. Per step DDP rounds mean_i g_i, lr·g and θ − lr·g; local
  SGD rounds θ − lr·g_i on each rank (half an ulp of max|θ|), θ_g − θ_i (exact by Sterbenz's lemma while
  lr|g_i| <= |θ|/2, else half an ulp of |Δ| << max|θ|), the all-reduce's sum and halving, and θ_g − Δ (half an ulp
  of max|θ|). So the two differ by at most ~2 eps·max|θ| per step; the next step's gradients, taken at parameters
  that differ by that much, move the difference by lr·(curvature)·(that), which a factor 2 covers: bound
  4·T eps at the scale max|θ| (20 eps at T = 5). Measured: MLP 2.0 eps, tiny GPT 3.0 eps (of max|θ|), while the
  runs moved their parameters by 1.6e6 (MLP) and 2.3e5 (GPT) eps of that scale: a wrong average (a missing or
  doubled rank) is an O(1) share of that, far outside the bound.
* rung 2: bit for bit: multiplying by 1 is exact, so θ_g + (−1)·Δ rounds once exactly as θ_g − Δ.
* rung 3, rung 5: bit for bit (the same operations in the same order) and byte counts exactly (0 tolerance).
* rung 4: the fp32 update against fp64 arithmetic on the same fp32 inputs Δ_k. Per outer step the fp32 path rounds
  the momentum (μ·b, + Δ), the step (Δ + μ·b), lr·step and θ_g − lr·step: a few half-ulps at the scale
  S = max|θ_0| + lr·(1+μ)·Σ_k max|Δ_k| / (1−μ), which bounds both max|θ_g| over the run and lr·(1+μ)·max|b|;
  carried into later steps through b (a geometric factor up to 1/(1−μ) = 10 at μ 0.9) and θ_g: bound
  2·K·(1 + 1/(1−μ))·eps·S over K steps (66 eps at K = 3). Measured: 0.41 eps of S (one process, K = 3), 0.25 eps
  over 2 ranks (K = 3; there the test averages the ranks' θ_g − θ_i in fp64, while the run's Δ also carries the
  all-reduce's rounding, half an ulp of max|Δ|, inside the same bound). Against torch.optim.SGD(nesterov=True)
  on the same fp32 tensors: asserted to ROUNDOFF_K eps; measured bit for bit (parameters and momentum buffer).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from equivalence import ROUNDOFF_K, assert_close_to_scale, eps, gpt_batch, mlp_batch, scale_of, shard
from torch import nn

from workbench import launch, trace
from workbench.models import GPTConfig, build_gpt, build_mlp
from workbench.parallel.ddp import FlatDDP
from workbench.parallel.local_sgd import OUTERS, LocalSGD
from workbench.theory.comm import bus_bytes, dp_step_volume
from workbench.theory.local_sgd import bytes_per_step, bytes_per_token, outer_collectives

pytestmark = [pytest.mark.numerics, pytest.mark.timeout(120)]

WORLD = 2
GLOBAL_BATCH = 8
TINY = GPTConfig.preset("tiny", seq_len=16)
LADDER_STEPS, LADDER_LR = 5, 0.1
H = 4
H_STEPS = 2 * H
NESTEROV = dict(local_steps=2, outer="nesterov", outer_lr=0.7, outer_momentum=0.9)
NESTEROV_STEPS = 6
RESUME = dict(local_steps=3, outer="nesterov", outer_lr=0.7, outer_momentum=0.9)
RESUME_STEPS, RESUME_AT = 10, 5  # saved 2 inner steps into the second round: replicas differ there


def _build(name: str, seed: int = 0) -> nn.Module:
    return build_mlp(seed=seed) if name == "mlp" else build_gpt(TINY, seed=seed)


def _batch(name: str, step: int, rank: int) -> tuple[torch.Tensor, ...]:
    batch = mlp_batch(step, GLOBAL_BATCH) if name == "mlp" else gpt_batch(step, GLOBAL_BATCH, seq_len=16)
    return shard(batch, rank, WORLD)


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _inner_step(model: nn.Module, opt: torch.optim.Optimizer, name: str, step: int, rank: int) -> None:
    opt.zero_grad(set_to_none=True)
    model(*_batch(name, step, rank)).backward()
    opt.step()


# -- rank side -------------------------------------------------------------------------------------------------

def _ladder(name: str, rank: int) -> dict:
    """Rung 1: local_steps=1 + plain SGD + avg, against FlatDDP with the same SGD."""
    model = _build(name)
    start = _params(model)
    lsgd = LocalSGD(model, local_steps=1, outer="avg")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LADDER_LR)
    for step in range(LADDER_STEPS):
        _inner_step(model, opt, name, step, rank)
        assert lsgd.after_inner_step()
    ddp = FlatDDP(_build(name))
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=LADDER_LR)
    for step in range(LADDER_STEPS):
        opt.zero_grad(set_to_none=True)
        ddp(*_batch(name, step, rank)).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
    return {"local": _params(model), "ddp": _params(ddp.module), "start": start}


def _avg_vs_sgd1(rank: int) -> dict:
    """Rung 2: the same run (AdamW inner, H = 3) with outer avg and outer sgd at lr 1."""
    out = {}
    for outer in ("avg", "sgd"):
        model = _build("mlp")
        lsgd = LocalSGD(model, local_steps=3, outer=outer, outer_lr=1.0)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for step in range(7):
            _inner_step(model, opt, "mlp", step, rank)
            lsgd.after_inner_step()
        out[outer] = _params(model)
    return out


def _every_h(rank: int) -> dict:
    """Rung 3: H = 4 over 8 inner steps: what the comm log holds, and the replicas after each step."""
    model = _build("mlp")
    tracer = trace.current()
    tracer.trace.comms.clear()
    lsgd = LocalSGD(model, local_steps=H, outer="avg")
    init_ops = [(c.op, c.tag) for c in tracer.trace.comms]
    tracer.trace.comms.clear()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LADDER_LR)
    returned, snapshots, global_matches = [], [], []
    for step in range(H_STEPS):
        _inner_step(model, opt, "mlp", step, rank)
        returned.append(lsgd.after_inner_step())
        snapshots.append(_trainable(model))
        global_matches.append(all(torch.equal(g, p) for g, p in zip(
            lsgd.global_params().values(), snapshots[-1].values(), strict=True)))
    return {"init_ops": init_ops, "ops": [(c.op, c.tag, c.nbytes, c.dtype, c.bus_bytes) for c in tracer.trace.comms],
            "returned": returned, "snapshots": snapshots, "global_matches": global_matches,
            "history": list(lsgd.history), "last_outer_bytes": lsgd.last_outer_bytes, "numel": lsgd.numel,
            "names": lsgd.names, "theory": lsgd.bytes_per_step(),
            "trainable_bytes": sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()
                                                           if p.requires_grad}.values())}


def _nesterov(rank: int) -> dict:
    """Rung 4 over 2 ranks: each outer step's θ_g before, this rank's θ_i, θ_g after (the test redoes the step)."""
    model = _build("mlp")
    lsgd = LocalSGD(model, **NESTEROV)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rounds, identical = [], []
    for step in range(NESTEROV_STEPS):
        _inner_step(model, opt, "mlp", step, rank)
        before = {n: t.clone() for n, t in lsgd.global_params().items()}
        local = _trainable(model)
        if lsgd.after_inner_step():
            rounds.append((before, local, {n: t.clone() for n, t in lsgd.global_params().items()}))
            identical.append(_trainable(model))
    return {"rounds": rounds, "after_outer": identical}


def _resume(rank: int) -> dict:
    """Rung 5: an uninterrupted run against one saved in mid-round (through torch.save) and resumed."""
    model = _build("mlp")
    lsgd = LocalSGD(model, **RESUME)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    saved = None
    for step in range(RESUME_STEPS):
        _inner_step(model, opt, "mlp", step, rank)
        lsgd.after_inner_step()
        if step + 1 == RESUME_AT:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "local_sgd": lsgd.state_dict()}, buf)
            saved = buf.getvalue()
    whole = {"params": _params(model), "state": lsgd.state_dict()}

    state = torch.load(io.BytesIO(saved), weights_only=True)
    model = _build("mlp", seed=1)  # another start: construction broadcasts it, then the checkpoint replaces it
    lsgd = LocalSGD(model, **RESUME)  # construct first (it broadcasts rank 0's model), then load
    model.load_state_dict(state["model"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    opt.load_state_dict(state["opt"])
    lsgd.load_state_dict(state["local_sgd"])
    for step in range(RESUME_AT, RESUME_STEPS):
        _inner_step(model, opt, "mlp", step, rank)
        lsgd.after_inner_step()
    return {"whole": whole, "resumed": {"params": _params(model), "state": lsgd.state_dict()}}


def _rank() -> dict:
    rank = torch.distributed.get_rank()
    return {"ladder": {name: _ladder(name, rank) for name in ("mlp", "gpt")}, "avg_vs_sgd1": _avg_vs_sgd1(rank),
            "every_h": _every_h(rank), "nesterov": _nesterov(rank), "resume": _resume(rank)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launch(_rank, WORLD, device="cpu", timeout=90)


# -- rung 1 ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_one_local_step_of_sgd_with_averaging_is_ddp(ranks, name):
    got = [r["ladder"][name] for r in ranks]
    for n, p in got[0]["local"].items():  # the replicas end identical, bit for bit, and so do DDP's
        assert torch.equal(got[1]["local"][n], p), n
        assert torch.equal(got[1]["ddp"][n], got[0]["ddp"][n]), n
    local, ddp, start = got[0]["local"], got[0]["ddp"], got[0]["start"]
    scale = scale_of(ddp.values())
    k = 4 * LADDER_STEPS
    for n in ddp:
        assert_close_to_scale(local[n], ddp[n], k=k, scale=scale, msg=f"{name} {n}")
    moved = max(float((ddp[n] - start[n]).abs().max()) for n in ddp)
    assert moved > 1e3 * k * eps() * scale, "not vacuous: training moved the parameters far beyond the bound"


# -- rung 2 ------------------------------------------------------------------------------------------------------

def test_outer_sgd_at_lr_1_is_averaging_bit_for_bit(ranks):
    for got in ranks:
        for n, p in got["avg_vs_sgd1"]["avg"].items():
            assert torch.equal(got["avg_vs_sgd1"]["sgd"][n], p), n


def test_outer_sgd_at_lr_1_is_averaging_on_one_process():
    """The same with arbitrary θ_g and θ_local (no launch): one rounding either way."""
    runs = {}
    for outer in ("avg", "sgd"):
        model = nn.Linear(7, 5)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for p in model.parameters():
                p.data = torch.randn(p.shape, device="cpu")
            lsgd = LocalSGD(model, local_steps=1, outer=outer, outer_lr=1.0)
            for _ in range(3):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, device="cpu") * 1e-2)
                lsgd.after_inner_step()
        runs[outer] = _params(model)
    for n, p in runs["avg"].items():
        assert torch.equal(runs["sgd"][n], p), n


# -- rung 3 ------------------------------------------------------------------------------------------------------

def test_one_outer_all_reduce_of_the_trainable_parameters_every_h_steps(ranks):
    for got in ranks:
        e = got["every_h"]
        # construction: broadcasts only; training: no gradient communication, one outer all-reduce per H steps
        assert {op for op, _ in e["init_ops"]} == {"broadcast"} and {t for _, t in e["init_ops"]} == {"init"}
        assert e["returned"] == [(s + 1) % H == 0 for s in range(H_STEPS)]
        assert e["numel"] * 4 == e["trainable_bytes"]  # the tied weight once, the frozen layer not at all
        nbytes = e["trainable_bytes"]
        assert e["ops"] == [("all_reduce", "outer", nbytes, "float32", bus_bytes("all_reduce", nbytes, WORLD))] * (
            H_STEPS // H)
        assert [(h.outer_step, h.inner_step, h.sent, h.bus) for h in e["history"]] == [
            (i + 1, (i + 1) * H, nbytes, bus_bytes("all_reduce", nbytes, WORLD)) for i in range(H_STEPS // H)]
        assert e["last_outer_bytes"] == nbytes
        # theory: the measured log, per inner step
        logged = sum(op[2] for op in e["ops"]) / H_STEPS
        assert e["theory"] == bytes_per_step(e["numel"], WORLD, H) == {
            "tensor": logged, "bus": sum(op[4] for op in e["ops"]) / H_STEPS}
        assert e["global_matches"] == e["returned"]  # right after an outer step the model is θ_g


def test_replicas_differ_inside_a_round_and_are_identical_after_an_outer_step(ranks):
    a, b = (r["every_h"]["snapshots"] for r in ranks)
    for step in range(H_STEPS):
        same = all(torch.equal(a[step][n], b[step][n]) for n in a[step])
        assert same == ((step + 1) % H == 0), f"inner step {step + 1}"


# -- rung 4 ------------------------------------------------------------------------------------------------------

def _nesterov_reference(theta: torch.Tensor, deltas: list[torch.Tensor], lr: float, mu: float) -> torch.Tensor:
    """The update by hand, in fp64: b = μ b + Δ; θ = θ − lr (Δ + μ b)."""
    theta, b = theta.double(), torch.zeros_like(theta, dtype=torch.float64)
    for d in deltas:
        b = mu * b + d.double()
        theta = theta - lr * (d.double() + mu * b)
    return theta


def _nesterov_bound(steps: int, mu: float, scale: float) -> float:
    return 2 * steps * (1 + 1 / (1 - mu)) * eps() * scale


def test_nesterov_outer_step_matches_a_hand_computation():
    lr, mu, steps = 0.7, 0.9, 3
    g = torch.Generator(device="cpu").manual_seed(3)
    theta0 = torch.randn(40, generator=g, device="cpu")
    deltas = [torch.randn(40, generator=g, device="cpu") * 1e-2 for _ in range(steps)]
    model = nn.Module()
    model.w = nn.Parameter(theta0.clone())
    lsgd = LocalSGD(model, local_steps=1, outer="nesterov", outer_lr=lr, outer_momentum=mu)
    torch_theta = nn.Parameter(theta0.clone())
    torch_opt = torch.optim.SGD([torch_theta], lr=lr, momentum=mu, nesterov=True)
    applied = []
    for d in deltas:
        with torch.no_grad():
            model.w.copy_(lsgd.global_params()["w"] - d)  # θ_local, so that θ_g − θ_local is d up to rounding
        applied.append(lsgd.global_params()["w"] - model.w.detach())  # the Δ the outer step sees, in fp32
        assert lsgd.after_inner_step()
        torch_theta.grad = applied[-1].clone()
        torch_opt.step()
    got = lsgd.global_params()["w"]
    assert torch.equal(model.w.detach(), got)  # the model is θ_g again
    want = _nesterov_reference(theta0, applied, lr, mu)
    scale = float(theta0.abs().max()) + lr * (1 + mu) * sum(float(d.abs().max()) for d in applied) / (1 - mu)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=_nesterov_bound(steps, mu, scale))
    assert float((got.double() - theta0.double()).abs().max()) > 1e3 * _nesterov_bound(steps, mu, scale)
    assert_close_to_scale(got, torch_theta.detach(), k=ROUNDOFF_K)  # torch's own SGD(nesterov=True)
    buf = torch_opt.state[torch_theta]["momentum_buffer"]
    assert_close_to_scale(lsgd.state_dict()["momentum"]["w"], buf, k=ROUNDOFF_K)


def test_nesterov_over_two_ranks_is_the_hand_computation_on_the_averaged_pseudo_gradient(ranks):
    lr, mu = NESTEROV["outer_lr"], NESTEROV["outer_momentum"]
    rounds = [r["nesterov"]["rounds"] for r in ranks]
    assert len(rounds[0]) == NESTEROV_STEPS // NESTEROV["local_steps"]
    for a, b in zip(*(r["nesterov"]["after_outer"] for r in ranks), strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)
    theta0 = rounds[0][0][0]
    for name in theta0:
        deltas = [sum(r[k][0][name].double() - r[k][1][name].double() for r in rounds) / WORLD
                  for k in range(len(rounds[0]))]
        want = _nesterov_reference(theta0[name], deltas, lr, mu)
        got = rounds[0][-1][2][name]
        scale = scale_of([theta0[name]]) + lr * (1 + mu) * sum(float(d.abs().max()) for d in deltas) / (1 - mu)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=_nesterov_bound(len(deltas), mu, scale),
                                   msg=lambda m, n=name: f"{n}: {m}")


# -- rung 5 ------------------------------------------------------------------------------------------------------

def test_state_dict_round_trip_resumes_bit_identically(ranks):
    for got in ranks:
        whole, resumed = got["resume"]["whole"], got["resume"]["resumed"]
        for n, p in whole["params"].items():
            assert torch.equal(resumed["params"][n], p), n
        for key in ("inner_steps", "since_outer", "outer_steps", "outer", "local_steps"):
            assert resumed["state"][key] == whole["state"][key], key
        for part in ("global_params", "momentum"):
            assert whole["state"][part]  # nesterov keeps both
            for n, t in whole["state"][part].items():
                assert torch.equal(resumed["state"][part][n], t), f"{part} {n}"
    assert ranks[0]["resume"]["whole"]["state"]["outer_steps"] == RESUME_STEPS // RESUME["local_steps"]


def test_load_state_dict_refuses_another_model_or_outer_optimizer():
    lsgd = LocalSGD(nn.Linear(3, 2), local_steps=2, outer="nesterov")
    lsgd.after_inner_step()
    state = lsgd.state_dict()
    with pytest.raises(ValueError, match="outer='nesterov' cannot be loaded into one with outer='avg'"):
        LocalSGD(nn.Linear(3, 2), local_steps=2, outer="avg").load_state_dict(state)
    with pytest.raises(ValueError, match="shape"):
        LocalSGD(nn.Linear(4, 2), local_steps=2, outer="nesterov").load_state_dict(state)
    with pytest.raises(ValueError, match="trainable ones are"):
        LocalSGD(nn.Sequential(nn.Linear(3, 2)), local_steps=2, outer="nesterov").load_state_dict(state)
    with pytest.raises(ValueError, match="1 inner steps into a round; this LocalSGD has local_steps=1"):
        LocalSGD(nn.Linear(3, 2), local_steps=1, outer="nesterov").load_state_dict(state)
    with pytest.raises(ValueError, match="lacks"):
        LocalSGD(nn.Linear(3, 2), local_steps=2, outer="nesterov").load_state_dict({"outer": "nesterov"})
    fresh = LocalSGD(nn.Linear(3, 2), local_steps=4, outer="nesterov")  # a longer H: the round goes on
    fresh.load_state_dict(state)
    assert (fresh.inner_steps, fresh.since_outer) == (1, 1)


# -- rung 6 ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(local_steps=0), "local_steps must be an int >= 1"),
    (dict(local_steps=2.0), "local_steps must be an int >= 1"),
    (dict(local_steps=True), "local_steps must be an int >= 1"),
    (dict(outer="adam"), "unknown outer optimizer 'adam'; valid: avg, sgd, nesterov"),
    (dict(outer_lr=0), "outer_lr must be a finite number > 0"),
    (dict(outer_lr=-0.7), "outer_lr must be a finite number > 0"),
    (dict(outer_lr=math.inf), "outer_lr must be a finite number > 0"),
    (dict(outer_lr=math.nan), "outer_lr must be a finite number > 0"),
    (dict(outer_momentum=1.0), r"outer_momentum must be a number in \[0, 1\)"),
    (dict(outer_momentum=-0.1), r"outer_momentum must be a number in \[0, 1\)"),
])
def test_bad_inputs_raise_before_anything_runs(kwargs, message):
    model = nn.Linear(3, 2)
    before = _params(model)
    with pytest.raises(ValueError, match=message):
        LocalSGD(model, **kwargs)
    assert all(torch.equal(p, before[n]) for n, p in _params(model).items())


def test_a_model_without_trainable_parameters_or_no_model_raises():
    with pytest.raises(ValueError, match="no trainable parameters"):
        LocalSGD(nn.Linear(3, 2).requires_grad_(False))
    with pytest.raises(ValueError, match="must be a torch.nn.Module"):
        LocalSGD([nn.Parameter(torch.zeros(2, device="cpu"))])


def test_outers_are_the_documented_three():
    assert OUTERS == ("avg", "sgd", "nesterov")


# -- theory ------------------------------------------------------------------------------------------------------

def test_bytes_per_step_is_ddps_over_h_and_per_token_falls_h_times():
    n, world = 123_456, 8
    ddp = dp_step_volume(n, 4, 0, world)["ring_wire"]
    assert bytes_per_step(n, world) == {"tensor": n * 4.0, "bus": ddp}  # H = 1: DDP's gradient all-reduce
    for h in (1, 4, 500):
        assert bytes_per_step(n, world, h) == pytest.approx({"tensor": n * 4.0 / h, "bus": ddp / h})
        assert bytes_per_token(n, world, h, tokens_per_step=4096) == pytest.approx(
            {"tensor": n * 4.0 / h / 4096, "bus": ddp / h / 4096})
    assert outer_collectives(n) == [("all_reduce", n * 4.0)]
    assert bytes_per_step(n, 1, 4)["bus"] == 0  # one rank sends nothing
    for bad, message in ((dict(local_steps=0), "local_steps"), (dict(world=0), "world"),
                         (dict(numel=-1), "numel")):
        args = {"numel": n, "world": world, "local_steps": 4} | bad
        with pytest.raises(ValueError, match=message):
            bytes_per_step(**args)
