"""Notebook 06's exercise: MFU against HFU under recomputation, and the measurements behind it.

Model FLOPs utilisation (MFU, Chowdhery et al. 2022, "PaLM", appendix B) divides the FLOPs the *model* needs per
step by what the hardware could do in the step's time: a forward's FLOPs F and a backward's 2F, so 3F, whatever
the implementation recomputes. Hardware FLOPs utilisation (HFU) divides what was actually *executed*, the
recomputation included: under full recomputation each block's forward runs twice, about 4F. MFU is the one to
compare runs by (recomputation is not useful work); HFU says how busy the chips were.

The learner writes ``utilisation(forward_flops, executed_flops, seconds, peak_flops) -> (mfu, hfu)``, fractions.
``check_utilisation(fn)`` compares it with the definitions on steps without, with selective and with full
recomputation, and names the classic mistakes (the recomputation counted as model FLOPs, the backward left out,
percent for a fraction, HFU assumed to be 4F). The reference solution is ``labs/solutions/nb06_utilisation.py``.

``compare_policies`` measures one real transformer block of the notebook's GPT under no recomputation, full
recomputation and lab 06's "save the matmuls, recompute the pointwise rest" policy, with lab 06's measurement
(``workbench.labs.checkpoint_policy.measure``: bytes kept for backward, FLOPs recomputed, gradients).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from workbench.labs import LabCheckFailed, show_hint
from workbench.labs.checkpoint_policy import measure, plan_policy, profile_block

MORE = " (more help: hint(1), hint(2), hint(3))"
H100_BF16_PEAK = 989.4e12  # dense BF16 tensor-core peak of an H100 SXM5 (NVIDIA's whitepaper), FLOP/s

# (what, forward FLOPs F, executed FLOPs, seconds): a 70B-like step per GPU, without, with selective and with
# full recomputation (executed = 3F + the recomputed part; the numbers are the exercise's, not measured).
CASES = [("no recomputation", 2.0e14, 6.0e14, 1.55), ("selective recomputation", 2.0e14, 6.12e14, 1.58),
         ("full recomputation", 2.0e14, 8.0e14, 2.02)]

HINTS = {
    1: "Both are 'FLOPs done per second, as a fraction of the peak': FLOPs / (seconds · peak). They differ in "
       "which FLOPs. MFU counts the model's: a forward and its backward, which is twice the forward, whatever "
       "the implementation recomputed. HFU counts what the hardware executed, the recomputation included.",
    2: "model FLOPs per step = 3 · forward_flops (forward F, backward 2F). executed_flops is already measured: "
       "it holds forward, backward and whatever was recomputed. Return fractions (0.4, not 40) as a pair "
       "(mfu, hfu). Without recomputation the two are equal when executed = 3F; under full recomputation HFU is "
       "about 4/3 of MFU.",
    3: "def utilisation(forward_flops, executed_flops, seconds, peak_flops):\n"
       "    budget = seconds * peak_flops\n"
       "    return 3 * forward_flops / budget, executed_flops / budget",
}


def hint(level: int = 1) -> str:
    """Print (and return) hint ``level`` (1: the idea, 2: the pieces, 3: nearly the code)."""
    return show_hint(HINTS, level)


def _definitions(forward: float, executed: float, seconds: float, peak: float) -> tuple[float, float]:
    budget = seconds * peak
    return 3 * forward / budget, executed / budget


def _mistakes(forward: float, executed: float, seconds: float, peak: float) -> dict[str, tuple[float, float]]:
    mfu, hfu = _definitions(forward, executed, seconds, peak)
    budget = seconds * peak
    return {
        "MFU counted the executed FLOPs: recomputation is not model work, so MFU uses 3 x forward_flops and "
        "stays the same whatever is recomputed": (executed / budget, hfu),
        "MFU left the backward out: a step's model FLOPs are the forward's and the backward's, 3 x forward_flops":
            (forward / budget, hfu),
        "returned percent: return fractions (0.38, not 38)": (100 * mfu, 100 * hfu),
        "HFU equals MFU: HFU counts what was executed (executed_flops), the recomputation included": (mfu, mfu),
        "HFU assumed 4 x forward_flops: that is full recomputation only; use the measured executed_flops":
            (mfu, 4 * forward / budget),
        "the pair is the wrong way round: return (mfu, hfu)": (hfu, mfu),
    }


def _close(got: tuple[float, float], want: tuple[float, float]) -> bool:
    return all(math.isclose(g, w, rel_tol=1e-9) for g, w in zip(got, want, strict=True))


def _as_pair(out: Any, what: str) -> tuple[float, float]:
    try:
        mfu, hfu = out
        return float(mfu), float(hfu)
    except (TypeError, ValueError):
        raise LabCheckFailed(f"on a step with {what}: return a pair (mfu, hfu) of numbers, got {out!r}"
                             + MORE) from None


def check_utilisation(fn: Callable[[float, float, float, float], tuple[float, float]]) -> None:
    """Raise ``LabCheckFailed`` naming the mistake, or print MFU and HFU of the exercise's three steps."""
    if not callable(fn):
        raise LabCheckFailed(f"check_utilisation wants your function utilisation, got {fn!r}")
    lines = []
    for what, forward, executed, seconds in CASES:
        try:
            out = fn(forward, executed, seconds, H100_BF16_PEAK)
        except NotImplementedError as error:
            raise LabCheckFailed(f"utilisation is still the stub ({error}): write it, then run this cell again"
                                 + MORE) from None
        except Exception as error:  # noqa: BLE001 -- explained to the learner
            raise LabCheckFailed(f"utilisation raised {type(error).__name__}: {error} (step with {what})"
                                 + MORE) from None
        got, want = _as_pair(out, what), _definitions(forward, executed, seconds, H100_BF16_PEAK)
        if not _close(got, want):
            for name, pair in _mistakes(forward, executed, seconds, H100_BF16_PEAK).items():
                if _close(got, pair) and not _close(pair, want):
                    raise LabCheckFailed(f"on the step with {what}: {name}." + MORE)
            raise LabCheckFailed(f"on the step with {what} (F = {forward:.3g}, executed {executed:.3g} FLOPs in "
                                 f"{seconds} s, peak {H100_BF16_PEAK:.4g} FLOP/s) you returned MFU {got[0]:.4g}, "
                                 f"HFU {got[1]:.4g}; the definitions give other numbers" + MORE)
        lines.append(f"{what:24s} {seconds:5.2f} s   MFU {want[0]:6.1%}   HFU {want[1]:6.1%}")
    print("✓ MFU and HFU as defined. Per GPU, a 70B-like step on an H100 (bf16 peak):\n  " + "\n  ".join(lines)
          + "\nFull recomputation raises HFU and lowers MFU: the chip is busier, the model trains slower.")


