"""Tensor parallelism (Megatron-LM): every rank of the tp group holds a slice of each weight matrix.

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", §3. For the MLP Z = GeLU(X A) B, split A by *columns* and B by *rows*:

    X [b, s, h] ──f──► X A_i [b, s, 4h/tp] ──GeLU──► Y_i ──► Y_i B_i [b, s, h] ──g──► Σ_i Y_i B_i = Z

GeLU acts on each column alone, so no communication is needed between the two matmuls; the partial
products are summed once, by g. Attention is split the same way: q, k, v column-parallel (whole heads, H/tp
per rank; softmax is per head, so again no communication inside), the output projection row-parallel.

f and g are conjugate (§3, Fig. 3): f is the identity in forward and an all-reduce in backward (each rank
computes dL/dX through its own columns only: a partial sum), g an all-reduce in forward and the identity in
backward. Per block and step that is 2 all-reduces in forward and 2 in backward, each of b·s·h elements
(``workbench.theory.comm.tp_block_collectives``); tagged ``"tp"`` in the comm log.

Everything outside the split layers (LayerNorms, position embedding, the row layers' biases) is
replicated: because f makes dL/dX whole before it reaches them, every tp rank computes the same full
gradient for them, and identical AdamW steps keep the copies identical without any extra collective.

**The GPT's embedding, tied head and loss.** ``models/gpt.py`` ties ``lm_head.weight`` to ``wte.weight``
and computes ``F.cross_entropy`` on the full logits [b, s, V]. Here both ends become vocab-parallel
(Megatron §3, "input embedding" / "output embedding"): rank i owns vocabulary rows [i·V/tp, (i+1)·V/tp) of
the one shared matrix. The embedding looks up only the tokens it owns and g sums the rows (tag
``"tp_vocab"``); the head is a column-parallel linear over the vocabulary whose weight *is* the embedding's
shard (the tie survives, as one Parameter named ``wte.weight``), producing this rank's logits
[b, s, V/tp]. The model's loss cannot take a logit slice, so ``apply_tensor_parallel`` installs a forward on
the model instance (gpt.py is untouched): it calls the model's own forward without targets, then
``vocab_parallel_cross_entropy``, which all-reduces three numbers per token (max, target logit, sum of
exponentials; tag ``"tp_loss"``) and never gathers the b·s·V logits. Called without targets the
parallelized model returns this rank's vocab slice of the logits.

**The plan.** ``gpt_plan`` names a style per module (column / row / vocab_embedding / vocab_head, "copy_input"
for a column region's entry, "sequence" for the LayerNorms and the position embedding that TP leaves
replicated); ``apply_plan`` realises it with ``TensorParallelStyles``. Sequence parallelism
(``workbench.parallel.sequence``) is the same plan realised with ``SequenceParallelStyles``.

Parameters keep their names and hold this rank's shard; ``full_parameters``/``full_gradients`` gather them
(tag ``"tp_gather"``) into the unsplit tensors one process would hold. Each layer is cut from the full,
seeded layer (``ColumnParallelLinear.from_linear``...), so tp=N starts exactly where tp=1 does.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workbench import comm
from workbench.mesh import Mesh
from workbench.parallel.grad_norm import clip_by_shares_

TP_TAG = "tp"  # f and g inside the transformer blocks
VOCAB_TAG = "tp_vocab"  # g after the vocab-parallel embedding, f before the vocab-parallel head
LOSS_TAG = "tp_loss"  # the vocab-parallel cross-entropy's three per-token all-reduces
GATHER_TAG = "tp_gather"  # gathering shards into full tensors (checks, checkpoints): not part of a step

STYLES = ("copy_input", "column", "row", "vocab_embedding", "vocab_head", "sequence")


# ---------------------------------------------------------------------------------------------------------
# The tp group: a process group plus this rank's place in it.


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group, its size and this rank's index in it."""

    group: Any
    size: int
    rank: int


