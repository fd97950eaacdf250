"""Training health: spike/NaN detection with warn / rollback / stop, a held-out validation split that no training
window touches, the duplicated-shard check, stragglers."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest

from workbench.cli import run_training
from workbench.health import (
    MAX_ROLLBACKS,
    HealthMonitor,
    SpikeDetector,
    Split,
    check_disjoint,
    check_split,
    split_windows,
    stragglers,
    window_tokens,
)
from workbench.train import RunConfig

pytestmark = pytest.mark.timeout(300)

SMALL = dict(nproc=2, batch_size=8, seq_len=32, steps=6)


def _steps(monitor: HealthMonitor, losses: list[float], has_checkpoint) -> list:
    return [monitor.verdict({"step": i, "loss": loss, "grad_norm": 1.0}, has_checkpoint)
            for i, loss in enumerate(losses)]


def test_monitor_returns_the_configured_action_and_records_it() -> None:
    asked = []
    for action in ("warn", "stop"):
        monitor = HealthMonitor(on_spike=action)
        verdicts = _steps(monitor, [1.0] * 6 + [math.nan], lambda: asked.append(1) or True)
        assert verdicts[:6] == [None] * 6 and verdicts[6] == ("loss is nan", action)
        assert monitor.events == [{"step": 6, "problem": "loss is nan", "action": action}]
    assert not asked, "the checkpoint folder is read only when a rollback is due"


def test_monitor_rolls_back_while_it_can_then_stops() -> None:
    monitor = HealthMonitor(on_spike="rollback")
    assert _steps(monitor, [math.inf], lambda: False) == [("loss is inf", "stop")]  # nothing to go back to
    monitor = HealthMonitor(on_spike="rollback")
    for attempt in range(MAX_ROLLBACKS):
        assert _steps(monitor, [math.nan], lambda: True) == [("loss is nan", "rollback")]
        monitor.rolled_back(to_step=attempt)
        assert monitor.events[-1]["rolled_back_to_step"] == attempt and len(monitor.detector.recent) == 0
    assert _steps(monitor, [math.nan], lambda: True) == [("loss is nan", "stop")]  # it keeps coming back
    assert monitor.rollbacks == MAX_ROLLBACKS


def test_monitor_refuses_an_unknown_action() -> None:
    with pytest.raises(ValueError, match="on_spike='retry'; valid: warn, rollback, stop"):
        HealthMonitor(on_spike="retry")


def test_detector_flags_nan_inf_and_spikes_but_not_ordinary_noise() -> None:
    d = SpikeDetector(factor=2.0, window=5, warmup=3)
    assert [d.check(x, 1.0) for x in (5.0, 4.8, 4.9, 4.7, 5.2)] == [None] * 5
    assert "nan" in d.check(math.nan, 1.0)
    assert "gradient norm is inf" in d.check(4.0, math.inf)
    assert "loss spike: 11" in d.check(11.0, 1.0)
    assert d.check(9.0, 1.0) is None  # 9 < 2 x median(4.8, 4.9, 4.7, 5.2, 5.0): an unhealthy step is not history
    with pytest.raises(ValueError, match="spike factor must be a number > 1"):
        SpikeDetector(factor=1.0)


def test_validation_split_is_held_out_behind_a_guard() -> None:
    split = split_windows(100, 0.1)
    assert (split.train, split.val_start, split.total) == (89, 90, 100)
    check_split(split, seq_len=32)
    assert window_tokens(split.train - 1, 32)[-1] < window_tokens(split.val_start, 32)[0]
    with pytest.raises(ValueError, match="contaminated validation split: training window 89 reads token 2880"):
        check_split(Split(train=90, val_start=90, total=100), seq_len=32)
    with pytest.raises(ValueError, match="val_fraction must be a number in"):
        split_windows(100, 1.5)


def test_duplicated_shards_name_the_ranks_and_window() -> None:
    check_disjoint([[0, 1], [2, 3]], step=4)
    with pytest.raises(ValueError, match="step 4: data-parallel ranks 0 and 1 both drew window 1"):
        check_disjoint([[0, 1], [1, 3]], step=4)


def test_stragglers_stand_out() -> None:
    out = stragglers([[0.10, 0.11, 0.10], [0.10, 0.10, 0.12], [0.30, 0.31, 0.29]])
    assert out["stragglers"] == [2]
    assert out["median_step_time_s"][2] == pytest.approx(0.30)


def test_validation_loss_and_health_in_the_summary(tmp_path: Path) -> None:
    summary = run_training(RunConfig(**SMALL, val_every=3), out=tmp_path, progress=False)
    health = summary["health"]
    assert [step for step, _ in health["val_losses"]] == [2, 5]
    assert all(math.isfinite(v) and 2 < v < 7 for _, v in health["val_losses"])
    assert health["val_split"]["val_windows"] >= 1 and health["events"] == []
    assert len(health["stragglers"]["median_step_time_s"]) == 2


def test_a_nan_is_rolled_back_and_its_batches_skipped(tmp_path: Path) -> None:
    """Rank 1's weights turn NaN before step 3; the NaN loss is seen on both ranks, which reload step 1's
    checkpoint and skip batches 2-3, so the run finishes finite (and differs from an unbroken run by those
    batches)."""
    cfg = RunConfig(**SMALL, ckpt_dir=str(tmp_path / "ckpt"), ckpt_every=2, inject_fault="nan:rank=1:step=3",
                    on_spike="rollback")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = run_training(cfg, progress=False)
    [event] = summary["health"]["events"]
    assert event["step"] == 3 and event["action"] == "rollback" and event["rolled_back_to_step"] == 1
    assert "loss is nan" in event["problem"]
    assert summary["health"]["data_skip"] == 2
    assert [m["step"] for m in summary["history"]] == list(range(6))
    assert all(math.isfinite(m["loss"]) for m in summary["history"])


def test_a_nan_with_stop_ends_the_run_there(tmp_path: Path) -> None:
    cfg = RunConfig(**SMALL, inject_fault="nan:rank=0:step=2", on_spike="stop")
    summary = run_training(cfg, progress=False)
    assert summary["stopped_after_step"] == 2
    assert [m["step"] for m in summary["history"]] == [0, 1, 2]
    [event] = summary["health"]["events"]
    assert event["action"] == "stop" and "loss is nan" in event["problem"]


@pytest.mark.parametrize("flags, message", [
    (dict(on_spike="panic"), "on_spike='panic'; valid: warn, rollback, stop"),
    (dict(on_spike="rollback"), "on_spike='rollback' needs ckpt_dir"),
    (dict(val_every=0), "val_every must be a positive int"),
    (dict(val_every=2, pp=2, nproc=2), "val_every with pp > 1 is not supported yet"),
    (dict(val_every=2, val_fraction=0.0), "val_fraction must be a number in"),
    (dict(spike_factor=0.5), "spike factor must be a number > 1"),
])
def test_bad_health_flags_are_rejected_before_spawning(flags: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunConfig(**{**SMALL, **flags})
