"""Mixed precision wired into every strategy and the trainer (``workbench run --precision``).

Tolerance for "tracks fp32". bf16 keeps 8 mantissa bits (unit roundoff 2**-9), fp16 11 (2**-12); autocast rounds
each matmul's inputs, accumulates in fp32 and the loss is fp32, so a step's loss (a mean over 256 tokens) moves
far less than one rounding: measured over these 4 steps at most ~1.2e-4 relative (bf16, ZeRO-3's pure-bf16 units)
and ~4e-5 (fp16). The bound, 1e-3 relative (0.005 in a loss of ~5.5), leaves headroom for other CPUs yet fails
on a step taken on wrong gradients. AdamW barely notices a gradient left scaled (its update is scale-invariant),
so the gradient norm is checked too: an fp16 norm not unscaled would be 65536x fp32's; measured within 1 %,
bound 5 %.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from workbench import launch
from workbench.cli import run_training
from workbench.precision import AMP_TAG
from workbench.train import RunConfig, Trainer, params_sha256

pytestmark = pytest.mark.timeout(300)

SMALL = dict(batch_size=8, seq_len=32, steps=4)
LOSS_RTOL = 1e-3
NORM_RTOL = 5e-2

#: The cheapest set covering each code path: autocast over one process, DDP's hooks, ZeRO-1 (unscales the DDP
#: gradients before the optimizer slices them), ZeRO-2 (unscales its gradient shards), ZeRO-3 (FSDP2-style
#: policy: low-precision gather, no autocast), TP (autocast over the f/g collectives), PP (the last stage scales
#: its loss). fp16 where the loss scaler's path differs, bf16 where autocast's does.
CASES = {
    "single-bf16": dict(nproc=1, precision="bf16"),
    "ddp-fp16": dict(nproc=2, precision="fp16"),
    "zero1-fp16": dict(nproc=2, zero=1, precision="fp16"),
    "zero2-fp16": dict(nproc=2, zero=2, precision="fp16"),
    "zero3-fp16": dict(nproc=2, zero=3, precision="fp16"),
    "tp2-bf16": dict(nproc=2, tp=2, precision="bf16"),
    "tp2-sp-fp16": dict(nproc=2, tp=2, sp=True, precision="fp16"),  # SP's own linear backward, in fp16
    "pp2-fp16": dict(nproc=2, pp=2, precision="fp16"),
    # ... and what composes with them: recomputation re-runs forward under the saved autocast state; gradient
    # accumulation (no_sync, ZeRO-3 accumulating in reduce_dtype); offloaded shards unscaled on the host.
    "single-bf16-recompute": dict(nproc=1, precision="bf16", recompute="full"),
    "ddp-fp16-accum": dict(nproc=2, precision="fp16", grad_accum=2),
    "zero3-bf16-accum-reduce-bf16": dict(nproc=2, zero=3, precision="bf16", reduce_dtype="bf16", grad_accum=2),
    "zero3-offload-fp16": dict(nproc=2, zero=3, offload=True, precision="fp16"),
    "zero1-offload-bf16": dict(nproc=2, zero=1, offload=True, precision="bf16"),
}


def _run_configs(cfgs: list[RunConfig]) -> list[dict]:
    """Train each config in turn on these ranks (one launch for several runs: spawning ranks costs more than 4 tiny
    steps). Per run: the per-step metrics, this rank's ledger peaks, the last step's collectives by (op, tag) with
    their dtypes, and the dtypes of the parameters the optimizer steps."""
    from workbench import trace

    tracer, out = trace.current(), []
    for cfg in cfgs:
        tracer.trace.comms.clear()
        tracer.memory.current.clear()
        tracer.memory.reset_peaks()
        trainer = Trainer(cfg)
        history = [trainer.step() for _ in range(cfg.steps)]
        comms: dict[tuple[str, str], dict] = {}
        for c in tracer.trace.comms:
            if c.step == cfg.steps - 1:
                entry = comms.setdefault((c.op, c.tag), {"bytes": 0, "dtypes": set()})
                entry["bytes"] += c.nbytes
                entry["dtypes"].add(c.dtype)
        out.append({"history": history, "peak": dict(tracer.memory.peak), "comms": comms,
                    "param_dtypes": {p.dtype for p in trainer.strategy.model.parameters()}})
    return out


def _runs(nproc: int, configs: dict[str, dict]) -> dict[str, dict]:
    """Rank 0's view of each named run (flags over SMALL), all in one launch of ``nproc`` ranks."""
    cfgs = [RunConfig(nproc=nproc, **{**SMALL, **flags}) for flags in configs.values()]
    return dict(zip(configs, launch(_run_configs, nproc, cfgs, timeout=240)[0], strict=True))


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    """fp32 in one process (every strategy already matches it in fp32: the equivalence tests) and every case."""
    one = {"fp32": {}, **{k: {**v, "nproc": 1} for k, v in CASES.items() if v["nproc"] == 1}}
    two = {k: v for k, v in CASES.items() if v["nproc"] == 2}
    return {**_runs(1, {k: {f: x for f, x in v.items() if f != "nproc"} for k, v in one.items()}),
            **_runs(2, {k: {f: x for f, x in v.items() if f != "nproc"} for k, v in two.items()})}


