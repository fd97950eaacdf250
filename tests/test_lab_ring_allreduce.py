"""Lab 02 checker: the stub and typical mistakes get pointed hints; the solution passes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from workbench import comm
from workbench.labs import LabCheckFailed
from workbench.labs.ring_allreduce import check

LABS = Path(__file__).resolve().parent.parent / "labs"
if str(LABS) not in sys.path:  # the reference solutions live beside the labs, outside the workbench package
    sys.path.insert(0, str(LABS))

from solutions.ring_allreduce import ring_all_reduce  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def stub(tensor: torch.Tensor, group: object = None) -> torch.Tensor:
    raise NotImplementedError("split the tensor into N chunks, then reduce-scatter and all-gather")


def does_nothing(tensor: torch.Tensor, group: object = None) -> torch.Tensor:
    return tensor


def averages(tensor: torch.Tensor, group: object = None) -> torch.Tensor:
    return ring_all_reduce(tensor, group).div_(comm.group_size(group))


def calls_all_reduce(tensor: torch.Tensor, group: object = None) -> torch.Tensor:
    comm.all_reduce(tensor, group=group)
    return tensor


def whole_tensor_each_step(tensor: torch.Tensor, group: object = None) -> torch.Tensor:
    """Correct sum, but passes the full tensor around the ring N-1 times: (N-1) x S bytes per rank."""
    rank, world = comm.group_rank(group), comm.group_size(group)
    passing, total = tensor.clone(), tensor.clone()
    for _ in range(world - 1):
        incoming = torch.empty_like(passing)
        sent = comm.isend(passing, comm.global_rank(group, (rank + 1) % world), group)
        comm.irecv(incoming, comm.global_rank(group, (rank - 1) % world), group).wait()
        sent.wait()
        total += incoming
        passing = incoming
    tensor.copy_(total)
    return tensor


def blocking_send_first(tensor: torch.Tensor, group: object = None) -> torch.Tensor:
    rank, world = comm.group_rank(group), comm.group_size(group)
    incoming = torch.empty_like(tensor)
    comm.send(tensor, comm.global_rank(group, (rank + 1) % world), group)  # every rank blocks here
    comm.recv(incoming, comm.global_rank(group, (rank - 1) % world), group)
    return tensor.add_(incoming)


def skips_all_gather(tensor: torch.Tensor, group: object = None) -> torch.Tensor:
    """Reduce-scatter only: each rank ends with one finished chunk and partial sums elsewhere."""
    rank, world = comm.group_rank(group), comm.group_size(group)
    chunks = tensor.view(-1).tensor_split(world)
    for step in range(world - 1):
        send_chunk, recv_chunk = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        incoming = torch.empty_like(recv_chunk)
        sent = comm.isend(send_chunk, comm.global_rank(group, (rank + 1) % world), group)
        comm.irecv(incoming, comm.global_rank(group, (rank - 1) % world), group).wait()
        sent.wait()
        recv_chunk.add_(incoming)
    return tensor


def adds_chunk_to_itself(tensor: torch.Tensor, group: object = None) -> torch.Tensor:
    """Typo in the reduce-scatter: adds the chunk to itself instead of the received data."""
    rank, world = comm.group_rank(group), comm.group_size(group)
    chunks = tensor.view(-1).tensor_split(world)
    for step in range(world - 1):
        send_chunk, recv_chunk = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        incoming = torch.empty_like(recv_chunk)
        sent = comm.isend(send_chunk, comm.global_rank(group, (rank + 1) % world), group)
        comm.irecv(incoming, comm.global_rank(group, (rank - 1) % world), group).wait()
        sent.wait()
        recv_chunk.add_(recv_chunk)
    for step in range(world - 1):
        send_chunk, recv_chunk = chunks[(rank + 1 - step) % world], chunks[(rank - step) % world]
        sent = comm.isend(send_chunk, comm.global_rank(group, (rank + 1) % world), group)
        comm.irecv(recv_chunk, comm.global_rank(group, (rank - 1) % world), group).wait()
        sent.wait()
    return tensor


def returns_new_tensor(tensor: torch.Tensor, group: object = None) -> torch.Tensor:
    return ring_all_reduce(tensor.clone(), group)


@pytest.mark.parametrize("fn, hint", [
    (stub, "still the stub (NotImplementedError: split the tensor"),
    (does_nothing, "nothing was reduced"),
    (averages, "you averaged instead of summed"),
    (calls_all_reduce, "Use send/recv only"),
    (whole_tensor_each_step, "you sent the whole tensor each step"),
    (skips_all_gather, "the all-gather did not pass every finished chunk around"),
    (returns_new_tensor, "must be in place"),
    (adds_chunk_to_itself, "a chunk was added to itself. Chunk indices are off"),
])
def test_wrong_answers_get_pointed_hints(fn: object, hint: str) -> None:
    with pytest.raises(LabCheckFailed, match=hint.replace("(", r"\(")) as info:
        check(fn, timeout=20)
    assert str(info.value).endswith("(more help: hint(1), hint(2), hint(3))")


def test_deadlock_hint() -> None:
    with pytest.raises(LabCheckFailed, match="use comm.isend/comm.irecv|Use comm.isend/comm.irecv") as info:
        check(blocking_send_first, timeout=3)
    assert "rank parity" in str(info.value)


def test_solution_passes(capsys: pytest.CaptureFixture[str]) -> None:
    check(ring_all_reduce)
    assert "Correct" in capsys.readouterr().out


def test_lab_check_failed_is_an_assertion_error() -> None:
    assert issubclass(LabCheckFailed, AssertionError)
