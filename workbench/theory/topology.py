"""A cluster as nodes of ranks joined by two α-β links: which link each mesh axis crosses (issue 20, "A topology").

Every link is Hockney's α-β model (Hockney 1994, ``theory.comm.Link``): a message of S bytes costs α + S/B. A
topology is ``nodes`` machines of ``ranks_per_node`` ranks each; ranks on one node talk over ``intra`` (NVLink,
PCIe), ranks on different nodes over ``inter`` (InfiniBand, Ethernet). Ranks are numbered node-major, as torchrun
(``--nnodes``, ``--nproc-per-node``) and Slurm's block distribution number them: node 0 holds ranks
0 .. ranks_per_node-1, node 1 the next ones, and so on.

``distribution="cyclic"`` deals ranks out round-robin instead (Slurm's ``--distribution=cyclic``): rank r on node
r mod nodes. With the mesh's tp-fastest order that puts each tp pair on two nodes, the placement to avoid, which is
how a learner measures what putting tensor parallelism across the slow link costs.

A mesh axis (dp, tp, pp) is a set of groups of ranks that run collectives together; a group whose ranks sit on
one node uses ``intra`` only, a group spanning nodes has hops on ``inter`` too. A ring is as slow as its slowest
hop and a collective on an axis as slow as its slowest group, so ``axis_links`` gives each axis the slowest link
any of its groups crosses. That is what makes the usual placement (tp fastest, inside a node; dp and pp across
nodes) visible in ``workbench calc --nodes``.

Pure Python, floor 0: no torch and no other floor. The rank order of the mesh (tp fastest, then cp, dp, pp) is
``workbench.dist.mesh.MeshShape``'s, written again here because theory may not import ``dist``;
``tests/test_topology.py`` checks the two agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workbench.theory.checks import positive_int
from workbench.theory.comm import Link
from workbench.theory.parallelism import AXES, INFINIBAND, NVLINK

# Orders of magnitude from vendors' data sheets, not measurements: fit your own link
# (calibration.fit_ring_allreduce on a real machine) and pass it as GBPS,US. Bandwidth is per GPU, each way.
# - nvlink: NVLink 4 (H100 SXM), 900 GB/s per GPU both ways together = 450 GB/s each way, ~5 µs through NCCL
#   (parallelism.NVLINK, the same link);
# - pcie: PCIe 4.0 x16, 32 GB/s each way on paper, ~25 GB/s achieved, ~10 µs (GPUs without NVLink; PCIe 5.0
#   doubles the bandwidth to ~50 GB/s);
# - infiniband: one 400 Gb/s InfiniBand NDR NIC per GPU = 50 GB/s, ~10 µs across nodes (parallelism.INFINIBAND);
# - ethernet: 100 Gb/s Ethernet = 12.5 GB/s, ~20 µs with RoCE (plain TCP sockets are nearer 50 µs).
PCIE = Link(alpha=10e-6, bandwidth=25e9, name="PCIe 4 x16 (25 GB/s, 10 µs)")
ETHERNET = Link(alpha=20e-6, bandwidth=12.5e9, name="Ethernet 100 GbE (12.5 GB/s, 20 µs)")
LINK_PRESETS: dict[str, Link] = {"nvlink": NVLINK, "pcie": PCIE, "infiniband": INFINIBAND, "ethernet": ETHERNET}

# Dense peak matrix-multiply rates from NVIDIA's data sheets (H100 SXM5, A100 SXM4; sparsity not counted), the
# GPUs a time scale can map this machine onto (dist.emulation.time_scale_for). FLOP/s.
GPU_PEAK_FLOPS: dict[str, float] = {
    "h100-bf16": 989e12, "h100-tf32": 495e12, "a100-bf16": 312e12, "a100-tf32": 156e12,
}

#: How ranks are dealt to nodes, in Slurm's words: block (node-major, torchrun's and Slurm's default) or cyclic.
DISTRIBUTIONS = ("block", "cyclic")

SPEC_HELP = f"BANDWIDTH_GBPS,LATENCY_US such as 50,10 or a preset ({', '.join(LINK_PRESETS)})"


def parse_link(spec: str) -> Link:
    """A link from the command line: a preset name of ``LINK_PRESETS`` (any case) or ``GBPS,US``, the bandwidth
    in GB/s each way and the latency in microseconds (``50,10``); ``ValueError`` naming the value otherwise."""
    if not isinstance(spec, str):
        raise ValueError(f"link spec must be a str, got {spec!r}; expected {SPEC_HELP}")
    text = spec.strip()
    if text.lower() in LINK_PRESETS:
        return LINK_PRESETS[text.lower()]
    parts = text.split(",")
    try:
        gbps, us = (float(x) for x in parts)
    except ValueError:
        raise ValueError(f"unknown link {spec!r}: expected {SPEC_HELP}") from None
    if not (math.isfinite(gbps) and gbps > 0):
        raise ValueError(f"link {spec!r}: bandwidth must be a finite number of GB/s > 0, got {parts[0].strip()!r}")
    if not (math.isfinite(us) and us >= 0):
        raise ValueError(f"link {spec!r}: latency must be a finite number of µs >= 0, got {parts[1].strip()!r}")
    return Link(alpha=us * 1e-6, bandwidth=gbps * 1e9, name=f"{gbps:g} GB/s, {us:g} µs")


def link_label(link: Link, detail: bool = False) -> str:
    """A link as one sentence shows it: its preset name (``nvlink``), with its figures when ``detail``
    (``ethernet: 12.5 GB/s, 20 µs``); a link given by hand shows its figures only."""
    figures = f"{link.bandwidth / 1e9:g} GB/s, {link.alpha * 1e6:g} µs"
    preset = next((name for name, known in LINK_PRESETS.items() if known == link), None)
    if preset is None:
        return figures
    return f"{preset}: {figures}" if detail else preset


def slowest(links: list[Link]) -> Link:
    """The slowest of ``links``: the lowest bandwidth, then the highest latency (the bandwidth term dominates the
    per-step traffic the calculator prices, so it orders first)."""
    if not links:
        raise ValueError("slowest() needs at least one link")
    return min(links, key=lambda link: (link.bandwidth, -link.alpha))


@dataclass(frozen=True)
class Topology:
    """``nodes`` machines of ``ranks_per_node`` ranks, numbered node-major (``distribution="block"``) or dealt
    round-robin (``"cyclic"``); ``intra`` joins ranks of one node, ``inter`` ranks of different nodes."""

    nodes: int
    ranks_per_node: int
    intra: Link
    inter: Link
    distribution: str = "block"

    def __post_init__(self) -> None:
        positive_int("nodes", self.nodes)
        positive_int("ranks_per_node", self.ranks_per_node)
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution={self.distribution!r}; valid: {', '.join(DISTRIBUTIONS)}")
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise ValueError(f"{name} must be a theory.comm.Link (see parse_link), got {getattr(self, name)!r}")

    @classmethod
    def from_nproc(cls, nproc: int, nodes: int, intra: Link = NVLINK, inter: Link = INFINIBAND,
                   distribution: str = "block") -> Topology:
        """``nproc`` ranks spread evenly over ``nodes`` nodes; ``ValueError`` if ``nodes`` does not divide them."""
        positive_int("nproc", nproc)
        positive_int("nodes", nodes)
        if nproc % nodes:
            raise ValueError(f"nodes={nodes} must divide the {nproc} ranks (every node holds as many ranks); "
                             f"valid node counts: {', '.join(str(n) for n in range(1, nproc + 1) if nproc % n == 0)}")
        return cls(nodes=nodes, ranks_per_node=nproc // nodes, intra=intra, inter=inter, distribution=distribution)

    @property
    def world(self) -> int:
        """Ranks in all: nodes x ranks_per_node."""
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """The node holding ``rank``: block, ranks 0 .. ranks_per_node-1 on node 0; cyclic, rank mod nodes."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"rank must be an int in [0, {self.world}) for {self.describe()}, got {rank!r}")
        return rank % self.nodes if self.distribution == "cyclic" else rank // self.ranks_per_node

    def spans_nodes(self, ranks: list[int]) -> bool:
        """Whether the group ``ranks`` sits on more than one node."""
        return len({self.node_of(r) for r in self._group(ranks)}) > 1

    def link_of(self, ranks: list[int]) -> Link:
        """The slowest link a group of ranks crosses: ``intra`` inside one node; for a group spanning nodes
        ``inter``, or ``intra`` if that is slower and two of the group's ranks share a node (a ring over the
        group then has hops on both, and runs at its slowest hop's pace)."""
        group = self._group(ranks)
        nodes = [self.node_of(r) for r in group]
        if len(set(nodes)) == 1:
            return self.intra
        crossed = [self.inter] + ([self.intra] if len(set(nodes)) < len(nodes) else [])
        return slowest(crossed)

    def describe(self) -> str:
        """``2 nodes x 4 ranks`` (``, cyclic`` when ranks are dealt round-robin)."""
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.ranks_per_node} rank" \
               f"{'s' if self.ranks_per_node > 1 else ''}" + (", cyclic" if self.distribution == "cyclic" else "")

    def _group(self, ranks: list[int]) -> list[int]:
        group = list(ranks)
        if not group:
            raise ValueError("a group of ranks must hold at least one rank, got none")
        return group