def tp_group_of(mesh_or_group: Any) -> TPGroup:
    """A ``Mesh`` (its tp axis), a process group (``None`` = the world) or a ``TPGroup``, as a ``TPGroup``.

    A mesh built without torch.distributed (planning a layout) still knows its tp size and index, which is
    what the divisibility checks and the slicing need."""
    if isinstance(mesh_or_group, TPGroup):
        return mesh_or_group
    if isinstance(mesh_or_group, Mesh):
        return TPGroup(mesh_or_group.tp_group, mesh_or_group.tp_size, mesh_or_group.tp_rank)
    return TPGroup(mesh_or_group, comm.group_size(mesh_or_group), comm.group_rank(mesh_or_group))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _owned_range(size: int, tp: TPGroup, what: str) -> slice:
    """This rank's contiguous 1/tp of ``size`` rows, or a ValueError naming the sizes that would work."""
    if size % tp.size:
        raise ValueError(f"tensor parallel: {what}={size} is not divisible by tp={tp.size}; "
                         f"valid tp values: {', '.join(map(str, _divisors(size)))}")
    local = size // tp.size
    return slice(tp.rank * local, (tp.rank + 1) * local)


# ---------------------------------------------------------------------------------------------------------
# Megatron's f and g (§3, Fig. 3).


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's f: identity in forward, all-reduce of the gradient in backward.

    Sits where a replicated activation X [b, s, h] enters column-parallel layers. Each rank's dL/dX [b, s, h]
    only flows through its own columns, a partial sum; the all-reduce makes it the full gradient, so the
    LayerNorm and residual stream before it see exactly what one process would."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, tag: str) -> torch.Tensor:
        ctx.group, ctx.tag = group, tag
        return x.view_as(x)  # a new autograd node over the same data: nothing moves in forward

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # Reduce a copy: autograd may hand the same gradient buffer to other branches (e.g. the residual).
        grad = grad.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(grad, group=ctx.group, tag=ctx.tag)
        return grad, None, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's g: all-reduce in forward, identity in backward.

    Sums the partial outputs Y_i B_i [b, s, h] of a row-parallel layer (or the masked lookups of a
    vocab-parallel embedding). The sum's gradient with respect to each term is the incoming gradient
    itself, already the same on every rank, so backward moves nothing."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, tag: str) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)  # never all-reduce an autograd input in place
        comm.all_reduce(out, group=group, tag=tag)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def copy_to_tp_region(x: torch.Tensor, group: Any, tag: str = TP_TAG) -> torch.Tensor:
    """f(x): identity forward, all-reduce backward over ``group``."""
    return CopyToTensorParallelRegion.apply(x, group, tag)


def reduce_from_tp_region(x: torch.Tensor, group: Any, tag: str = TP_TAG) -> torch.Tensor:
    """g(x): all-reduce forward over ``group``, identity backward."""
    return ReduceFromTensorParallelRegion.apply(x, group, tag)


# ---------------------------------------------------------------------------------------------------------
# The split layers. ``tp_shard_dims`` says which parameters are shards and along which dim (the rest are
# replicated); ``full_parameters`` reads it to gather.


