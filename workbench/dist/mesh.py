"""A device mesh: the ranks arranged on a pp x dp x cp x tp grid, with one process group per axis.

Rank layout follows Megatron-LM: tensor parallel varies fastest (neighbouring ranks, which on a real node
share NVLink), then context parallel, then data parallel, and pipeline parallel slowest (stages may sit on
different nodes, where only activations cross the slow link):

    rank = ((pp_idx * dp + dp_idx) * cp + cp_idx) * tp + tp_idx

``Mesh(dp=2, tp=2)`` on 4 ranks: tp groups {0,1} {2,3}; dp groups {0,2} {1,3}. Expert parallelism, when
it lands, reuses the dp x cp ranks (as in Megatron) and adds an axis here, not a new mechanism.

A mesh owns its groups: nothing is kept in module globals, so two meshes can coexist (e.g. a 2x2 and a
4x1 view of the same four ranks in one lesson).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from workbench.dist import emulation
from workbench.dist.launch import group_timeout, rank_device

#: Axes from slowest- to fastest-varying rank index.
AXES = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class MeshShape:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {axis} must be a positive int, got {size!r}")

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, axis) for axis in AXES)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis."""
        coords = {}
        for axis in reversed(AXES):
            size = getattr(self, axis)
            coords[axis] = rank % size
            rank //= size
        return {axis: coords[axis] for axis in AXES}

    def rank_of(self, **coords: int) -> int:
        rank = 0
        for axis in AXES:
            size = getattr(self, axis)
            index = coords.get(axis, 0)
            if not 0 <= index < size:
                raise ValueError(f"{axis}={index} out of range for mesh axis of size {size}")
            rank = rank * size + index
        return rank

    def axis_ranks(self, axis: str, rank: int) -> list[int]:
        """Global ranks that share every coordinate with ``rank`` except ``axis``, in axis order."""
        _check_axis(axis)
        coords = self.coords(rank)
        return [self.rank_of(**{**coords, axis: i}) for i in range(getattr(self, axis))]

    def all_axis_groups(self, axis: str) -> list[list[int]]:
        """Every group of ``axis`` (each a list of global ranks), e.g. to colour a figure by group."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(tuple(self.axis_ranks(axis, rank)), None)
        return [list(g) for g in seen]

    def fused_ranks(self, axes: tuple[str, ...], rank: int) -> list[int]:
        """Global ranks that share every coordinate with ``rank`` except those of ``axes`` (e.g. ``("dp", "cp")``:
        the ranks that hold the same parameters under context parallelism), in rank order."""
        for axis in axes:
            _check_axis(axis)
        coords = self.coords(rank)
        return [r for r in range(self.world_size)
                if all(self.coords(r)[a] == coords[a] for a in AXES if a not in axes)]


def _check_axis(axis: str) -> None:
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}; valid: {', '.join(AXES)}")


class Mesh:
    """This rank's view of a dp x tp x pp (x cp) grid: coordinates and one process group per axis.

    Inside ``launch`` the world size comes from the process group and must equal dp*tp*pp*cp. Without a
    process group (one process, or planning a layout), pass ``world_size``/``rank`` or leave them: the
    mesh is then a single rank whose groups are ``None`` (every ``comm`` op is an identity).
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, *, rank: int | None = None,
                 world_size: int | None = None) -> None:
        self.shape = MeshShape(pp=pp, dp=dp, cp=cp, tp=tp)
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            world_size = dist.get_world_size()
            rank = dist.get_rank()
        world_size = self.shape.world_size if world_size is None else world_size
        if self.shape.world_size != world_size:
            raise ValueError(f"mesh {self.describe()} has {self.shape.world_size} ranks but world size is "
                             f"{world_size}; choose sizes whose product is {world_size}")
        self.rank = 0 if rank is None else rank
        self.world_size = world_size
        self.coords = self.shape.coords(self.rank)
        #: Where this rank's tensors are born: ``cuda:LOCAL_RANK`` under NCCL, else the CPU.
        self.device: torch.device = rank_device()
        self._groups: dict[str, Any] = {axis: None for axis in AXES}
        self._dp_cp_group: Any = None
        if distributed:
            self._build_groups()

    def _build_groups(self) -> None:
        # use_local_synchronization: only a group's members take part in creating it, so each rank builds
        # exactly its own group per axis instead of every group of the mesh.
        timeout = group_timeout()
        for axis in AXES:
            ranks = self.shape.axis_ranks(axis, self.rank)
            self._groups[axis] = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
        if self.shape.cp > 1:  # context parallel ranks hold the same parameters: their gradients are averaged too
            ranks = self.shape.fused_ranks(("dp", "cp"), self.rank)
            self._dp_cp_group = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)

    def describe(self) -> str:
        return " x ".join(f"{axis}={getattr(self.shape, axis)}" for axis in AXES)

    def __repr__(self) -> str:
        return f"Mesh({self.describe()}, rank={self.rank}, coords={self.coords}, device={self.device})"

    def size(self, axis: str) -> int:
        _check_axis(axis)
        return getattr(self.shape, axis)

    def index(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (its rank inside that axis' group)."""
        _check_axis(axis)
        return self.coords[axis]

    def group(self, axis: str) -> Any:
        """The process group of ``axis`` that contains this rank (None without torch.distributed)."""
        _check_axis(axis)
        return self._groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's ``axis`` group, in axis order."""
        return self.shape.axis_ranks(axis, self.rank)

    @property
    def ranks_per_node(self) -> int:
        """Ranks on one node: the emulated topology's (``launch(..., nodes=N)``), else torchrun's
        ``LOCAL_WORLD_SIZE``, else the whole world (one machine)."""
        clock = emulation.current()
        if clock is not None:
            return clock.emulation.topology.ranks_per_node
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)) or self.world_size

    def node_of(self, rank: int) -> int:
        """The node holding global ``rank``: the emulated topology's placement (block or cyclic), else node-major
        as torchrun and Slurm place ranks by default."""
        clock = emulation.current()
        if clock is not None:
            return clock.emulation.topology.node_of(rank)
        return rank // self.ranks_per_node

    @property
    def node(self) -> int:
        """The node this rank is on."""
        return self.node_of(self.rank)

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // self.ranks_per_node)

    def spans_nodes(self, axis: str) -> bool:
        """Whether this rank's ``axis`` group crosses nodes (and so the slow link)."""
        return len({self.node_of(r) for r in self.ranks(axis)}) > 1

    # Shorthands for the axes every strategy uses.
    @property
    def dp_group(self) -> Any:
        return self.group("dp")

    @property
    def tp_group(self) -> Any:
        return self.group("tp")

    @property
    def pp_group(self) -> Any:
        return self.group("pp")

    @property
    def cp_group(self) -> Any:
        return self.group("cp")

    @property
    def dp_cp_group(self) -> Any:
        """The ranks that hold the same parameters: dp x cp (Megatron's data-parallel group with context
        parallelism). Gradients are averaged, and ZeRO shards, over it; the dp group when cp = 1."""
        return self._dp_cp_group if self.shape.cp > 1 else self.dp_group

    @property
    def dp_cp_size(self) -> int:
        return self.size("dp") * self.size("cp")

    @property
    def dp_cp_rank(self) -> int:
        return self.index("dp") * self.size("cp") + self.index("cp")

    @property
    def cp_rank(self) -> int:
        return self.index("cp")

    @property
    def cp_size(self) -> int:
        return self.size("cp")

    @property
    def dp_rank(self) -> int:
        return self.index("dp")

    @property
    def tp_rank(self) -> int:
        return self.index("tp")

    @property
    def pp_rank(self) -> int:
        return self.index("pp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def tp_size(self) -> int:
        return self.size("tp")

    @property
    def pp_size(self) -> int:
        return self.size("pp")
