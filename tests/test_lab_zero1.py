"""Lab 04 checker: the stub and typical mistakes get their pointed hints; the solution passes."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from workbench import comm
from workbench.labs import LabCheckFailed
from workbench.labs.zero1 import ShardedOptimizerScaffold, check

LABS = Path(__file__).resolve().parent.parent / "labs"
if str(LABS) not in sys.path:  # the reference solutions live beside the labs, outside the workbench package
    sys.path.insert(0, str(LABS))

from solutions.zero1 import LearnerShardedOptimizer  # noqa: E402


class Stub(ShardedOptimizerScaffold):
    """What the learner starts with: the scaffold's NotImplementedError methods."""


class NotSharded(LearnerShardedOptimizer):
    """Every rank 'owns' everything: correct numbers, no memory saved."""

    def partition(self) -> list[int]:
        return [self.rank] * len(self.params)

    def step(self) -> None:
        self.optimizer.step()


class NoBroadcast(LearnerShardedOptimizer):
    def step(self) -> None:
        self.optimizer.step()


class RandomPartition(LearnerShardedOptimizer):
    """Seeded by rank: each rank computes a different partition."""

    def partition(self) -> list[int]:
        rng = random.Random(self.rank)
        return [rng.randrange(self.world_size) for _ in self.params]


class WrongSource(LearnerShardedOptimizer):
    def step(self) -> None:
        self.optimizer.step()
        for p, owner in zip(self.params, self.owners, strict=True):
            comm.broadcast(p.data, src=(owner + 1) % self.world_size, group=self.group)


class OffByOne(LearnerShardedOptimizer):
    def partition(self) -> list[int]:
        return [o + 1 for o in super().partition()]


class ByCount(LearnerShardedOptimizer):
    """Half the parameters each, by position: the big weights all land on one rank."""

    def partition(self) -> list[int]:
        big_first = sorted(range(len(self.params)), key=lambda i: -self.params[i].numel())
        owners = [0] * len(self.params)
        for i in big_first[len(big_first) // 3:]:
            owners[i] = 1
        return owners


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cls, hint", [
    (Stub, "still the stub"),
    (NotSharded, "every rank holds state for all parameters"),
    (NoBroadcast, "params not shared after step: ranks diverge"),
    (RandomPartition, "partition not deterministic across ranks"),
    (WrongSource, "FROM ITS OWNER"),
    (OffByOne, "off by one"),
    (ByCount, "unbalanced"),
])
def test_wrong_answers_get_their_hint(cls, hint):
    with pytest.raises(LabCheckFailed, match=hint) as info:
        check(cls)
    assert str(info.value).endswith("(more help: hint(1), hint(2), hint(3))")


@pytest.mark.timeout(180)
def test_solution_passes(capsys):
    check(LearnerShardedOptimizer)
    assert "ZeRO-1 works" in capsys.readouterr().out


def test_not_a_class():
    with pytest.raises(LabCheckFailed, match="ShardedOptimizerScaffold"):
        check(lambda: None)
