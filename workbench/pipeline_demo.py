"""Pipeline schedules run on real ranks for the course: notebook 08, the schedule explorer and lab 08.

Entry-point level (DESIGN.md): this module launches ranks and builds models, so the viz and widgets that show
its results never import torch.distributed; they receive a ``PipelineRun``, plain numbers and traces.

* ``run_schedules(["gpipe", "1f1b"], p, m)`` runs named schedules (``theory.pipeline.make_plan``) with
  ``workbench.parallel.pipeline.Pipeline`` on ``p`` gloo ranks in ONE launch, alternating schedules step by
  step so that each sees the same machine, and measures each one's bubble from its trace.
* ``run_plan(plan)`` runs any hand-written action list (lab 08's 1F1B) with the same executor, after
  ``check_plan`` and ``simulate`` have accepted it (a plan that would deadlock on real ranks is refused
  before any rank starts), and gathers every rank's gradients for comparison with one process
  (``reference``).

The model (``demo_config``): one GPT layer per stage, 384 wide with 64-token sequences, so a stage's forward
is ~10 ms of matmul on one core while an activation message takes well under a millisecond. Theory's bubble
assumes exactly that (compute dominates the point-to-point messages); the tiny preset (64 wide) spends as
long in Python and messages as in compute, and its measured bubble says more about overheads than schedules.
A 64-token vocabulary keeps the last stage's head and loss from unbalancing the stages. Each rank runs one
thread, as theory gives each stage one worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from workbench import trace
from workbench.dist import comm
from workbench.dist.launch import launch, rank_device
from workbench.models import GPTConfig, build_gpt
from workbench.parallel.pipeline import Pipeline, measured_bubble
from workbench.theory import pipeline as theory
from workbench.theory.pipeline import Plan, Simulation

DEMO_SHAPE = {"vocab_size": 64, "seq_len": 64, "n_head": 6, "d_model": 384}


def demo_config(p: int, v: int = 1, **overrides: int) -> GPTConfig:
    """The GPT a demo pipeline of ``p`` ranks x ``v`` virtual stages runs: ``p·v`` layers, one per stage."""
    return GPTConfig(**{**DEMO_SHAPE, "n_layer": p * v, **overrides})


def demo_batch(cfg: GPTConfig, m: int, microbatch_size: int, seed: int = 0,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``m`` micro-batches of ``microbatch_size`` random sequences: (tokens, next tokens), each [m·b, T]."""
    g = torch.Generator(device="cpu").manual_seed(seed)  # drawn on the CPU, so every device gets the same tokens
    x = torch.randint(0, cfg.vocab_size, (m * microbatch_size, cfg.seq_len + 1), generator=g, device="cpu")
    return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)


@dataclass
class PipelineRun:
    """One schedule run on real ranks, beside theory's view of the same action lists.

    ``step`` is the step drawn and quoted (``bubble_measured`` is its bubble): of the steps after the first
    (which warms up allocators and connections), the one whose bubble is the median (the lower one of two).
    ``peak_in_flight`` is the executor's count per rank
    (forwards whose backward has not run), ``peak_activation_bytes`` the ledger's peak per rank.
    """

    name: str
    p: int
    m: int
    v: int
    plan: Plan
    simulation: Simulation
    traces: list[trace.Trace]
    step: int
    losses: list[float]
    bubble_per_step: list[float]
    bubble_measured: float
    bubble_theory: float | None  # the closed form; None for a hand-written plan (see bubble_simulated)
    peak_in_flight: list[int]
    peak_activation_bytes: list[int]
    grads: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def bubble_simulated(self) -> float:
        return self.simulation.bubble_fraction

    @property
    def peak_in_flight_theory(self) -> list[int]:
        return self.simulation.peak_in_flight

    def summary(self) -> str:
        v = f", v={self.v}" if self.v > 1 else ""
        theory_said = self.bubble_theory if self.bubble_theory is not None else self.bubble_simulated
        return (f"{self.name} (p={self.p}, m={self.m}{v}): bubble measured {self.bubble_measured:.1%} (step "
                f"{self.step}), theory {theory_said:.1%} (error {self.bubble_measured - theory_said:+.1%}); peak "
                f"in-flight micro-batches per rank measured {self.peak_in_flight}, theory "
                f"{self.peak_in_flight_theory}")


# ---------------------------------------------------------------------------------------------------------
# On each rank.


def _pipeline(cfg: GPTConfig, schedule: str, m: int, v: int, plan: Plan | None) -> Pipeline:
    """The executor for a named schedule, or for a hand-written plan (one stage per rank)."""
    return Pipeline(build_gpt(cfg, seed=0), None, schedule, m, v, plan=plan)


