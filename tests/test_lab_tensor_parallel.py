"""Lab 07 checker: the stub and each typical mistake get their pointed message; the solution passes.

The reference solution lives beside the lab notebooks (labs/solutions/), not in the workbench package."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from workbench import comm
from workbench.labs import LabCheckFailed
from workbench.labs.tensor_parallel import HINTS, TensorParallelLinear, check, hint

LABS = Path(__file__).resolve().parent.parent / "labs"
if str(LABS) not in sys.path:
    sys.path.insert(0, str(LABS))

from solutions.tensor_parallel import (  # noqa: E402
    ColumnParallel,
    CopyToTensorParallel,
    ReduceFromTensorParallel,
    RowParallel,
)

# -- the learner's starting point: every piece a stub --------------------------------------------------------


class StubF(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("f: identity forward, all-reduce backward")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("f: identity forward, all-reduce backward")


class StubColumn(TensorParallelLinear):
    """The scaffold's NotImplementedError shard and forward."""


# -- f: the identity forward, all-reduce backward ------------------------------------------------------------


class FNoReduce(CopyToTensorParallel):
    """The most common slip: f is the identity both ways, so dL/dX stays a partial sum."""

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class FReduceForward(CopyToTensorParallel):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        comm.all_reduce(out, group=group)
        return out


class FAverage(CopyToTensorParallel):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        comm.all_reduce(grad, op="avg", group=ctx.group)
        return grad, None


class FReturnsOne(CopyToTensorParallel):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        comm.all_reduce(grad, group=ctx.group)
        return grad


class FNotLogged(CopyToTensorParallel):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)  # right numbers, but invisible to the communication log
        return grad, None


# -- g: all-reduce forward, identity backward ----------------------------------------------------------------


class GNoReduce(ReduceFromTensorParallel):
    @staticmethod
    def forward(ctx, x, group):
        return x.clone()


class GBothWays(ReduceFromTensorParallel):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        comm.all_reduce(grad)
        return grad, None


# -- the layers ----------------------------------------------------------------------------------------------


class ColumnWrongDim(ColumnParallel):
    @staticmethod
    def shard(weight, bias, tp_size, tp_rank):
        return RowParallel.shard(weight, bias, tp_size, tp_rank)


class ColumnWholeBias(ColumnParallel):
    @staticmethod
    def shard(weight, bias, tp_size, tp_rank):
        return ColumnParallel.shard(weight, bias, tp_size, tp_rank)[0], bias


class ColumnFirstBlock(ColumnParallel):
    """Every rank takes block 0 (e.g. a rank index that is always 0)."""

    @staticmethod
    def shard(weight, bias, tp_size, tp_rank):
        return ColumnParallel.shard(weight, bias, tp_size, 0)


class ColumnNoTuple(ColumnParallel):
    @staticmethod
    def shard(weight, bias, tp_size, tp_rank):
        return ColumnParallel.shard(weight, bias, tp_size, tp_rank)[0]


class ColumnWithoutF(ColumnParallel):
    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowWrongDim(RowParallel):
    @staticmethod
    def shard(weight, bias, tp_size, tp_rank):
        n = weight.shape[0] // tp_size
        return weight[tp_rank * n:(tp_rank + 1) * n], bias


class RowSlicedBias(RowParallel):
    @staticmethod
    def shard(weight, bias, tp_size, tp_rank):
        n = bias.shape[0] // tp_size
        return RowParallel.shard(weight, bias, tp_size, tp_rank)[0], bias[tp_rank * n:(tp_rank + 1) * n]


class RowBiasBeforeReduce(RowParallel):
    def forward(self, y):
        return ReduceFromTensorParallel.apply(F.linear(y, self.weight, self.bias), self.group)


class RowWithoutG(RowParallel):
    def forward(self, y):
        return F.linear(y, self.weight) + self.bias


