"""A toy regression MLP that deliberately contains the awkward cases data-parallel wrappers must handle.

A wrapper that is correct on a plain stack of Linears can still be wrong on real models. This one has:
  * a frozen parameter (`frozen_proj`): it must get no gradient, no all-reduce and no optimizer state;
  * a tied weight (`tied_a.weight is tied_b.weight`): one Parameter reached by two module paths, whose
    gradient must be reduced once, not twice, and sharded once;
  * a buffer (`scale`): state that is saved and must match across ranks but is never trained;
  * a `layers` ModuleList: the units that per-unit sharding (ZeRO-3 / FSDP style) wraps one by one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ToyMLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 32, n_layers: int = 3) -> None:
        super().__init__()
        for name, value in (("d_in", d_in), ("d_hidden", d_hidden), ("n_layers", n_layers)):
            if value <= 0:
                raise ValueError(f"ToyMLP: {name} must be a positive int, got {value}")
        self.inp = nn.Linear(d_in, d_hidden)
        # A fixed per-channel gain: a buffer, so it is in state_dict() but not in parameters().
        # Built on the CPU like every parameter here; build_mlp moves the whole module to the rank's device.
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d_hidden, device="cpu"))
        self.frozen_proj = nn.Linear(d_hidden, d_hidden)
        self.frozen_proj.requires_grad_(False)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(d_hidden, d_hidden), nn.Tanh()) for _ in range(n_layers)
        )
        self.tied_a = nn.Linear(d_hidden, d_hidden)
        self.tied_b = nn.Linear(d_hidden, d_hidden)
        self.tied_b.weight = self.tied_a.weight  # same Parameter object; biases stay separate
        self.out = nn.Linear(d_hidden, d_in)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, d_in] -> prediction [B, d_in], or the mean squared error if targets [B, d_in] given."""
        h = torch.tanh(self.inp(x)) * self.scale  # [B, d_hidden]
        h = h + self.frozen_proj(h)
        # Residual connections keep the gradient well-scaled however many layers there are.
        for layer in self.layers:
            h = h + layer(h)
        h = h + torch.tanh(self.tied_a(h))
        h = h + torch.tanh(self.tied_b(h))
        y = self.out(h)
        return y if targets is None else F.mse_loss(y, targets)


def build_mlp(seed: int = 0, device: str | torch.device = "cpu", **kwargs) -> ToyMLP:
    """Build a ToyMLP whose parameters depend only on `seed` (drawn on the CPU, then moved to `device`),
    leaving the caller's global RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ToyMLP(**kwargs).to(device=device, dtype=torch.float32)


def _generator(seed: int) -> torch.Generator:
    # The CPU generator: the same numbers on every machine, whatever device the batch then moves to.
    return torch.Generator(device="cpu").manual_seed(seed)


def regression_batch(
    batch_size: int, d_in: int = 16, seed: int = 0, step: int = 0, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (x, y) batch for (seed, step) on `device`: the same on every rank and every run, so a
    data-parallel run can be compared with a single-process one on exactly the same global batch.

    y = sin(x @ W) + 0.01 * noise, with W fixed for a given d_in (independent of seed and step), so
    every batch samples the same learnable function.
    """
    w = torch.randn(d_in, d_in, generator=_generator(12345 + d_in), device="cpu") / d_in**0.5
    # Mix seed and step into one 64-bit seed; distinct for step < 1_000_003.
    g = _generator((seed * 1_000_003 + step) % 2**63)
    x = torch.randn(batch_size, d_in, generator=g, device="cpu")
    noise = torch.randn(batch_size, d_in, generator=g, device="cpu")
    y = torch.sin(x @ w) + 0.01 * noise
    return x.to(device), y.to(device)
