"""Pipeline parallelism on gloo ranks: every schedule matches one process, torch.distributed.pipelining
agrees, the measured bubble is theory's, and the activation ledger follows the in-flight micro-batches.

Tolerances (tests/equivalence.py). The loss and gradients of one step agree with one process to fp32 rounding
(measured: 1.5e-8 absolute, 5e-7 of the largest gradient, i.e. 4 eps): micro-batching only changes the order in
which per-token terms are summed, so they are held to ROUNDOFF_K eps of their scale, on any CPU. After 3 AdamW
steps, Adam's division by sqrt(v) turns that rounding into a visible difference in an element whose gradient is
near zero, so parameters are compared by ``assert_adam_params_close``. Against torch.distributed.pipelining on the
same stages, weights and micro-batches both sides run the very same operations in the same order (forwards,
backwards, gradient accumulation micro-batch by micro-batch), so gradients and loss must agree bit for bit (on
any CPU: both sides run on the same one).

The bubble. Theory assumes a stage computes as fast whether or not the other stage computes too. The
GPipe/1F1B comparison therefore first measures that (``_parallel_slowdown``) and skips, with the measured
figures in the reason, on a machine whose CPUs do not run two ranks in parallel (the 2-vCPU CI machine:
a matmul runs ~2x slower while the other rank computes). The naive schedule, where only one rank ever
computes, is compared with theory everywhere.
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch
import torch.nn.functional as F
from equivalence import (
    assert_adam_params_close,
    assert_all_close_to_scale,
    assert_close_to_scale,
    gpt_batch,
    reference_grads,
    reference_train,
)
from torch import nn

from workbench import comm, launch, trace
from workbench.launch import rank_device
from workbench.models import GPTConfig, build_gpt
from workbench.parallel.pipeline import GPTStages, Pipeline, measured_bubble, split_gpt, stage_loss, sync_tied_grads
from workbench.theory import pipeline as tp

pytestmark = pytest.mark.numerics  # sums in another order: .ci/run's portable-ISA lane

STEPS = 3
GLOBAL_BATCH = 8
MICROBATCHES = 4
GPT4 = GPTConfig.preset("tiny", n_layer=4, seq_len=16)  # 4 layers: 2 stages, or 2 x 2 interleaved
GPT8 = GPTConfig.preset("tiny", n_layer=8, seq_len=16)  # 8 layers: 4 x 2 interleaved
LR_SUM = STEPS * 1e-3  # AdamW's default lr, every step
# Compute-dominated stages for the bubble: one 768-wide block per stage, 256 tokens per micro-batch, so a
# forward is ~30 ms of matmul while an activation message (0.8 MB) takes well under a millisecond; a
# 64-token vocabulary keeps the last stage's head and loss (1% of a block) from unbalancing the stages.
HEAVY = GPTConfig(vocab_size=64, seq_len=128, n_layer=2, n_head=12, d_model=768)
BUBBLE_POINTS = 0.05  # a measured share of wall time, not a float sum: the instruction set plays no part
MAX_PARALLEL_SLOWDOWN = 1.3  # see test_measured_bubble_of_gpipe_and_1f1b_is_theory


def _batch(step: int, cfg: GPTConfig = GPT4) -> tuple[torch.Tensor, torch.Tensor]:
    return gpt_batch(step, GLOBAL_BATCH, seq_len=cfg.seq_len, vocab=cfg.vocab_size)


def _train(cfg: GPTConfig, schedule: str, v: int = 1) -> dict:
    """3 AdamW steps of the pipeline over the world; what the test checks, from this rank."""
    pipe = Pipeline(build_gpt(cfg, seed=0), None, schedule, MICROBATCHES, v)
    optimizer = torch.optim.AdamW(list(pipe.parameters()))
    tracer = trace.current()
    tracer.memory.reset_peaks()
    losses = []
    for step in range(STEPS):
        trace.set_step(step)
        optimizer.zero_grad(set_to_none=True)
        losses.append(pipe.forward_backward(*_batch(step, cfg)).item())
        optimizer.step()
    return {"params": pipe.full_parameters(), "losses": losses, "names": [n for n, _ in pipe.named_parameters()],
            "peak_in_flight": pipe.peak_in_flight, "peak_activations": tracer.memory.peak.get("activations", 0),
            "activations_after": tracer.memory.current.get("activations", 0)}


def _train_all(runs: list[tuple[GPTConfig, str, int]]) -> dict:
    return {(schedule, v): _train(cfg, schedule, v) for cfg, schedule, v in runs}


def _reference(cfg: GPTConfig) -> tuple[dict, float, dict]:
    """One process: parameters after the same 3 AdamW steps, the first step's loss and gradients."""
    first_loss = build_gpt(cfg, seed=0)(*_batch(0, cfg)).item()
    grads0 = reference_grads(lambda: build_gpt(cfg, seed=0), lambda s: _batch(s, cfg))
    return reference_train(lambda: build_gpt(cfg, seed=0), lambda s: _batch(s, cfg), steps=STEPS), first_loss, grads0


