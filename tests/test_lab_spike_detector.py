"""Lab 11 checker: the stub and each typical mistake in a spike/NaN/divergence detector get their pointed message on
the recorded runs; the reference solution passes every run. Also the recorded runs themselves (each fault where it
was planted, clean twins equal before it) and the corrupted-batch helpers that made the spikes."""

from __future__ import annotations

import math
import statistics
import sys
from collections import deque
from pathlib import Path

import pytest

from workbench.labs import LabCheckFailed
from workbench.labs.spike_detector import DIVERGENCE_WINDOW, check, load_runs, replay
from workbench.training.config import RunConfig
from workbench.training.health import corrupt_windows, corrupted_corpus, step_windows

LABS = Path(__file__).resolve().parent.parent / "labs"
if str(LABS) not in sys.path:  # the reference solutions live beside the labs, outside the workbench package
    sys.path.insert(0, str(LABS))

from solutions.spike_detector import Detector  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class Stub:
    def observe(self, loss, grad_norm):
        raise NotImplementedError("flag nan, spike or divergence")


class NanAfterWarmup(Detector):
    """Ignores a NaN while warming up: the one at step 3 is flagged only once warm, 7 steps late."""

    def observe(self, loss, grad_norm):
        if self.steps < self.warmup and not math.isfinite(loss):
            self.steps += 1
            return None
        return super().observe(loss, grad_norm)


class GradNormSpikes(Detector):
    """Also calls a gradient-norm jump a spike: healthy runs have those."""

    def __init__(self):
        super().__init__()
        self.norms = deque(maxlen=20)

    def observe(self, loss, grad_norm):
        if self.norms and math.isfinite(grad_norm) and grad_norm > 5 * statistics.median(self.norms):
            return "spike"
        self.norms.append(grad_norm)
        return super().observe(loss, grad_norm)


class SpikesOnly(Detector):
    """No divergence test: the drift never stands 1.5x above a median that climbs with it."""

    def __init__(self):
        super().__init__(rise=math.inf)


class PreviousStep:
    """A jump over the previous step's loss: the noise of a small batch trips it."""

    def __init__(self):
        self.last = None

    def observe(self, loss, grad_norm):
        if not math.isfinite(loss):
            return "nan"
        jump = self.last is not None and loss > 1.1 * self.last
        self.last = loss
        return "spike" if jump else None


class Mean(Detector):
    """A mean of the whole past as the divergence baseline: it lags behind the falling loss."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def observe(self, loss, grad_norm):
        if math.isfinite(loss) and self.seen and self.steps > 30 and loss > 1.2 * statistics.fmean(self.seen[-30:]):
            return "divergence"
        self.seen.append(loss)
        return super().observe(loss, grad_norm)


@pytest.mark.parametrize("detector, expected", [
    (Stub, "still the stub"),
    (NanAfterWarmup, "late: run 'nan-early'"),
    (GradNormSpikes, "the gradient norm jumped there with the loss steady"),
    (SpikesOnly, "missed: run 'divergence'"),
    (PreviousStep, "false alarm in run 'clean"),
    (Mean, "is a spike"),
    (lambda: object(), "no observe(loss, grad_norm) method"),
    (Detector(), "pass something that makes a fresh detector"),
], ids=["stub", "nan-after-warmup", "grad-norm", "spikes-only", "previous-step", "mean", "no-observe", "instance"])
def test_mistake_gets_pointed_message(detector, expected):
    with pytest.raises(LabCheckFailed, match="hint") as failure:
        check(detector)
    assert expected in str(failure.value), str(failure.value)


def test_wrong_kind_is_named():
    class Shouts(Detector):
        def observe(self, loss, grad_norm):
            return "NaN" if not math.isfinite(loss) else super().observe(loss, grad_norm)

    with pytest.raises(LabCheckFailed, match="must return None or one of 'nan'"):
        check(Shouts)


def test_solution_passes(capsys):
    check(Detector)
    out = capsys.readouterr().out
    assert out.startswith("Correct:") and "divergence: divergence at step" in out, out


def test_solution_flags_each_fault_where_planted():
    """The reference is well inside every window: NaN and spike at their step, the drift 2 steps after its onset."""
    for run in load_runs():
        alarms = replay(Detector, run)
        if run["fault"] is None:
            assert alarms == [], run["name"]
        else:
            step, kind = alarms[0]
            assert kind == run["fault"] and run["step"] <= step <= run["step"] + (2 if kind == "divergence" else 0)


def test_recorded_runs_show_their_faults():
    """Each recording holds what its name says: the NaN from its step on, the spike at its step only (its clean
    twin equal before it, to 2 %: the corrupted windows share one boundary token with neighbours served earlier),
    the drift rising for good; so the grading above is about the detector, not about a mislabelled run."""
    runs = {r["name"]: r for r in load_runs()}
    assert len(runs) == 8 and all(len(r["loss"]) == 80 for r in runs.values())
    for name in ("nan", "nan-early"):
        s, loss = runs[name]["step"], runs[name]["loss"]
        assert all(math.isfinite(v) for v in loss[:s]) and all(math.isnan(v) for v in loss[s:]), name
    for name, twin in (("spike", "clean-seed1"), ("spike-early", "clean")):
        s, loss, clean = runs[name]["step"], runs[name]["loss"], runs[twin]["loss"]
        assert all(abs(a - b) <= 0.02 * b for a, b in zip(loss[:s], clean[:s], strict=True)), name
        assert loss[s] > 1.8 * clean[s] and loss[s + 1] < 1.1 * clean[s + 1], name
    drift, clean = runs["divergence"], runs["clean-seed1"]["loss"]
    s = drift["step"]
    assert all(abs(a - b) <= 0.02 * b for a, b in zip(drift["loss"][:s], clean[:s], strict=True))
    rise = [statistics.median(drift["loss"][i - 2:i + 3]) for i in range(s + 2, s + DIVERGENCE_WINDOW * 2, 3)]
    assert rise == sorted(rise) and rise[-1] > 1.5 * statistics.median(clean[s - 5:s]), rise


def test_corrupt_windows_replaces_exactly_those_windows():
    text = "abcdefghij" * 10
    out = corrupt_windows(text, [2, 5], seq_len=10, seed=1)
    assert len(out) == len(text)
    changed = {i // 10 for i, (a, b) in enumerate(zip(text, out, strict=True)) if a != b}
    assert changed == {2, 5}
    assert out[20:30].isprintable() and out[20:30] != text[20:30]
    with pytest.raises(ValueError, match="window 10 of 10 tokens lies outside"):
        corrupt_windows(text, [10], seq_len=10)
    with pytest.raises(ValueError, match="needs an ASCII text"):
        corrupt_windows("é" * 40, [0], seq_len=10)


def test_corrupted_corpus_hits_the_batches_the_sampler_serves(tmp_path):
    cfg = RunConfig(model="tiny", nproc=2, steps=10, batch_size=8, seq_len=64, seed=3)
    windows = corrupted_corpus(cfg, str(tmp_path / "c.txt"), {4: 8, 6: 3})
    total = (len(Path(tmp_path / "c.txt").read_text(encoding="utf-8")) - 1) // 64
    assert windows == step_windows(total, 8, 4, seed=3) + step_windows(total, 8, 6, seed=3)[:3]
    with_val = RunConfig(model="tiny", nproc=2, steps=10, batch_size=8, seq_len=64, val_every=5)
    held_out = corrupted_corpus(with_val, str(tmp_path / "v.txt"), {0: 8})
    assert max(held_out) < int(total * (1 - with_val.val_fraction))  # only training windows are served
