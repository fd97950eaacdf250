"""The shared α-β calibration: the fit recovers a known link, errors and predictions are reported right, bad input
is refused, and a real 2-rank calibration returns a usable model (its timings are never asserted)."""

from __future__ import annotations

import math

import pytest

from workbench.measure import allreduce_sweep, calibrate_link
from workbench.theory.calibration import LinkModel, check_prediction, fit_ring_allreduce, relative_error, worst_error
from workbench.theory.comm import ring_allreduce_time


@pytest.mark.parametrize("world", [2, 4, 8])
def test_fit_recovers_a_synthetic_link(world: int) -> None:
    sizes = [2**k for k in range(10, 23, 2)]
    times = [ring_allreduce_time(s, world, 250e-6, 2e9) for s in sizes]
    m = fit_ring_allreduce(sizes, times, world)
    assert m.alpha == pytest.approx(250e-6) and m.bandwidth == pytest.approx(2e9) and m.world == world
    assert [m.ring_allreduce(s) for s in sizes] == pytest.approx(times)


def test_fit_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="world"):
        fit_ring_allreduce([1, 2], [1.0, 2.0], 1)
    with pytest.raises(ValueError, match="times"):
        fit_ring_allreduce([1, 2], [1.0, 0.0], 2)
    with pytest.raises(ValueError, match="distinct"):
        fit_ring_allreduce([1, 1], [1.0, 2.0], 2)


def test_errors() -> None:
    assert relative_error(2.0, 3.0) == pytest.approx(0.5)
    assert worst_error([1.0, 1.0, 1.0], [1.1, 0.25, 2.0]) == (1, pytest.approx(-0.75))
    with pytest.raises(ValueError, match="measured"):
        relative_error(0.0, 1.0)
    with pytest.raises(ValueError, match="equal length"):
        worst_error([1.0], [])


def test_check_prediction_lines() -> None:
    assert "no prediction given" in check_prediction("x", None, 10.0, 10.0)
    line = check_prediction("bytes", 105.0, 100.0, 50.0)
    assert "+5% from the measurement" in line and "+110% from the theory" in line and line.endswith("✓")
    assert not check_prediction("bytes", 200.0, 100.0).endswith("✓")
    assert check_prediction("stage", "3", "3").endswith("✓")
    assert check_prediction("stage", "2", "3").endswith("✗")


def test_link_model_describe() -> None:
    m = LinkModel(alpha=1e-4, bandwidth=1.5e9, world=2)
    assert "100 us" in m.describe() and "1.50 GB/s" in m.describe()
    assert m.ring_allreduce(0, world=1) == 0.0


def test_calibrate_link_on_two_ranks() -> None:
    for algorithm in ("gloo all_reduce", "ring"):
        model, times = calibrate_link(2, sizes=[1 << 10, 1 << 16, 1 << 18], reps=2, algorithm=algorithm, timeout=60)
        assert len(times) == 3 and all(t > 0 for t in times)
        assert model.world == 2 and model.alpha >= 0 and model.bandwidth > 0 and not math.isnan(model.bandwidth)


def test_sweep_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown algorithm"):
        allreduce_sweep(2, [1024], algorithms=("butterfly",))
    with pytest.raises(ValueError, match="node_size"):
        allreduce_sweep(4, [1024], algorithms=("hierarchical",), node_size=3)
    with pytest.raises(ValueError, match="world"):
        calibrate_link(1)
    with pytest.raises(ValueError, match="unknown algorithm"):
        calibrate_link(2, algorithm="butterfly")
