"""``workbench.parallel.buckets.bucket_params``: the one bucketing rule DDP, ZeRO and lab 03 share (issue 19)."""
from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from workbench.labs.bucketed_ddp import BucketedDDPScaffold
from workbench.models import build_mlp
from workbench.parallel.buckets import bucket_params
from workbench.parallel.ddp import BucketedDDP
from workbench.parallel.zero import ZeroOptimizer


def _params(*numels: int, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in numels]


def _numels(buckets: list[list[nn.Parameter]]) -> list[list[int]]:
    return [[p.numel() for p in b] for b in buckets]


def _nbytes(bucket: list[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in bucket)


def test_greedy_runs_in_the_given_order_with_the_cap_inclusive() -> None:
    # fp32: 4 bytes an element; cap 16 bytes = 4 elements, and a bucket of exactly the cap is full, not over
    assert _numels(bucket_params(_params(1, 2, 1, 3, 1, 4, 2, 2), 16)) == [[1, 2, 1], [3, 1], [4], [2, 2]]


def test_a_parameter_over_the_cap_gets_a_bucket_of_its_own() -> None:
    # before it a bucket closes, after it a new one opens: the big one never shares, even with a tiny one
    assert _numels(bucket_params(_params(1, 9, 1, 1, 7), 12)) == [[1], [9], [1, 1], [7]]
    assert _numels(bucket_params(_params(9), 12)) == [[9]]


def test_dtype_or_device_change_ends_a_bucket() -> None:
    # each bucket becomes one flat tensor: one dtype, one device
    params = [*_params(1, 1), *_params(1, dtype=torch.bfloat16), *_params(1)]
    assert _numels(bucket_params(params, 1 << 20)) == [[1, 1], [1], [1]]
    meta = nn.Parameter(torch.zeros(1, device="meta"))
    assert [len(b) for b in bucket_params([*_params(1), meta, *_params(1)], float("inf"))] == [1, 1, 1]


def test_infinite_cap_is_one_bucket_and_no_params_no_bucket() -> None:
    params = _params(5, 1000, 3)
    assert bucket_params(params, float("inf")) == [params]
    assert bucket_params([], 16) == []


def test_accepts_any_iterable_such_as_reversed() -> None:
    params = _params(1, 2, 3)
    assert _numels(bucket_params(reversed(params), 12)) == [[3], [2, 1]]


@pytest.mark.parametrize("seed", range(20))
def test_random_layouts_keep_every_rule(seed: int) -> None:
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.float16]
    params = [nn.Parameter(torch.zeros(rng.randint(1, 40), dtype=rng.choice(dtypes)))
              for _ in range(rng.randint(1, 30))]
    cap = rng.randint(1, 120)
    buckets = bucket_params(params, cap)
    flat = [p for b in buckets for p in b]
    assert [id(p) for p in flat] == [id(p) for p in params]  # every parameter exactly once, order kept
    for b in buckets:
        assert b, "an empty bucket"
        assert len(b) == 1 or _nbytes(b) <= cap  # the cap holds unless one parameter alone exceeds it
        assert len({(p.dtype, p.device) for p in b}) == 1
    for b, nxt in zip(buckets[:-1], buckets[1:], strict=True):  # greedy: ends only where the next cannot join
        head = nxt[0]
        assert head.dtype != b[0].dtype or _nbytes(b) + head.numel() * head.element_size() > cap


class _NoBroadcast(BucketedDDPScaffold):
    def broadcast_parameters(self) -> None:  # one process: nothing to broadcast
        pass


def test_ddp_zero_and_lab_cut_the_same_buckets() -> None:
    """The three former copies (ddp.py, zero/flat.py, the lab scaffold) now agree: last layers first."""
    model = build_mlp(seed=0)
    cap_mb = 0.004
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]  # frozen ones are never communicated
    cut = bucket_params(reversed(trainable), int(cap_mb * 2**20))
    expected = [[names[id(p)] for p in b] for b in cut]
    assert len(expected) >= 3 and expected[0][0] == "out.bias"
    assert BucketedDDP(model, bucket_mb=cap_mb).bucket_param_names() == expected
    assert _NoBroadcast(model, bucket_mb=cap_mb).bucket_param_names() == expected
    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=1, bucket_cap_mb=cap_mb, lr=0.1)
    assert [[names[id(p)] for p in b.params] for b in opt.buckets] == expected


def test_the_helper_imports_no_workbench_module() -> None:
    """A helper any strategy may import: it must not reach a strategy (or the package that combines them)."""
    path = Path(__file__).resolve().parents[1] / "workbench" / "parallel" / "buckets.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in modules if m.split(".")[0] == "workbench"]
