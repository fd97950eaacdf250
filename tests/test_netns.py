"""A real shaped link (workbench.dist.netns, issue 20): the emulation's times hold where the bytes really cross one.

Two network namespaces (one per node) joined by a veth pair with a tbf token bucket on both ends; ranks of each
node run inside their namespace. Three nodes: each node's veth pair runs to a bridge in a switch namespace, shaped
on both ends (a leaf-to-switch star). Needs root, iproute2 and tbf: where any is missing (a CI runner without the
rights) these tests skip with the reason ``unavailable_reason()`` gives, except the ones that need none of it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from workbench.dist import comm, netns
from workbench.dist.launch import RankError

# The extended lane: real shaped links take a minute of measurement (benchmarks/bench_netns.py keeps the figure).
pytestmark = [pytest.mark.timeout(120), pytest.mark.extended]

SIZES = {"256KiB": 256 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20}  # the benchmark goes on to 64 MiB
# The bound (netns.agreement_bound), for predicted / real and emulated / real: within 1 +- (10 % + 8 ms / T), T the
# op's time over the real link.
# * 10 %, relative to T: what the α-β model leaves out. It has no term for the all-reduce's arithmetic and copies:
#   with no shaping at all, four ranks on two busy cores take 20 ms for 4 MiB, 320 ms for 64 MiB (~8 % of the shaped
#   time at every size, as both grow with the bytes), and gloo's ring does part of it between transfers (measured:
#   3-7 % slower than the link fitted on a one-way send; a send, with nothing to add, within 1 %). A bucket refilled
#   during a pause lets its 8 KiB burst through at once (3 % of 256 KiB); the rate drifts by a % or two between the
#   fit and the measurement.
# * 8 ms, relative to T: four ranks, this test runner and other users share two cores, so a rank waits ~3-4 ms for a
#   core now and then (with no shaping at all, a 256 KiB all-reduce takes a median 10 ms here, 4 to 95 ms), and an
#   all-reduce has six ring steps to wait at; not all of it overlaps the link's time, even in a median (measured: the
#   256 KiB all-reduce's median 1 to 7.5 ms over the model in a dozen runs; one run of the test failed with a 4 ms
#   allowance). It dominates at 256 KiB (T ~ 20 ms: +-50 %), and fades by 4 MiB (T ~ 275 ms: +-13 %). The
#   emulation's ~1 ms wake-up after its sleep fits in it too.
# Measured on this machine, busy (predicted / real): send 0.99..1.05 at every size; all-reduce 0.76..0.91 at 256 KiB,
# 0.93..0.94 at 1 MiB, 0.93..0.97 at 4 MiB to 64 MiB. What this rules out: the loopback's speed (ratio < 0.1) at every
# size, and from 1 MiB on (+-21 %) a ring all-reduce priced as one message (1 / 1.5 = 0.67) or as 2 S / B (1.33).


@pytest.fixture(scope="module")
def usable() -> None:
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def link(usable: None) -> Iterator[netns.ShapedLink]:
    with netns.shaped_link() as shaped:
        yield shaped
    assert netns.leftovers(shaped) == []


@pytest.fixture(scope="module")
def comparison(link: netns.ShapedLink) -> netns.Comparison:
    return netns.compare(link, SIZES, reps=2, timeout=100)


# ---------------------------------------------------------------------------------------------------------------
# Without the rights


def test_unavailable_reason_names_root_for_a_normal_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(os, "geteuid", lambda: 1000, raising=False)
    reason = netns.unavailable_reason()
    assert reason is not None and "root" in reason and "\n" not in reason


def test_token_bucket_is_given_in_bits_with_burst_and_limit_in_bytes() -> None:
    bucket = netns.TokenBucket.for_rate(25e6)
    assert bucket.tc_args() == ["tbf", "rate", "200000000bit", "burst", "8192", "limit", str(4 << 20)]
    assert netns.TokenBucket.for_rate(1e9).burst == 250_000  # 0.25 ms of a fast link
    port = netns.TokenBucket.for_switch_port(25e6)  # a switch port's: the same rate, a burst of 64 KiB
    assert (port.rate, port.burst, port.limit) == (25e6, 64 << 10, 4 << 20)
    assert netns.size_label(256 << 10) == "256KiB" and netns.size_label(64 << 20) == "64MiB"


# ---------------------------------------------------------------------------------------------------------------
# With them


def _interfaces() -> set[str]:
    return {name for _, name in socket.if_nameindex()}


def test_each_nodes_ranks_live_in_that_nodes_namespace(link: netns.ShapedLink) -> None:
    seen = netns.run_ranks(_interfaces, 4, link, timeout=60)
    assert seen[0] == seen[1] == {"lo", link.interfaces[0]}
    assert seen[2] == seen[3] == {"lo", link.interfaces[1]}
    assert link.interfaces[0] not in _interfaces()  # the machine's own namespace never sees the pair


def test_shaped_link_times_agree_with_the_emulation(comparison: netns.Comparison) -> None:
    # The link really is shaped: gloo's bandwidth sits just under the tbf rate (headers take ~4 %), not at the
    # loopback's GB/s, so the agreement below is about the link.
    assert 0.85 * comparison.bucket.rate <= comparison.link.bandwidth <= comparison.bucket.rate
    for timing in comparison.timings:
        assert timing.allowed == netns.agreement_bound(timing.shaped_s)
        assert abs(timing.ratio - 1) <= timing.allowed, timing.describe()
        assert abs(timing.emulated_s / timing.shaped_s - 1) <= timing.allowed, timing.describe()
        assert timing.within_bound()


def _fail_on_rank_three() -> None:
    if dist.get_rank() == 3:
        raise ValueError("boom")
    comm.barrier()  # the others wait for rank 3, which never comes


def _sleep() -> None:
    time.sleep(60)


def test_a_failing_or_stuck_rank_stops_every_rank(link: netns.ShapedLink) -> None:
    with pytest.raises(RankError, match="rank 3 failed: ValueError: boom"):
        netns.run_ranks(_fail_on_rank_three, 4, link, timeout=30)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="timeout=3s"):
        netns.run_ranks(_sleep, 2, link, timeout=3)
    assert time.monotonic() - start < 15
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("workbench-netns-rank")]


@pytest.mark.parametrize("nodes", [2, 3])
def test_teardown_leaves_nothing_behind_after_an_error(nodes: int, usable: None,
                                                       request: pytest.FixtureRequest) -> None:
    if nodes > 2:
        request.getfixturevalue("usable_star")
    with pytest.raises(RuntimeError, match="inside the block"):
        with netns.shaped_link(nodes=nodes) as shaped:
            # the veth ends (and the bridge) are inside the namespaces, the switch's among them from 3 nodes
            assert netns.leftovers(shaped) == list(shaped.all_namespaces())
            assert len(shaped.all_namespaces()) == (2 if nodes == 2 else nodes + 1)
            raise RuntimeError("inside the block")
    assert netns.leftovers(shaped) == []


def test_namespaces_of_a_killed_process_are_removed(usable: None) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid now names no process
    stale = [f"wb{gone.pid}x0-node0", f"wb{gone.pid}x0-node2", f"wb{gone.pid}x0-switch"]  # a 3-node link's too
    for name in stale:
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert set(stale) <= set(netns.remove_stale())
    finally:
        for name in stale:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    assert not [name for name in stale if (netns.NETNS_DIR / name).exists()]


# ----------------------------------------------------------------------------------------------------------------
# More than two nodes: each node's link runs to a switch (a bridge in a namespace of its own), shaped on both ends

# The bound for three nodes: netns.agreement_bound, as for the pair, for the message; 10 % more for the all-reduce
# (netns.STAR_ALL_REDUCE_SLACK, which says why: each ring step crosses two buckets and the bridge, whose per-packet
# work runs on the same busy cores; measured predicted / real 0.85..0.95 over the sizes, against the message's
# 0.97..1.02). What the looser bound still rules out from 1 MiB on: the loopback (ratio > 10) and a ring whose hops
# share a link (two flows on one uplink or downlink: ratio <= 0.67).


@pytest.fixture(scope="module")
def usable_star(usable: None) -> None:
    reason = netns.unavailable_reason(3)
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def star(usable_star: None) -> Iterator[netns.ShapedLink]:
    with netns.shaped_link(nodes=3) as shaped:
        assert shaped.switch is not None and len(shaped.ports) == 3
        yield shaped
    assert netns.leftovers(shaped) == []


def test_a_shaped_link_joins_two_to_max_nodes() -> None:
    for nodes in (1, netns.MAX_NODES + 1, 2.0):
        with pytest.raises(ValueError, match="a shaped link joins 2 to"):
            with netns.shaped_link(nodes=nodes):
                pass
    assert [netns.node_address(i) for i in (0, 2)] == ["10.213.0.1", "10.213.0.3"]
    assert netns.ranks_of_op(6, 3) == {"all_reduce": (0, 1, 2, 3, 4, 5), "send": (0, 4)}
    assert netns.ranks_of_op(4, 2) == netns.RANKS_OF_OP == {"all_reduce": (0, 1, 2, 3), "send": (0, 2)}


def _sums_and_message() -> tuple[set[str], float, list[float]]:
    """This rank's interfaces, the all-reduced sum of rank + 1, and what rank 0's message to the last node's first
    rank holds there (empty elsewhere)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([rank + 1.0], device="cpu")
    comm.all_reduce(total)
    peer = netns.message_peer(world, 3)
    message = torch.zeros(3, device="cpu")
    if rank == 0:
        comm.send(torch.tensor([7.0, 8.0, 9.0], device="cpu"), peer)
    elif rank == peer:
        comm.recv(message, 0)
    return _interfaces(), total.item(), message.tolist() if rank == peer else []


