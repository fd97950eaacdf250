"""Lab 12 checker: the stub and typical mistakes get pointed hints on the emulated cluster; the solution passes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from workbench import comm
from workbench.labs import LabCheckFailed
from workbench.labs.hierarchical_allreduce import check

LABS = Path(__file__).resolve().parent.parent / "labs"
if str(LABS) not in sys.path:  # the reference solutions live beside the labs, outside the workbench package
    sys.path.insert(0, str(LABS))

from solutions.hierarchical_allreduce import hierarchical_all_reduce  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def stub(tensor, intra_group, inter_group):
    raise NotImplementedError("design the phases: which bytes cross the slow link?")


def flat(tensor, intra_group, inter_group):
    """One all-reduce over every rank: right, but the whole tensor crosses the slow link."""
    comm.all_reduce(tensor)
    return tensor


def node_only(tensor, intra_group, inter_group):
    comm.all_reduce(tensor, group=intra_group)
    return tensor


def whole_tensor_across(tensor, intra_group, inter_group):
    """Reduce inside the node, then all-reduce the whole tensor across: S crosses instead of S / node_size."""
    comm.all_reduce(tensor, group=intra_group)
    comm.all_reduce(tensor, group=inter_group)
    return tensor


def skips_all_gather(tensor, intra_group, inter_group):
    flat_view = tensor.view(-1)
    k = comm.group_size(intra_group)
    mine = torch.empty(flat_view.numel() // k)
    comm.reduce_scatter(mine, flat_view, group=intra_group)
    comm.all_reduce(mine, group=inter_group)
    local = comm.group_rank(intra_group)
    flat_view[local * mine.numel():(local + 1) * mine.numel()].copy_(mine)
    return tensor


def averages(tensor, intra_group, inter_group):
    return hierarchical_all_reduce(tensor, intra_group, inter_group).div_(4)


def not_in_place(tensor, intra_group, inter_group):
    return hierarchical_all_reduce(tensor.clone(), intra_group, inter_group)


def test_the_reference_solution_passes(capsys) -> None:
    check(hierarchical_all_reduce)
    assert "only a 1/2 shard crossed the slow link" in capsys.readouterr().out


@pytest.mark.parametrize("fn, message", [
    (stub, "still the stub"),
    (flat, "as much as a flat ring over every rank"),
    (whole_tensor_across, "2.0x the"),
    (node_only, "the sum over this rank's node only"),
    (skips_all_gather, "only this rank's 1/2 of the tensor"),
    (averages, "divided by 4: you averaged"),
    (not_in_place, "leaves the tensor it was given unchanged"),
], ids=lambda v: getattr(v, "__name__", "msg"))
def test_each_mistake_gets_its_message(fn, message: str) -> None:
    with pytest.raises(LabCheckFailed, match=message) as info:
        check(fn)
    assert "hint(1)" in str(info.value)