def _check(results: list[dict], want: dict, first_loss: float, grads0: dict, schedule: str, p: int, v: int) -> None:
    for rank, got in enumerate(results):
        assert_adam_params_close(got["params"], want, grads0, LR_SUM, msg=f"{schedule} v={v} rank {rank} ")
        assert got["losses"] == results[0]["losses"], "every pp rank reports the last stage's loss"
        assert_close_to_scale(got["losses"][0], first_loss, msg=f"{schedule} loss")
        simulated = tp.simulate(tp.make_plan(schedule, p, MICROBATCHES, v)).peak_in_flight[rank]
        assert got["peak_in_flight"] == simulated
        assert got["activations_after"] == 0, "every saved activation is released by its backward"
    names = [n for got in results for n in got["names"]]
    assert sorted(n for n in names if n != "lm_head.weight") == sorted(want), "names survive the cut"
    assert ("lm_head.weight" in names) == (p > 1), "the last stage's copy of the tied matrix"


RUNS_2 = [(GPT4, "naive", 1), (GPT4, "gpipe", 1), (GPT4, "1f1b", 1), (GPT4, "zb", 1), (GPT4, "interleaved", 2)]


@pytest.mark.timeout(120)
def test_every_schedule_on_2_stages_matches_single_process():
    results = launch(_train_all, 2, RUNS_2, device="cpu", timeout=60)
    want, first_loss, grads0 = _reference(GPT4)
    for _, schedule, v in RUNS_2:
        _check([r[(schedule, v)] for r in results], want, first_loss, grads0, schedule, 2, v)
    # The ledger follows the plan: GPipe holds all 4 micro-batches' activations at the turn, 1F1B on the
    # first stage p = 2 of them, so its peak is exactly half (same stage, same micro-batch shapes).
    rank0 = results[0]
    assert rank0[("gpipe", 1)]["peak_activations"] == 2 * rank0[("1f1b", 1)]["peak_activations"] > 0
    # Spans: one per action, named with its micro-batch, coloured forward/backward.
    spans = [s for s in results.traces[0].spans if s.step == 0]
    names = [(s.name, s.category) for s in spans if s.category in ("forward", "backward")]
    assert names[:4] == [("F mb0", "forward"), ("B mb0", "backward"), ("F mb1", "forward"),
                         ("B mb1", "backward")]  # naive on rank 0: one micro-batch at a time
    assert ("W mb3", "backward") in names and ("I mb3", "backward") in names and ("B mb1 s2", "backward") in names


RUNS_4 = [(GPT8, "1f1b", 1), (GPT8, "interleaved", 2)]


@pytest.mark.timeout(120)
def test_1f1b_and_interleaved_on_4_stages_match_single_process():
    results = launch(_train_all, 4, RUNS_4, device="cpu", timeout=60)
    want, first_loss, grads0 = _reference(GPT8)
    for _, schedule, v in RUNS_4:
        _check([r[(schedule, v)] for r in results], want, first_loss, grads0, schedule, 4, v)