F_OK, G_OK = CopyToTensorParallel, ReduceFromTensorParallel


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pieces, message", [
    ((StubF, G_OK, StubColumn, RowParallel), r"^f \(StubF\) is still the stub: f: identity"),
    ((F_OK, G_OK, StubColumn, RowParallel), r"shard is still the stub"),
    ((FNoReduce, G_OK, ColumnParallel, RowParallel), r"f's backward .* partial sum"),
    ((FReduceForward, G_OK, ColumnParallel, RowParallel), r"f's forward all-reduced X"),
    ((FAverage, G_OK, ColumnParallel, RowParallel), r"f's backward averaged"),
    ((FReturnsOne, G_OK, ColumnParallel, RowParallel), r"one value per input of forward .* `return grad, None`"),
    ((FNotLogged, G_OK, ColumnParallel, RowParallel), r"shows no collective.*workbench\.comm\.all_reduce"),
    ((F_OK, GNoReduce, ColumnParallel, RowParallel), r"g's forward returned this rank's partial result"),
    ((F_OK, GBothWays, ColumnParallel, RowParallel), r"all-reducing in both directions"),
    ((F_OK, G_OK, ColumnWrongDim, RowParallel), r"split fc's weight along the wrong dim: got \(256, 32\), "
                                                r"want \(128, 64\)"),
    ((F_OK, G_OK, ColumnWholeBias, RowParallel), r"the bias must be sliced like the output features"),
    ((F_OK, G_OK, ColumnFirstBlock, RowParallel), r"\(tp_rank=1\) returned block 0 .* rank 1 owns block 1"),
    ((F_OK, G_OK, ColumnNoTuple, RowParallel), r"return a pair \(weight, bias\)"),
    ((F_OK, G_OK, ColumnWithoutF, RowParallel), r"input gradient is a partial sum .* through f"),
    ((F_OK, G_OK, ColumnParallel, RowWrongDim), r"sliced the row-parallel weight along the wrong dim: got "
                                                r"\(32, 256\), want \(64, 128\)"),
    ((F_OK, G_OK, ColumnParallel, RowSlicedBias), r"the row layer's bias stays whole"),
    ((F_OK, G_OK, ColumnParallel, RowBiasBeforeReduce), r"\(tp−1\)·bias: .* counted tp times"),
    ((F_OK, G_OK, ColumnParallel, RowWithoutG), r"its own partial sum Y_r·B_r: .* g"),
], ids=lambda v: v if isinstance(v, str) else "-".join(c.__name__ for c in v))
def test_each_mistake_gets_its_pointed_message(pieces, message):
    with pytest.raises(LabCheckFailed, match=message) as info:
        check(*pieces)
    assert str(info.value).endswith("(more help: hint(1), hint(2), hint(3))")


@pytest.mark.timeout(180)
def test_solution_passes(capsys):
    check(CopyToTensorParallel, ReduceFromTensorParallel, ColumnParallel, RowParallel)
    out = capsys.readouterr().out
    assert "equals the single-process MLP" in out and "1 all-reduce forward and 1 backward" in out


def test_wrong_kinds_of_argument_are_named():
    with pytest.raises(LabCheckFailed, match=r"f as a torch.autograd.Function subclass \(the class, not .apply\)"):
        check(CopyToTensorParallel.apply, ReduceFromTensorParallel, ColumnParallel, RowParallel)
    with pytest.raises(LabCheckFailed, match="row_cls as a subclass of TensorParallelLinear"):
        check(CopyToTensorParallel, ReduceFromTensorParallel, ColumnParallel, torch.nn.Linear)


def test_hints_are_tiered_and_bad_levels_raise(capsys):
    for level in (1, 2, 3):
        hint(level)
        assert capsys.readouterr().out.startswith(f"hint {level}/3:\n")
    assert len(HINTS[1]) < len(HINTS[2]) and "F.linear" in HINTS[3] and "F.linear" not in HINTS[1]
    with pytest.raises(ValueError, match="hint level 4: choose one of \\[1, 2, 3\\]"):
        hint(4)


def test_the_package_does_not_ship_the_solution():
    import workbench.labs.tensor_parallel as checker

    source = Path(checker.__file__).read_text()
    assert "import solutions" not in source and "from solutions" not in source
    assert not (Path(checker.__file__).parent / "solutions" / "tensor_parallel.py").exists()
