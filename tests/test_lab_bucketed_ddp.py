"""Lab 03 checker: the stub and typical mistakes get their pointed hints; the solution passes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from workbench import comm
from workbench.labs import LabCheckFailed
from workbench.labs.bucketed_ddp import BucketedDDPScaffold, check

LABS = Path(__file__).resolve().parent.parent / "labs"
if str(LABS) not in sys.path:  # the reference solutions live beside the labs, outside the workbench package
    sys.path.insert(0, str(LABS))

from solutions.bucketed_ddp import LearnerBucketedDDP  # noqa: E402


class Stub(BucketedDDPScaffold):
    """What the notebook's stub cell defines: nothing written yet."""


class Summed(LearnerBucketedDDP):
    def finish_gradient_synchronization(self) -> None:
        for handle in self.handles:
            handle.wait()
        for bucket in self.buckets:
            for p in bucket:
                p.grad.copy_(self.slot(p))
        self.reset_pending()


class NoBroadcast(LearnerBucketedDDP):
    def broadcast_parameters(self) -> None:
        pass


class ParamsOnly(LearnerBucketedDDP):
    def broadcast_parameters(self) -> None:
        for p in self.module.parameters():
            comm.broadcast(p.detach(), src=0, group=self.group)


class NoWait(LearnerBucketedDDP):
    def finish_gradient_synchronization(self) -> None:
        for bucket, buffer in zip(self.buckets, self.bucket_buffers, strict=True):
            buffer.div_(self.world_size)
            for p in bucket:
                p.grad.copy_(self.slot(p))
        self.reset_pending()


class LastBucketOnly(LearnerBucketedDDP):
    def finish_gradient_synchronization(self) -> None:
        for handle in self.handles:
            handle.wait()
        last = len(self.buckets) - 1  # the bucket whose all-reduce went out last
        self.bucket_buffers[last].div_(self.world_size)
        for p in self.buckets[last]:
            p.grad.copy_(self.slot(p))
        self.reset_pending()


class NoReset(LearnerBucketedDDP):
    def finish_gradient_synchronization(self) -> None:
        for handle in self.handles:
            handle.wait()
        self.handles = []
        for bucket, buffer in zip(self.buckets, self.bucket_buffers, strict=True):
            buffer.div_(self.world_size)
            for p in bucket:
                p.grad.copy_(self.slot(p))


class LaunchBeforeCopy(LearnerBucketedDDP):
    def _on_grad_ready(self, param) -> None:
        i = self.bucket_of(param)
        self.pending[i] -= 1
        if self.pending[i] == 0:
            self.handles.append(comm.all_reduce(self.bucket_buffers[i], group=self.group, async_op=True))
        self.slot(param).copy_(param.grad)


CASES = [
    (Stub, "not written yet: copy rank 0's parameters"),
    (Summed, "summed, not averaged: .*divide each bucket by the world size"),
    (NoBroadcast, "rank 1 holds different weights than rank 0"),
    (ParamsOnly, "buffer 'scale' differs"),
    (NoWait, "still in flight .* must call .wait\\(\\) on every handle"),
    (LastBucketOnly, "only bucket \\d+ was averaged"),
    (NoReset, "countdown was not reset"),
    (LaunchBeforeCopy, "all-reduce start before all of its gradients were copied in"),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cls, hint", CASES, ids=[c.__name__ for c, _ in CASES])
def test_mistakes_get_pointed_hints(cls, hint):
    with pytest.raises(LabCheckFailed, match=hint) as info:
        check(cls)
    assert str(info.value).endswith("(more help: hint(1), hint(2), hint(3))")


@pytest.mark.timeout(180)
def test_solution_passes(capsys):
    check(LearnerBucketedDDP)
    assert "Correct!" in capsys.readouterr().out