def _losses(history: list[dict]) -> list[float]:
    return [m["loss"] for m in history]


@pytest.mark.parametrize("case", list(CASES))
def test_low_precision_runs_track_fp32(case: str, runs: dict) -> None:
    history, reference = runs[case]["history"], runs["fp32"]["history"]
    assert _losses(history) == pytest.approx(_losses(reference), rel=LOSS_RTOL)
    assert _losses(history) != _losses(reference), "the compute dtype changed nothing: autocast did not apply"
    norms = [m["grad_norm"] for m in history]
    assert norms == pytest.approx([m["grad_norm"] for m in reference], rel=NORM_RTOL)
    scale = 2.0 ** 16 if CASES[case]["precision"] == "fp16" else 1.0
    assert [(m["loss_scale"], m["skipped"]) for m in history] == [(scale, False)] * SMALL["steps"]
    assert runs[case]["param_dtypes"] == {torch.float32}, "the optimizer steps fp32 masters"
    amp = runs[case]["comms"].get(("all_reduce", AMP_TAG))
    if scale > 1 and CASES[case]["nproc"] > 1:  # fp16: one inf/NaN agreement per step, over the world
        assert amp is not None and amp["dtypes"] == {"float32"}
    if scale == 1:
        assert amp is None, "no loss scaler, no inf agreement, outside fp16"


def test_recomputation_under_autocast_changes_nothing(runs: dict) -> None:
    """Bit-identical, as without autocast: the checkpoint replays forward under the autocast state it saved."""
    def pick(history: list[dict]) -> list[tuple[float, float]]:
        return [(m["loss"], m["grad_norm"]) for m in history]

    assert pick(runs["single-bf16-recompute"]["history"]) == pick(runs["single-bf16"]["history"])


def test_fp32_reports_no_scaler_and_the_cli_runs_it(runs: dict, tmp_path) -> None:
    assert all(m["loss_scale"] == 1.0 and m["skipped"] is False for m in runs["fp32"]["history"])
    summary = run_training(RunConfig(nproc=1, **{**SMALL, "steps": 1}), tmp_path, progress=False)
    assert summary["history"][0]["loss"] == runs["fp32"]["history"][0]["loss"]


def test_activations_saved_under_bf16_autocast_shrink_but_do_not_halve(runs: dict) -> None:
    """The ledger's saved activations of one process, bf16 autocast against fp32. Measured 0.67, not 0.5:
    the matmuls' saved inputs are bf16 (half), but autocast keeps the residual stream the LayerNorms save and
    the loss's log-softmax in fp32 (a quarter of the tiny GPT's fp32 activations: its 256-token vocabulary
    makes the logits large). Autocast's bf16 copies of the weights, which each matmul saves for backward, are
    parameter bytes, not activations: the tracer leaves them out (trace.is_parameter_bytes)."""
    fp32, bf16 = (runs[k]["peak"]["activations"] for k in ("fp32", "single-bf16"))
    print(f"activations: fp32 {fp32} B, bf16 {bf16} B, ratio {bf16 / fp32:.3f}")
    assert 0.55 < bf16 / fp32 < 0.8


# --- an overflow on one rank is skipped by every rank ----------------------------------------------------------