# -- torch.distributed.pipelining on the same stages, weights and batch -------------------------------------


class _OneStage(nn.Module):
    """One stage of our cut as the plain module torch's PipelineStage wants: forward(x) -> y. It registers
    only that stage's modules, so torch scales each gradient once when a rank holds several stages."""

    def __init__(self, stages: GPTStages, stage: int) -> None:
        super().__init__()
        self.run = functools.partial(stages.forward, stage=stage)
        ends = [stages.wte, stages.wpe] if stage == 0 else []
        ends += [stages.ln_f, stages.lm_head] if stage == stages.num_stages - 1 else []
        self.owned = nn.ModuleList([stages.blocks[str(i)] for i in stages.layers[stage]] + ends)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


TORCH_SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2}  # schedule -> virtual stages per rank


def _torch_pipelining(schedule: str) -> tuple[float | None, dict]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    rank, world, v = torch.distributed.get_rank(), torch.distributed.get_world_size(), TORCH_SCHEDULES[schedule]
    stages = split_gpt(build_gpt(GPT4, seed=0), rank, world, v)
    torch_stages = [PipelineStage(_OneStage(stages, s), s, world * v, rank_device()) for s in stages.stages]
    # mean cross-entropy per micro-batch; scale_grads (default) divides the summed gradients by m
    loss_fn = lambda out, y: F.cross_entropy(out.flatten(0, 1).float(), y.flatten())  # noqa: E731
    if schedule == "interleaved":
        runner = ScheduleInterleaved1F1B(torch_stages, MICROBATCHES, loss_fn=loss_fn)
    else:
        single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        runner = single(torch_stages[0], MICROBATCHES, loss_fn=loss_fn)
    x, y = _batch(0)
    losses: list[torch.Tensor] = []
    if rank == 0:
        runner.step(x)
    else:
        runner.step(target=y, losses=losses)
    sync_tied_grads(stages)  # torch knows nothing of our tied copies; the same exchange as ours
    loss = torch.stack(losses).mean().item() if losses else None
    return loss, {n: p.grad.clone() for n, p in stages.named_parameters()}


def _ours(schedule: str) -> tuple[float, dict]:
    pipe = Pipeline(build_gpt(GPT4, seed=0), None, schedule, MICROBATCHES, TORCH_SCHEDULES[schedule])
    loss = pipe.forward_backward(*_batch(0)).item()
    return loss, {n: p.grad.clone() for n, p in pipe.named_parameters()}


def _against_torch() -> dict:
    return {schedule: (_ours(schedule), _torch_pipelining(schedule)) for schedule in TORCH_SCHEDULES}


@pytest.mark.timeout(120)
def test_gpipe_1f1b_and_interleaved_agree_with_torch_pipelining():
    results = launch(_against_torch, 2, device="cpu", timeout=60)
    for schedule in TORCH_SCHEDULES:
        for rank, per_rank in enumerate(results):
            (loss, grads), (torch_loss, torch_grads) = per_rank[schedule]
            assert list(grads) == list(torch_grads)
            for name in grads:  # the same operations in the same order: bit for bit (module docstring)
                assert torch.equal(grads[name], torch_grads[name]), f"{schedule} rank {rank} {name}"
            if torch_loss is not None:  # torch reports the loss on the last stage only; ours everywhere
                assert loss == torch_loss, f"{schedule} loss {loss} vs torch's {torch_loss}"


# -- the bubble, measured ------------------------------------------------------------------------------------


