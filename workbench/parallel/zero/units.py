"""ZeRO stage 3's layout decisions: which submodules become units, which parameters stay whole.

Units (FSDP's auto-wrap policy, Zhao et al. 2023, "PyTorch FSDP", VLDB, §3.2.1): each unit's parameters are
gathered together, so the unit is the granularity of stage 3's memory saving (Rajbhandari et al. 2020 §5.3): the
largest unit, gathered, is what a rank must hold on top of its shards. ``default_units`` takes each child of every
``nn.ModuleList``; ``units_from_policy`` picks them by module type, by size (FSDP1's
``size_based_auto_wrap_policy``) or by a callable; ``check_units`` refuses what could never be gathered.

Replicated parameters (FSDP's ``ignored_params``): ``replicated_params`` resolves ``replicate=`` to the trainable
parameters kept whole on every rank, outside the flat shards (small ones, such as norms, that every unit uses).

Pure functions of the model: no communication, nothing of the package imported. ``fully_sharded.py`` uses them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def default_units(module: nn.Module) -> list[nn.Module]:
    """FSDP's usual wrapping: each child of every ``nn.ModuleList`` (GPT blocks, ToyMLP layers)."""
    return [child for m in module.modules() if isinstance(m, nn.ModuleList) for child in m]


#: Containers without a forward of their own: a forward hook on them never fires, so they cannot be units
#: (FSDP1's size-based policy skips them too, ``exclude_wrap_modules``).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
VALID_WRAP_POLICIES = ("a set/tuple of nn.Module types (each submodule of such a type is a unit)",
                       "a positive int (size-based: a submodule becomes a unit once the trainable parameters not "
                       "already inside a smaller unit reach that many elements)",
                       "a callable (qualified_name, module) -> bool")


def units_from_policy(module: nn.Module, wrap_policy: Any,
                      exclude: Iterable[nn.Parameter] = ()) -> list[nn.Module]:
    """The submodules of ``module`` that ``wrap_policy`` makes units, parents before children (FSDP's auto-wrap
    policies, Zhao et al. 2023 §3.2.1; the root is never listed: it takes what no unit does).

    ``wrap_policy``: a set/tuple/list of ``nn.Module`` types (a bare type is read as one); a positive int,
    FSDP1's ``size_based_auto_wrap_policy``: bottom-up, a submodule becomes a unit when its trainable
    parameters not already inside a smaller unit reach that many elements (``exclude``: parameters that are
    not sharded, e.g. replicated ones, do not count); or a callable ``(qualified_name, module) -> bool``.
    None: ``default_units``. Containers without a forward (``nn.ModuleList``...) are never units."""
    if wrap_policy is None:
        return default_units(module)
    named = [(n, m) for n, m in module.named_modules() if m is not module]
    if isinstance(wrap_policy, type):
        wrap_policy = (wrap_policy,)
    if isinstance(wrap_policy, (set, frozenset, tuple, list)):
        types = tuple(wrap_policy)
        if not types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
            raise ValueError(f"wrap_policy {wrap_policy!r} is not valid: a collection must hold nn.Module types "
                             f"(e.g. {{nn.Linear, Block}}); valid: {'; '.join(VALID_WRAP_POLICIES)}")
        chosen = [m for _, m in named if isinstance(m, types)]
    elif isinstance(wrap_policy, int) and not isinstance(wrap_policy, bool):
        if wrap_policy <= 0:
            raise ValueError(f"wrap_policy {wrap_policy!r}: a size-based policy needs a positive number of "
                             f"elements; valid: {'; '.join(VALID_WRAP_POLICIES)}")
        chosen = _size_units(module, wrap_policy, {id(p) for p in exclude})
    elif callable(wrap_policy):
        chosen = [m for n, m in named if wrap_policy(n, m)]
    else:
        raise ValueError(f"wrap_policy {wrap_policy!r} ({type(wrap_policy).__name__}) is not valid; valid: "
                         f"{'; '.join(VALID_WRAP_POLICIES)}")
    picked = {id(m) for m in chosen}
    containers = [n for n, m in named if id(m) in picked and isinstance(m, _CONTAINERS)]
    if containers and not isinstance(wrap_policy, int):
        raise ValueError(f"wrap_policy {wrap_policy!r} picks {containers[:3]}, containers without a forward (their "
                         "hooks never fire, so their parameters would never be gathered); pick their children")
    return chosen


def _size_units(module: nn.Module, min_numel: int, excluded: set[int]) -> list[nn.Module]:
    """FSDP1's size-based policy: children first, so a submodule counts only what no unit inside it took."""
    order = {id(m): i for i, m in enumerate(module.modules())}
    claimed: set[int] = set(excluded)
    chosen: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            visit(child)
        if m is module or isinstance(m, _CONTAINERS) or any(c is m for c in chosen):  # shared: visited twice
            return
        free = {id(p): p.numel() for p in m.parameters() if p.requires_grad and id(p) not in claimed}
        if sum(free.values()) >= min_numel:
            chosen.append(m)
            claimed.update(free)

    visit(module)
    return sorted(chosen, key=lambda m: order[id(m)])  # parents before children: the innermost unit wins


def check_units(module: nn.Module, units: list[nn.Module]) -> None:
    """Refuse, at construction, a unit that would never be gathered or would swallow the root."""
    inside = {id(m) for m in module.modules()}
    for u in units:
        if not isinstance(u, nn.Module) or id(u) not in inside:
            raise ValueError(f"every unit must be a submodule of the wrapped model; got {type(u).__name__} "
                             "that is not (use default_units(model) or children of model)")
        if u is module:
            raise ValueError("the wrapped model itself is the root unit; list only its submodules in units")
        if isinstance(u, _CONTAINERS):
            raise ValueError(f"a {type(u).__name__} cannot be a unit: it has no forward, so its hooks never fire and "
                             "its parameters would never be gathered; list its children instead")


def replicated_params(module: nn.Module, replicate: Any) -> dict[str, nn.Parameter]:
    """``replicate`` resolved to {name: parameter} of trainable parameters (first name of a tied one).

    ``replicate``: None; an iterable of parameters or of their qualified names (``module.named_parameters``);
    or a callable ``(name, param) -> bool``. Frozen parameters are replicated anyway and are skipped."""
    if replicate is None:
        return {}
    named = dict(module.named_parameters())
    aliases = dict(module.named_parameters(remove_duplicate=False))
    first_name = {id(p): n for n, p in named.items()}
    if callable(replicate):
        picked = [p for n, p in aliases.items() if replicate(n, p)]
    elif isinstance(replicate, (str, torch.Tensor)) or not isinstance(replicate, Iterable):
        raise ValueError(f"replicate {replicate!r} is not valid; valid: an iterable of parameters or of their "
                         "qualified names (e.g. ['ln_f.weight']), or a callable (name, param) -> bool")
    else:
        picked = []
        for item in replicate:
            if isinstance(item, str):
                if item not in aliases:
                    raise ValueError(f"replicate names {item!r}, which is not a parameter of the wrapped model; "
                                     f"valid names include {list(named)[:4]}")
                picked.append(aliases[item])
            elif isinstance(item, nn.Parameter) and id(item) in first_name:
                picked.append(item)
            else:
                raise ValueError(f"replicate holds {type(item).__name__} {str(item)[:40]!r}: each item must be a "
                                 "parameter of the wrapped model or its qualified name")
    return {first_name[id(p)]: p for p in picked if p.requires_grad}