def _overflow_rank(cfgs: list[RunConfig], planted_step: int) -> list[dict]:
    """Train each config, planting an inf in ONE rank's gradient (rank 1, after the gradient sync) at
    ``planted_step``: without the agreement, rank 0 (finite gradients: a DDP average, or its own ZeRO-3 shard)
    would step."""
    return [_train_with_planted_inf(cfg, planted_step) for cfg in cfgs]


def _train_with_planted_inf(cfg: RunConfig, planted_step: int) -> dict:
    trainer = Trainer(cfg)
    s = trainer.strategy
    sync = s.finish_grad_sync

    def finish_and_plant() -> None:
        sync()
        if trainer.step_index == planted_step and torch.distributed.get_rank() == 1:
            grad = next(p.grad for p in s.model.parameters() if p.grad is not None)
            grad.view(-1)[0] = math.inf

    s.finish_grad_sync = finish_and_plant
    history, shas, finite = [], [], True
    for _ in range(cfg.steps):
        history.append(trainer.step())
        full = s.full_parameters()
        shas.append(params_sha256(full))
        finite = finite and all(bool(torch.isfinite(t).all()) for t in full.values())
    return {"history": history, "shas": shas, "finite": finite}


def test_an_overflow_on_one_rank_is_skipped_everywhere_and_the_scale_backs_off() -> None:
    cfgs = [RunConfig(nproc=2, zero=zero, precision="fp16", **SMALL) for zero in (0, 3)]  # DDP, ZeRO-3
    results = launch(_overflow_rank, 2, cfgs, 1, timeout=240)
    for strategy, ranks in zip(("DDP", "ZeRO-3"), zip(*results, strict=True), strict=True):
        for r in ranks:
            assert [m["skipped"] for m in r["history"]] == [False, True, False, False], strategy
            assert [m["loss_scale"] for m in r["history"]] == [2.0 ** 16, 2.0 ** 16, 2.0 ** 15, 2.0 ** 15], strategy
            assert r["shas"][1] == r["shas"][0], f"{strategy}: the skipped step changed the weights"
            assert r["shas"][2] != r["shas"][1], f"{strategy}: training did not continue after the skip"
            assert r["finite"], f"{strategy}: a NaN/inf reached the weights"
            assert math.isnan(r["history"][1]["grad_norm"]), strategy
            assert all(math.isfinite(m["loss"]) for m in r["history"]), strategy
        assert ranks[0]["shas"] == ranks[1]["shas"], f"{strategy}: the replicas diverged"


# --- ZeRO-3's policy: fp32 shards, low-precision gathers, reduce-scatter in reduce_dtype -------------------------


def test_zero3_bf16_keeps_fp32_shards_gathers_bf16_and_halves_gathered_and_reduced_bytes() -> None:
    zero3 = _runs(2, {"fp32": dict(zero=3, steps=2), "bf16": dict(zero=3, steps=2, precision="bf16"),
                      "bf16-wire": dict(zero=3, steps=2, precision="bf16", reduce_dtype="bf16")})
    fp32, bf16, wire = zero3["fp32"], zero3["bf16"], zero3["bf16-wire"]
    assert fp32["param_dtypes"] == bf16["param_dtypes"] == {torch.float32}, "the shards are the fp32 masters"
    gather, reduce = ("all_gather", "param"), ("reduce_scatter", "grad")
    assert (fp32["comms"][gather]["dtypes"], bf16["comms"][gather]["dtypes"]) == ({"float32"},
                                                                                {"bfloat16"})
    assert bf16["peak"]["gathered_params"] * 2 == fp32["peak"]["gathered_params"] > 0
    assert bf16["comms"][gather]["bytes"] * 2 == fp32["comms"][gather]["bytes"] > 0, "cast before the all-gather"
    assert bf16["comms"][reduce]["bytes"] == fp32["comms"][reduce]["bytes"] > 0, "reduce_dtype fp32 reduces fp32"
    assert wire["comms"][reduce]["dtypes"] == {"bfloat16"}
    assert wire["comms"][reduce]["bytes"] * 2 == fp32["comms"][reduce]["bytes"]


# --- checkpoints carry the scaler ------------------------------------------------------------------------------


