"""`theory.topology` (issue 20, "A topology"): link presets and specs, nodes of ranks, the link each mesh axis
crosses (against `dist.mesh.MeshShape`'s groups), and `workbench calc --nodes`."""

from __future__ import annotations

import re

import pytest

from workbench.cli import main
from workbench.dist.mesh import MeshShape
from workbench.theory import parallelism
from workbench.theory.comm import Link
from workbench.theory.parallelism import Layout, analyze_layout
from workbench.theory.topology import (
    LINK_PRESETS,
    Topology,
    axis_groups,
    axis_links,
    describe_placement,
    link_label,
    parse_link,
)

NVLINK, PCIE, IB, ETH = (LINK_PRESETS[k] for k in ("nvlink", "pcie", "infiniband", "ethernet"))


def test_presets_are_ordered_and_reuse_parallelism_links() -> None:
    assert list(LINK_PRESETS) == ["nvlink", "pcie", "infiniband", "ethernet"]
    assert NVLINK is parallelism.NVLINK and IB is parallelism.INFINIBAND  # one link, defined once
    assert (ETH.bandwidth, ETH.alpha) == (12.5e9, 20e-6) and (PCIE.bandwidth, PCIE.alpha) == (25e9, 10e-6)
    assert NVLINK.bandwidth > PCIE.bandwidth > ETH.bandwidth and IB.bandwidth > ETH.bandwidth


@pytest.mark.parametrize("spec, link", [("nvlink", parallelism.NVLINK), ("Ethernet", ETH), (" pcie ", PCIE)])
def test_parse_link_knows_the_presets(spec: str, link: Link) -> None:
    assert parse_link(spec) is link


@pytest.mark.parametrize("spec, gbps, us", [("50,10", 50, 10), ("12.5, 20", 12.5, 20), ("100,0", 100, 0)])
def test_parse_link_reads_gbps_and_microseconds(spec: str, gbps: float, us: float) -> None:
    link = parse_link(spec)
    assert link.bandwidth == pytest.approx(gbps * 1e9) and link.alpha == pytest.approx(us * 1e-6)
    assert link.name == f"{gbps:g} GB/s, {us:g} µs"


