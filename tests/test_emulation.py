"""Emulated nodes and links (issue 20): every comm op waits the α-β model's time over the links it crosses.

The multi-rank tests use a deliberately slow inter-node link (20 MB/s, 1 ms) so that the modelled times (tens to
hundreds of ms) dwarf what gloo really takes on this machine's loopback (a few ms for these sizes): the emulation
only ever adds waiting, so a measured time sits between the modelled one and the modelled one plus the real
op plus the scheduler's wake-up delay. The bounds below allow that slack (30 % + 40 ms, generous for two busy
cores) and stay far from the wrong answers they rule out (no charge at all, no overlap, no queueing).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from workbench import trace
from workbench.dist import comm, emulation
from workbench.dist.emulation import (
    LinkEmulation,
    Straggler,
    check_time_scale,
    resolve_time_scale,
    time_scale_for,
)
from workbench.dist.launch import launch, link_emulation
from workbench.dist.mesh import Mesh
from workbench.dist.rank_pool import RankPool
from workbench.run import run_training
from workbench.theory.comm import Link
from workbench.theory.topology import ETHERNET, GPU_PEAK_FLOPS, Topology
from workbench.training.config import RunConfig

pytestmark = pytest.mark.timeout(300)

SLOW = "0.02,1000"  # 20 MB/s, 1 ms: an inter-node link slow enough to measure on a loaded CPU
SLOW_LINK = Link(alpha=1e-3, bandwidth=0.02e9)
FAST = "2,10"
MIB = 1 << 20


def _within(measured: float, modelled: float) -> bool:
    """Measured is the modelled time plus the real op and a wake-up: never less, not much more."""
    return modelled - 2e-3 <= measured <= 1.3 * modelled + 0.04


# ---------------------------------------------------------------------------------------------------------------
# The model, without ranks


def test_link_class_and_modelled_time_follow_the_topology() -> None:
    links = LinkEmulation.build(4, nodes=2, intra_link=FAST, inter_link=SLOW)
    assert links.link_class((0, 1)) == "intra" and links.link_class((1, 2)) == "inter"
    assert links.modelled_time("all_reduce", MIB, (0, 1, 2, 3)) == pytest.approx(SLOW_LINK.ring_allreduce(MIB, 4))
    assert links.modelled_time("send", MIB, (0, 1)) == pytest.approx(1e-5 + MIB / 2e9)
    assert links.modelled_time("all_reduce", MIB, (3,)) == 0.0  # a group of one sends nothing
    scaled = LinkEmulation(links.topology, time_scale=10.0)
    assert scaled.modelled_time("send", MIB, (1, 2)) == pytest.approx(10 * links.modelled_time("send", MIB, (1, 2)))
    assert "2 nodes x 2 ranks" in links.describe() and "emulated" in links.describe()


@pytest.mark.parametrize("kwargs, message", [
    (dict(nodes=3), "nodes=3 must divide the 4 ranks"),
    (dict(nodes=2, inter_link="fast"), "inter_link: unknown link 'fast'"),
    (dict(nodes=2, intra_link="0,10"), "intra_link: link '0,10': bandwidth must be a finite number of GB/s > 0"),
    (dict(nodes=2, inter_link="-5,10"), "bandwidth must be a finite number of GB/s > 0"),
    (dict(nodes=0), "nodes must be a positive int"),
    (dict(nodes=2, time_scale=0), "time_scale must be a finite number > 0"),
    (dict(nodes=2, time_scale="tpu"), "unknown GPU 'tpu'"),
])
def test_bad_topology_is_refused_before_any_rank_starts(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        link_emulation(4, **kwargs)


def test_time_scale_maps_this_machine_onto_a_gpu() -> None:
    # 8 ranks sharing 100 GFLOP/s compute at 12.5 GFLOP/s each: an H100's 989 TFLOP/s is 79120 times faster.
    assert time_scale_for("h100-bf16", 8, rate=100e9) == pytest.approx(GPU_PEAK_FLOPS["h100-bf16"] / 12.5e9)
    assert resolve_time_scale("2.5", 4) == 2.5 and resolve_time_scale(3.0, 4) == 3.0
    measured = resolve_time_scale("a100-bf16", 1)
    assert 1 < measured < 1e9  # a CPU is slower than an A100, and not absurdly so
    check_time_scale("h100-bf16")
    check_time_scale(None)
    with pytest.raises(ValueError, match="expected a number > 0 or a GPU name"):
        check_time_scale("fast")


# ---------------------------------------------------------------------------------------------------------------
# Ranks on a 2 x 2 cluster


def _collectives(nbytes: int) -> dict:
    rank = dist.get_rank()
    node_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    node_group = node_groups[rank // 2]
    x = torch.full((nbytes // 4,), float(rank))
    out: dict = {}
    comm.barrier()
    t0 = time.time()
    comm.all_reduce(x)
    out["inter"] = (time.time() - t0, trace.current().trace.comms[-1])
    y = torch.ones(nbytes // 4)
    comm.barrier()
    t0 = time.time()
    comm.all_reduce(y, group=node_group)
    out["intra"] = (time.time() - t0, trace.current().trace.comms[-1])
    modelled = out["inter"][1].modelled_s
    comm.barrier()
    t0 = time.time()
    work = comm.all_reduce(torch.ones(nbytes // 4), async_op=True)
    time.sleep(0.6 * modelled)  # compute while the op is on the wire
    work.wait()
    out["overlapped"] = time.time() - t0
    comm.barrier()
    t0 = time.time()
    works = [comm.all_reduce(torch.ones(nbytes // 4), async_op=True) for _ in range(2)]
    for w in works:
        w.wait()
    out["queued"] = time.time() - t0
    out["sum"] = x[0].item()
    return out


@pytest.fixture(scope="module")
def cluster_run() -> list[dict]:
    return list(launch(_collectives, 4, 4 * MIB, nodes=2, intra_link=FAST, inter_link=SLOW, timeout=60))


def test_a_collective_across_nodes_takes_the_slow_links_time(cluster_run: list[dict]) -> None:
    expected = SLOW_LINK.ring_allreduce(4 * MIB, 4)  # 6 ms of latency + 1.5 x 4 MiB at 20 MB/s = 0.32 s
    for out in cluster_run:
        seconds, event = out["inter"]
        assert event.link == "inter" and event.modelled_s == pytest.approx(expected)
        assert _within(seconds, expected), (seconds, expected)
        assert out["sum"] == 0 + 1 + 2 + 3  # the data really moved


def test_a_group_inside_a_node_pays_only_the_fast_link(cluster_run: list[dict]) -> None:
    for out in cluster_run:
        seconds, event = out["intra"]
        assert event.link == "intra" and event.modelled_s == pytest.approx(Link(1e-5, 2e9).ring_allreduce(4 * MIB, 2))
        assert seconds < 0.25 * out["inter"][0]  # the same bytes inside a node: far cheaper


def test_an_async_op_overlaps_compute_and_ops_on_one_link_queue(cluster_run: list[dict]) -> None:
    modelled = cluster_run[0]["inter"][1].modelled_s
    for out in cluster_run:
        assert _within(out["overlapped"], modelled), (out["overlapped"], modelled)  # not modelled + 0.6 x modelled
        assert _within(out["queued"], 2 * modelled), (out["queued"], modelled)  # one link: one after the other


def _messages(nbytes: int) -> dict:
    rank = dist.get_rank()
    data = torch.full((nbytes // 4,), 7.0)
    comm.barrier()
    if rank == 0:
        time.sleep(0.1)  # the receiver waits first: the message cannot arrive before it was sent + α + S/B
        comm.send(data, 2)
        comm.send(data, 1)
    elif rank in (1, 2):
        got = torch.empty_like(data)
        comm.recv(got, 0)
        assert got[0].item() == 7.0
    return {"events": [e for e in trace.current().trace.comms if e.op in ("send", "recv")]}


def test_a_message_arrives_its_modelled_time_after_it_was_sent() -> None:
    results = list(launch(_messages, 4, MIB, nodes=2, intra_link=FAST, inter_link=SLOW, timeout=60))
    to_node_1, to_local = results[0]["events"]
    assert (to_node_1.link, to_local.link) == ("inter", "intra")
    assert to_node_1.modelled_s == pytest.approx(SLOW_LINK.message_time(MIB))
    received = results[2]["events"][0]
    assert _within(received.t1 - to_node_1.t0, to_node_1.modelled_s)  # from the send, not from the posted receive
    assert _within(to_node_1.t1 - to_node_1.t0, to_node_1.modelled_s)  # the sender's link is busy that long


def _plain(nbytes: int) -> dict:
    x = torch.full((nbytes // 4,), float(dist.get_rank()))
    comm.all_reduce(x)
    event = trace.current().trace.comms[-1]
    mesh = Mesh(dp=2, tp=2)
    return {"sum": x.sum().item(), "link": event.link, "modelled": event.modelled_s, "active": emulation.current(),
            "node": (mesh.node, mesh.nodes, mesh.spans_nodes("tp"), mesh.spans_nodes("dp"))}


def test_without_emulation_nothing_changes_and_the_mesh_knows_its_nodes() -> None:
    plain = list(launch(_plain, 4, MIB, timeout=60))
    emulated = list(launch(_plain, 4, MIB, nodes=2, inter_link=ETHERNET, timeout=60))
    assert [p["sum"] for p in plain] == [e["sum"] for e in emulated]
    assert all(p["link"] == "" and p["modelled"] is None and p["active"] is None for p in plain)
    assert all(e["link"] == "inter" and e["modelled"] > 0 for e in emulated)
    assert [p["node"] for p in plain] == [(0, 1, False, False)] * 4  # one machine, one node
    # tp varies fastest: a tp pair shares a node, a dp pair crosses (the placement Megatron and torchtitan use)
    assert [e["node"] for e in emulated] == [(0, 2, False, True)] * 2 + [(1, 2, False, True)] * 2


def test_a_rank_pool_runs_on_emulated_nodes() -> None:
    links = LinkEmulation(Topology.from_nproc(2, 2, inter=SLOW_LINK))
    with RankPool(2, timeout=30, links=links) as pool:
        results = pool.run("import time\nx = torch.ones(1024)\nt0 = time.time()\ncomm.all_reduce(x)\n"
                           "(time.time() - t0, x[0].item())")
    expected = SLOW_LINK.ring_allreduce(4096, 2)
    for r in results:
        assert r.error is None, r.error
        seconds, value = eval(r.value)  # the cell's last expression, as its repr
        assert value == 2.0 and _within(seconds, expected)
    with pytest.raises(ValueError, match="links are for 2 nodes x 1 rank = 2 ranks, but the pool has 4"):
        RankPool(4, links=links)


def test_emulation_changes_time_never_numbers() -> None:
    small = dict(nproc=2, steps=3, batch_size=8, seq_len=32)
    plain = run_training(RunConfig(**small), progress=False)
    emulated = run_training(RunConfig(**small, nodes=2, inter_link="ethernet"), progress=False)
    assert emulated["final_params_sha256"] == plain["final_params_sha256"]
    assert emulated["losses"] == plain["losses"]
    assert "links" not in plain
    links = emulated["links"]
    assert (links["nodes"], links["ranks_per_node"], links["time_scale"]) == (2, 1, 1.0)
    assert links["inter"] == {"alpha_s": ETHERNET.alpha, "bandwidth_Bps": ETHERNET.bandwidth}
    inter = links["rank0_by_link"]["inter"]  # dp = 2 over 2 nodes: every gradient all-reduce crosses
    assert inter["ops"] > 0 and inter["bus_bytes"] > 0 and inter["modelled_s"] > 0
    assert inter["measured_s"] >= 0.99 * inter["modelled_s"]  # emulation only adds waiting


@pytest.mark.parametrize("spec, message", [
    ("rank=4:factor=2", "straggler rank 4 does not exist: the run has ranks 0..3"),
    ("rank=1:factor=0.5", "straggler factor must be a finite number >= 1"),
    ("rank=1:factor=inf", "straggler factor must be a finite number >= 1"),
    ("rank=1", "straggler 'rank=1': expected rank=R:factor=F"),
    ("rank=x:factor=2", "straggler 'rank=x:factor=2': expected rank=R:factor=F"),
    ("slow", "straggler 'slow': expected"),
])
def test_a_bad_straggler_is_named(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Straggler.parse(spec, 4)


def test_a_straggler_holds_everyone_back_and_the_report_names_it(tmp_path) -> None:
    small = dict(nproc=2, steps=4, batch_size=8, seq_len=32)
    plain = run_training(RunConfig(**small), progress=False)
    slowed = run_training(RunConfig(**small, straggler="rank=1:factor=4"), out=tmp_path, progress=False)
    assert slowed["final_params_sha256"] == plain["final_params_sha256"]  # slower, never different
    found = slowed["health"]["stragglers"]
    assert found["judged_on"] == "compute" and found["stragglers"] == [1]
    (compute0, compute1), (wait0, wait1) = found["median_compute_s"], found["median_wait_s"]
    assert compute1 > 2.5 * compute0  # 4x, less what the sleeping straggler frees for rank 0 on shared cores
    assert wait0 > wait1 + 0.5 * (compute1 - compute0)  # rank 0 spent the difference waiting at the all-reduce
    assert slowed["step_time_s"] > 1.5 * plain["step_time_s"]  # synchronous: everyone's step follows the slowest
    report = (tmp_path / "report.html").read_text()
    assert "computing vs waiting" in report and "rank(s) 1 computed more than" in report
    assert "emulated: rank=1:factor=4" in report


@pytest.mark.extended  # the test command has notebook 12's TP inside vs across nodes, measured and asserted
def test_tp_across_nodes_moves_the_same_bytes_over_the_slow_link() -> None:
    """Block placement keeps each tp pair on one node; cyclic deals it across both. Same run, same numbers: the tp
    and dp ops only trade link classes (every op is charged on the link its group crosses)."""
    layout = dict(nproc=4, tp=2, steps=2, batch_size=8, seq_len=32, nodes=2, inter_link="ethernet")
    block = run_training(RunConfig(**layout), progress=False)
    cyclic = run_training(RunConfig(**layout, distribution="cyclic"), progress=False)
    assert cyclic["final_params_sha256"] == block["final_params_sha256"]
    assert cyclic["links"]["distribution"] == "cyclic"
    by_block, by_cyclic = block["links"]["rank0_by_link"], cyclic["links"]["rank0_by_link"]
    assert by_block["inter"]["bus_bytes"] == by_cyclic["intra"]["bus_bytes"] > 0  # dp's ops: inter, then intra
    assert by_block["intra"]["bus_bytes"] == by_cyclic["inter"]["bus_bytes"] > 0  # tp's ops: intra, then inter