def _stop_and_resume_rank(unbroken: RunConfig, stopped: RunConfig) -> tuple[dict, dict]:
    """An unbroken 6-step run, then a run stopped after 4 steps and resumed to 6, on the same ranks."""
    full = _scaled_run(unbroken)
    _scaled_run(stopped)
    torch.distributed.barrier()  # every rank's checkpoint is written before any rank looks for one
    resumed = _scaled_run(replace(stopped, steps=unbroken.steps, resume=True))
    return full, resumed


def _scaled_run(cfg: RunConfig) -> dict:
    """Train from an init scale so large that step 0 overflows (2**24: the loss gradient times 2**24 passes
    fp16's 65504), so the scale afterwards differs from a fresh scaler's; save checkpoints; resume if asked."""
    trainer = Trainer(cfg)
    if cfg.resume:
        trainer.resume()
    else:
        trainer.strategy.scaler.scale_value = 2.0 ** 24
    history = []
    for _ in range(trainer.step_index, cfg.steps):
        history.append(trainer.step())
        if trainer.checkpoint_due():
            trainer.save_checkpoint()
    return {"history": history, "sha": params_sha256(trainer.strategy.full_parameters())}


def test_the_loss_scaler_state_survives_checkpoint_and_resume(tmp_path) -> None:
    flags = dict(nproc=2, precision="fp16", batch_size=8, seq_len=32, ckpt_every=2)
    unbroken = RunConfig(steps=6, ckpt_dir=str(tmp_path / "full"), **flags)
    stopped = RunConfig(steps=4, ckpt_dir=str(tmp_path / "ckpt"), **flags)
    full, resumed = launch(_stop_and_resume_rank, 2, unbroken, stopped, timeout=240)[0]
    assert full["history"][0]["skipped"], "2**24 should overflow fp16 on the first step"
    assert [m["step"] for m in resumed["history"]] == [4, 5]
    assert [m["loss_scale"] for m in resumed["history"]] == [m["loss_scale"] for m in full["history"][4:]]
    assert resumed["history"][0]["loss_scale"] != 2.0 ** 16, "the resumed scale is a fresh scaler's"
    assert resumed["sha"] == full["sha"]


# --- bad input -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "match"), [
    (dict(precision="fp8"), r"unknown precision 'fp8'; valid: fp32, bf16, fp16"),
    (dict(precision="bf16", reduce_dtype="fp16"), r"reduce_dtype='fp16' with precision='bf16'; valid: fp32, bf16"),
    (dict(precision="fp32", reduce_dtype="bf16"), r"reduce_dtype='bf16' with precision='fp32'; valid: fp32"),
    (dict(nproc=2, precision="bf16", reduce_dtype="bf16"), r"reduce_dtype='bf16' needs zero=3.*zero=0"),
    (dict(nproc=2, zero=2, precision="fp16", reduce_dtype="fp16"), r"needs zero=3.*zero=2"),
])
def test_bad_precision_flags_are_refused_before_any_rank_starts(flags: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunConfig(**{**SMALL, **flags})


def test_the_cli_passes_precision_and_refuses_an_unknown_one(capsys) -> None:
    from workbench.cli import _config_from_args, build_parser

    args = build_parser().parse_args(["run", "--precision", "bf16", "--reduce-dtype", "bf16", "--zero", "3",
                                      "--nproc", "2", "--batch-size", "8", "--seq-len", "32"])
    cfg = _config_from_args(args)
    assert (cfg.precision, cfg.reduce_dtype) == ("bf16", "bf16")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--precision", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_a_sharded_model_refuses_a_policy_without_dtypes() -> None:
    from workbench.models import GPTConfig, build_gpt
    from workbench.parallel.zero import FullyShardedModel

    with pytest.raises(ValueError, match=r"mp_policy must carry floating param_dtype and reduce_dtype.*'bf16'"):
        FullyShardedModel(build_gpt(GPTConfig.preset("tiny")), mp_policy="bf16")


def test_autocast_is_a_no_op_in_fp32_and_casts_matmuls_otherwise() -> None:
    from workbench.precision import autocast, policy

    x = torch.ones(2, 2, device="cpu")
    with autocast(policy("fp32"), "cpu"):
        assert (x @ x).dtype == torch.float32
    with autocast(policy("bf16"), "cpu"):
        assert (x @ x).dtype == torch.bfloat16
