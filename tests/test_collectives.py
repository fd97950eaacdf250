"""Ring, tree and hierarchical all-reduce from send/recv: equal to gloo's all_reduce, and the bytes they send.

Tolerances: results differ from gloo's only by the order in which the N ranks' terms are added. A sum of N
terms in any order is within (N-1)·u·Σ|x_i| of the exact one (u = eps/2; an average rounds once more), so two
orders differ by at most N·eps·Σ|x_i|: ``_mismatch`` checks that bound element by element, in each dtype's own
eps (bfloat16's is 2^-7). It holds on any CPU: the bound is order-free, and an element's adds are the same scalar
operations whatever the vector width. A bug (a chunk from the wrong rank, a rank left out) is off by a whole term,
~Σ|x_i|/N. A max rounds nothing: bit for bit.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from workbench import comm, launch, trace
from workbench.parallel import collectives as C

pytestmark = [pytest.mark.numerics, pytest.mark.timeout(180)]  # numerics: .ci/run's portable-ISA lane

CASES = [(n, dtype, op) for n in (1, 7, 1000) for dtype in (torch.float32, torch.bfloat16) for op in ("sum", "avg")]
CASES += [(100_003, torch.float32, "sum")]  # many segments per chunk (pipelining), an odd size (uneven chunks)


def _data(numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + numel + salt)
    return torch.randn(numel, generator=g).to(dtype)


def _reference(x: torch.Tensor, op: str, group: object = None) -> torch.Tensor:
    want = x.clone()
    dist.all_reduce(want, group=group)  # the yardstick: gloo's own all-reduce
    return want / comm.group_size(group) if op == "avg" else want


def _terms(x: torch.Tensor) -> torch.Tensor:
    """Σ|x_i| over the ranks, element by element (in float32): the size of the terms every order adds."""
    size = x.detach().abs().float()
    dist.all_reduce(size)
    return size


def _mismatch(name: str, got: torch.Tensor, want: torch.Tensor, terms: torch.Tensor) -> list[str]:
    """[] where |got - want| <= N·eps·Σ|x_i| everywhere (the module docstring's bound), else what differs."""
    bound = dist.get_world_size() * torch.finfo(want.dtype).eps * terms
    excess = (got.float() - want.float()).abs() - bound
    if got.shape == want.shape and got.dtype == want.dtype and bool((excess <= 0).all()):
        return []
    worst = int(excess.flatten().argmax()) if got.shape == want.shape else -1
    return [f"rank {dist.get_rank()} {name}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}, "
            f"worst element {worst} beyond N eps sum|x| by {float(excess.max()) if worst >= 0 else 'n/a'}"]


def _sent_bytes(events: list, prefix: str) -> int:
    return sum(e.nbytes for e in events if e.op == "send" and e.tag.startswith(prefix))


def _equivalence_on_ranks(segment_bytes: int) -> dict:
    """Every case on this rank; returns the list of mismatches (empty = all equal) and byte counts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    errors: list[str] = []
    for numel, dtype, op in CASES:
        x = _data(numel, dtype)
        want, terms = _reference(x, op), _terms(x)
        terms = terms / world if op == "avg" else terms
        case = f"n={numel} {dtype} {op}"
        errors += _mismatch(f"ring {case}", C.ring_all_reduce(x.clone(), op=op, segment_bytes=segment_bytes),
                            want, terms)
        errors += _mismatch(f"tree {case}", C.tree_all_reduce(x.clone(), op=op), want, terms)
        if op == "sum":
            bounds = [c.numel() for c in x.tensor_split(world)]
            start = sum(bounds[:rank])
            shard = C.ring_reduce_scatter(x, segment_bytes=segment_bytes)
            errors += _mismatch(f"reduce_scatter {case}", shard, want[start:start + bounds[rank]],
                                terms[start:start + bounds[rank]])
            gathered = C.ring_all_gather(shard, numel=numel, segment_bytes=segment_bytes)
            errors += _mismatch(f"all_gather {case}", gathered, want, terms)
    # other ops, dtypes and layouts
    ints = torch.arange(10, dtype=torch.int64) * (rank + 1)
    if not torch.equal(C.ring_all_reduce(ints.clone()), _reference(ints, "sum")):
        errors.append(f"rank {rank}: int64 sum differs")
    y = _data(33, torch.float32, salt=1)
    want_max = y.clone()
    dist.all_reduce(want_max, op=dist.ReduceOp.MAX)
    if not torch.equal(C.ring_all_reduce(y.clone(), op="max", segment_bytes=8), want_max):  # a max rounds nothing
        errors.append(f"rank {rank}: ring max differs")
    strided = _data(60, torch.float32, salt=2).reshape(6, 10)
    view = strided.t()  # not contiguous: must still be reduced in place
    want_view, terms = _reference(view.contiguous(), "sum"), _terms(view)
    C.ring_all_reduce(view)
    errors += _mismatch("non-contiguous", view, want_view, terms)
    equal_chunks = C.ring_all_gather(torch.full((3,), float(rank)))
    if equal_chunks.tolist() != [float(r) for r in range(world) for _ in range(3)]:
        errors.append(f"rank {rank}: all_gather of equal chunks gave {equal_chunks.tolist()}")
    return {"errors": errors, "bitwise_equal_result": C.ring_all_reduce(_data(1001, torch.float32), op="avg")}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_and_tree_equal_gloo_all_reduce(world: int) -> None:
    # 4 KiB segments: the 100_003-element case runs through 25-49 pipelined messages per chunk.
    results = launch(_equivalence_on_ranks, world, 4096, timeout=60)
    errors = [e for r in results for e in r["errors"]]
    assert not errors, "\n".join(errors)
    # every chunk is finished once by its owner and copied, so all ranks hold bitwise the same result
    assert all(torch.equal(r["bitwise_equal_result"], results[0]["bitwise_equal_result"]) for r in results)


def _traced_bytes(numel: int) -> dict:
    x = torch.ones(numel)
    C.ring_all_reduce(x, segment_bytes=4096)
    ring_events = list(trace.current().trace.comms)
    C.tree_all_reduce(torch.ones(numel))
    tree_events = trace.current().trace.comms[len(ring_events):]
    return {"value": x[0].item(), "ring_sent": _sent_bytes(ring_events, "ring"),
            "rs_sent": _sent_bytes(ring_events, "ring-rs"), "ag_sent": _sent_bytes(ring_events, "ring-ag"),
            "tags": [e.tag for e in ring_events if e.op == "send"],
            "ops": {e.op for e in ring_events + tree_events},
            "tree_sent": _sent_bytes(tree_events, "tree")}


@pytest.mark.parametrize("world, numel", [(4, 10_001), (3, 3000)])
def test_trace_records_ring_volume(world: int, numel: int) -> None:
    results = launch(_traced_bytes, world, numel, timeout=60)
    size = numel * 4
    chunk = [c.numel() * 4 for c in torch.empty(numel).tensor_split(world)]
    for rank, r in enumerate(results):
        assert r["value"] == world
        assert r["ops"] <= {"send", "recv"}, "built from point-to-point only"
        # reduce-scatter sends every chunk but its own; all-gather every chunk but the one its right
        # neighbour (the receiver) finished itself
        assert r["rs_sent"] == size - chunk[rank]
        assert r["ag_sent"] == size - chunk[(rank + 1) % world]
        assert abs(r["ring_sent"] - 2 * (world - 1) / world * size) <= 2 * 4  # +- the uneven remainder
        phases = {C.parse_tag(t)[0] for t in r["tags"]}
        assert phases == {"ring-rs", "ring-ag"}
        steps = {C.parse_tag(t)[1] for t in r["tags"]}
        assert steps == set(range(world - 1))
    # binomial tree: leaves send once, inner nodes more, the root only in the broadcast
    assert results[0]["tree_sent"] == size * ((world - 1).bit_length() if world > 1 else 0)


def _hierarchical() -> dict:
    intra, inter = C.hierarchical_groups(2)
    errors = []
    for numel, op in ((1, "sum"), (13, "avg"), (100_001, "sum")):
        x = _data(numel, torch.float32)
        terms = _terms(x) / (4 if op == "avg" else 1)  # 4 ranks
        errors += _mismatch(f"hierarchical n={numel} {op}", C.hierarchical_all_reduce(x.clone(), intra, inter, op=op),
                            _reference(x, op), terms)
    start = len(trace.current().trace.comms)
    C.hierarchical_all_reduce(torch.ones(4000), intra, inter, segment_bytes=1024)
    events = trace.current().trace.comms[start:]
    return {"errors": errors, "intra": comm.group_ranks(intra), "inter": comm.group_ranks(inter),
            "intra_sent": _sent_bytes(events, "hier-intra"), "inter_sent": _sent_bytes(events, "hier-inter")}


def test_hierarchical_two_nodes_of_two() -> None:
    results = launch(_hierarchical, 4, timeout=60)
    assert not [e for r in results for e in r["errors"]]
    assert [r["intra"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["inter"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    # 16 000 bytes: within the node each rank sends half (RS) + half (AG); across nodes only its
    # 8 000-byte shard is all-reduced, half of it each way: S/node_size crosses the slow link.
    assert all(r["intra_sent"] == 16_000 and r["inter_sent"] == 8_000 for r in results)


def test_world_size_one_is_identity() -> None:
    x = torch.arange(5.0)
    assert C.ring_all_reduce(x, op="avg") is x and x.tolist() == [0, 1, 2, 3, 4]
    assert C.tree_all_reduce(x).tolist() == [0, 1, 2, 3, 4]
    assert C.ring_reduce_scatter(x).tolist() == [0, 1, 2, 3, 4]
    assert C.ring_all_gather(x).tolist() == [0, 1, 2, 3, 4]
    assert C.hierarchical_groups(1) == (None, None)
    assert C.hierarchical_all_reduce(x, None, None).tolist() == [0, 1, 2, 3, 4]
    assert list(launch(lambda: C.ring_all_reduce(torch.ones(3)).tolist(), 1, timeout=30)) == [[1, 1, 1]]


def test_schedule_owner_and_tag_round_trip() -> None:
    # after reduce-scatter, rank r has received (and finished) chunk r
    assert all(C.ring_schedule(r, 4)[2][2] == r for r in range(4))
    assert C.ring_schedule(0, 4)[3] == ("ag", 0, 3)
    assert C.parse_tag("hier-inter-rs:2:5") == ("hier-inter-rs", 2, 5)


@pytest.mark.parametrize("call, message", [
    (lambda: C.ring_all_reduce(torch.ones(2), op="mean"), "unknown reduce op 'mean'; valid: sum, avg"),
    (lambda: C.ring_all_reduce(torch.ones(2, dtype=torch.int32), op="avg"), "op='avg' needs a floating-point"),
    (lambda: C.ring_all_reduce(torch.ones(2), segment_bytes=0), "segment_bytes must be a positive int"),
    (lambda: C.tree_all_reduce([1.0, 2.0]), "expected a torch.Tensor, got list"),
    (lambda: C.hierarchical_groups(0), "node_size must be a positive divisor of the group size 1"),
    (lambda: C.ring_all_gather(torch.ones(3), numel=7), "pass the numel that was split"),
])
def test_bad_input_is_value_error(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
