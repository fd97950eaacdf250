"""Checker for lab 15: token dispatch and combine, the two all-to-alls of expert parallelism.

The learner writes the two data movements of one MoE layer under expert parallelism (GShard, Lepikhin et al. 2020
§2.2; DeepSpeed-MoE; ``workbench.parallel.expert``), for ``ep`` ranks each holding a contiguous block of E/ep of
the E experts (rank r holds experts r·E/ep … (r+1)·E/ep − 1):

* ``dispatch(rows, counts, group=None) -> (received, incoming)``: ``rows`` [M, d] are this rank's kept
  (token, expert) assignments sorted expert-major over all E experts, ``counts`` [E] (int64) how many rows each
  expert gets from here. Every row must reach the rank holding its expert. ``received`` holds the rows this rank's
  experts were sent, **source-major** (all of rank 0's rows, in the order rank 0 sorted them, then rank 1's, ...),
  and ``incoming`` [ep, E/ep] (int64) how many came from rank s for this rank's j-th expert. A receiver must know
  how many rows arrive before they do: the counts travel first, by an equal-split all-to-all.
* ``combine(out, incoming, counts, group=None) -> back``: ``out`` [R, d] the experts' outputs of ``received`` in
  the same order; every output returns to the rank its row came from, in the order the rows left: [M, d].

``all_to_all`` (given) is ``torch.distributed.all_to_all_single``'s contract through ``workbench.dist.comm``, with
the lab's checks: one split size per rank, summing to the rows, and — checked across the ranks before any data
moves — each rank expecting from every other exactly what that one sends (a mismatch would otherwise hang or fail
deep inside gloo).

``check(dispatch, combine)`` starts 4 gloo ranks (E = 8, so 2 experts per rank) and runs three cases in order:

1. **even routing**: every rank sends 2 rows to each expert;
2. **uneven routing**: per-rank counts from a seeded draw, an expert nobody chose, a rank that sends nothing to
   another, and a rank with no rows at all;
3. **a MoE layer**: the learner's pair plugged into a real ``models.moe.MoEMLP`` (top-2 of 8 experts, no capacity
   limit) as its expert runner, forward and backward — where dispatch's gradient is combine's data movement and
   combine's is dispatch's (the all-to-all with the splits swapped) — against one process holding every expert on
   the four ranks' tokens.

Cases 1 and 2 move data only: each row carries its origin (source rank, expert, position, a serial number), the
results are compared exactly, and a wrong row is named by where it came from. Case 3 compares outputs, input
gradients and expert-weight gradients in rounding units (``workbench.labs.rounding_error``): both sides run every
expert on the same rows in the same order, so only a matmul's blocking over a different number of rows can differ;
the checker allows ``ROUNDING_UNITS``. Measured with the reference solution (x86 CPU, default ISA): 0 units
(bit-identical) for all three; a misplaced row is off by ~10⁶ units.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from workbench.dist import comm
from workbench.labs import LabCheckFailed, rounding_error, show_hint

WORLD, EXPERTS = 4, 8  # 2 experts per rank
D_ROW = 4  # row width in cases 1-2: (source rank, expert, position, serial)
D_MODEL, HIDDEN, TOKENS = 8, 16, (2, 6)  # case 3's layer and each rank's batch (sequences, tokens)
ROUNDING_UNITS = 64  # see the module docstring: 0 measured, a misplaced row ~1e6
TIMEOUT = 90.0
CHECK_TAG = "lab15_check"
MORE = " (more help: hint(1), hint(2), hint(3))"

HINTS = {
    1: "Dispatch is two all-to-alls. The rows cannot go first: a receiver must size its buffer, and only the "
       "senders know how many rows they have for it. So first every rank tells every other how many rows it has "
       "for each of that rank's experts (counts is expert-major, and rank r's experts are a contiguous block, so "
       "chunk r of counts is exactly what rank r needs to hear). Then the rows, whose expert-major order already "
       "makes each destination's rows one contiguous block. Combine is the same journey backwards.",
    2: "In dispatch: incoming = an equal-split all_to_all of counts, viewed as [ep, E/ep] (row s: what rank s "
       "sends to each of your experts). Rows to send to rank r: the sum of counts' chunk r, i.e. "
       "counts.view(ep, -1).sum(1); rows to receive from rank s: incoming.sum(1). In combine the two lists swap "
       "roles: send back incoming.sum(1) rows to each source, receive counts.view(ep, -1).sum(1) from each.",
    3: "ep = group_size(group)\n"
       "incoming = torch.empty_like(counts)\n"
       "all_to_all(incoming, counts, group=group)              # equal split: E/ep counts to each rank\n"
       "incoming = incoming.view(ep, -1)\n"
       "send, recv = counts.view(ep, -1).sum(1).tolist(), incoming.sum(1).tolist()\n"
       "received = rows.new_empty((sum(recv), *rows.shape[1:]))\n"
       "all_to_all(received, rows, output_split_sizes=recv, input_split_sizes=send, group=group)\n"
       "return received, incoming\n"
       "# combine: the same second all_to_all with send and recv swapped, into out.new_empty((sum(send), ...))",
}


def hint(level: int = 1) -> str:
    """Print (and return) hint ``level``: 1 the idea, 2 the split sizes, 3 nearly the code."""
    return show_hint(HINTS, level)


# -- what the learner is given ------------------------------------------------------------------------------------

def group_size(group: Any = None) -> int:
    """Ranks in ``group`` (None: the world): ep."""
    return comm.group_size(group)


def group_rank(group: Any = None) -> int:
    """This rank's index in ``group``."""
    return comm.group_rank(group)


