"""Tensor parallelism's plan: module name -> style, realised by a set of styles (torchtitan's shape).

Part of the tensor-parallel strategy (``workbench.parallel.tensor``). ``gpt_plan`` names a style per module
(column / row / vocab_embedding / vocab_head, "copy_input" for a column region's entry, "sequence" for the
LayerNorms and the position embedding that TP leaves replicated); ``apply_plan`` realises it with
``TensorParallelStyles``. Sequence parallelism (``sequence.py`` beside this file) is the same plan realised
with ``SequenceParallelStyles``: one strategy, two sets of styles.

Everything outside the split layers (LayerNorms, position embedding, the row layers' biases) is
replicated under TP's styles: because f makes dL/dX whole before it reaches them, every tp rank computes the
same full gradient for them, and identical AdamW steps keep the copies identical without any extra collective.

**The GPT's embedding, tied head and loss.** ``models/gpt.py`` ties ``lm_head.weight`` to ``wte.weight``
and computes ``F.cross_entropy`` on the full logits [b, s, V]. Here both ends become vocab-parallel: the
head's weight *is* the embedding's shard (the tie survives, as one Parameter named ``wte.weight``). The
model's loss cannot take a logit slice, so ``apply_tensor_parallel`` installs a forward on the model
instance (gpt.py is untouched): it calls the model's own forward without targets, then
``vocab_parallel_cross_entropy`` (``loss.py``). Called without targets the parallelized model returns this
rank's vocab slice of the logits.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from workbench.dist import comm
from workbench.parallel.tensor.layers import (
    TP_TAG,
    VOCAB_TAG,
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    copy_to_tp_region,
    divisors,
    tp_group_of,
)
from workbench.parallel.tensor.loss import vocab_parallel_cross_entropy

STYLES = ("copy_input", "column", "row", "vocab_embedding", "vocab_head", "sequence")


# ---------------------------------------------------------------------------------------------------------
# The plan: module name -> style, applied from outside the model (torchtitan's shape).

#: One GPT block (names relative to the block). "copy_input" marks the entry of a column region: TP applies
#: f once to the module's input, so q, k and v share one backward all-reduce of dL/dX instead of three.
#: "sequence" marks what TP leaves replicated (the LayerNorms): untouched here, run on this rank's slice of
#: the sequence under sequence parallelism (``workbench.parallel.tensor.sequence``), the same plan with SP's styles.
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
    returns the module to put in its place. ``workbench.parallel.tensor.sequence.SequenceParallelStyles`` overrides
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
        valid = [d for d in divisors(cfg.n_head) if all(size % d == 0 for size in sizes.values())]
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


__all__ = [
    "BLOCK_PLAN", "STYLES", "TensorParallelStyles", "apply_plan", "apply_tensor_parallel",
    "check_tensor_parallel_sizes", "gpt_plan",
]