def _timed_matmuls(a: torch.Tensor, w: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for _ in range(8):
        a @ w.t()
    return time.perf_counter() - t0


def _parallel_slowdown() -> float:
    """How much slower this rank's matmuls run while every rank runs them at once than alone: 1.0 where
    the ranks have a core each, 2.0 where two "cores" are one core's time shared (some 2-vCPU VMs)."""
    a, w = torch.randn(256, 768), torch.randn(3072, 768)
    _timed_matmuls(a, w)  # warm up
    alone = 0.0
    for turn in range(torch.distributed.get_world_size()):
        comm.barrier()
        if turn == torch.distributed.get_rank():
            alone = _timed_matmuls(a, w)
        comm.barrier()
    together = _timed_matmuls(a, w)
    return max(comm.all_gather_object(together / alone))


def _bubble_rank(schedules: list[str], steps: int) -> float:
    torch.set_num_threads(1)  # the same ~30 ms forward on any machine: compute dominates the messages
    slowdown = _parallel_slowdown() if TIMING_TESTS else float("nan")  # only the opt-in test reads it
    pipes = {name: Pipeline(build_gpt(HEAVY, seed=0), None, name, MICROBATCHES) for name in schedules}
    x, y = _batch(0, HEAVY)
    for step in range(steps):  # schedules alternate step by step, so all see the same machine
        for i, name in enumerate(schedules):
            trace.set_step(100 * i + step)
            pipes[name].forward_backward(x, y)
    return slowdown


TIMING_TESTS = os.environ.get("WORKBENCH_TIMING_TESTS") == "1"
# gpipe and 1f1b only feed the opt-in timing test: without it, measure naive alone (a third of the launch).
BUBBLE_SCHEDULES, BUBBLE_STEPS = (["naive", "gpipe", "1f1b"], 4) if TIMING_TESTS else (["naive"], 3)


@pytest.fixture(scope="module")
def bubble_run() -> tuple[float, dict[str, float]]:
    """One launch for the bubble tests: the machine's parallel slowdown and each schedule's bubble."""
    results = launch(_bubble_rank, 2, BUBBLE_SCHEDULES, BUBBLE_STEPS, device="cpu", timeout=120)
    # Step 0 warms up the allocator; of the rest take the least disturbed step (other processes on the
    # machine can only add idle time, never remove it).
    measured = {name: min(measured_bubble(results.traces, 100 * i + step) for step in range(1, BUBBLE_STEPS))
                for i, name in enumerate(BUBBLE_SCHEDULES)}
    return results[0], measured


@pytest.mark.timeout(180)
def test_measured_bubble_of_naive_is_theory(bubble_run):
    # One micro-batch at a time: only one rank ever computes, so this holds on any machine.
    _, measured = bubble_run
    assert measured["naive"] == pytest.approx(tp.bubble_fraction("naive", 2, MICROBATCHES), abs=BUBBLE_POINTS)


@pytest.mark.timeout(180)
def test_measured_bubble_of_gpipe_and_1f1b_is_theory(bubble_run):
    if not TIMING_TESTS:
        # Measured once as flaky in the full suite on 2 shared cores (it passes alone): a timing assertion
        # belongs beside the benchmarks. Opt in on a quiet machine with a core per rank.
        pytest.skip("timing-dependent: set WORKBENCH_TIMING_TESTS=1 on a quiet machine with a core per rank")
    slowdown, measured = bubble_run
    if slowdown > MAX_PARALLEL_SLOWDOWN:
        # Theory assumes a stage computes as fast whether or not the other one does. On a machine whose
        # two CPUs share one core's time, work done alone in the fill and drain runs ~2x faster than in
        # the steady state, which shrinks the measured bubble (measured here: about 0.17 against 0.2).
        pytest.skip(f"the 2 ranks do not compute in parallel here: a matmul runs {slowdown:.1f}x slower while "
                    f"the other rank computes too (limit {MAX_PARALLEL_SLOWDOWN}); measured bubbles gpipe "
                    f"{measured['gpipe']:.3f}, 1f1b {measured['1f1b']:.3f} against 0.2; run on a machine with a "
                    f"core per rank to compare them with theory")
    for name in ("gpipe", "1f1b"):
        theory = tp.bubble_fraction(name, 2, MICROBATCHES)  # (p−1)/(m+p−1) = 0.2
        assert measured[name] == pytest.approx(theory, abs=BUBBLE_POINTS), f"{name}: measured {measured[name]:.3f}"


# -- errors and the single-process path ----------------------------------------------------------------------


def test_more_stages_than_layers_is_a_clear_error():
    model = build_gpt(GPTConfig.preset("tiny"), seed=0)  # 2 layers
    with pytest.raises(ValueError, match="4 pipeline stages but the model has only 2 layers"):
        split_gpt(model, 0, 4)
    with pytest.raises(ValueError, match="2 pipeline stages but the model has only 1 layer:"):
        Pipeline(build_gpt(GPTConfig.preset("tiny", n_layer=1), seed=0), None, "interleaved", 2, 2)


def test_one_process_pipeline_is_the_model():
    """pp=1: one rank holds every stage (tie kept) and each schedule reproduces the model's loss and grads."""
    x, y = _batch(0)
    model = build_gpt(GPT4, seed=0)
    loss = model(x, y)
    loss.backward()
    with pytest.raises(ValueError, match="not divisible into 3 micro-batches"):
        Pipeline(build_gpt(GPT4, seed=0), None, "gpipe", 3).forward_backward(x, y)
    for schedule, v in [("naive", 1), ("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2), ("interleaved", 4)]:
        pipe = Pipeline(build_gpt(GPT4, seed=0), None, schedule, MICROBATCHES, v)
        assert pipe.module.lm_head.weight is pipe.module.wte.weight
        got = pipe.forward_backward(x, y)
        assert_close_to_scale(got.item(), loss.item(), msg=f"{schedule} loss")
        grads = {n: p.grad for n, p in pipe.named_parameters()}
        assert_all_close_to_scale(grads, {n: p.grad for n, p in model.named_parameters()}, msg=f"{schedule} ")


def test_stage_loss_sums_to_the_mean():
    logits = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[0, 1, 2], [3, 4, 0], [1, 1, 1], [2, 2, 2]])
    parts = sum(stage_loss(lg, t, targets.numel()) for lg, t in zip(logits.chunk(2), targets.chunk(2), strict=True))
    assert_close_to_scale(parts, F.cross_entropy(logits.flatten(0, 1), targets.flatten()), msg="two halves")


def test_a_hand_written_plan_runs_and_is_checked_first():
    """``Pipeline(plan=...)`` runs a plan given as data (lab 08's); one that breaks the rules is refused before
    anything runs, naming what is wrong."""
    x, y = _batch(0)
    model = build_gpt(GPT4, seed=0)
    loss = model(x, y)
    by_hand = [[a for a in tp.gpipe(1, MICROBATCHES)[0]]]
    pipe = Pipeline(build_gpt(GPT4, seed=0), None, microbatches=MICROBATCHES, plan=by_hand)
    assert pipe.schedule == "custom"
    assert_close_to_scale(pipe.forward_backward(x, y).item(), loss.item(), msg="hand-written plan")
    with pytest.raises(ValueError, match="one stage per rank: got 2 action lists"):
        Pipeline(build_gpt(GPT4, seed=0), None, microbatches=MICROBATCHES, plan=tp.gpipe(2, MICROBATCHES))
    missing = [[a for a in by_hand[0] if (a.kind, a.microbatch) != ("B", 0)]]
    with pytest.raises(ValueError, match="stage 0 micro-batch 0 needs B, or I and W"):
        Pipeline(build_gpt(GPT4, seed=0), None, microbatches=MICROBATCHES, plan=missing)


def test_activation_meter_counts_autocast_input_copies_not_weight_copies():
    """Under autocast a stage saves bf16 copies of its weights (model bytes, as the ledger counts them) and of its
    received input (an activation, although a leaf that requires grad): only the latter is counted."""
    from workbench.parallel.pipeline import ActivationMeter

    layer = torch.nn.Linear(32, 16, bias=False)
    received = torch.randn(8, 32, requires_grad=True)  # what recv hands a stage: a leaf that needs its gradient
    meter = ActivationMeter()
    with torch.autocast("cpu", dtype=torch.bfloat16), meter.saving(stage=0, mb=0):
        layer(received).float().sum()
    assert meter.held[(0, 0)] == received.numel() * 2, "the bf16 copy of the input, and nothing of the weight"