def local_experts(experts: int, ep: int, rank: int) -> range:
    """The global indices of the experts ``rank`` holds: a contiguous block of experts/ep."""
    per = experts // ep
    return range(rank * per, (rank + 1) * per)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None, group: Any = None) -> None:
    """Rows of ``input`` to every rank, rows of ``output`` from every rank (``all_to_all_single``'s contract):
    ``input_split_sizes[r]`` rows (dim 0) go to rank r, ``output_split_sizes[s]`` rows arrive from rank s, in
    rank order; None: equal chunks. Checked across the ranks before any data moves (the module docstring)."""
    ep = comm.group_size(group)
    sends = _sizes("input_split_sizes", input_split_sizes, input, ep)
    expects = _sizes("output_split_sizes", output_split_sizes, output, ep)
    if output.dtype != input.dtype or output.shape[1:] != input.shape[1:]:
        raise LabCheckFailed(f"all_to_all: output {tuple(output.shape)} {output.dtype} and input "
                             f"{tuple(input.shape)} {input.dtype} must share dtype and every dimension but the first")
    _agree(sends, expects, group)
    comm.all_to_all(output, input.contiguous(), group, tag="lab15", output_split_sizes=expects,
                    input_split_sizes=sends)


def _sizes(name: str, sizes: Any, tensor: torch.Tensor, ep: int) -> list[int]:
    if sizes is None:
        if tensor.shape[0] % ep:
            raise LabCheckFailed(f"all_to_all without {name}: dim 0 ({tensor.shape[0]}) must split into {ep} equal "
                                 "chunks; pass the split sizes for uneven chunks")
        return [tensor.shape[0] // ep] * ep
    sizes = sizes.tolist() if isinstance(sizes, torch.Tensor) else list(sizes)
    if len(sizes) != ep or any(int(n) < 0 for n in sizes) or sum(int(n) for n in sizes) != tensor.shape[0]:
        raise LabCheckFailed(f"all_to_all: {name} must be {ep} row counts, one per rank of the group (not one per "
                             f"expert), non-negative and summing to that tensor's dim 0 ({tensor.shape[0]}); got "
                             f"{sizes}")
    return [int(n) for n in sizes]


def _agree(sends: list[int], expects: list[int], group: Any) -> None:
    """Every rank's sizes gathered everywhere, so that all ranks stop together, naming the first mismatch."""
    ep, mine = comm.group_size(group), torch.tensor([sends, expects], dtype=torch.int64, device="cpu")
    table = torch.empty((ep * 2, ep), dtype=torch.int64, device="cpu")
    comm.all_gather(table, mine, group, tag=CHECK_TAG)
    table = table.view(ep, 2, ep)  # [rank, (sends, expects), peer]
    for receiver in range(ep):
        for source in range(ep):
            sent, expected = int(table[source, 0, receiver]), int(table[receiver, 1, source])
            if sent != expected:
                raise LabCheckFailed(
                    f"all_to_all: rank {receiver} expects {expected} rows from rank {source}, which sends it {sent}. "
                    f"output_split_sizes[s] must be what rank s sends here, and until the counts travel only rank s "
                    f"knows it (all sizes: sends {table[:, 0].tolist()}, expects {table[:, 1].tolist()})")


# -- the cases ------------------------------------------------------------------------------------------------------

def _counts(case: str, rank: int) -> torch.Tensor:
    """Rows rank ``rank`` sends to each expert [E] in a data-movement case (the same on every process)."""
    if case == "even":
        return torch.full((EXPERTS,), 2, dtype=torch.int64, device="cpu")
    g = torch.Generator(device="cpu").manual_seed(150 + rank)
    counts = torch.randint(0, 6, (EXPERTS,), generator=g, device="cpu")
    counts[3] = 0  # expert 3: nobody chose it
    if rank == 2:
        counts[2:4] = 0  # rank 2 sends nothing to rank 1
    if rank == 3:
        counts.zero_()  # rank 3 has no rows at all
    return counts


def _rows(case: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows, expert-major, each (source, expert, position within (source, expert), serial)."""
    counts = _counts(case, rank).tolist()
    rows = [[rank, e, p, 0] for e, n in enumerate(counts) for p in range(n)]
    out = torch.tensor(rows, dtype=torch.float32, device="cpu").reshape(-1, D_ROW)
    out[:, 3] = torch.arange(out.shape[0], device="cpu") + 1000 * rank
    return out


def _expected_received(case: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    mine = local_experts(EXPERTS, WORLD, rank)
    parts = [r[(r[:, 1] >= mine.start) & (r[:, 1] < mine.stop)] for r in (_rows(case, s) for s in range(WORLD))]
    incoming = torch.stack([_counts(case, s)[mine.start:mine.stop] for s in range(WORLD)])
    return torch.cat(parts), incoming


def _origin(row: torch.Tensor) -> str:
    source, expert, position, _ = (int(v) for v in row.tolist())
    return f"rank {source}'s row {position} for expert {expert}"


def _expert_fn(received: torch.Tensor) -> torch.Tensor:
    """The 'experts' of cases 1-2: a recognisable change of every row, so a result can be traced to its input."""
    return received * torch.tensor([1.0, 1.0, 1.0, -1.0], device="cpu")


def _call(fn: Callable, args: tuple, name: str, where: str) -> Any:
    try:
        return fn(*args)
    except NotImplementedError as error:
        raise LabCheckFailed(f"your {name} is still the stub (NotImplementedError: {error}). Replace its "
                             "body.") from None
    except LabCheckFailed as error:
        raise LabCheckFailed(f"{where}, in your {name}: {error}") from None
    except Exception as error:  # the learner's code: any error is theirs to see, pointed at the case
        raise LabCheckFailed(f"{where}: your {name} raised {type(error).__name__}: {error}") from None


def _check_dispatch(got: Any, rows: torch.Tensor, counts: torch.Tensor, want: tuple, where: str) -> None:
    want_received, want_incoming = want
    if not (isinstance(got, tuple | list) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        raise LabCheckFailed(f"{where}: dispatch must return a pair (received, incoming) of tensors")
    received, incoming = got
    if tuple(incoming.shape) != tuple(want_incoming.shape) or not torch.equal(incoming.long(), want_incoming):
        own = counts.view(WORLD, -1)
        is_own = incoming.shape == own.shape and torch.equal(incoming.long(), own)
        why = ("incoming is your own counts: those are the rows you send; incoming[s, j] is what rank s sends to "
               "your j-th expert, which only rank s knows until the counts travel (an all-to-all of counts)"
               if is_own else f"incoming must be [{WORLD}, {EXPERTS // WORLD}], row s what rank s sends to each of "
                              f"your experts: want {want_incoming.tolist()}, got {incoming.tolist()}")
        raise LabCheckFailed(f"{where}: {why}")
    if received.shape != want_received.shape:
        raise LabCheckFailed(f"{where}: received has shape {tuple(received.shape)}; your experts were sent "
                             f"{want_received.shape[0]} rows of width {want_received.shape[1]}")
    if not torch.equal(received, want_received):
        if torch.equal(received, want_received[torch.argsort(want_received[:, 1], stable=True)]):
            raise LabCheckFailed(f"{where}: received is sorted by expert; the contract is source-major (rank 0's rows "
                                 "first, as rank 0 sent them, then rank 1's...), as they arrive; the experts' own sort "
                                 "happens after, where they are run")
        bad = int((received != want_received).any(1).nonzero()[0])
        raise LabCheckFailed(f"{where}: received row {bad} is {_origin(received[bad])}, where "
                             f"{_origin(want_received[bad])} belongs (source-major, each source's rows in the order "
                             "it sent them)")


def _check_combine(got: Any, rows: torch.Tensor, where: str) -> None:
    want = _expert_fn(rows)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise LabCheckFailed(f"{where}: combine must return one output per row this rank sent, {tuple(want.shape)}, "
                             f"got {shape}")
    if not torch.equal(got, want):
        bad = int((got != want).any(1).nonzero()[0])
        came = _origin(_expert_fn(got[bad:bad + 1])[0])  # the expert function is its own inverse
        raise LabCheckFailed(f"{where}: combine's row {bad} holds the output of {came}, where the output of "
                             f"{_origin(rows[bad])} belongs: every output goes back to the rank its row came from, "
                             "in the order the rows left")


def _data_case(dispatch: Callable, combine: Callable, case: str) -> None:
    rank = comm.group_rank()
    where = {"even": "even routing (2 rows from every rank to every expert)",
             "uneven": "uneven routing (an expert nobody chose, rank 2 sending nothing to rank 1, rank 3 with no "
                       "rows)"}[case]
    rows, counts = _rows(case, rank), _counts(case, rank)
    got = _call(dispatch, (rows.clone(), counts.clone()), "dispatch", where)
    _check_dispatch(got, rows, counts, _expected_received(case, rank), where)
    received, incoming = got
    back = _call(combine, (_expert_fn(received), incoming.clone(), counts.clone()), "combine", where)
    _check_combine(back, rows, where)


# -- case 3: a MoE layer --------------------------------------------------------------------------------------------

LAYER_CASE = "a MoE layer (top-2 of 8 experts, no capacity limit), forward and backward"


def _layer() -> torch.nn.Module:
    from workbench.models.moe import MoEConfig, MoEMLP

    with torch.random.fork_rng(devices=[]):  # the same weights on every process; the caller's RNG untouched
        torch.manual_seed(15)
        return MoEMLP(D_MODEL, HIDDEN, MoEConfig(EXPERTS, top_k=2, capacity_factor=None))


def _layer_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's tokens and the loss's fixed probe, [WORLD, sequences, tokens, d]."""
    g = torch.Generator(device="cpu").manual_seed(151)
    x = torch.randn(WORLD, *TOKENS, D_MODEL, generator=g, device="cpu")
    return x, torch.randn(WORLD, *TOKENS, D_MODEL, generator=g, device="cpu")


class _Dispatch(torch.autograd.Function):
    """The learner's dispatch; its gradient goes back by the learner's combine (the same journey reversed)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, counts: torch.Tensor, pair: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        got = _call(pair[0], (rows.detach().clone(), counts.clone()), "dispatch", LAYER_CASE)
        if not (isinstance(got, tuple | list) and len(got) == 2):
            raise LabCheckFailed(f"{LAYER_CASE}: dispatch must return a pair (received, incoming)")
        ctx.pair, ctx.counts, ctx.incoming = pair, counts, got[1]
        ctx.mark_non_differentiable(got[1])
        return got[0], got[1]

    @staticmethod
    def backward(ctx, grad_received: torch.Tensor, _: Any) -> tuple:
        grad = _call(ctx.pair[1], (grad_received.contiguous(), ctx.incoming.clone(), ctx.counts.clone()),
                     "combine (run as dispatch's gradient)", LAYER_CASE)
        return grad, None, None


class _Combine(torch.autograd.Function):
    """The learner's combine; its gradient goes out by the learner's dispatch (the counts exchanged again)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, incoming: torch.Tensor, counts: torch.Tensor, pair: tuple) -> torch.Tensor:
        ctx.pair, ctx.counts = pair, counts
        return _call(pair[1], (out.detach().clone(), incoming.clone(), counts.clone()), "combine", LAYER_CASE)

    @staticmethod
    def backward(ctx, grad_back: torch.Tensor) -> tuple:
        got = _call(ctx.pair[0], (grad_back.contiguous(), ctx.counts.clone()), "dispatch (run as combine's gradient)",
                    LAYER_CASE)
        return got[0], None, None, None


def _learner_runner(pair: tuple) -> Callable:
    from workbench.parallel.expert import run_local_experts

    def run(rows: torch.Tensor, counts: torch.Tensor, experts: torch.nn.ModuleDict) -> torch.Tensor:
        received, incoming = _Dispatch.apply(rows, counts, pair)
        return _Combine.apply(run_local_experts(received, incoming, experts), incoming, counts, pair)
    return run


def _layer_case(dispatch: Callable, combine: Callable) -> dict[str, Any]:
    rank = comm.group_rank()
    layer = _layer()
    for key in list(layer.experts):  # keep this rank's block of experts, as apply_expert_parallel does
        if int(key) not in local_experts(EXPERTS, WORLD, rank):
            del layer.experts[key]
    layer.run_experts = _learner_runner((dispatch, combine))
    x, probe = _layer_inputs()
    x = x[rank].clone().requires_grad_()
    out = layer(x)
    (out * probe[rank]).sum().backward()
    return {"out": out.detach(), "dx": x.grad, "experts": {n: p.grad for n, p in layer.experts.named_parameters()}}


def _reference() -> dict[str, Any]:
    """One process holding all 8 experts, on the four ranks' tokens in rank order."""
    layer, (x, probe) = _layer(), _layer_inputs()
    b, t = TOKENS
    x = x.reshape(WORLD * b, t, D_MODEL).requires_grad_()
    out = layer(x)
    (out * probe.reshape(WORLD * b, t, D_MODEL)).sum().backward()
    return {"out": out.detach().view(WORLD, b, t, D_MODEL), "dx": x.grad.view(WORLD, b, t, D_MODEL),
            "experts": {n: p.grad for n, p in layer.experts.named_parameters()}}


def _compare_layer(results: list[dict[str, Any]]) -> float:
    """The largest difference from one process in rounding units; raises naming the first quantity off."""
    want = _reference()
    grad_scale = max(g.abs().max().item() for g in want["experts"].values())
    worst = 0.0
    for rank, got in enumerate(results):
        checks = [("the layer's output", got["out"], want["out"][rank], None),
                  ("the gradient of its input", got["dx"], want["dx"][rank], None)]
        checks += [(f"the gradient of expert parameter {n}", g, want["experts"][n], grad_scale)
                   for n, g in got["experts"].items()]
        for what, g, w, scale in checks:
            units = rounding_error(g, w, scale)
            if units > ROUNDING_UNITS:
                raise LabCheckFailed(f"{LAYER_CASE}: on rank {rank}, {what} differs from one process holding every "
                                     f"expert by {units:.3g} rounding units (allowed {ROUNDING_UNITS}). Cases 1 and 2 "
                                     "passed, so look at what differs here: rows of width 8 that carry gradients, and "
                                     "your functions called again in backward with the gradients")
            worst = max(worst, units)
    return worst


def _rank_cases(dispatch: Callable, combine: Callable) -> dict[str, Any]:
    _data_case(dispatch, combine, "even")
    _data_case(dispatch, combine, "uneven")
    return _layer_case(dispatch, combine)


def _on_ranks(dispatch: Callable, combine: Callable, timeout: float) -> list[dict[str, Any]]:
    from workbench import RankError
    from workbench.dist.launch import launch

    try:
        return launch(_rank_cases, WORLD, dispatch, combine, device="cpu", timeout=timeout)
    except RankError as error:
        message = error.message.removeprefix("LabCheckFailed: ")
        raise LabCheckFailed(f"on rank {error.rank} of {WORLD}: {message}") from None


def check(dispatch: Callable[..., Any], combine: Callable[..., Any], timeout: float = TIMEOUT) -> None:
    """Check ``dispatch(rows, counts, group=None)`` and ``combine(out, incoming, counts, group=None)`` on 4 gloo
    ranks; print a success message or raise ``LabCheckFailed`` naming the mistake."""
    try:
        if not (callable(dispatch) and callable(combine)):
            raise LabCheckFailed("pass your two functions themselves: check(dispatch, combine)")
        worst = _compare_layer(_on_ranks(dispatch, combine, timeout))
    except LabCheckFailed as error:
        raise LabCheckFailed(f"{error}{MORE}") from None
    print(f"Correct: on {WORLD} gloo ranks with {EXPERTS} experts, every row reached its expert's rank source-major "
          f"with the right counts and came back in the order it left, under even and uneven routing (an expert "
          f"nobody chose, a rank with nothing to send); and as a MoE layer's expert runner, forward and backward, "
          f"your pair equals one process holding every expert within {worst:.2g} rounding units (allowed "
          f"{ROUNDING_UNITS}).")


__all__ = ["HINTS", "all_to_all", "check", "group_rank", "group_size", "hint", "local_experts"]
