"""Lab 07: Megatron's f and g, and a column- then row-parallel MLP, checked on real ranks.

Shoeybi et al. 2019, "Megatron-LM", §3: the MLP Z = GeLU(X A) B is split across the tp ranks of a group
so that no rank holds A or B whole, and the whole block needs one all-reduce in forward and one in
backward. The learner writes four pieces:

* ``f``, an autograd Function whose forward is the identity and whose backward all-reduces the gradient;
* ``g``, its conjugate: all-reduce in forward, identity in backward;
* a column-parallel and a row-parallel layer (subclasses of ``TensorParallelLinear``), each a ``shard``
  that cuts this rank's share out of a full ``nn.Linear``'s weight and bias, and a ``forward``.

``check(f, g, column_cls, row_cls)`` runs them on 2 real gloo ranks: f and g alone (so a mistake in one is
named as such), then ``row(gelu(column(x)))`` built from the tiny GPT's own seeded MLP, against the
single-process MLP: output, input gradient and the full weights' gradients, and the communication log
(exactly one all-reduce in forward and one in backward). Every failure is a ``LabCheckFailed`` whose
message points at the likely mistake; ``hint(1)``, ``hint(2)``, ``hint(3)`` say more, tier by tier.

Tolerance: fp32 throughout. The split matmuls and the all-reduce may add the same products in another order
than one process (and another SIMD width, ``ATEN_CPU_CAPABILITY=avx512`` against avx2, orders a matmul's sums
differently again), so results agree to float32 rounding at the scale of each tensor: within
``ROUNDING_UNITS`` × eps(fp32) × max|reference| (``workbench.labs.rounding_error``). Measured with the reference
solution on 2 gloo CPU ranks under ATEN_CPU_CAPABILITY=default and avx2: at most 0.8 units (the output; the
gradients agreed exactly). Every mistake the checker names is off by ~10⁶ units or more (a bias counted twice
is 8e6, a partial sum, a factor tp).
"""

from __future__ import annotations

import math
import sys
import traceback
from typing import Any

import torch
from torch import nn

from workbench.dist import comm
from workbench.labs import LabCheckFailed, rounding_error, show_hint, within_rounding

WORLD_SIZE = 2
BATCH, SEQ = 2, 8  # X is [BATCH, SEQ, d_model] on every rank
ROUNDING_UNITS = 64  # see the module docstring: 0.8 measured, mistakes >= 1e6
TIMEOUT = 60.0
MORE = " (more help: hint(1), hint(2), hint(3))"

HINTS = {
    1: "Start from the invariant. X [b, s, h] is whole on every rank. GeLU acts on each feature alone, so if "
       "every rank computes SOME of fc's output features (its own block), it can apply GeLU to them with no "
       "communication. proj then needs only the inputs that rank has; its products are partial sums over the "
       "features, and the full output is their sum over ranks. Backward mirrors it: each rank's dL/dX is a "
       "partial sum too, because X's gradient flows back through that rank's features only. So one collective "
       "forward (after proj) and one backward (before fc): that is g and f.",
    2: "nn.Linear stores weight as [out_features, in_features] and computes x @ weight.T + bias. Column-parallel "
       "(fc): rank r keeps the r-th contiguous block of the OUTPUT features, rows of weight (dim 0) and the same "
       "block of the bias. Row-parallel (proj): rank r keeps the r-th block of the INPUT features, columns of "
       "weight (dim 1), and the whole bias, added once after the sum (added on every rank before it, it would "
       "be counted tp times). f: forward returns x unchanged, backward all-reduces (sums) the gradient. g: "
       "forward all-reduces (sums), backward returns the gradient unchanged. A backward returns one value per "
       "input of forward: (grad, None), None for the group. Use workbench.comm.all_reduce so the checker can "
       "count the collectives.",
    3: "f.forward(ctx, x, group): ctx.group = group; return x.view_as(x)\n"
       "f.backward(ctx, grad): grad = grad.clone(); comm.all_reduce(grad, group=ctx.group); return grad, None\n"
       "g.forward(ctx, x, group): out = x.clone(); comm.all_reduce(out, group=group); return out\n"
       "g.backward(ctx, grad): return grad, None\n"
       "column.shard(weight, bias, tp_size, tp_rank): n = weight.shape[0] // tp_size; "
       "rows = slice(tp_rank * n, (tp_rank + 1) * n); return weight[rows], bias[rows]\n"
       "column.forward(x): return F.linear(f.apply(x, self.group), self.weight, self.bias)\n"
       "row.shard(weight, bias, tp_size, tp_rank): n = weight.shape[1] // tp_size; "
       "return weight[:, tp_rank * n:(tp_rank + 1) * n], bias\n"
       "row.forward(y): return g.apply(F.linear(y, self.weight), self.group) + self.bias",
}