def axis_groups(axis: str, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1) -> list[list[int]]:
    """Every group of ``axis`` as lists of global ranks, in ``MeshShape``'s rank order and group order:
    ``rank = ((pp_idx * dp + dp_idx) * cp + cp_idx) * tp + tp_idx`` (tp fastest, so a tp group is consecutive
    ranks). The dp groups are the data-parallel ones proper; with cp > 1 gradients are averaged over dp x cp."""
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; valid: {', '.join(AXES)}")
    sizes = {"dp": positive_int("dp", dp), "tp": positive_int("tp", tp), "pp": positive_int("pp", pp),
             "cp": positive_int("cp", cp)}
    stride = {"tp": 1, "cp": tp, "dp": cp * tp, "pp": dp * cp * tp}[axis]
    world = dp * cp * tp * pp
    bases = [r for r in range(world) if (r // stride) % sizes[axis] == 0]  # the ranks with index 0 on the axis
    return [[base + i * stride for i in range(sizes[axis])] for base in bases]


def axis_links(topology: Topology, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1) -> dict[str, Link]:
    """The link each mesh axis's collectives cross on ``topology``: the slowest over the axis's groups (a step
    waits for its slowest group). An axis of size 1 sends nothing and gets ``intra``."""
    _check_world(topology, dp, tp, pp, cp)
    links = {}
    for axis in AXES:
        groups = axis_groups(axis, dp=dp, tp=tp, pp=pp, cp=cp)
        links[axis] = slowest([topology.link_of(g) for g in groups]) if len(groups[0]) > 1 else topology.intra
    return links


def describe_placement(topology: Topology, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1) -> str:
    """One line: which axis stays inside a node and which crosses nodes, over which link, e.g.
    ``2 nodes x 4 ranks; tp inside a node (nvlink), dp across nodes (ethernet: 12.5 GB/s, 20 µs)``."""
    links = axis_links(topology, dp=dp, tp=tp, pp=pp, cp=cp)
    parts = []
    for axis in AXES:
        groups = axis_groups(axis, dp=dp, tp=tp, pp=pp, cp=cp)
        if len(groups[0]) == 1:
            continue
        crossing = sum(topology.spans_nodes(g) for g in groups)
        if not crossing:
            parts.append(f"{axis} inside a node ({link_label(links[axis])})")
            continue
        where = "across nodes" if crossing == len(groups) else f"across nodes in {crossing} of {len(groups)} groups"
        parts.append(f"{axis} {where} ({link_label(links[axis], detail=True)})")
    return f"{topology.describe()}; {', '.join(parts) if parts else 'no axis communicates (one rank)'}"


def _check_world(topology: Topology, dp: int, tp: int, pp: int, cp: int = 1) -> None:
    for name, size in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
        positive_int(name, size)
    if dp * cp * tp * pp != topology.world:
        cp_ = (" x cp", f" x {cp}") if cp > 1 else ("", "")
        raise ValueError(f"dp{cp_[0]} x tp x pp = {dp}{cp_[1]} x {tp} x {pp} = {dp * cp * tp * pp} ranks but the "
                         f"topology has {topology.describe()} = {topology.world}")


__all__ = [
    "DISTRIBUTIONS", "ETHERNET", "GPU_PEAK_FLOPS", "LINK_PRESETS", "PCIE", "SPEC_HELP", "Topology", "axis_groups",
    "axis_links", "describe_placement", "link_label", "parse_link", "slowest",
]