@dataclass(frozen=True)
class PolicyRun:
    """One recomputation policy on one block, measured."""

    kept_bytes: int  # bytes forward keeps for backward
    recomputed_flops: int  # matmul FLOPs backward does on top of a backward without recomputation
    executed_flops: int  # forward + backward matmul FLOPs actually executed
    seconds: float  # median time of one forward + backward
    grads_equal: bool  # gradients bit-identical to no recomputation


def compare_policies(block: torch.nn.Module, x: torch.Tensor, repeats: int = 5) -> dict[str, PolicyRun]:
    """Measure ``block`` on ``x`` under no recomputation, full recomputation and "save matmuls" (lab 06's policy,
    expressed as the ops with matmul FLOPs kept: ``plan_policy``): bytes and FLOPs once with lab 06's ``measure``,
    seconds as the median of ``repeats`` plain forward + backward runs (no measuring hooks in the way)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    g = torch.Generator(device="cpu").manual_seed(1)
    probe = torch.randn(x.shape, generator=g, device="cpu", dtype=x.dtype)
    inputs = (block, x, probe)
    ops = profile_block(block, x)
    forward = sum(op.flops for op in ops)
    heavy = [op.index for op in ops if op.flops > 0]
    contexts = {"none": None, "full": None,
                "save matmuls": lambda: create_selective_checkpoint_contexts(plan_policy(heavy))}
    base = measure("none", block_and_inputs=inputs)
    runs = {name: base if name == "none" else measure("checkpoint", context, inputs, base)
            for name, context in contexts.items()}
    equal = {name: all(torch.equal(a, b) for a, b in zip(run.grads, base.grads, strict=True))
             for name, run in runs.items()}  # before the timed runs, which write new gradients
    seconds: dict[str, list[float]] = {name: [] for name in contexts}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as lab 06 measures: one thread, steadier on a shared CPU
    try:
        for _ in range(repeats):  # interleaved, so that the machine's noise hits every policy alike
            for name, context in contexts.items():
                seconds[name].append(_time_step(block, x, probe, "none" if name == "none" else "checkpoint",
                                                context))
    finally:
        torch.set_num_threads(threads)
    return {name: PolicyRun(run.kept_bytes, run.recomputed_flops, forward + run.backward_flops,
                            statistics.median(seconds[name]), equal[name])
            for name, run in runs.items()}


def _time_step(block: torch.nn.Module, x: torch.Tensor, probe: torch.Tensor, mode: str,
               context: Callable[[], Any] | None) -> float:
    """Seconds of one forward + backward of ``block`` (checkpointed unless ``mode`` is "none")."""
    x = x.detach().requires_grad_()
    for p in block.parameters():
        p.grad = None  # fresh gradients: the measured runs' stay as they were
    start = time.perf_counter()
    if mode == "none":
        out = block(x)
    else:
        out = checkpoint(block, x, use_reentrant=False, **({} if context is None else {"context_fn": context}))
    (out * probe).sum().backward()
    return time.perf_counter() - start


def forward_flops(block: torch.nn.Module, x: torch.Tensor) -> int:
    """The matmul FLOPs of one forward of ``block`` on ``x`` (lab 06's count)."""
    return sum(op.flops for op in profile_block(block, x))


__all__ = ["CASES", "H100_BF16_PEAK", "HINTS", "PolicyRun", "check_utilisation", "compare_policies",
           "forward_flops", "hint"]