def hint(level: int = 1) -> str:
    """Print (and return) hint ``level`` (1: the idea, 2: which dims and which direction, 3: nearly the code)."""
    return show_hint(HINTS, level)


# ---------------------------------------------------------------------------------------------------------
# The scaffold the learner's layers subclass.


class TensorParallelLinear(nn.Module):
    """This rank's share of an ``nn.Linear``: ``weight`` and ``bias`` (Parameters, possibly slices) and the tp
    group (``self.group``, ``self.tp_size``, ``self.tp_rank``).

    ``from_linear(linear, group)`` builds one from a full, seeded ``nn.Linear`` by calling the subclass's
    ``shard``, so tp ranks start exactly where one process does. Subclasses write ``shard`` and ``forward``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.group = group
        self.tp_size, self.tp_rank = comm.group_size(group), comm.group_rank(group)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any = None) -> TensorParallelLinear:
        """This rank's share of ``linear`` (copies: the full layer is left as it was)."""
        bias = None if linear.bias is None else linear.bias.detach()
        weight, bias = _call_shard(cls, linear.weight.detach(), bias, comm.group_size(group),
                                   comm.group_rank(group))
        return cls(weight.detach().clone(), None if bias is None else bias.detach().clone(), group)

    @staticmethod
    def shard(weight: torch.Tensor, bias: torch.Tensor | None, tp_size: int,
              tp_rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The full layer's weight [out, in] and bias [out] -> this rank's (weight, bias)."""
        raise NotImplementedError("shard(weight, bias, tp_size, tp_rank) must return this rank's (weight, bias)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("forward(x) must compute this rank's part of the layer")


def _call_shard(cls: type, weight: torch.Tensor, bias: torch.Tensor | None, size: int,
                rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    out = cls.shard(weight, bias, size, rank)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)
            and (out[1] is None or isinstance(out[1], torch.Tensor))):
        raise LabCheckFailed(f"{cls.__name__}.shard returned {type(out).__name__}: return a pair (weight, bias) "
                             "of tensors (bias None only when the full layer has none)" + MORE)
    return out


# ---------------------------------------------------------------------------------------------------------
# The layers under test: the tiny GPT's first MLP, and its input.


def _full_mlp(device: torch.device) -> nn.Module:
    """The tiny GPT's first MLP (fc [4h, h], proj [h, 4h], tanh GeLU), seeded. GPT-2 starts its biases at zero,
    which would hide a bias added tp times or left unsliced, so they are redrawn (seeded, N(0, 0.1²))."""
    from workbench.models import GPTConfig, build_gpt

    mlp = build_gpt(GPTConfig.preset("tiny"), seed=0, device=device).blocks[0].mlp
    with torch.no_grad():
        for seed, linear in enumerate((mlp.fc, mlp.proj), start=10):
            linear.bias.copy_(0.1 * _seeded(tuple(linear.bias.shape), seed, device))
    return mlp


def _seeded(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator(device=device).manual_seed(seed), device=device)


def _inputs(d_model: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """X [b, s, h] and the probe P that the loss sum(Z * P) weighs the output with (the same on every rank)."""
    return _seeded((BATCH, SEQ, d_model), 1, device), _seeded((BATCH, SEQ, d_model), 2, device)


# ---------------------------------------------------------------------------------------------------------
# What runs on each rank. Each stage catches its own error, so a mistake in f is reported as f's even when
# the layers fail too; every rank runs the same code, so all ranks fail at the same collective.


def _ops(log: list, start: int, stop: int | None = None) -> list[str]:
    return [c.op for c in log[start:stop]]


def _stage(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 -- reported to the caller, which explains it
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def _run_f(f: Any, rank: int) -> dict[str, Any]:
    from workbench import trace
    from workbench.dist.launch import rank_device

    log = trace.current().trace.comms
    x, probe = _inputs(8, rank_device())
    a = x.clone().requires_grad_()
    start = len(log)
    y = f.apply(a, None)
    middle = len(log)
    (y * probe * (rank + 1)).sum().backward()  # each rank's gradient differs: f's backward must sum them
    return {"out": y.detach().clone(), "grad": None if a.grad is None else a.grad.clone(),
            "forward": _ops(log, start, middle), "backward": _ops(log, middle)}


def _run_g(g: Any, rank: int) -> dict[str, Any]:
    from workbench import trace
    from workbench.dist.launch import rank_device

    log = trace.current().trace.comms
    x, probe = _inputs(8, rank_device())
    base = x.clone().requires_grad_()
    partial = base * (rank + 1)  # a different partial result on each rank
    start = len(log)
    z = g.apply(partial, None)
    middle = len(log)
    (z * probe).sum().backward()  # dL/dZ = probe, the same on every rank
    return {"out": z.detach().clone(), "grad": None if base.grad is None else base.grad.clone(),
            "forward": _ops(log, start, middle), "backward": _ops(log, middle)}


def _grad(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None or p.grad is None else p.grad.detach().clone()


def _run_mlp(column_cls: type, row_cls: type) -> dict[str, Any]:
    from workbench import trace
    from workbench.dist.launch import rank_device

    log = trace.current().trace.comms
    mlp = _full_mlp(rank_device())
    column, row = column_cls.from_linear(mlp.fc, None), row_cls.from_linear(mlp.proj, None)
    x, probe = _inputs(mlp.fc.in_features, rank_device())
    x = x.requires_grad_()
    start = len(log)
    z = row(mlp.act(column(x)))
    middle = len(log)
    (z * probe).sum().backward()
    return {"out": z.detach().clone(), "x_grad": _grad(x), "forward": _ops(log, start, middle),
            "backward": _ops(log, middle), "nbytes": [c.nbytes for c in log[start:]],
            "column_weight_grad": _grad(column.weight), "column_bias_grad": _grad(column.bias),
            "row_weight_grad": _grad(row.weight), "row_bias_grad": _grad(row.bias)}


def _rank_run(f: Any, g: Any, column_cls: type, row_cls: type) -> dict[str, Any]:
    torch.set_num_threads(1)
    rank = comm.group_rank()
    return {"f": _stage(_run_f, f, rank), "g": _stage(_run_g, g, rank), "mlp": _stage(_run_mlp, column_cls, row_cls)}


# ---------------------------------------------------------------------------------------------------------
# The single-process reference.


def _reference() -> dict[str, Any]:
    device = torch.device("cpu")
    mlp = _full_mlp(device)
    x, probe = _inputs(mlp.fc.in_features, device)
    x = x.requires_grad_()
    hidden = mlp.act(mlp.fc(x))  # [b, s, 4h]
    z = mlp.proj(hidden)
    (z * probe).sum().backward()
    return {"mlp": mlp, "x": x.detach(), "out": z.detach(), "hidden": hidden.detach(), "x_grad": x.grad,
            "fc_weight_grad": mlp.fc.weight.grad, "fc_bias_grad": mlp.fc.bias.grad,
            "proj_weight_grad": mlp.proj.weight.grad, "proj_bias_grad": mlp.proj.bias.grad}


# ---------------------------------------------------------------------------------------------------------
# Explaining what went wrong.


def _close(got: Any, want: torch.Tensor) -> bool:
    return isinstance(got, torch.Tensor) and within_rounding(got, want, ROUNDING_UNITS)


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} instead of {tuple(want.shape)}"
    return (f"max difference {(got - want).abs().max().item():.2e}, {rounding_error(got, want):.3g} × eps × the "
            f"largest value, where float32 rounding stays within {ROUNDING_UNITS}")


def _explain_error(where: str, stage: dict[str, Any], rank: int = 0) -> LabCheckFailed:
    text = stage["error"]
    if text.startswith("LabCheckFailed: "):
        return LabCheckFailed(text.removeprefix("LabCheckFailed: "))
    if text.startswith("NotImplementedError"):
        detail = text.partition(":")[2].strip()
        return LabCheckFailed(f"{where} is still the stub" + (f": {detail}" if detail else "") + MORE)
    if "incorrect number of gradients" in text:
        return LabCheckFailed(f"{where}: backward must return one value per input of forward (x and group): "
                              f"`return grad, None`, None for the group ({text})" + MORE)
    if "shapes cannot be multiplied" in text or "size of tensor" in text:
        return LabCheckFailed(f"{where}: the shapes do not fit ({text}). Check which dim of nn.Linear's "
                              "[out, in] weight each layer splits, and that the bias matches" + MORE)
    last = stage.get("traceback", "").rstrip().splitlines()[-3:]
    return LabCheckFailed(f"{where} raised on rank {rank}: {text}\n" + "\n".join(last) + MORE)


def _check_ops(where: str, ops: list[str], want: list[str], what: str) -> None:
    if ops == want:
        return
    if not ops and want:
        raise LabCheckFailed(f"{where}: the communication log shows no collective, but {what}. Use "
                             "workbench.comm.all_reduce (torch.distributed's own is not logged, so it cannot "
                             "be counted)" + MORE)
    raise LabCheckFailed(f"{where} ran {ops or 'no collective'}; it should run {want or 'nothing'}: {what}" + MORE)


def _check_f(results: list[dict[str, Any]], name: str) -> None:
    total = sum(range(1, len(results) + 1))  # rank r's loss weighs f's output by (r + 1)
    for rank, r in enumerate(results):
        got = r["f"]
        if "error" in got:
            raise _explain_error(f"f ({name})", got, rank)
        x, probe = _inputs(8, torch.device("cpu"))
        if _close(got["out"], x * len(results)):
            raise LabCheckFailed("f's forward all-reduced X: X is already whole on every rank, so f's forward is "
                                 "the identity (the sum over ranks made it tp·X)" + MORE)
        if not _close(got["out"], x):
            raise LabCheckFailed(f"f's forward must return its input unchanged ({_max_diff(got['out'], x)})" + MORE)
        grad = got["grad"]
        if grad is None:
            raise LabCheckFailed("f's backward returned no gradient for x: return (the all-reduced gradient, "
                                 "None)" + MORE)
        if _close(grad, probe * (rank + 1)):
            raise LabCheckFailed("f's backward returns this rank's gradient as it came: that is a partial sum "
                                 "(each rank's dL/dX flows through its own columns only). All-reduce (sum) it, so "
                                 "every rank gets the full dL/dX" + MORE)
        if _close(grad, probe * total / len(results)):
            raise LabCheckFailed("f's backward averaged the gradients: the full dL/dX is the SUM of the ranks' "
                                 "partial gradients (op='sum', the default), not their mean" + MORE)
        if not _close(grad, probe * total):
            raise LabCheckFailed("f's backward gave the wrong gradient: it must be the sum over ranks of the "
                                 f"incoming gradients ({_max_diff(grad, probe * total)})" + MORE)
        _check_ops("f's forward", got["forward"], [], "f moves nothing in forward")
        _check_ops("f's backward", got["backward"], ["all_reduce"], "one all-reduce of the gradient")


def _check_g(results: list[dict[str, Any]], name: str) -> None:
    world = len(results)
    total = sum(range(1, world + 1))  # rank r's partial result is X·(r + 1)
    for rank, r in enumerate(results):
        got = r["g"]
        if "error" in got:
            raise _explain_error(f"g ({name})", got, rank)
        x, probe = _inputs(8, torch.device("cpu"))
        if _close(got["out"], x * (rank + 1)):
            raise LabCheckFailed("g's forward returned this rank's partial result unchanged: it must all-reduce "
                                 "(sum) the partial results, so every rank holds the full output" + MORE)
        if _close(got["out"], x * total / world):
            raise LabCheckFailed("g's forward averaged: the output is the SUM of the ranks' partial results "
                                 "(op='sum'), not their mean" + MORE)
        if not _close(got["out"], x * total):
            raise LabCheckFailed(f"g's forward must return the sum over ranks of its input "
                                 f"({_max_diff(got['out'], x * total)})" + MORE)
        want = probe * (rank + 1)
        if got["grad"] is None:
            raise LabCheckFailed("g's backward returned no gradient for x: return (grad, None)" + MORE)
        if _close(got["grad"], want * world):
            raise LabCheckFailed("g's backward all-reduced too (all-reducing in both directions): the incoming "
                                 "dL/dZ is already the same, full gradient on every rank, so summing it makes "
                                 "it tp× too large. g's backward is the identity" + MORE)
        if not _close(got["grad"], want):
            raise LabCheckFailed("g's backward must pass the gradient through unchanged "
                                 f"({_max_diff(got['grad'], want)})" + MORE)
        _check_ops("g's forward", got["forward"], ["all_reduce"], "one all-reduce of the partial results")
        _check_ops("g's backward", got["backward"], [], "g moves nothing in backward")


def _check_shards(column_cls: type, row_cls: type, mlp: nn.Module, world: int) -> None:
    """Each rank's slices, checked here in one process: which dim, which block, the biases (bit for bit: a
    shard is a copy of part of the full tensor, no arithmetic)."""
    fc_w, fc_b = mlp.fc.weight.detach(), mlp.fc.bias.detach()  # [4h, h], [4h]
    proj_w, proj_b = mlp.proj.weight.detach(), mlp.proj.bias.detach()  # [h, 4h], [h]
    for rank in range(world):
        rows = slice(rank * fc_w.shape[0] // world, (rank + 1) * fc_w.shape[0] // world)
        cols = slice(rank * proj_w.shape[1] // world, (rank + 1) * proj_w.shape[1] // world)
        try:
            column = _call_shard(column_cls, fc_w, fc_b, world, rank)
            row = _call_shard(row_cls, proj_w, proj_b, world, rank)
        except LabCheckFailed:
            raise
        except NotImplementedError as e:
            raise LabCheckFailed(f"shard is still the stub: {e}" + MORE) from None
        except Exception as e:  # noqa: BLE001 -- the learner's code, explained
            raise LabCheckFailed(f"shard raised for tp_rank={rank}: {type(e).__name__}: {e}" + MORE) from None
        _check_column_shard(column, fc_w, fc_b, rows, rank, world, f"{column_cls.__name__}.shard (tp_rank={rank})")
        _check_row_shard(row, proj_w, proj_b, cols, rank, world, f"{row_cls.__name__}.shard (tp_rank={rank})")


def _which_block(got: torch.Tensor, full: torch.Tensor, dim: int, world: int) -> int | None:
    blocks = full.chunk(world, dim=dim)
    return next((i for i, b in enumerate(blocks) if b.shape == got.shape and torch.equal(b, got)), None)


def _check_column_shard(shard: tuple, w: torch.Tensor, b: torch.Tensor, rows: slice, rank: int, world: int,
                        where: str) -> None:
    weight, bias = shard
    want = (w.shape[0] // world, w.shape[1])
    if tuple(weight.shape) == (w.shape[0], w.shape[1] // world):
        raise LabCheckFailed(f"{where} split fc's weight along the wrong dim: got {tuple(weight.shape)}, want "
                             f"{want}. A column-parallel layer keeps a block of the OUTPUT features, which are "
                             "the rows (dim 0) of nn.Linear's [out, in] weight" + MORE)
    if tuple(weight.shape) != want:
        raise LabCheckFailed(f"{where}: weight has shape {tuple(weight.shape)}, want {want} (1/tp of the output "
                             "features, all the input features)" + MORE)
    if not torch.equal(weight, w[rows]):
        other = _which_block(weight, w, 0, world)
        if other is not None:
            raise LabCheckFailed(f"{where} returned block {other} of the output features; rank {rank} owns block "
                                 f"{rank} (tp_rank·out/tp to (tp_rank+1)·out/tp)" + MORE)
        raise LabCheckFailed(f"{where}: weight is not rows [{rows.start}, {rows.stop}) of the full weight: rank "
                             f"{rank} owns the {rank}-th contiguous block of output features" + MORE)
    if bias is None or tuple(bias.shape) == tuple(b.shape):
        raise LabCheckFailed(f"{where}: the bias must be sliced like the output features, shape "
                             f"({w.shape[0] // world},): each rank adds the bias of the features it computes "
                             f"(got {None if bias is None else tuple(bias.shape)})" + MORE)
    if not torch.equal(bias, b[rows]):
        raise LabCheckFailed(f"{where}: the bias slice must be the same block as the weight's rows, "
                             f"[{rows.start}, {rows.stop})" + MORE)


def _check_row_shard(shard: tuple, w: torch.Tensor, b: torch.Tensor, cols: slice, rank: int, world: int,
                     where: str) -> None:
    weight, bias = shard
    want = (w.shape[0], w.shape[1] // world)
    if tuple(weight.shape) == (w.shape[0] // world, w.shape[1]):
        raise LabCheckFailed(f"{where} sliced the row-parallel weight along the wrong dim: got "
                             f"{tuple(weight.shape)}, want {want}. A row-parallel layer keeps a block of the INPUT "
                             "features (the ones the column layer left on this rank), which are the columns "
                             "(dim 1) of nn.Linear's [out, in] weight" + MORE)
    if tuple(weight.shape) != want:
        raise LabCheckFailed(f"{where}: weight has shape {tuple(weight.shape)}, want {want} (all the output "
                             "features, 1/tp of the input features)" + MORE)
    if not torch.equal(weight, w[:, cols]):
        other = _which_block(weight, w, 1, world)
        if other is not None:
            raise LabCheckFailed(f"{where} returned block {other} of the input features; rank {rank} owns block "
                                 f"{rank}, the features its column layer computed" + MORE)
        raise LabCheckFailed(f"{where}: weight is not columns [{cols.start}, {cols.stop}) of the full weight" + MORE)
    if bias is None or tuple(bias.shape) != tuple(b.shape) or not torch.equal(bias, b):
        raise LabCheckFailed(f"{where}: the row layer's bias stays whole, shape {tuple(b.shape)} (got "
                             f"{None if bias is None else tuple(bias.shape)}): the output features are not "
                             "split, and the bias is added once, after the sum over ranks" + MORE)


def _gathered(results: list[dict], key: str, dim: int) -> torch.Tensor | None:
    parts = [r["mlp"][key] for r in results]
    return None if any(p is None for p in parts) else torch.cat(parts, dim=dim)


def _check_mlp_forward(results: list[dict], ref: dict[str, Any]) -> None:
    world, want, bias = len(results), ref["out"], ref["mlp"].proj.bias.detach()
    hidden, proj_w = ref["mlp"].fc.out_features, ref["mlp"].proj.weight.detach()
    for rank, r in enumerate(results):
        got = r["mlp"]["out"]
        if _close(got, want):
            continue
        block = slice(rank * hidden // world, (rank + 1) * hidden // world)
        partial = ref["hidden"][..., block] @ proj_w[:, block].T  # Y_r B_r, this rank's partial product
        if _close(got, want + (world - 1) * bias):
            raise LabCheckFailed("the output is off by (tp−1)·bias: the row layer adds its bias before the "
                                 "all-reduce, so the bias is counted tp times. Add it once, after g" + MORE)
        if _close(got, partial + bias) or _close(got, partial):
            raise LabCheckFailed(f"rank {rank}'s output is its own partial sum Y_r·B_r: the row layer must sum the "
                                 "partial products over ranks with g (an all-reduce in forward)" + MORE)
        if _close(got, (want - bias) / world + bias):
            raise LabCheckFailed("the output is the mean of the partial products: g must SUM them (op='sum')" + MORE)
        if _close(got, want - bias):
            raise LabCheckFailed("the output lacks the row layer's bias: add it (once, after g)" + MORE)
        raise LabCheckFailed(f"row(gelu(column(x))) on rank {rank} differs from the single-process MLP "
                             f"({_max_diff(got, want)})" + MORE)
    _check_ops("the MLP's forward", results[0]["mlp"]["forward"], ["all_reduce"],
               "exactly one all-reduce per MLP (g after the row layer); f is free in forward, and nothing is "
               "needed between the layers since GeLU acts on each feature alone")


def _check_mlp_backward(results: list[dict], ref: dict[str, Any]) -> None:
    world = len(results)
    grads = [r["mlp"]["x_grad"] for r in results]
    if any(g is None for g in grads):
        raise LabCheckFailed("x got no gradient: the column layer's forward must use x (through f)" + MORE)
    want = ref["x_grad"]
    if not all(_close(g, want) for g in grads):
        if _close(sum(grads), want):
            raise LabCheckFailed("the input gradient is a partial sum on each rank (the ranks' gradients add up "
                                 "to the right one): the column layer must pass x through f, whose backward "
                                 "all-reduces dL/dX" + MORE)
        if all(_close(g, want * world) for g in grads):
            raise LabCheckFailed("the input gradient is tp× too large: it was all-reduced twice (in both "
                                 "directions?). Only f's backward sums; g's backward is the identity" + MORE)
        raise LabCheckFailed(f"x.grad differs from the single-process gradient ({_max_diff(grads[0], want)})" + MORE)
    pairs = {"fc.weight": (_gathered(results, "column_weight_grad", 0), ref["fc_weight_grad"]),
             "fc.bias": (_gathered(results, "column_bias_grad", 0), ref["fc_bias_grad"]),
             "proj.weight": (_gathered(results, "row_weight_grad", 1), ref["proj_weight_grad"])}
    for name, (got, full) in pairs.items():
        if got is None:
            raise LabCheckFailed(f"{name}'s slices got no gradient: use self.weight and self.bias in forward" + MORE)
        if _close(got, full * world):
            raise LabCheckFailed(f"the gradient of {name} is tp× too large: g's backward must not all-reduce "
                                 "(dL/dZ is already whole on every rank)" + MORE)
        if not _close(got, full):
            raise LabCheckFailed(f"the gradient of {name}, gathered from the ranks' slices, differs from the "
                                 f"single-process one ({_max_diff(got, full)})" + MORE)
    for rank, r in enumerate(results):
        got, full = r["mlp"]["row_bias_grad"], ref["proj_bias_grad"]
        if got is None or not _close(got, full):
            raise LabCheckFailed(f"proj.bias's gradient on rank {rank} should equal the single-process one (the "
                                 "bias is added once, after g, to the full output)" + MORE)
    _check_ops("the MLP's backward", results[0]["mlp"]["backward"], ["all_reduce"],
               "exactly one all-reduce per MLP (f's, summing dL/dX before the column layer); g's backward is free")


def _check_classes(f: Any, g: Any, column_cls: Any, row_cls: Any) -> None:
    for name, fn in (("f", f), ("g", g)):
        if not (isinstance(fn, type) and issubclass(fn, torch.autograd.Function)):
            raise LabCheckFailed(f"check() wants {name} as a torch.autograd.Function subclass (the class, not "
                                 f".apply), got {fn!r}")
    for name, cls in (("column_cls", column_cls), ("row_cls", row_cls)):
        if not (isinstance(cls, type) and issubclass(cls, TensorParallelLinear)):
            raise LabCheckFailed(f"check() wants {name} as a subclass of TensorParallelLinear, got {cls!r}")


def _ship_by_value(*objects: Any) -> None:
    """Classes from a module the ranks may not import (labs/solutions/..., a script) travel by value, as a
    notebook cell's do; the workbench package is importable everywhere."""
    import cloudpickle

    for obj in objects:
        module = sys.modules.get(getattr(obj, "__module__", ""))
        if module is not None and module.__name__ != "__main__" and not module.__name__.startswith("workbench"):
            cloudpickle.register_pickle_by_value(module)


