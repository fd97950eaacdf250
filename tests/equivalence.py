"""Shared helpers for equivalence tests: single-process reference training on the global batch.

Every strategy test trains the same model (same seed) on the same global batches and compares the final
parameters with ``reference_train``'s. Batches are produced by a function of the step so that ranks can
take their own shard of exactly the global batch the reference sees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# fp32, a handful of steps: summation order differs between one process and N ranks, so the results
# agree to float32 rounding amplified by a few AdamW steps, not bitwise.
RTOL = 1e-4
ATOL = 1e-5


def mlp_batch(step: int, global_batch: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    from workbench.models import regression_batch

    return regression_batch(global_batch, seed=seed, step=step)


def gpt_batch(step: int, global_batch: int = 8, seq_len: int = 16, vocab: int = 256,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def shard(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s contiguous slice of a global batch (what the sharded sampler hands it)."""
    return tuple(t.chunk(world)[rank] for t in batch)


def reference_train(build: Callable[[], torch.nn.Module], batch_fn: Callable[[int], tuple],
                    steps: int = 3, optimizer_cls: Any = torch.optim.AdamW, max_norm: float | None = None,
                    **optimizer_kwargs: Any) -> dict[str, torch.Tensor]:
    """Train ``build()`` in one process on the full global batch; return {name: parameter}."""
    model = build()
    optimizer = optimizer_cls([p for p in model.parameters() if p.requires_grad], **optimizer_kwargs)
    for step in range(steps):
        x, y = batch_fn(step)
        optimizer.zero_grad(set_to_none=True)
        model(x, y).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                        rtol: float = RTOL, atol: float = ATOL) -> None:
    assert list(got) == list(want), f"parameter names differ: {list(got)} vs {list(want)}"
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
