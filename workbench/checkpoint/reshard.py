"""Resharding: move training state from one layout (dp x tp x pp, ZeRO stage, offload) to another.

A checkpoint holds each rank's shards in its strategy's own form: ZeRO-1/2 flat bucket pieces, ZeRO-3 unit
shards, tensor-parallel slices, pipeline stages. To resume on another layout (dp=4 ZeRO-3 -> dp=2 ZeRO-1, after
losing half the nodes) we go through the one form every layout shares, the *full* state by parameter name:

1. ``full_training_state``, on the saved layout: the full parameters and, for each of Adam's moments, the full
   moment tensors by parameter name.
2. ``load_full_training_state``, on the new layout: the full tensors sharded the new way.

Both rest on one fact: Adam's moments are elementwise, so each is sharded exactly like the parameter it belongs
to. So no strategy needs code of its own: to gather a moment, write it into the tensors the optimizer steps and
ask the strategy for its full parameters (the gather every strategy already has); to scatter one, build the new
layout's strategy on a model whose weights *are* that moment and read what lands in the tensors its optimizer
steps. This is how PyTorch DCP's load-time resharding sees it too: a checkpoint is a set of named tensors, each
rank reads the pieces its layout needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

#: The per-parameter optimizer state that is sharded like its parameter (AdamW's two moments).
MOMENTS = ("exp_avg", "exp_avg_sq")


def optimizer_slots(optimizer: Any) -> list[torch.Tensor]:
    """The tensors ``optimizer`` steps, in ``param_groups`` order: the model's parameters for a replicated
    optimizer, a ZeRO optimizer's shard pieces (or their offloaded masters) otherwise."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def publish(optimizer: Any) -> None:
    """Make the model show what the stepped tensors hold (a ZeRO optimizer all-gathers its shards)."""
    if hasattr(optimizer, "publish_shards"):
        optimizer.publish_shards()


def _step_count(optimizer: Any, slots: list[torch.Tensor]) -> float:
    steps = {float(optimizer.state[s]["step"]) for s in slots if "step" in optimizer.state.get(s, {})}
    if len(steps) > 1:
        raise ValueError(f"optimizer slots disagree on their step count: {sorted(steps)}")
    return steps.pop() if steps else 0.0


def _on_host(full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", copy=True) for name, t in full.items()}


@torch.no_grad()
def full_training_state(strategy: Any) -> dict[str, Any]:
    """The full parameters and AdamW moments by parameter name, and the optimizer's step count, on every rank's
    host memory (collective: every rank calls it). The strategy's state is unchanged afterwards."""
    optimizer = strategy.optimizer
    slots = optimizer_slots(optimizer)
    originals = [s.detach().clone() for s in slots]
    out: dict[str, Any] = {"params": _on_host(strategy.full_parameters()),
                           "optimizer_step": _step_count(optimizer, slots)}
    try:
        for key in MOMENTS:
            for slot in slots:
                state = optimizer.state.get(slot, {})
                slot.copy_(state[key] if key in state else torch.zeros_like(slot))
            publish(optimizer)
            out[key] = _on_host(strategy.full_parameters())
    finally:
        for slot, original in zip(slots, originals, strict=True):
            slot.copy_(original)
        publish(optimizer)
    return out


@torch.no_grad()
def load_full_training_state(strategy: Any, full: Mapping[str, Any],
                             shard_like_params: Callable[[Mapping[str, torch.Tensor]], list[torch.Tensor]]) -> None:
    """Load ``full`` (from ``full_training_state`` on any layout) into ``strategy``'s shards.

    ``shard_like_params(values)`` builds this layout's strategy on a model whose parameters are ``values`` (by
    name) and returns its optimizer's slots: each moment lands where its parameter's shard does.
    """
    optimizer = strategy.optimizer
    slots = optimizer_slots(optimizer)
    pieces = {key: shard_like_params(full[key]) for key in ("params", *MOMENTS)}
    for key, values in pieces.items():
        if len(values) != len(slots):
            raise ValueError(f"the resharded {key} has {len(values)} pieces but this optimizer steps {len(slots)}")
    # On the CPU, as torch's AdamW keeps its step count unless capturable or fused.
    step = torch.tensor(float(full["optimizer_step"]), dtype=torch.float32, device="cpu")
    for i, slot in enumerate(slots):
        slot.copy_(pieces["params"][i])
        optimizer.state[slot] = {"step": step.clone(),
                                 **{key: pieces[key][i].to(slot.device, copy=True) for key in MOMENTS}}
    publish(optimizer)