def check(f: Any, g: Any, column_cls: Any, row_cls: Any) -> None:
    """Run f, g and ``row(gelu(column(x)))`` on 2 ranks; raise ``LabCheckFailed`` naming the mistake, or print
    what works."""
    from workbench.dist.launch import RankError, launch

    _check_classes(f, g, column_cls, row_cls)
    _ship_by_value(f, g, column_cls, row_cls)
    try:
        results = launch(_rank_run, WORLD_SIZE, f, g, column_cls, row_cls, device="cpu", timeout=TIMEOUT)
    except RankError as e:
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise LabCheckFailed("a collective timed out: every rank must call the same all-reduces in the same "
                                 "order (no `if rank == ...` around a collective)" + MORE) from None
        raise LabCheckFailed(f"your code raised on a rank:\n{e}" + MORE) from None
    _check_f(results, f.__name__)
    _check_g(results, g.__name__)
    ref = _reference()
    _check_shards(column_cls, row_cls, ref["mlp"], WORLD_SIZE)
    for rank, r in enumerate(results):
        if "error" in r["mlp"]:
            raise _explain_error("row(gelu(column(x)))", r["mlp"], rank)
    _check_mlp_forward(results, ref)
    _check_mlp_backward(results, ref)
    nbytes = results[0]["mlp"]["nbytes"]
    x = ref["x"]
    print(f"✓ on {WORLD_SIZE} ranks, row(gelu(column(x))) equals the single-process MLP "
          f"({ref['mlp'].fc.in_features}→{ref['mlp'].fc.out_features}→{ref['mlp'].proj.out_features}) in forward, "
          f"in x.grad and in the gradients of the full fc/proj weights (to float32 rounding: within "
          f"{ROUNDING_UNITS} × eps × each tensor's largest value); the log shows 1 all-reduce forward and 1 "
          f"backward, each of "
          f"{nbytes[0]:,} bytes = b·s·h·4 = {math.prod(x.shape) * 4:,}.")


__all__ = ["HINTS", "ROUNDING_UNITS", "TensorParallelLinear", "WORLD_SIZE", "check", "hint"]