@pytest.mark.parametrize("spec, message", [
    ("fast", "unknown link 'fast': expected BANDWIDTH_GBPS,LATENCY_US such as 50,10 or a preset (nvlink, pcie, "
             "infiniband, ethernet)"),
    ("50", "unknown link '50'"),
    ("50,10,3", "unknown link '50,10,3'"),
    ("", "unknown link ''"),
    ("0,10", "link '0,10': bandwidth must be a finite number of GB/s > 0, got '0'"),
    ("-5,10", "link '-5,10': bandwidth must be"),
    ("inf,10", "link 'inf,10': bandwidth must be"),
    ("50,-1", "link '50,-1': latency must be a finite number of µs >= 0, got '-1'"),
    ("50,nan", "link '50,nan': latency must be"),
])
def test_parse_link_refuses_naming_the_value(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_link(spec)


def test_link_label() -> None:
    assert link_label(ETH) == "ethernet" and link_label(ETH, detail=True) == "ethernet: 12.5 GB/s, 20 µs"
    assert link_label(parse_link("50,10")) == "50 GB/s, 10 µs" == link_label(parse_link("50,10"), detail=True)


def test_node_major_placement() -> None:
    topo = Topology(nodes=2, ranks_per_node=4, intra=NVLINK, inter=ETH)
    assert topo.world == 8
    assert [topo.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.link_of([0, 1, 2, 3]) is NVLINK and topo.link_of([4, 7]) is NVLINK and topo.link_of([5]) is NVLINK
    assert topo.link_of([0, 4]) is ETH and topo.link_of([3, 4]) is ETH and topo.link_of(range(8)) is ETH
    for bad in (8, -1, True, 1.0):
        with pytest.raises(ValueError, match=re.escape(f"in [0, 8) for 2 nodes x 4 ranks, got {bad!r}")):
            topo.node_of(bad)
    with pytest.raises(ValueError, match="at least one rank"):
        topo.link_of([])


def test_cyclic_placement_deals_ranks_round_robin_and_puts_tp_across_nodes() -> None:
    topo = Topology(nodes=2, ranks_per_node=4, intra=NVLINK, inter=ETH, distribution="cyclic")
    assert [topo.node_of(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert topo.describe() == "2 nodes x 4 ranks, cyclic"
    links = axis_links(topo, dp=2, tp=4)
    assert links["tp"] is ETH and links["dp"] is NVLINK  # the placement to avoid: tp on the slow link
    assert axis_links(Topology(2, 4, NVLINK, ETH), dp=2, tp=4)["tp"] is NVLINK  # block: tp inside a node
    assert "tp across nodes" in describe_placement(topo, dp=2, tp=4)
    with pytest.raises(ValueError, match="distribution='scatter'; valid: block, cyclic"):
        Topology(2, 4, NVLINK, ETH, distribution="scatter")


def test_a_group_spanning_nodes_runs_at_its_slowest_hop() -> None:
    # PCIe boxes joined by InfiniBand: a ring over [0, 1, 4, 5] has PCIe hops (0-1, 4-5), slower than the NIC's.
    topo = Topology(nodes=2, ranks_per_node=4, intra=PCIE, inter=IB)
    assert topo.link_of([0, 1, 4, 5]) is PCIE
    assert topo.link_of([0, 4]) is IB  # one rank per node: only inter-node hops


@pytest.mark.parametrize("kwargs, message", [
    (dict(nodes=0, ranks_per_node=4, intra=NVLINK, inter=IB), "nodes must be a positive int, got 0"),
    (dict(nodes=2, ranks_per_node=1.5, intra=NVLINK, inter=IB), "ranks_per_node must be a positive int, got 1.5"),
    (dict(nodes=2, ranks_per_node=4, intra="nvlink", inter=IB), "intra must be a theory.comm.Link"),
])
def test_topology_refuses_bad_fields(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Topology(**kwargs)


def test_from_nproc() -> None:
    topo = Topology.from_nproc(16, 2, intra=PCIE, inter=ETH)
    assert (topo.nodes, topo.ranks_per_node, topo.intra, topo.inter) == (2, 8, PCIE, ETH)
    assert Topology.from_nproc(8, 1) == Topology(1, 8, NVLINK, IB)
    with pytest.raises(ValueError, match=r"nodes=3 must divide the 8 ranks.*valid node counts: 1, 2, 4, 8"):
        Topology.from_nproc(8, 3)
    with pytest.raises(ValueError, match="nodes must be a positive int, got 0"):
        Topology.from_nproc(8, 0)


LAYOUTS = [dict(dp=2, tp=4, pp=1), dict(dp=1, tp=8, pp=1), dict(dp=1, tp=4, pp=2), dict(dp=2, tp=2, pp=2),
           dict(dp=3, tp=2, pp=1), dict(dp=4, tp=1, pp=3), dict(dp=1, tp=1, pp=1)]


@pytest.mark.parametrize("sizes", LAYOUTS)
def test_axis_groups_are_the_mesh_groups(sizes: dict[str, int]) -> None:
    mesh = MeshShape(**sizes)
    for axis in ("dp", "tp", "pp"):
        assert axis_groups(axis, **sizes) == mesh.all_axis_groups(axis), axis


@pytest.mark.parametrize("nodes, sizes", [(2, LAYOUTS[0]), (2, LAYOUTS[1]), (2, LAYOUTS[2]), (2, LAYOUTS[3]),
                                          (4, LAYOUTS[3]), (2, LAYOUTS[4]), (3, LAYOUTS[4]), (4, LAYOUTS[5])])
def test_axis_links_is_the_slowest_link_over_the_mesh_groups(nodes: int, sizes: dict[str, int]) -> None:
    world = sizes["dp"] * sizes["tp"] * sizes["pp"]
    topo = Topology.from_nproc(world, nodes, intra=NVLINK, inter=ETH)
    links = axis_links(topo, **sizes)
    for axis in ("dp", "tp", "pp"):
        groups = MeshShape(**sizes).all_axis_groups(axis)
        crosses = any(len({r // topo.ranks_per_node for r in g}) > 1 for g in groups)
        assert links[axis] is (ETH if crosses and sizes[axis] > 1 else NVLINK), axis


@pytest.mark.parametrize("sizes, expected", [
    (dict(dp=2, tp=4), {"dp": ETH, "cp": NVLINK, "tp": NVLINK, "pp": NVLINK}),   # tp inside a node, dp across
    (dict(tp=8), {"dp": NVLINK, "cp": NVLINK, "tp": ETH, "pp": NVLINK}),         # tp too wide for a node
    (dict(tp=4, pp=2), {"dp": NVLINK, "cp": NVLINK, "tp": NVLINK, "pp": ETH}),   # one stage per node
    (dict(dp=4, tp=2), {"dp": ETH, "cp": NVLINK, "tp": NVLINK, "pp": NVLINK}),   # dp groups [0,2,4,6], [1,3,5,7]
    (dict(dp=2, cp=4), {"dp": ETH, "cp": NVLINK, "tp": NVLINK, "pp": NVLINK}),   # cp inside a node, dp across
    (dict(cp=2, tp=4), {"dp": NVLINK, "cp": ETH, "tp": NVLINK, "pp": NVLINK}),   # cp groups [0,4] ... span nodes
])
def test_axis_links_on_two_nodes_of_four(sizes: dict[str, int], expected: dict[str, Link]) -> None:
    assert axis_links(Topology(2, 4, NVLINK, ETH), **sizes) == expected


def test_an_axis_pays_for_its_slowest_group() -> None:
    # 2 nodes x 3 ranks, tp=2: tp groups [0,1], [2,3], [4,5]; [2,3] straddles the nodes, so tp pays inter.
    topo = Topology(2, 3, NVLINK, ETH)
    assert [topo.spans_nodes(g) for g in axis_groups("tp", dp=3, tp=2)] == [False, True, False]
    assert axis_links(topo, dp=3, tp=2)["tp"] is ETH
    assert "tp across nodes in 1 of 3 groups (ethernet: 12.5 GB/s, 20 µs)" in describe_placement(topo, dp=3, tp=2)


def test_axis_links_refuses_a_layout_of_another_size() -> None:
    with pytest.raises(ValueError, match=re.escape("dp x tp x pp = 2 x 2 x 1 = 4 ranks but the topology has "
                                                   "2 nodes x 4 ranks = 8")):
        axis_links(Topology(2, 4, NVLINK, IB), dp=2, tp=2)
    with pytest.raises(ValueError, match="unknown mesh axis 'ep'"):
        axis_groups("ep", dp=2)
    with pytest.raises(ValueError, match=re.escape("dp x cp x tp x pp = 2 x 2 x 1 x 1 = 4 ranks but the topology")):
        axis_links(Topology(2, 4, NVLINK, IB), dp=2, cp=2)


def test_cp_groups_sit_between_tp_and_dp_in_the_rank_order() -> None:
    """Megatron's order, as ``MeshShape``: tp fastest, then cp, dp, pp."""
    for axis in ("dp", "cp", "tp", "pp"):
        assert axis_groups(axis, dp=2, cp=2, tp=2, pp=2) == MeshShape(dp=2, cp=2, tp=2, pp=2).all_axis_groups(axis)


def test_describe_placement() -> None:
    line = describe_placement(Topology(2, 4, NVLINK, ETH), dp=2, tp=4)
    assert line == "2 nodes x 4 ranks; dp across nodes (ethernet: 12.5 GB/s, 20 µs), tp inside a node (nvlink)"
    assert describe_placement(Topology(1, 1, NVLINK, IB)) == "1 node x 1 rank; no axis communicates (one rank)"


# ---------------------------------------------------------------- workbench calc --nodes

BASE = ["calc", "--model", "llama-7B", "--nproc", "8", "--tp", "4"]  # dp 2 x tp 4


def _calc(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert main([*BASE, *flags]) == 0
    return capsys.readouterr().out


def _comm(out: str, axis: str) -> tuple[float, str]:
    """(ms, link name) of an axis's communication line."""
    line = next(x for x in out.splitlines() if x.strip().startswith(f"{axis} ") and " ms " in x)
    return float(line.split(" ms")[0].split()[-1]), line.split("[")[-1].rstrip("]")


def _theory_ms(axis: str, links: dict[str, Link]) -> float:
    return analyze_layout("llama-7B", Layout(dp=2, tp=4), links=links)["comm"][axis]["time_s"] * 1e3


def test_calc_without_nodes_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    out = _calc(capsys)
    assert "topology" not in out
    for axis in ("dp", "tp"):
        ms, name = _comm(out, axis)
        assert name == parallelism.DEFAULT_LINKS[axis].name
        assert ms == pytest.approx(_theory_ms(axis, parallelism.DEFAULT_LINKS), abs=0.01)
    # the defaults spelled out give the very same text: without --nodes calc prices DEFAULT_LINKS, as before
    assert _calc(capsys, "--dp-link", "infiniband", "--tp-link", "nvlink", "--pp-link", "infiniband") == out


def test_calc_on_two_ethernet_nodes_slows_dp_only(capsys: pytest.CaptureFixture[str]) -> None:
    one = _calc(capsys, "--nodes", "1")
    two = _calc(capsys, "--nodes", "2", "--inter-link", "ethernet")
    assert "topology: 1 node x 8 ranks; dp inside a node (nvlink), tp inside a node (nvlink)" in one
    assert ("topology: 2 nodes x 4 ranks; dp across nodes (ethernet: 12.5 GB/s, 20 µs), tp inside a node (nvlink)"
            in two)
    (dp1, name1), (dp2, name2) = _comm(one, "dp"), _comm(two, "dp")
    assert name1 == NVLINK.name and name2 == ETH.name
    assert dp2 > 10 * dp1  # 450 GB/s vs 12.5 GB/s on the same bytes
    assert dp1 == pytest.approx(_theory_ms("dp", {"dp": NVLINK}), abs=0.01)
    assert dp2 == pytest.approx(_theory_ms("dp", {"dp": ETH}), abs=0.01)
    assert _comm(one, "tp") == _comm(two, "tp")  # tp stays inside a node
    # and dp over Ethernet is slower than the default InfiniBand dp link of a calc without --nodes
    assert dp2 > _comm(_calc(capsys), "dp")[0]


def test_calc_tp_wider_than_a_node_goes_over_the_inter_link(capsys: pytest.CaptureFixture[str]) -> None:
    out = _calc(capsys, "--nodes", "2", "--intra-link", "pcie", "--inter-link", "10,30", "--tp", "8")
    assert "topology: 2 nodes x 4 ranks; tp across nodes (10 GB/s, 30 µs)" in out
    ms, name = _comm(out, "tp")
    assert name == "10 GB/s, 30 µs"
    theory = analyze_layout("llama-7B", Layout(dp=1, tp=8), links={"tp": parse_link("10,30")})
    assert ms == pytest.approx(theory["comm"]["tp"]["time_s"] * 1e3, abs=0.01)


def test_an_explicit_axis_link_overrides_the_topology(capsys: pytest.CaptureFixture[str]) -> None:
    out = _calc(capsys, "--nodes", "2", "--inter-link", "ethernet", "--dp-link", "100,2")
    assert "dp across nodes (ethernet: 12.5 GB/s, 20 µs)" in out and "(overridden by --dp-link 100 GB/s, 2 µs)" in out
    ms, name = _comm(out, "dp")
    assert name == "100 GB/s, 2 µs"
    assert ms == pytest.approx(_theory_ms("dp", {"dp": parse_link("100,2")}), abs=0.01)
    assert _comm(out, "tp")[1] == NVLINK.name  # the axes not overridden keep the topology's link


def test_intra_link_alone_means_one_node(capsys: pytest.CaptureFixture[str]) -> None:
    out = _calc(capsys, "--intra-link", "pcie")
    assert "topology: 1 node x 8 ranks; dp inside a node (pcie), tp inside a node (pcie)" in out
    assert _comm(out, "dp")[1] == _comm(out, "tp")[1] == PCIE.name


@pytest.mark.parametrize("flags, message", [
    (["--nodes", "3"], "nodes=3 must divide the 8 ranks"),
    (["--nodes", "0"], "nodes must be a positive int, got 0"),
    (["--nodes", "two"], "argument --nodes: invalid int value: 'two'"),
    (["--nodes", "2", "--inter-link", "fast"], "argument --inter-link: unknown link 'fast': expected BANDWIDTH_GBPS"),
    (["--intra-link", "0,5"], "argument --intra-link: link '0,5': bandwidth must be"),
    (["--tp-link", "50,-3"], "argument --tp-link: link '50,-3': latency must be"),
])
def test_bad_topology_is_one_line_exit_2(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*BASE, *flags])
    assert info.value.code == 2
    captured = capsys.readouterr()
    err = captured.err
    last = err.strip().splitlines()[-1]  # argparse's usage, then one line: the error
    assert "error:" in last and message in last, err
    assert "Traceback" not in err and err.count("error:") == 1
    assert captured.out == ""  # refused before anything is printed
