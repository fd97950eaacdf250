"""Lab 15 checker: the stub and each typical mistake in token dispatch and combine get their pointed message (on 4
gloo ranks); the reference solution passes every case, the MoE layer's forward and backward included."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from workbench.labs import LabCheckFailed
from workbench.labs.token_dispatch import all_to_all, check, group_size

LABS = Path(__file__).resolve().parent.parent / "labs"
if str(LABS) not in sys.path:  # the reference solutions live beside the labs, outside the workbench package
    sys.path.insert(0, str(LABS))

from solutions.token_dispatch import combine, dispatch  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def stub(*args, **kwargs):
    raise NotImplementedError("send each row to its expert's rank")


def own_counts_as_incoming(rows, counts, group=None):
    """Skips the counts' all-to-all: what this rank sends stands in for what it receives (right only when every
    rank routes alike, as under even routing)."""
    ep = group_size(group)
    incoming = counts.view(ep, -1).clone()
    send, recv = counts.view(ep, -1).sum(1).tolist(), incoming.sum(1).tolist()
    received = rows.new_empty((sum(recv), *rows.shape[1:]))
    all_to_all(received, rows, output_split_sizes=recv, input_split_sizes=send, group=group)
    return received, incoming


def splits_per_expert(rows, counts, group=None):
    received, incoming = dispatch(rows, counts, group)  # counts exchanged right, then the rows with E splits
    out = rows.new_empty(received.shape)
    all_to_all(out, rows, output_split_sizes=incoming.reshape(-1).tolist(), input_split_sizes=counts.tolist(),
               group=group)
    return out, incoming


def sorted_by_expert(rows, counts, group=None):
    received, incoming = dispatch(rows, counts, group)
    return received[torch.argsort(received[:, 1], stable=True)], incoming


def combine_without_sending_back(out, incoming, counts, group=None):
    return out


@pytest.mark.parametrize("pair, expected", [
    ((stub, combine), "still the stub"),
    ((dispatch, stub), "your combine is still the stub"),
    # even routing makes every rank's counts alike, so skipping the exchange shows only in the uneven case,
    # named at the all-to-all before any row moves
    ((own_counts_as_incoming, combine), "uneven routing (an expert nobody chose"),
    ((splits_per_expert, combine), "one per rank of the group (not one per expert)"),
    ((sorted_by_expert, combine), "the contract is source-major"),
    ((dispatch, combine_without_sending_back), "in the order the rows left"),
], ids=["stub", "combine-stub", "own-counts", "splits-per-expert", "sorted-by-expert", "no-combine"])
def test_mistake_gets_pointed_message(pair, expected):
    with pytest.raises(LabCheckFailed, match="hint") as failure:
        check(*pair)
    assert expected in str(failure.value), str(failure.value)
    if pair[0] is own_counts_as_incoming:
        assert "expects" in str(failure.value) and "only rank" in str(failure.value), str(failure.value)


def test_solution_passes(capsys):
    check(dispatch, combine)
    out = capsys.readouterr().out
    assert out.startswith("Correct:") and "rounding units (allowed 64)" in out, out
