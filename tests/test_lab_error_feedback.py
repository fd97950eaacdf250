"""Lab 13 checker: the stub and each typical mistake in error feedback get their pointed message (all on one
process, before the ranks); the reference solution passes every case, convergence on 2 gloo ranks included."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from workbench.labs import LabCheckFailed
from workbench.labs.error_feedback import EF_BAND, ROUNDING_UNITS, check

LABS = Path(__file__).resolve().parent.parent / "labs"
if str(LABS) not in sys.path:  # the reference solutions live beside the labs, outside the workbench package
    sys.path.insert(0, str(LABS))

from solutions.error_feedback import ErrorFeedback  # noqa: E402

pytestmark = pytest.mark.timeout(240)


class Stub(ErrorFeedback):
    def step(self, key, grad):
        raise NotImplementedError("compress grad plus the residual")


class ForgetsToAdd(ErrorFeedback):
    """Keeps the residual, never adds it."""

    def step(self, key, grad):
        c = self.compress(grad)
        self.residuals[key] = grad + self.residuals.get(key, torch.zeros_like(grad)) - c
        return c


class KeepsWhatWasSent(ErrorFeedback):
    def step(self, key, grad):
        c = self.compress(grad + self.residuals.get(key, torch.zeros_like(grad)))
        self.residuals[key] = c
        return c


class FlippedSign(ErrorFeedback):
    def step(self, key, grad):
        p = grad + self.residuals.get(key, torch.zeros_like(grad))
        c = self.compress(p)
        self.residuals[key] = c - p
        return c


class Accumulates(ErrorFeedback):
    """Never resets: adds the new leftover to the old residual, which p already contained."""

    def step(self, key, grad):
        e = self.residuals.get(key, torch.zeros_like(grad))
        p = grad + e
        c = self.compress(p)
        self.residuals[key] = e + p - c
        return c


class FromGradientAlone(ErrorFeedback):
    def step(self, key, grad):
        c = self.compress(grad + self.residuals.get(key, torch.zeros_like(grad)))
        self.residuals[key] = grad - c
        return c


class KeepsWholeInput(ErrorFeedback):
    def step(self, key, grad):
        p = grad + self.residuals.get(key, torch.zeros_like(grad))
        self.residuals[key] = p
        return self.compress(p)


class SubtractsResidual(ErrorFeedback):
    def step(self, key, grad):
        p = grad - self.residuals.get(key, torch.zeros_like(grad))
        c = self.compress(p)
        self.residuals[key] = p - c
        return c


class SharedResidual:
    """One residual for every tensor (per shape it would be the same mistake)."""

    def __init__(self, compress):
        self.compress, self.e = compress, None

    def step(self, key, grad):
        p = grad if self.e is None or self.e.shape != grad.shape else grad + self.e
        c = self.compress(p)
        self.e = p - c
        return c

    def residual(self, key):
        return self.e


class ReturnsInput(ErrorFeedback):
    def step(self, key, grad):
        p = grad + self.residuals.get(key, torch.zeros_like(grad))
        self.residuals[key] = p - self.compress(p)
        return p


class AddsAfterCompressing(ErrorFeedback):
    def step(self, key, grad):
        e = self.residuals.get(key, torch.zeros_like(grad))
        c = self.compress(grad)
        self.residuals[key] = grad - c
        return c + e


class CompressesTwice(ErrorFeedback):
    def step(self, key, grad):
        self.compress(grad)
        return super().step(key, grad)


class NeverCompresses(ErrorFeedback):
    def step(self, key, grad):
        self.residuals[key] = torch.zeros_like(grad)
        return grad


class StartsFromOnes(ErrorFeedback):
    def step(self, key, grad):
        self.residuals.setdefault(key, torch.ones_like(grad))
        return super().step(key, grad)


class FlatResidual(ErrorFeedback):
    def residual(self, key):
        return self.residuals[key].reshape(-1)


class FailsOnRanks(ErrorFeedback):
    def step(self, key, grad):
        if torch.distributed.is_initialized():
            raise RuntimeError("only on a rank")
        return super().step(key, grad)


def test_the_reference_solution_passes(capsys) -> None:
    check(ErrorFeedback)
    out = capsys.readouterr().out
    assert out.startswith("Correct:") and f"(allowed {ROUNDING_UNITS})" in out and f"<= {EF_BAND}" in out


@pytest.mark.parametrize("cls, message", [
    (Stub, "still the stub"),
    (ForgetsToAdd, "compress got the gradient alone: the residual was kept .* but never added"),
    (KeepsWhatWasSent, "the residual kept is what was sent"),
    (FlippedSign, "the residual has the wrong sign"),
    (Accumulates, "the residual was accumulated, e \\+ \\(p - c\\): .* counted twice"),
    (FromGradientAlone, "the new residual was taken from the gradient alone"),
    (KeepsWholeInput, "kept the whole input .* never let go of what was sent"),
    (SubtractsResidual, "compress got the gradient minus the residual"),
    (SharedResidual, "three tensors.*one residual is shared between tensors"),
    (ReturnsInput, "step returned its input .* uncompressed"),
    (AddsAfterCompressing, "step added the residual after compressing"),
    (CompressesTwice, "called compress 2 times for one gradient"),
    (NeverCompresses, "returned the gradient without calling compress"),
    (StartsFromOnes, "the first time a key is stepped its residual must be zero"),
    (FlatResidual, "residual\\('w'\\) returned shape \\(64,\\)"),
], ids=lambda v: getattr(v, "__name__", "msg"))
def test_each_mistake_gets_its_message(cls, message: str) -> None:
    with pytest.raises(LabCheckFailed, match=message) as info:
        check(cls)
    assert "hint(1)" in str(info.value)


def test_an_instance_instead_of_the_class_is_named() -> None:
    with pytest.raises(LabCheckFailed, match="pass your class itself"):
        check(ErrorFeedback(lambda p: p))


def test_an_error_on_the_ranks_is_reported_with_its_traceback() -> None:
    with pytest.raises(LabCheckFailed, match=r"least squares on 2 ranks failed: rank \d failed: RuntimeError") as info:
        check(FailsOnRanks)
    assert "only on a rank" in str(info.value)


def test_the_invariant_holds_for_the_compressors_in_the_package_too() -> None:
    """The lab's contract is what parallel.compression's top-k keeps: its residual equals the solution's, step by
    step, on one process (a world of 1: the all-gather is the rank's own message)."""
    from workbench.labs.error_feedback import topk
    from workbench.parallel.compression import TopKCompressor

    package, mine = TopKCompressor(ratio=0.125), ErrorFeedback(topk(0.125))
    for step in range(5):
        g = torch.randn(64, generator=torch.Generator().manual_seed(step))
        sent = mine.step(0, g.clone())
        unit = g.clone()
        package.reduce(unit, key=0).wait()
        package.end_step()
        assert torch.equal(unit, sent) and torch.equal(package.residuals()[0], mine.residual(0))
