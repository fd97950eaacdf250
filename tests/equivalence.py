"""Shared helpers for equivalence tests: single-process reference training on the global batch, and tolerances
that follow from the numerics.

Every strategy test trains the same model (same seed) on the same global batches and compares the final
parameters with ``reference_train``'s. Batches are produced by a function of the step so that ranks can
take their own shard of exactly the global batch the reference sees.

Tolerances. Two runs that add the same terms in another order (N ranks vs one process, shards vs the whole, a
ring vs gloo, micro-batches vs the batch, or another SIMD width: ``ATEN_CPU_CAPABILITY``) differ by rounding
only, and the rounding error of a sum is at most its length times eps times the size of the terms it adds, in
*every* order (Higham, *Accuracy and Stability of Numerical Algorithms*, §4.2). So a bound is a number of eps
at the scale of the quantity, and holds on any CPU: ``assert_close_to_scale``. For a family computed together (a
model's gradients, Adam's moments) the scale is the family's largest element: an element whose terms cancel
(attn.k.bias's gradient is exactly 0 in exact arithmetic) carries the rounding of its terms, not of its own
size. A real bug (a wrong shard, a missing or doubled gradient) is an O(1) relative error, 10^5 times these
bounds. Parameters after AdamW steps need one more argument: ``assert_adam_params_close``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

#: Units of eps (at the quantity's scale) that one forward/backward, one collective, or Adam's moments after a
#: few steps may differ by when summed in another order. Measured in fp32 (largest gradient, largest moment):
#: gradients 3.4 (default vs AVX2 ISA, one batch vs two micro-batches: at most 0.8), Adam's second moment after
#: 3 steps 4.6 (AVX2) and 8.5 (the AVX-512 CI failure of issue 18). 64 leaves a 7x margin over the worst.
ROUNDOFF_K = 64
#: A step-0 gradient element below NOISE_UNITS eps times the model's largest gradient is within ~16x of its own
#: rounding error: its sign and size, and so Adam's step for it (up to lr), are decided by the summation order.
NOISE_UNITS = 64
#: Elements whose gradient carries signal move, after AdamW steps, by at most this share of the learning rates'
#: sum differently: Adam's step lr·m/sqrt(v) depends on a gradient through ratios, which rounding moves at the
#: scale of rounding. Measured (tiny GPT, 3 steps at lr 1e-3, default and AVX2 ISAs): at most 1.5e-6 =
#: lr_sum/2000 for DDP, ZeRO and pipelines, 7.7e-6 = lr_sum/390 for TP at tp=4 (whose vocab-parallel loss is
#: also another formula). 1/32 leaves a 12x margin over the worst and is 32x below an O(1) error in the updates.
SIGNAL_SHARE = 1 / 32
#: Rounding-driven elements must stay a small minority, or the tight check above would cover too little.
MAX_NOISE_SHARE = 0.05


def eps(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps


def scale_of(tensors: Iterable[torch.Tensor]) -> float:
    """The largest |element| over ``tensors``: the scale that a family computed together rounds at."""
    return max((float(t.detach().abs().max()) for t in tensors if t is not None and t.numel()), default=0.0)


def assert_close_to_scale(actual: Any, expected: Any, k: float = ROUNDOFF_K, scale: float | None = None,
                          msg: str = "") -> None:
    """|actual - expected| <= k·eps(dtype)·scale for every element; ``scale`` defaults to max|expected|.

    Tensors or Python floats (float32 losses); no relative term: rounding is relative to the scale of the terms
    summed, not to an element's own (possibly cancelled) value."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    scale = scale_of([expected]) if scale is None else scale
    atol = k * eps(expected.dtype) * scale
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol,
                               msg=lambda m: f"{msg}: {m}\n(bound: {k} eps x scale {scale:.3g} = {atol:.3g})")


def assert_all_close_to_scale(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], k: float = ROUNDOFF_K,
                              msg: str = "") -> None:
    """Each tensor of a family (a model's gradients, Adam's moments) within k eps of the family's largest element."""
    assert list(got) == list(want), f"names differ: {list(got)} vs {list(want)}"
    scale = scale_of(want.values())
    for name in want:
        assert_close_to_scale(got[name], want[name], k, scale, msg=f"{msg}{name}")


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


def reference_grads(build: Callable[[], torch.nn.Module],
                    batch_fn: Callable[[int], tuple]) -> dict[str, torch.Tensor | None]:
    """One process's step-0 gradients by parameter name (None: frozen), for ``assert_adam_params_close``."""
    model = build()
    model(*batch_fn(0)).backward()
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def assert_adam_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                             grads0: dict[str, torch.Tensor | None], lr_sum: float, msg: str = "") -> None:
    """Parameters after AdamW steps from the same start, the gradients summed in another order.

    Where the step-0 gradient carries signal (|g| >= NOISE_UNITS eps G, G the model's largest gradient
    element), within SIGNAL_SHARE of ``lr_sum`` (the learning rates of the steps, summed). Where it is rounding
    noise, Adam may step either way in either run: within 2 lr_sum, the most two runs of Adam can part. A frozen
    parameter (grad None) is a copy of the start on both sides: bit-identical."""
    assert list(got) == list(want), f"parameter names differ: {list(got)} vs {list(want)}"
    floor = NOISE_UNITS * eps() * scale_of(g for g in grads0.values() if g is not None)
    noise_total = total = 0
    for name, w in want.items():
        g = grads0[name]
        if g is None:
            assert torch.equal(got[name], w), f"{msg}{name}: a frozen parameter changed"
            continue
        noise = g.abs() < floor
        for part, atol in ((~noise, SIGNAL_SHARE * lr_sum), (noise, 2 * lr_sum)):
            torch.testing.assert_close(got[name][part], w[part], rtol=0, atol=atol,
                                       msg=lambda m, n=name, a=atol: f"{msg}{n}: {m} (bound {a:.3g})")
        noise_total, total = noise_total + int(noise.sum()), total + g.numel()
    assert noise_total <= MAX_NOISE_SHARE * total, f"{noise_total} of {total} elements have rounding-noise gradients"


def assert_params_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Bit for bit: for runs that do the very same operations in the same order."""
    assert list(got) == list(want), f"parameter names differ: {list(got)} vs {list(want)}"
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs"