def _rank_run(jobs: list[tuple[str, str, int, Plan | None]], m: int, steps: int, microbatch_size: int,
              cfg: GPTConfig, keep_grads: bool) -> dict[str, dict]:
    torch.set_num_threads(1)  # one worker per stage, as theory has it; 2 ranks do not fight over 2 cores
    rank, world = comm.group_rank(), comm.group_size()
    x, y = demo_batch(cfg, m, microbatch_size, device=rank_device())
    pipes = {key: _pipeline(cfg, schedule, m, v, plan) for key, schedule, v, plan in jobs}
    tracers = {key: trace.Tracer(rank, world) for key in pipes}
    losses: dict[str, list[float]] = {key: [] for key in pipes}
    for step in range(steps):
        for key, pipe in pipes.items():  # alternate: every schedule sees the same machine conditions
            for param in pipe.parameters():
                param.grad = None
            with trace.tracing(tracers[key]):
                trace.set_step(step)
                losses[key].append(pipe.forward_backward(x, y).item())
    return {key: {"trace": tracers[key].trace, "losses": losses[key], "peak_in_flight": pipe.peak_in_flight,
                  "peak_activations": tracers[key].memory.peak.get("activations", 0),
                  "grads": {n: p.grad.detach().cpu().clone() for n, p in pipe.named_parameters()} if keep_grads
                  else None}
            for key, pipe in pipes.items()}


# ---------------------------------------------------------------------------------------------------------
# In the caller.


def _measured_step(bubbles: list[float]) -> int:
    """The step after the warm-up step whose bubble is the median (the first step if there is only one)."""
    candidates = list(range(1, len(bubbles))) or [0]
    ordered = sorted(candidates, key=lambda s: bubbles[s])
    return ordered[(len(ordered) - 1) // 2]


def _collect(per_rank: list[dict], name: str, plan: Plan, v: int, m: int,
             bubble_theory: float | None) -> PipelineRun:
    traces = [r["trace"] for r in per_rank]
    steps = len(per_rank[0]["losses"])
    bubbles = [measured_bubble(traces, s) for s in range(steps)]
    step = _measured_step(bubbles)
    grads = None
    if per_rank[0]["grads"] is not None:
        grads = {}
        for r in per_rank:
            grads.update(r["grads"])
    return PipelineRun(name=name, p=len(plan), m=m, v=v, plan=plan, simulation=theory.simulate(plan),
                       traces=traces, step=step, losses=per_rank[0]["losses"], bubble_per_step=bubbles,
                       bubble_measured=bubbles[step],
                       bubble_theory=bubble_theory, peak_in_flight=[r["peak_in_flight"] for r in per_rank],
                       peak_activation_bytes=[r["peak_activations"] for r in per_rank], grads=grads)


def run_schedules(schedules: Sequence[str], p: int, m: int, v: int = 1, *, steps: int = 4,
                  microbatch_size: int = 2, cfg: GPTConfig | None = None, device: str = "cpu",
                  timeout: float = 120.0) -> dict[str, PipelineRun]:
    """Run each named schedule (``v`` applies to ``interleaved``; the others run one stage per rank) on
    ``p`` ranks for ``steps`` steps of ``m`` micro-batches; ValueError before spawning for a bad size."""
    if not schedules:
        raise ValueError("run_schedules needs at least one schedule name")
    cfg = cfg or demo_config(p, v)
    jobs = []
    for name in schedules:
        v_name = v if name == "interleaved" else 1
        theory.validate(name, p, m, v_name, cfg.n_layer)
        jobs.append((name, name, v_name, None))
    _check_steps(steps)
    results = launch(_rank_run, p, jobs, m, steps, microbatch_size, cfg, False, device=device, timeout=timeout)
    return {name: _collect([r[name] for r in results], name, theory.make_plan(name, p, m, v_name, cfg.n_layer),
                           v_name, m, theory.bubble_fraction(name, p, m, v_name))
            for name, _, v_name, _ in jobs}


def run_schedule(schedule: str, p: int, m: int, v: int = 1, **kwargs) -> PipelineRun:
    """``run_schedules([schedule], p, m, v, ...)[schedule]``: the schedule explorer's runner."""
    return run_schedules([schedule], p, m, v, **kwargs)[schedule]


def run_plan(plan: Plan, *, steps: int = 1, microbatch_size: int = 1, cfg: GPTConfig | None = None,
             name: str = "your plan", device: str = "cpu", timeout: float = 60.0) -> PipelineRun:
    """Run a hand-written plan (one stage per rank, ``plan[rank]`` = that rank's actions) on ``len(plan)``
    ranks and gather the gradients of its last step (``PipelineRun.grads``, the full model's names).

    The plan is checked first (``check_plan``, then ``simulate``, which names a deadlock): ValueError before
    any rank starts, since a deadlocking plan would otherwise only end at the timeout.
    """
    p = len(plan)
    if p < 1:
        raise ValueError("a plan needs at least one rank's action list")
    m = theory.num_microbatches(plan)
    theory.check_plan(plan, m)
    if theory.num_stages(plan) != p:
        raise ValueError(f"run_plan runs one stage per rank: the plan has {theory.num_stages(plan)} stages on "
                         f"{p} ranks")
    theory.simulate(plan)  # raises, naming what each rank waits for, if the order deadlocks
    _check_steps(steps)
    cfg = cfg or demo_config(p)
    results = launch(_rank_run, p, [(name, "custom", 1, plan)], m, steps, microbatch_size, cfg, True,
                     device=device, timeout=timeout)
    return _collect([r[name] for r in results], name, plan, 1, m, None)


def _check_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")


def reference(cfg: GPTConfig, m: int, microbatch_size: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the whole model, the same batch: its mean loss and every parameter's gradient."""
    model = build_gpt(cfg, seed=0)
    loss = model(*demo_batch(cfg, m, microbatch_size))
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


__all__ = ["DEMO_SHAPE", "PipelineRun", "demo_batch", "demo_config", "reference", "run_plan", "run_schedule",
           "run_schedules"]
