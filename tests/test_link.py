"""theory.comm.Link: the package's one α-β link type (issue 19 item 5). One class under three import paths, one
least-squares fit behind ``fit_ring_allreduce``, methods that are the float functions, and bad input refused by name.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

import workbench.theory
from workbench.theory import calibration, comm, parallelism
from workbench.theory.calibration import fit_ring_allreduce
from workbench.theory.comm import (
    Link,
    all_gather_time,
    bus_bytes,
    fit_alpha_beta,
    p2p_time,
    reduce_scatter_time,
    ring_allreduce_time,
    tree_allreduce_time,
)

SIZES = [2.0**k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB: both the latency and the bandwidth regime


def test_one_class_under_every_import_path() -> None:
    assert parallelism.Link is calibration.LinkModel is comm.Link is workbench.theory.Link
    assert isinstance(parallelism.NVLINK, calibration.LinkModel)
    assert dataclasses.is_dataclass(Link) and Link.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        parallelism.NVLINK.alpha = 0.0  # type: ignore[misc]


@pytest.mark.parametrize("world", [2, 3, 8])
def test_fit_ring_allreduce_recovers_a_synthetic_link(world: int) -> None:
    true = Link(alpha=40e-6, bandwidth=3e9, world=world)
    m = fit_ring_allreduce(SIZES, [true.ring_allreduce(s) for s in SIZES], world)
    assert isinstance(m, Link) and m.world == world and m.name == ""
    assert m.alpha == pytest.approx(true.alpha, rel=1e-6)
    assert m.bandwidth == pytest.approx(true.bandwidth, rel=1e-9)


def test_fit_ring_allreduce_is_fit_alpha_beta_on_bus_bytes() -> None:
    # Noisy times, so that any second least-squares implementation (other weights, a log fit) would differ.
    world = 4
    noise = [1.00, 1.07, 0.95, 1.02, 0.98, 1.10, 0.93, 1.01, 1.04]
    times = [ring_allreduce_time(s, world, 1e-4, 1e9) * f for s, f in zip(SIZES, noise, strict=True)]
    intercept, bandwidth = fit_alpha_beta([bus_bytes("all_reduce", s, world) for s in SIZES], times)
    m = fit_ring_allreduce(SIZES, times, world)
    assert m == Link(alpha=intercept / (2 * (world - 1)), bandwidth=bandwidth, world=world)


@pytest.mark.parametrize("world", [1, 2, 5, 16])
@pytest.mark.parametrize("nbytes", [0.0, 1e3, 3e8])
def test_methods_are_the_float_functions(world: int, nbytes: float) -> None:
    link = Link(alpha=7e-6, bandwidth=25e9)
    a, b = link.alpha, link.bandwidth
    assert link.message_time(nbytes) == p2p_time(nbytes, a, b)
    assert link.ring_allreduce(nbytes, world) == ring_allreduce_time(nbytes, world, a, b)
    assert link.reduce_scatter(nbytes, world) == reduce_scatter_time(nbytes, world, a, b)
    assert link.all_gather(nbytes, world) == all_gather_time(nbytes, world, a, b)
    assert link.tree_allreduce(nbytes, world) == tree_allreduce_time(nbytes, world, a, b)


def test_methods_against_hand_counts() -> None:
    a, b, s = 1e-5, 1e10, 4e8  # S/B = 40 ms, α = 10 µs
    link = Link(alpha=a, bandwidth=b, world=4)
    assert link.message_time(s) == pytest.approx(a + s / b, rel=1e-12)
    assert link.ring_allreduce(s) == pytest.approx(6 * a + 1.5 * s / b, rel=1e-12)  # 2(N−1)α + 2(N−1)/N·S/B
    assert link.reduce_scatter(s) == pytest.approx(3 * a + 0.75 * s / b, rel=1e-12)
    assert link.all_gather(s) == pytest.approx(3 * a + 0.75 * s / b, rel=1e-12)
    assert link.tree_allreduce(s, 8) == pytest.approx(6 * (a + s / b), rel=1e-12)  # 2·log2(8) whole-message hops
    assert link.ring_allreduce(s, 1) == 0.0  # one rank sends nothing, whatever the fitted N


def test_collective_time_dispatches_by_op_name() -> None:
    link = Link(alpha=2e-6, bandwidth=1e11, world=8)
    s = 1e7
    assert link.collective_time("all_reduce", s) == link.ring_allreduce(s)
    assert link.collective_time("allreduce", s, 2) == link.ring_allreduce(s, 2)  # torch's spelling, another N
    assert link.collective_time("reduce_scatter_tensor", s) == link.reduce_scatter(s)
    assert link.collective_time("all_gather_into_tensor", s) == link.all_gather(s)
    assert link.collective_time("send", s) == link.collective_time("recv", s) == link.message_time(s)
    assert link.collective_time("broadcast", s) == link.collective_time("reduce", s) == 3 * link.message_time(s)
    assert link.collective_time("all_to_all", s) == pytest.approx(7 * link.message_time(s / 8))
    assert link.collective_time("barrier", s) == 3 * link.alpha  # log2(8) empty rounds, whatever S
    with pytest.raises(ValueError, match="unknown op 'butterfly'"):
        link.collective_time("butterfly", s)


def test_world_defaults_to_the_fitted_one_and_is_needed_otherwise() -> None:
    fitted = Link(alpha=1e-5, bandwidth=1e9, world=4)
    assert fitted.ring_allreduce(1e6) == fitted.ring_allreduce(1e6, 4) != fitted.ring_allreduce(1e6, 8)
    with pytest.raises(ValueError, match="has no fitted world size: pass world=N"):
        Link(alpha=1e-5, bandwidth=1e9, name="eth").ring_allreduce(1e6)


@pytest.mark.parametrize("kwargs, message", [
    ({"alpha": -1e-6, "bandwidth": 1e9}, "link latency alpha must be a finite number of seconds >= 0, got -1e-06"),
    ({"alpha": math.nan, "bandwidth": 1e9}, "alpha must be a finite number of seconds >= 0, got nan"),
    ({"alpha": 1e-6, "bandwidth": 0.0}, "link bandwidth must be > 0 bytes/s, got 0.0"),
    ({"alpha": 1e-6, "bandwidth": -5e9}, "link bandwidth must be > 0 bytes/s, got -5000000000.0"),
    ({"alpha": 1e-6, "bandwidth": 1e9, "world": 1}, "must be an integer >= 2 or None, got 1"),
    ({"alpha": 1e-6, "bandwidth": 1e9, "world": 2.0}, "must be an integer >= 2 or None, got 2.0"),
    ({"alpha": 1e-6, "bandwidth": 1e9, "world": True}, "must be an integer >= 2 or None, got True"),
    ({"alpha": 1e-6, "bandwidth": 1e9, "name": 4}, "link name must be a str, got 4"),
])
def test_bad_input_is_refused_naming_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Link(**kwargs)


def test_bad_call_arguments_are_refused() -> None:
    link = Link(alpha=1e-6, bandwidth=1e9, world=2)
    with pytest.raises(ValueError, match=re.escape("nbytes must be >= 0, got -1.0")):
        link.message_time(-1.0)
    with pytest.raises(ValueError, match="world must be a positive int, got 0"):
        link.ring_allreduce(1.0, 0)


def test_a_latency_only_fit_is_a_valid_link() -> None:
    m = fit_ring_allreduce([1e3, 1e4], [2e-4, 2e-4], 2)  # flat times: fit_alpha_beta's B = inf
    assert m.bandwidth == math.inf and m.alpha == pytest.approx(1e-4, rel=1e-12)
    assert m.ring_allreduce(1e9) == pytest.approx(2e-4, rel=1e-12)


def test_describe() -> None:
    assert Link(alpha=1e-4, bandwidth=1.5e9, world=2).describe() == (
        "alpha = 100 us per message, B = 1.50 GB/s (fitted at N = 2)")
    assert parallelism.NVLINK.describe() == "NVLink (450 GB/s, 5 µs): alpha = 5 us per message, B = 450.00 GB/s"


def test_every_op_comm_runs_has_a_price() -> None:
    """Emulated links (dist.emulation) charge every op comm runs, so each canonical op must have a formula."""
    from workbench.theory.comm import OPS

    link = Link(alpha=1e-5, bandwidth=1e9)
    for op in OPS:
        assert link.collective_time(op, 1e6, 4) >= 0
    assert link.collective_time("barrier", 0, 1) == 0  # a group of one waits for nobody