def _parameter(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=like.requires_grad)


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i^T + b_i: this rank's out/tp output features (rows of nn.Linear's [out, in] weight).

    Input X [..., in] replicated; output [..., out/tp], this rank's slice (left split for a row-parallel
    layer to consume, or for attention to read as H/tp whole heads). With ``copy_input`` the layer applies
    f itself; layers that share one input (q, k, v) leave it to their parent so backward all-reduces once."""

    tp_shard_dims = {"weight": 0, "bias": 0}

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tp: TPGroup, copy_input: bool = True,
                 tag: str = TP_TAG) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias  # [out/tp, in], [out/tp]
        self.tp, self.copy_input, self.tag = tp, copy_input, tag

    @classmethod
    def from_linear(cls, linear: nn.Linear, mesh_or_group: Any, copy_input: bool = True,
                    tag: str = TP_TAG) -> ColumnParallelLinear:
        """Cut this rank's rows out of a full (seeded) ``nn.Linear``, on the linear's device."""
        tp = tp_group_of(mesh_or_group)
        rows = _owned_range(linear.out_features, tp, "out_features")
        weight = _parameter(linear.weight.detach()[rows].clone(), linear.weight)
        bias = None if linear.bias is None else _parameter(linear.bias.detach()[rows].clone(), linear.bias)
        return cls(weight, bias, tp, copy_input, tag)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp_region(x, self.tp.group, self.tag)
        return F.linear(x, self.weight, self.bias)  # [..., out/tp]

    def extra_repr(self) -> str:
        out_local, in_features = self.weight.shape
        return (f"in={in_features}, out={out_local}x{self.tp.size} (this rank: {out_local}), "
                f"bias={self.bias is not None}, copy_input={self.copy_input}")


class RowParallelLinear(nn.Module):
    """Z = g(Σ_i Y_i B_i^T) + b: this rank's in/tp input features (columns of nn.Linear's weight).

    Input Y_i [..., in/tp], this rank's slice (a column-parallel layer's output); output [..., out]
    replicated. The bias is replicated and added once, after g, not tp times."""

    tp_shard_dims = {"weight": 1}

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, tp: TPGroup, tag: str = TP_TAG) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias  # [out, in/tp], [out]
        self.tp, self.tag = tp, tag

    @classmethod
    def from_linear(cls, linear: nn.Linear, mesh_or_group: Any, tag: str = TP_TAG) -> RowParallelLinear:
        """Cut this rank's input columns out of a full (seeded) ``nn.Linear``; the bias is copied whole."""
        tp = tp_group_of(mesh_or_group)
        cols = _owned_range(linear.in_features, tp, "in_features")
        weight = _parameter(linear.weight.detach()[:, cols].clone(), linear.weight)
        bias = None if linear.bias is None else _parameter(linear.bias.detach().clone(), linear.bias)
        return cls(weight, bias, tp, tag)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.reduce(F.linear(x, self.weight))  # [..., out]
        return out if self.bias is None else out + self.bias

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """g: sum the ranks' partial products (sequence parallelism overrides this with a reduce-scatter)."""
        return reduce_from_tp_region(partial, self.tp.group, self.tag)

    def extra_repr(self) -> str:
        out_features, in_local = self.weight.shape
        return f"in={in_local}x{self.tp.size} (this rank: {in_local}), out={out_features}, bias={self.bias is not None}"


class VocabParallelEmbedding(nn.Module):
    """Rank i owns rows [i·V/tp, (i+1)·V/tp) of the [V, d] table; a token's row comes from its owner.

    Each rank looks up the tokens it owns and writes zeros for the rest; g sums over ranks, and since
    exactly one rank owns each token the sum is the full lookup [b, s, d]. In backward each rank's
    rows get gradient only from the tokens it owns (the masked positions contribute zeros)."""

    tp_shard_dims = {"weight": 0}

    def __init__(self, weight: nn.Parameter, vocab_start: int, tp: TPGroup, tag: str = VOCAB_TAG) -> None:
        super().__init__()
        self.weight = weight  # [V/tp, d]
        self.vocab_start, self.tp, self.tag = vocab_start, tp, tag

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, mesh_or_group: Any,
                       tag: str = VOCAB_TAG) -> VocabParallelEmbedding:
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("VocabParallelEmbedding: padding_idx and max_norm are not supported")
        tp = tp_group_of(mesh_or_group)
        rows = _owned_range(embedding.num_embeddings, tp, "vocab_size")
        weight = _parameter(embedding.weight.detach()[rows].clone(), embedding.weight)
        return cls(weight, rows.start, tp, tag)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start  # [b, s]; in [0, V/tp) exactly where this rank owns the token
        owned = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.masked_fill(~owned, 0), self.weight)  # [b, s, d], row 0 as a placeholder
        return self.reduce(rows.masked_fill(~owned.unsqueeze(-1), 0.0))

    def reduce(self, rows: torch.Tensor) -> torch.Tensor:
        """g: sum the ranks' masked lookups (sequence parallelism overrides this with a reduce-scatter)."""
        return reduce_from_tp_region(rows, self.tp.group, self.tag)

    def extra_repr(self) -> str:
        rows, dim = self.weight.shape
        return f"vocab={rows}x{self.tp.size} (this rank: [{self.vocab_start}, {self.vocab_start + rows})), dim={dim}"


