"""Models the workbench trains: a tiny GPT (presets tiny/small/bench) and a toy MLP full of edge cases."""

from __future__ import annotations

from torch import nn

from workbench.models.gpt import GPT, PRESETS, GPTConfig, build_gpt
from workbench.models.mlp import ToyMLP, build_mlp, regression_batch

__all__ = [
    "GPT", "GPTConfig", "PRESETS", "build_gpt", "build_model", "ToyMLP", "build_mlp", "regression_batch",
]


def build_model(name: str = "tiny", seed: int = 0, **overrides) -> nn.Module:
    """Build a model by name: "mlp" for ToyMLP, or a GPT preset name; overrides go to its config."""
    if name == "mlp":
        return build_mlp(seed=seed, **overrides)
    if name in PRESETS:
        return build_gpt(GPTConfig.preset(name, **overrides), seed=seed)
    raise ValueError(f"unknown model {name!r}; valid names: {['mlp', *sorted(PRESETS)]}")
