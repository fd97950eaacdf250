"""Mixed precision: policies, the dynamic loss scaler (one process and 2 gloo ranks), fp32 masters, fp8 demo.

Tolerance for "tracks fp32": the tiny GPT, AdamW lr 1e-3, STEPS steps on the same batches. Measured: the
per-step loss differs from fp32's by at most ~3e-4 (bf16) and ~2e-4 (fp16), the fp32 masters by at most
~6e-3 (Adam moves an element by up to ~lr per step, and a sign flip of a tiny gradient flips that move).
The asserted bounds, 1e-2 in loss and 2 * lr * STEPS in masters, leave headroom for other CPUs: the loss bound
is ~5 roundings of bf16 (2^-9 relative) on a loss of ~5.5, 10^4 times the fp32 summation-order effects an
instruction set can change, and the masters' is Adam's reach (two runs part by at most lr a step each way).
The fp8 bounds are relative, set by e4m3's 3 mantissa bits (2^-4); a scale and a cast are elementwise, the same
operations on any CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from equivalence import gpt_batch, shard

from workbench import launch, trace
from workbench import precision as P
from workbench.launch import rank_device
from workbench.models import GPTConfig, build_gpt

TINY = GPTConfig.preset("tiny", seq_len=16)
STEPS = 6
LR = 1e-3
LOSS_TOL = 1e-2


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def _train(name: str, steps: int = STEPS, **policy_kwargs) -> tuple[list[float], P.MixedPrecisionStep]:
    pol = P.policy(name, **policy_kwargs)
    scaler = P.DynamicLossScaler() if pol.needs_scaler else None
    stepper = P.MixedPrecisionStep(build_gpt(TINY), pol, _adamw, scaler=scaler)
    losses = []
    for s in range(steps):
        x, y = gpt_batch(s, 8, seq_len=16)
        losses.append(stepper.step(lambda m, x=x, y=y: m(x, y)).loss)
    return losses, stepper


@pytest.fixture(scope="module")
def fp32_run() -> tuple[list[float], P.MixedPrecisionStep]:
    return _train("fp32")


# --- policies ------------------------------------------------------------------------------------------


def test_policies_name_their_dtypes() -> None:
    assert P.policy("fp32").param_dtype == torch.float32
    bf16, fp16 = P.policy("bf16"), P.policy("fp16", reduce_in_fp32=False)
    assert (bf16.param_dtype, bf16.reduce_dtype, bf16.master_dtype) == (torch.bfloat16, torch.float32,
                                                                        torch.float32)
    assert (fp16.param_dtype, fp16.reduce_dtype) == (torch.float16, torch.float16)
    assert [P.policy(n).needs_scaler for n in P.PRECISIONS] == [False, False, True]
    view = bf16.sharded()
    assert isinstance(view, P.MixedPrecision)
    assert (view.param_dtype, view.reduce_dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("call, match", [
    (lambda: P.policy("fp8"), "unknown precision 'fp8'; valid: fp32, bf16, fp16"),
    (lambda: P.policy("bf16", reduce_in_fp32="yes"), "reduce_in_fp32 must be True or False"),
    (lambda: P.PrecisionPolicy("bf16", torch.float16, torch.float32), "computes in torch.bfloat16"),
    (lambda: P.PrecisionPolicy("fp16", torch.float16, torch.bfloat16), "reduce_dtype must be"),
    (lambda: P.DynamicLossScaler(init_scale=0), "init_scale must be a finite number > 0, got 0"),
    (lambda: P.DynamicLossScaler(growth_factor=1.0), "growth_factor must be a number > 1"),
    (lambda: P.DynamicLossScaler(backoff_factor=1.5), r"backoff_factor must be a number in \(0, 1\)"),
    (lambda: P.DynamicLossScaler(growth_interval=0), "growth_interval must be an int >= 1, got 0"),
    (lambda: P.DynamicLossScaler(init_scale=0.5, min_scale=1.0), "need min_scale <= init_scale"),
    (lambda: P.MixedPrecisionStep(build_gpt(TINY), P.policy("fp16"), _adamw), "needs a DynamicLossScaler"),
    (lambda: P.cast_for_compute(build_gpt(TINY), "bf16"), "expected a PrecisionPolicy"),
    (lambda: P.cast_for_compute(build_gpt(TINY).half(), P.policy("bf16")), "expects an fp32 model"),
    (lambda: P.copy_masters_to_model([], build_gpt(TINY)), "0 masters for a model with"),
    (lambda: P.fp8_round_trip(torch.ones(2), torch.float16), "fp8 dtype must be"),
    (lambda: P.fp8_linear(torch.ones(2, 3), torch.ones(4, 5)), r"got \(2, 3\) and \(4, 5\)"),
])
def test_bad_arguments_raise_clear_value_errors(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# --- compute copy and masters ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_compute_copy_halves_parameter_bytes_and_masters_stay_fp32(name: str) -> None:
    model = build_gpt(TINY)
    fp32_bytes = P.param_bytes(model)
    masters = P.cast_for_compute(model, P.policy(name))
    assert P.param_bytes(model) * 2 == fp32_bytes
    assert sum(m.numel() * m.element_size() for m in masters) == fp32_bytes
    assert {p.dtype for p in model.parameters()} == {P.policy(name).param_dtype}
    assert {m.dtype for m in masters} == {torch.float32}
    assert all(m.device == p.device for m, p in zip(masters, model.parameters(), strict=True))


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_low_precision_training_tracks_fp32(name: str, fp32_run) -> None:
    ref_losses, ref = fp32_run
    losses, got = _train(name)
    gaps = [abs(a - b) for a, b in zip(losses, ref_losses, strict=True)]
    assert max(gaps) < LOSS_TOL, f"{name} loss strays from fp32 by {max(gaps):.2e}"
    assert max(gaps) > 0, f"{name} gave fp32's exact losses: did it compute in {name} at all?"
    pairs = zip(got.masters, ref.masters, strict=True)
    master_gap = max(float((a.detach() - b.detach()).abs().max()) for a, b in pairs)
    assert master_gap < 2 * LR * STEPS, f"{name} masters differ from fp32's by {master_gap:.2e}"
    opt_state = [t for s in got.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert opt_state and {t.dtype for t in opt_state} == {torch.float32}
    if got.scaler is not None:
        assert got.scaler.skipped_steps == 0 and got.scaler.scale_value == 2.0 ** 16


def test_overflow_is_skipped_scale_backs_off_and_no_nan_reaches_the_weights() -> None:
    scaler = P.DynamicLossScaler(init_scale=2.0 ** 10)
    stepper = P.MixedPrecisionStep(build_gpt(TINY), P.policy("fp16"), _adamw, scaler=scaler)
    x, y = gpt_batch(0, 8, seq_len=16)
    before = [m.detach().clone() for m in stepper.masters]
    weight = next(stepper.model.parameters())
    handle = weight.register_hook(lambda g: torch.full_like(g, math.inf))  # one gradient overflows
    result = stepper.step(lambda m: m(x, y))
    handle.remove()
    assert result.skipped and result.scale == 2.0 ** 10 and scaler.scale_value == 2.0 ** 9
    assert all(torch.equal(a, b) for a, b in zip(before, stepper.masters, strict=True)), "a skipped step moved a master"
    assert all(torch.isfinite(p).all() for p in stepper.model.parameters())
    assert not stepper.step(lambda m: m(x, y)).skipped  # the next clean step goes through
    assert all(torch.isfinite(m).all() for m in stepper.masters)


# --- the scaler's schedule and state --------------------------------------------------------------------


def test_scale_grows_after_growth_interval_clean_steps_and_respects_bounds() -> None:
    scaler = P.DynamicLossScaler(init_scale=4.0, growth_interval=3, min_scale=1.0, max_scale=16.0)
    scales = []
    for found_inf in [False] * 7 + [True] * 4:
        scaler.update(found_inf)
        scales.append(scaler.scale_value)
    assert scales == [4, 4, 8, 8, 8, 16, 16, 8, 4, 2, 1]  # capped at max_scale, floored at min_scale
    assert scaler.skipped_steps == 4 and scaler.total_steps == 11
    assert torch.equal(scaler.scale(torch.tensor(3.0, device="cpu")), torch.tensor(3.0, device="cpu"))
    grads = [torch.full((2,), 8.0, device="cpu"), None]
    P.DynamicLossScaler(init_scale=4.0).unscale_(grads)
    assert grads[0].tolist() == [2.0, 2.0]


def test_found_inf_in_one_process_catches_inf_and_nan() -> None:
    scaler = P.DynamicLossScaler()
    ok = torch.ones(3, device="cpu")
    assert not scaler.found_inf([ok, None])
    assert scaler.found_inf([ok, torch.tensor([1.0, math.nan], device="cpu")])
    assert scaler.found_inf([torch.tensor([-math.inf], device="cpu", dtype=torch.float16)])


def test_state_dict_round_trips_through_torch_save_weights_only(tmp_path) -> None:
    scaler = P.DynamicLossScaler(init_scale=256.0, growth_interval=2)
    for found_inf in (False, False, False, True, False):
        scaler.update(found_inf)
    torch.save(scaler.state_dict(), tmp_path / "scaler.pt")
    loaded = torch.load(tmp_path / "scaler.pt", weights_only=True)
    fresh = P.DynamicLossScaler()
    fresh.load_state_dict(loaded)
    assert fresh.state_dict() == scaler.state_dict()
    assert (fresh.scale_value, fresh.clean_steps, fresh.skipped_steps) == (256.0, 1, 1)
    fresh.update(False)
    scaler.update(False)
    assert fresh.state_dict() == scaler.state_dict()
    with pytest.raises(ValueError, match=r"missing \['total_steps'\]"):
        fresh.load_state_dict({k: v for k, v in loaded.items() if k != "total_steps"})
    with pytest.raises(ValueError, match="'scale' must be a finite number, got nan"):
        fresh.load_state_dict({**loaded, "scale": math.nan})


# --- two gloo ranks agree on the skip -------------------------------------------------------------------


def _agreement_rank() -> dict:
    # 1. The bare check: only rank 1's local gradient overflows, both ranks see it.
    local = [torch.ones(4, device=rank_device())]
    if torch.distributed.get_rank() == 1:
        local[0][2] = math.inf
    found_inf = P.DynamicLossScaler().found_inf(local)
    amp = [c for c in trace.current().trace.comms if c.tag == P.AMP_TAG and c.op == "all_reduce"]
    steps = {"fp32": _skip_steps(P.policy("fp16")), "fp16": _skip_steps(P.policy("fp16", reduce_in_fp32=False)),
             "local": _skip_steps(P.policy("fp16"), reduce_gradients=False)}
    return {"found_inf": found_inf, "amp_comms": len(amp), "steps": steps}


def _skip_steps(pol: P.PrecisionPolicy, reduce_gradients: bool = True) -> dict:
    """A data-parallel fp16 run: rank 1 alone gets an inf gradient on step 1 (of 0, 1, 2). Without the
    reduction ("local", as with ZeRO's gradient shards) only the scaler's all-reduce tells rank 0."""
    rank, out = torch.distributed.get_rank(), {}
    scaler = P.DynamicLossScaler(init_scale=2.0 ** 12)
    stepper = P.MixedPrecisionStep(build_gpt(TINY), pol, _adamw, scaler=scaler, reduce_gradients=reduce_gradients)
    skipped, masters_before_skip = [], None
    for step in range(3):
        x, y = shard(gpt_batch(step, 8, seq_len=16), rank, 2)
        handle = None
        if step == 1:
            masters_before_skip = [m.detach().clone() for m in stepper.masters]
            if rank == 1:
                handle = next(stepper.model.parameters()).register_hook(lambda g: torch.full_like(g, math.inf))
        skipped.append(stepper.step(lambda m, x=x, y=y: m(x, y)).skipped)
        if step == 1:
            pairs = zip(masters_before_skip, stepper.masters, strict=True)
            out["unchanged_by_skip"] = all(torch.equal(a, b) for a, b in pairs)
        if handle is not None:
            handle.remove()
    out["skipped"] = skipped
    out["scale"] = scaler.scale_value
    out["finite"] = all(bool(torch.isfinite(t).all()) for t in [*stepper.masters, *stepper.model.parameters()])
    out["masters"] = [m.detach().clone() for m in stepper.masters]
    return out


def test_two_ranks_skip_together_when_one_rank_overflows() -> None:
    results = launch(_agreement_rank, 2, timeout=60)
    for r in results:
        assert r["found_inf"] is True, "a rank would step although another rank's gradient overflowed"
        assert r["amp_comms"] == 1, "the inf check must be one all-reduce tagged 'amp'"
    for reduce in ("fp32", "fp16", "local"):  # gradients reduced in fp32, in fp16, not at all
        runs = [r["steps"][reduce] for r in results]
        for run in runs:
            assert run["skipped"] == [False, True, False], f"reduce={reduce}"
            assert run["unchanged_by_skip"] and run["finite"], f"reduce={reduce}"
            assert run["scale"] == 2.0 ** 11
        if reduce != "local":  # without a reduction each rank trains on its own data
            for a, b in zip(runs[0]["masters"], runs[1]["masters"], strict=True):
                assert torch.equal(a, b), f"replicas diverged (reduce={reduce})"


# --- the fp8 demo ---------------------------------------------------------------------------------------


def test_fp8_scaling_keeps_tiny_values_that_unscaled_fp8_flushes_to_zero() -> None:
    g = torch.Generator().manual_seed(0)
    tiny = torch.randn(256, generator=g, device="cpu") * 1e-4  # below e4m3's smallest subnormal, 2**-9
    unscaled = P.fp8_round_trip(tiny, P.FP8_FORWARD, scaled=False)
    scaled = P.fp8_round_trip(tiny, P.FP8_FORWARD, scaled=True)
    assert (unscaled == 0).float().mean() == 1.0
    assert (scaled == 0).sum() == 0
    assert float(((scaled - tiny).abs() / tiny.abs()).max()) <= 2.0 ** -4  # e4m3: 3 mantissa bits
    big = torch.tensor([1000.0, -1e5], device="cpu")  # beyond e4m3's 448: clamped unscaled, exact-ish scaled
    assert P.fp8_round_trip(big, P.FP8_FORWARD, scaled=False).tolist() == [448.0, -448.0]
    # the largest magnitude is scaled onto e4m3's largest value (representable, so the cast is exact) and back:
    # only float32's rounding of the scale remains (~1e-7); elementwise operations, the same on any CPU
    assert P.fp8_round_trip(big, P.FP8_FORWARD, scaled=True)[1].item() == pytest.approx(-1e5, rel=1e-6)


def test_fp8_linear_forward_and_backward_with_and_without_scaling() -> None:
    g = torch.Generator().manual_seed(1)
    # |x|, |w| < 2**-10, half e4m3's smallest subnormal: unscaled, every one rounds to 0.
    x = (torch.randn(4, 3, 8, generator=g, device="cpu") * 1e-4).requires_grad_()
    w = (torch.randn(5, 8, generator=g, device="cpu") * 1e-4).requires_grad_()
    want = x.detach() @ w.detach().t()
    y = P.fp8_linear(x, w)
    assert y.shape == (4, 3, 5)
    rel = float((y.detach() - want).norm() / want.norm())
    assert rel < 0.1, f"scaled fp8 matmul error {rel:.3f}"
    assert float(P.fp8_linear(x, w, scaled=False).detach().abs().max()) == 0.0  # every input flushed to zero
    grad_out = torch.randn(4, 3, 5, generator=g, device="cpu") * 1e-6  # below e5m2's smallest, 2**-16
    gx, gw = torch.autograd.grad(P.fp8_linear(x, w), (x, w), grad_out)
    want_gx = grad_out @ w.detach()
    assert gw.shape == w.shape and float((gx - want_gx).norm() / want_gx.norm()) < 0.2
    gx0, gw0 = torch.autograd.grad(P.fp8_linear(x, w, scaled=False), (x, w), grad_out)
    assert float(gx0.abs().max()) == 0.0 and float(gw0.abs().max()) == 0.0


# --- the trainer's memory ledger against theory's "amp" layout ------------------------------------------------


def _bf16_ledger_rank() -> dict:
    """One bf16 step of the real trainer at every ZeRO stage on 2 ranks: its ledger peaks and parameter count."""
    from workbench.train import RunConfig
    from workbench.training.trainer import Trainer

    out = {}
    for zero in (0, 1, 2, 3):
        tracer = trace.Tracer(torch.distributed.get_rank(), 2)
        with trace.tracing(tracer):
            trainer = Trainer(RunConfig(nproc=2, zero=zero, precision="bf16", steps=1, batch_size=4, seq_len=16))
            trainer.step()
        out[zero] = {"peak": dict(tracer.memory.peak), "n_params": trainer.n_params}
    return out


@pytest.mark.timeout(180)
def test_the_trainers_bf16_ledger_is_theorys_amp_layout_not_the_classic_one() -> None:
    """``workbench run --precision bf16`` keeps fp32 parameters and gradients under autocast: theory's "amp"
    layout (4 + 4 + 8 bytes a parameter, ZeRO-1 keeping 8 of them replicated), not the classic 2 + 2 + 4 + 8."""
    from workbench.theory.memory import model_state_bytes

    world = 2
    for got in launch(_bf16_ledger_rank, world, timeout=60):
        for zero, r in got.items():
            amp = model_state_bytes(r["n_params"], world, zero, "bf16", memory_layout="amp")
            classic = model_state_bytes(r["n_params"], world, zero, "bf16", memory_layout="classic")
            # ZeRO's flat shards pad each bucket or unit to a multiple of the world: at most world - 1 fp32 elements
            # per piece (the tiny GPT has fewer than 16 pieces) per copy, the Adam state holding two copies.
            slack = 4 * (world - 1) * 16
            for category, copies in (("parameters", 1), ("gradients", 1), ("optimizer_state", 2)):
                assert 0 <= r["peak"][category] - amp[category] <= slack * copies, (zero, category, r["peak"], amp)
            measured = sum(r["peak"][c] for c in ("parameters", "gradients", "optimizer_state"))
            if zero in (1, 2):  # where the layouts part: the trainer holds more than the classic layout prices
                assert measured > sum(classic.values()) + slack, (zero, measured, classic)
