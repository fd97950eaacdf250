"""Lab 05 checker: the stub and each classic mistake of a dynamic loss scaler get their pointed message; the
solution passes; the checker's simulated mistakes really differ from the reference on its stream.

The reference solution lives beside the lab notebooks (labs/solutions/), not in the workbench package."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from workbench import comm
from workbench.labs import LabCheckFailed
from workbench.labs.loss_scaler import CONFIG, MISTAKES, STREAM, _Sim, _simulate, check, run_fp16_demo

LABS = Path(__file__).resolve().parent.parent / "labs"
if str(LABS) not in sys.path:
    sys.path.insert(0, str(LABS))

from solutions.loss_scaler import LossScaler  # noqa: E402

# -- the planted mistakes, each one method away from the solution --------------------------------------------


class Stub(LossScaler):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("__init__: keep the current scale")


class LocalOnly(LossScaler):
    """Decides found_inf from this rank's gradients alone: the ranks disagree."""

    def unscale(self, grads, group=None):
        return [g.float() / self._scale for g in grads], any(not bool(torch.isfinite(g).all()) for g in grads)


class NoReset(LossScaler):
    """Forgets to reset the clean-step counter on backoff."""

    def update(self, found_inf):
        if found_inf:
            self._scale *= self.backoff_factor
            return False
        return super().update(False)


class GrowOnOverflow(LossScaler):
    """Counts every step, the overflowing one included, towards growth before backing off."""

    def update(self, found_inf):
        self._clean += 1
        if self._clean >= self.growth_interval:
            self._scale *= self.growth_factor
            self._clean = 0
        if found_inf:
            self._scale *= self.backoff_factor
            return False
        return True


class InfOnly(LossScaler):
    """torch.isinf misses NaN."""

    def unscale(self, grads, group=None):
        flag = torch.tensor([1.0 if any(bool(torch.isinf(g).any()) for g in grads) else 0.0])
        comm.all_reduce(flag, op="max", group=group)
        return [g.float() / self._scale for g in grads], bool(flag.item() > 0)


class LateGrowth(LossScaler):
    def update(self, found_inf):
        if found_inf:
            return super().update(True)
        self._clean += 1
        if self._clean > self.growth_interval:  # > instead of >=
            self._scale *= self.growth_factor
            self._clean = 0
        return True


class NoSkip(LossScaler):
    def update(self, found_inf):
        super().update(found_inf)
        return True


class NoBackoff(LossScaler):
    def update(self, found_inf):
        if found_inf:
            self._clean = 0
            return False
        return super().update(False)


class UnscaleInFp16(LossScaler):
    """Divides in fp16, then casts: the tiny gradients flush to zero."""

    def unscale(self, grads, group=None):
        out, found = super().unscale(grads, group)
        return [(g / self._scale).float() for g in grads], found


class NoUnscale(LossScaler):
    def unscale(self, grads, group=None):
        out, found = super().unscale(grads, group)
        return [g.float() for g in grads], found


class ReturnsFp16(LossScaler):
    def unscale(self, grads, group=None):
        out, found = super().unscale(grads, group)
        return [g.half() for g in out], found


class ScaleForgotten(LossScaler):
    def scale(self, loss):
        return loss


class StateWithoutCounter(LossScaler):
    def state_dict(self):
        return {k: v for k, v in super().state_dict().items() if k != "clean"}

    def load_state_dict(self, state):
        super().load_state_dict({**state, "clean": 0})


class StateWithoutInterval(LossScaler):
    def state_dict(self):
        return {"scale": self._scale, "clean": self._clean}

    def load_state_dict(self, state):
        self._scale, self._clean = float(state["scale"]), int(state["clean"])


class StateNotPlain(LossScaler):
    def state_dict(self):
        return {"scaler": self}  # an object: torch.load(weights_only=True) refuses it

    def load_state_dict(self, state):
        self.__dict__.update(state["scaler"].__dict__)


class StateLosesScale(LossScaler):
    def load_state_dict(self, state):
        super().load_state_dict({**state, "scale": 2.0 ** 16})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cls, message", [
    (Stub, r"^your scaler is still the stub: __init__"),
    (LocalOnly, r"each rank decided found_inf from its own gradients only: at step 3 the inf was on rank 1 only"),
    (NoReset, r"after the overflow at step 6 the clean-step counter kept counting"),
    (GrowOnOverflow, r"the step that overflowed \(step \d+\) was counted as clean"),
    (InfOnly, r"the NaN at step 9 was not caught"),
    (LateGrowth, r"grew one step late"),
    (NoSkip, r"the step that overflowed was taken \(update returned True at step 3\)"),
    (NoBackoff, r"the scale did not shrink after the overflow at step 3"),
    (UnscaleInFp16, r"the tiny gradients of step 1 .* came back as zeros: they were unscaled in fp16"),
    (NoUnscale, r"the gradients were not unscaled \(step 0: they are still × 4096\)"),
    (ReturnsFp16, r"unscale returned torch.float16 gradients: return fp32"),
    (ScaleForgotten, r"scale\(loss\) returned the loss unchanged"),
    (StateWithoutCounter, r"the state did not carry the clean-step counter"),
    (StateWithoutInterval, r"the state did not carry growth_interval"),
    (StateNotPlain, r"state_dict\(\) holds something torch.load\(weights_only=True\) refuses"),
    (StateLosesScale, r"after load_state_dict a fresh scaler's scale is 65536, not the saved 2048"),
], ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_each_mistake_gets_its_pointed_message(cls, message):
    with pytest.raises(LabCheckFailed, match=message) as info:
        check(cls)
    assert str(info.value).endswith("(more help: hint(1), hint(2), hint(3))")


@pytest.mark.timeout(180)
def test_solution_passes(capsys):
    check(LossScaler)
    out = capsys.readouterr().out
    assert out.startswith("✓ on 2 ranks") and "resumed exactly from its state_dict" in out


def test_every_simulated_mistake_is_told_apart_on_the_stream():
    """If two mistakes (or a mistake and the reference) gave the same trace, the checker could not name it."""
    start = _Sim(CONFIG["init_scale"], 0, CONFIG["growth_interval"])
    traces = {v: _simulate(v, STREAM, start)[0] for v in ["correct", *MISTAKES]}
    traces["local"] = _simulate("local", STREAM, start)  # per rank: the ranks must disagree
    assert traces["local"][0] != traces["local"][1]
    rank0 = [tuple(t) for v, t in traces.items() if v != "local"]
    assert len(set(map(tuple, rank0))) == len(rank0), "two simulated behaviours coincide"


def test_check_wants_a_class():
    with pytest.raises(LabCheckFailed, match="your scaler class"):
        check(LossScaler())


def test_demo_rejects_bad_steps():
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        run_fp16_demo(LossScaler, steps=0)