# ---------------------------------------------------------------------------------------------------------
# The vocab-parallel cross-entropy (Megatron §3; never the full logits).


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss log Σ_v exp(z_v) − z_target from logit slices [N, V/tp], with 3 all-reduces of [N].

    1. max over the vocabulary (all-reduce MAX), subtracted so that exp cannot overflow;
    2. the target's (shifted) logit: its owner contributes it, the others 0 (all-reduce SUM);
    3. Σ exp over the vocabulary (all-reduce SUM).
    The backward is local: dL/dz = softmax(z) − one_hot(target), on this rank's slice only."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: Any, vocab_start: int) -> torch.Tensor:
        logits_max = logits.max(dim=-1).values  # [N]
        comm.all_reduce(logits_max, op="max", group=group, tag=LOSS_TAG)
        shifted = logits - logits_max.unsqueeze(-1)  # [N, V/tp], <= 0 everywhere
        local_target = targets - vocab_start
        owned = (local_target >= 0) & (local_target < logits.shape[-1])  # [N]
        local_target = local_target.masked_fill(~owned, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        comm.all_reduce(target_logit, group=group, tag=LOSS_TAG)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)  # [N]
        comm.all_reduce(sum_exp, group=group, tag=LOSS_TAG)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, owned)  # this slice's softmax
        return sum_exp.log() - target_logit  # [N]

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, owned = ctx.saved_tensors
        one_hot = torch.zeros_like(softmax).scatter_(-1, local_target.unsqueeze(-1),
                                                     owned.unsqueeze(-1).to(softmax.dtype))
        return (softmax - one_hot) * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, group: Any,
                                 reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` over the full vocabulary, from this rank's logit slice [..., V/tp].

    ``group``: the tp process group (or a Mesh / TPGroup); group rank i holds vocab [i·V/tp, (i+1)·V/tp).
    ``targets`` [...] are global token ids. ``reduction``: "mean" over tokens (F.cross_entropy's default),
    "sum" (divide by a global token count yourself), or "none" (per token). Computed in fp32."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    tp = tp_group_of(group)
    vocab_start = tp.rank * local_logits.shape[-1]
    losses = VocabParallelCrossEntropy.apply(local_logits.flatten(0, -2).float(), targets.flatten(), tp.group,
                                             vocab_start)
    if reduction == "none":
        return losses.view(targets.shape)
    return losses.mean() if reduction == "mean" else losses.sum()


# ---------------------------------------------------------------------------------------------------------
# The plan: module name -> style, applied from outside the model (torchtitan's shape).

#: One GPT block (names relative to the block). "copy_input" marks the entry of a column region: TP applies
#: f once to the module's input, so q, k and v share one backward all-reduce of dL/dX instead of three.
#: "sequence" marks what TP leaves replicated (the LayerNorms): untouched here, run on this rank's slice of
#: the sequence under sequence parallelism (``workbench.parallel.sequence``), the same plan with SP's styles.
BLOCK_PLAN: dict[str, str] = {
    "ln1": "sequence",  # LayerNorm on [b, s, h], replicated
    "attn": "copy_input",  # f on ln1(x) [b, s, h]
    "attn.q": "column",  # [h, h] -> [h/tp, h]: H/tp whole heads per rank
    "attn.k": "column",
    "attn.v": "column",
    "attn.proj": "row",  # [h, h] -> [h, h/tp]; g sums the heads' contributions [b, s, h]
    "ln2": "sequence",
    "mlp": "copy_input",  # f on ln2(x) [b, s, h]
    "mlp.fc": "column",  # [4h, h] -> [4h/tp, h]; GeLU per column, no communication (§3)
    "mlp.proj": "row",  # [h, 4h] -> [h, 4h/tp]; g
}


def gpt_plan(n_layer: int) -> dict[str, str]:
    """The whole tiny GPT: every block by ``BLOCK_PLAN``, embedding and tied head along the vocabulary, the
    position embedding and the final LayerNorm as "sequence" modules."""
    plan = {"wte": "vocab_embedding", "wpe": "sequence"}
    for i in range(n_layer):
        plan.update({f"blocks.{i}.{name}": style for name, style in BLOCK_PLAN.items()})
    return {**plan, "ln_f": "sequence", "lm_head": "vocab_head"}


def _check_plan(model: nn.Module, plan: dict[str, str]) -> None:
    """Every entry names a module of ``model`` of the right kind and a known style."""
    wants = {"column": (nn.Linear,), "row": (nn.Linear,), "vocab_head": (nn.Linear,),
             "vocab_embedding": (nn.Embedding,), "sequence": (nn.LayerNorm, nn.Embedding)}
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"tensor-parallel plan: unknown style {style!r} for {name!r}; valid: {STYLES}")
        if name not in modules:
            raise ValueError(f"tensor-parallel plan: the model has no module {name!r}")
        if style in wants and type(modules[name]) not in wants[style]:
            kinds = " or ".join(f"nn.{kind.__name__}" for kind in wants[style])
            raise ValueError(f"tensor-parallel plan: {name!r} is a {type(modules[name]).__name__}; "
                             f"style {style!r} needs {kinds}")


class TensorParallelStyles:
    """How ``apply_plan`` realises each style of a plan over the tp group ``tp``: one method per style.

    ``copy_input(module)`` hooks the entry of a column region and returns a *region* value; every other
    style's method takes (module, region: what the nearest enclosing "copy_input" returned, else None) and
    returns the module to put in its place. ``workbench.parallel.sequence.SequenceParallelStyles`` overrides
    these methods, which is all that separates TP from TP+SP: one plan, two sets of styles."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp

    def copy_input(self, module: nn.Module) -> Any:
        """f on the module's input (a forward pre-hook); the column layers inside skip their own."""
        module.register_forward_pre_hook(_copy_input_hook(self.tp))
        return TP_TAG  # the region value: "the parent applies f"

    def column(self, linear: nn.Linear, region: Any) -> nn.Module:
        return ColumnParallelLinear.from_linear(linear, self.tp, copy_input=region is None)

    def vocab_head(self, linear: nn.Linear, region: Any) -> nn.Module:
        return ColumnParallelLinear.from_linear(linear, self.tp, copy_input=region is None, tag=VOCAB_TAG)

    def row(self, linear: nn.Linear, region: Any) -> nn.Module:
        return RowParallelLinear.from_linear(linear, self.tp)

    def vocab_embedding(self, embedding: nn.Embedding, region: Any) -> nn.Module:
        return VocabParallelEmbedding.from_embedding(embedding, self.tp)

    def sequence(self, module: nn.Module, region: Any) -> nn.Module:
        """Replicated: f makes dL/dX whole before it reaches the module, so its gradient is whole too."""
        return module


def _region_of(name: str, regions: dict[str, Any]) -> Any:
    """The region value of the nearest enclosing "copy_input" module, or None."""
    parts = name.split(".")
    enclosing = [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in regions]
    return regions[enclosing[0]] if enclosing else None


def _copy_input_hook(tp: TPGroup) -> Any:
    def hook(module: nn.Module, args: tuple) -> tuple:
        return (copy_to_tp_region(args[0], tp.group, TP_TAG), *args[1:])

    return hook


def _tied_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module, parameter name) that share one Parameter (the GPT's wte/lm_head)."""
    by_id: dict[int, list[tuple[str, str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        module, _, leaf = name.rpartition(".")
        by_id.setdefault(id(p), []).append((module, leaf))
    return [names for names in by_id.values() if len(names) > 1]


def _check_ties(plan: dict[str, str], ties: list[list[tuple[str, str]]]) -> None:
    """Tied parameters must be split alike (the GPT's wte and lm_head: both along the vocabulary)."""
    shard_dims = {"column": ColumnParallelLinear.tp_shard_dims, "vocab_head": ColumnParallelLinear.tp_shard_dims,
                  "row": RowParallelLinear.tp_shard_dims, "vocab_embedding": VocabParallelEmbedding.tp_shard_dims}
    for names in ties:
        dims = {f"{module}.{leaf}": shard_dims.get(plan.get(module, ""), {}).get(leaf) for module, leaf in names}
        if len(set(dims.values())) > 1:
            raise ValueError(f"tensor-parallel plan: {' and '.join(dims)} are tied but would be split differently "
                             f"(shard dims {list(dims.values())}, None = whole); give them matching styles")


def _retie(model: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
    """Make tied parameters one Parameter again after splitting (each module cut its own copy)."""
    for (first_module, first_leaf), *others in ties:
        shared = getattr(model.get_submodule(first_module), first_leaf)
        for module_name, leaf in others:
            setattr(model.get_submodule(module_name), leaf, shared)


def _check_group(tp: TPGroup) -> None:
    """A Mesh(tp=N) made outside ``launch`` can plan a layout but not run one: its collectives would be no-ops."""
    ranks = comm.group_size(tp.group)
    if ranks != tp.size:
        raise ValueError(f"tp={tp.size} but the tp process group has {ranks} rank(s); run this inside "
                         f"workbench.launch(fn, {tp.size}) (or on a mesh whose tp axis has {tp.size} ranks)")


def apply_plan(model: nn.Module, plan: dict[str, str], mesh_or_group: Any,
               styles: type[TensorParallelStyles] = TensorParallelStyles) -> nn.Module:
    """Split ``model`` in place by ``plan`` (module name -> style in ``STYLES``); return it.

    With TP's ``styles`` (the default): "column" / "row" / "vocab_embedding" / "vocab_head" replace the named
    module by its parallel version, cut from the module's own weights; "copy_input" applies f to the module's
    input (a forward pre-hook) and makes the column layers inside it skip their own; "sequence" leaves the
    module replicated. ``sequence.SequenceParallelStyles`` realises the same plan with sequence parallelism.
    Tied parameters stay tied. Every check (styles, module kinds, ties, the group) runs before the first
    module is replaced."""
    _check_plan(model, plan)
    ties = _tied_parameters(model)
    _check_ties(plan, ties)
    tp = tp_group_of(mesh_or_group)
    _check_group(tp)
    realise = styles(tp)
    regions = {name: realise.copy_input(model.get_submodule(name))
               for name, style in plan.items() if style == "copy_input"}  # before their column layers
    for name, style in plan.items():
        if style != "copy_input":
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, leaf, getattr(realise, style)(getattr(parent, leaf), _region_of(name, regions)))
    _retie(model, ties)
    return model


# ---------------------------------------------------------------------------------------------------------
# The tiny GPT.


def check_tensor_parallel_sizes(cfg: Any, tp: int) -> None:
    """Raise ValueError unless ``tp`` divides the GPT's heads, MLP hidden width and vocabulary.

    Pure arithmetic on the config: call it before spawning ranks as well (no collective is involved)."""
    sizes = {"n_head": cfg.n_head, "mlp hidden": cfg.mlp_ratio * cfg.d_model, "vocab_size": cfg.vocab_size}
    bad = [f"{name}={size}" for name, size in sizes.items() if size % tp]
    if bad:
        valid = [d for d in _divisors(cfg.n_head) if all(size % d == 0 for size in sizes.values())]
        raise ValueError(f"tensor parallel tp={tp} must divide the GPT's n_head={cfg.n_head}, mlp hidden "
                         f"(mlp_ratio*d_model)={sizes['mlp hidden']} and vocab_size={cfg.vocab_size}; not "
                         f"divisible: {', '.join(bad)}. Valid tp values for this model: {', '.join(map(str, valid))}")


def _vocab_parallel_forward(self: nn.Module, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """The GPT's own forward (its head now vocab-parallel: logits [b, s, V/tp]), then the vocab-parallel loss."""
    local_logits = type(self).forward(self, idx)  # the class's forward, not this instance override
    if targets is None:
        return local_logits
    return vocab_parallel_cross_entropy(local_logits, targets, self.lm_head.tp)


def apply_tensor_parallel(model: nn.Module, mesh_or_group: Any,
                          styles: type[TensorParallelStyles] = TensorParallelStyles) -> nn.Module:
    """Make the tiny GPT tensor-parallel over the tp axis of ``mesh_or_group``, in place; return it.

    Attention heads and the MLP are split by ``BLOCK_PLAN``, embedding and tied head along the vocabulary,
    and the loss becomes ``vocab_parallel_cross_entropy`` (see the module docstring). Sizes that tp does not
    divide raise ValueError before anything is changed or communicated. ``styles``: see ``apply_plan``."""
    tp = tp_group_of(mesh_or_group)
    check_tensor_parallel_sizes(model.cfg, tp.size)
    apply_plan(model, gpt_plan(model.cfg.n_layer), tp, styles)
    model.forward = types.MethodType(_vocab_parallel_forward, model)
    return model


# ---------------------------------------------------------------------------------------------------------
# Shards back to full tensors.


def _shard_dim(model: nn.Module, name: str) -> int | None:
    module_name, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(module_name), "tp_shard_dims", {}).get(leaf)


def _gather(shard: torch.Tensor, dim: int | None, tp: TPGroup) -> torch.Tensor:
    """The full tensor from every rank's ``shard`` along ``dim`` (None: replicated, a copy of this one)."""
    if dim is None or tp.size == 1:
        return shard.detach().clone()
    moved = shard.detach().movedim(dim, 0).contiguous()  # comm.all_gather concatenates along dim 0
    out = moved.new_empty((tp.size * moved.shape[0], *moved.shape[1:]))
    comm.all_gather(out, moved, group=tp.group, tag=GATHER_TAG)
    return out.movedim(0, dim).contiguous()


def full_parameters(model: nn.Module, mesh_or_group: Any) -> dict[str, torch.Tensor]:
    """{name: the unsplit parameter}, the same names and shapes as the model before ``apply_plan``."""
    return gather_full(model, dict(model.named_parameters()), mesh_or_group)


def gather_full(model: nn.Module, local: dict[str, torch.Tensor], mesh_or_group: Any) -> dict[str, torch.Tensor]:
    """{name: unsplit tensor} from this rank's tensors ``local`` of the split ``model``'s parameters, keyed by
    their names (e.g. what a data-parallel wrapper that re-homes the parameters gathered back by name)."""
    tp = tp_group_of(mesh_or_group)
    return {name: _gather(t, _shard_dim(model, name), tp) for name, t in local.items()}


def full_gradients(model: nn.Module, mesh_or_group: Any) -> dict[str, torch.Tensor | None]:
    """{name: the unsplit gradient} (None where this parameter has none: the same on every tp rank)."""
    tp = tp_group_of(mesh_or_group)
    return {name: None if p.grad is None else _gather(p.grad, _shard_dim(model, name), tp)
            for name, p in model.named_parameters()}


def norm_weights(model: nn.Module, mesh_or_group: Any) -> dict[str, float]:
    """{name: the share of its squared gradient norm this rank contributes}: 1 for a shard (the tp ranks'
    squares add up to the whole), 1/tp for a replicated parameter (every tp rank holds all of it)."""
    tp = tp_group_of(mesh_or_group)
    return {name: 1.0 if _shard_dim(model, name) is not None else 1.0 / tp.size
            for name, _ in model.named_parameters()}


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, mesh_or_group: Any) -> torch.Tensor:
    """Clip by the global gradient norm of the *unsplit* model, as one process would; return that norm (a 0-dim tensor).

    A sharded parameter's squared norm is spread over the tp ranks (sum them); a replicated one is whole on
    every rank (count it once). So each rank adds its shards' squares and 1/tp of the replicated ones, and one
    all-reduce of a scalar over tp gives the exact total. Same formula as ``torch.nn.utils.clip_grad_norm_``.
    """
    tp = tp_group_of(mesh_or_group)
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    device = named[0][1].device if named else torch.device("cpu")
    return clip_by_shares_(named, norm_weights(model, tp), (tp.group,), max_norm, device)


__all__ = [
    "BLOCK_PLAN", "STYLES", "ColumnParallelLinear", "CopyToTensorParallelRegion", "ReduceFromTensorParallelRegion",
    "RowParallelLinear", "TPGroup", "TensorParallelStyles", "VocabParallelCrossEntropy", "VocabParallelEmbedding",
    "apply_plan", "apply_tensor_parallel", "check_tensor_parallel_sizes", "clip_grad_norm_", "copy_to_tp_region",
    "full_gradients", "full_parameters", "gather_full", "gpt_plan", "norm_weights", "reduce_from_tp_region",
    "tp_group_of", "vocab_parallel_cross_entropy",
]