@pytest.mark.parametrize("per_node", [1, 2])
def test_three_nodes_all_reduce_and_message_give_the_right_numbers(star: netns.ShapedLink, per_node: int) -> None:
    world = 3 * per_node
    results = netns.run_ranks(_sums_and_message, world, star, timeout=60)
    for rank, (interfaces, total, message) in enumerate(results):
        assert interfaces == {"lo", star.interfaces[rank // per_node]}  # node-major, each node in its namespace
        assert total == world * (world + 1) / 2
        assert message == ([7.0, 8.0, 9.0] if rank == world - per_node else [])
    assert not set(star.all_interfaces()) & _interfaces()  # the machine's own namespace has none of it
    with pytest.raises(ValueError, match="multiple of the 3 nodes"):
        netns.run_ranks(_sums_and_message, 4, star)


def test_three_node_message_time_agrees_with_the_shaped_rate(star: netns.ShapedLink) -> None:
    # One rank per node: the message goes node 0 -> node 2 through node 0's uplink, the bridge and node 2's downlink.
    comparison = netns.compare(star, SIZES, reps=2, emulate=False, timeout=100, ranks_per_node=1)
    assert (comparison.world_size, comparison.nodes) == (3, 3)
    # Two buckets of one rate in series pass that rate: gloo sees it a few % under (headers), as over the pair.
    assert 0.85 * comparison.bucket.rate <= comparison.link.bandwidth <= comparison.bucket.rate
    for timing in comparison.timings:
        slack = netns.STAR_ALL_REDUCE_SLACK if timing.op == "all_reduce" else 0.0
        assert timing.allowed == netns.agreement_bound(timing.shaped_s) + slack
        assert abs(timing.ratio - 1) <= timing.allowed, timing.describe()
        assert timing.within_bound()


_SIGTERMED = textwrap.dedent("""
    import json, time
    from workbench.dist import netns
    with netns.shaped_link(nodes=3) as link:
        print(json.dumps([list(link.all_namespaces()), list(link.all_interfaces())]), flush=True)
        time.sleep(60)
""")


def test_sigterm_mid_run_removes_a_three_node_link(usable_star: None) -> None:
    import json

    child = subprocess.Popen([sys.executable, "-c", _SIGTERMED], stdout=subprocess.PIPE, text=True)
    try:
        namespaces, interfaces = json.loads(child.stdout.readline())
        assert all((netns.NETNS_DIR / name).exists() for name in namespaces) and len(namespaces) == 4
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 128 + signal.SIGTERM  # SystemExit from the handler: the block unwound
    finally:
        child.kill()
        child.wait()
    assert not [name for name in namespaces if (netns.NETNS_DIR / name).exists()]
    assert not set(interfaces) & _interfaces()


# ----------------------------------------------------------------------------------------------------------------
# `workbench run --netns`: the same training over the real shaped link


@pytest.mark.parametrize("flags, message", [
    (dict(netns=True), "pass --nodes"),
    (dict(netns=True, nodes=1, inter_link="0.05,0"), "N >= 2 nodes"),
    (dict(netns=True, nodes=2), "give --inter-link GBPS,US with GBPS <= 1"),
    (dict(netns=True, nodes=2, inter_link="ethernet"), "GBPS <= 1 .* got 'ethernet'"),
    (dict(netns=True, nodes=2, inter_link="0.05,0", time_scale=2), "leave out time_scale=2"),
    (dict(netns=True, nodes=2, inter_link="0.05,0", max_restarts=1), "leave out max_restarts"),
    (dict(netns=True, nodes=2, inter_link="0.05,0", nproc=3, batch_size=9), "nodes=2 must divide the 3 ranks"),
])
def test_netns_runs_refuse_what_they_cannot_do(flags: dict, message: str) -> None:
    from workbench.training.config import RunConfig

    with pytest.raises(ValueError, match=message):
        RunConfig(**{"nproc": 2, "steps": 2, "batch_size": 8, "seq_len": 32, **flags})


def test_netns_without_the_rights_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from workbench.run import run_training
    from workbench.training.config import RunConfig

    monkeypatch.setattr(netns, "unavailable_reason", lambda nodes=2: "not root (euid 1000): namespaces need root")
    cfg = RunConfig(nproc=2, steps=2, batch_size=8, seq_len=32, nodes=2, inter_link="0.05,0", netns=True)
    with pytest.raises(ValueError, match="--netns needs network namespaces and tc tbf.*not root"):
        run_training(cfg, progress=False)


def test_a_run_over_the_real_link_trains_the_same_numbers(usable: None, tmp_path) -> None:
    from workbench.run import run_training
    from workbench.training.config import RunConfig

    small = dict(nproc=2, steps=2, batch_size=8, seq_len=32)
    plain = run_training(RunConfig(**small), progress=False)
    shaped = run_training(RunConfig(**small, nodes=2, inter_link="0.05,0", netns=True), out=tmp_path,
                          progress=False)
    assert shaped["final_params_sha256"] == plain["final_params_sha256"]
    assert shaped["links"]["netns"] and "shaped with tc tbf to 50 MB/s" in shaped["links"]["describe"]
    assert "a real shaped link" in (tmp_path / "report.html").read_text()


def test_a_run_on_three_nodes_behind_the_switch_trains_the_same_numbers(usable_star: None, tmp_path) -> None:
    from workbench.run import run_training
    from workbench.training.config import RunConfig

    small = dict(nproc=3, steps=2, batch_size=9, seq_len=32)
    plain = run_training(RunConfig(**small), progress=False)
    shaped = run_training(RunConfig(**small, nodes=3, inter_link="0.05,0", netns=True), out=tmp_path, progress=False)
    assert shaped["final_params_sha256"] == plain["final_params_sha256"]
    links = shaped["links"]
    assert (links["nodes"], links["ranks_per_node"]) == (3, 1) and "to a switch" in links["describe"]
