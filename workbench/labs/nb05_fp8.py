"""Notebook 05's exercise: fp8 (e4m3) with one scale per channel, checked against per-tensor scaling's damage.

Per-tensor scaling (``workbench.precision.fp8_round_trip``) maps a tensor's largest magnitude onto e4m3's 448.
One outlier channel (Dettmers et al. 2022, "LLM.int8()": LLM activations hold a few channels 100-1000x larger,
and more under some recipes) sets that largest magnitude for everyone: at 10^5 x the other channels' values land
below e4m3's normal range (2^-6), in its subnormals and below 2^-9, where they lose their mantissa bits or flush
to zero. One scale per channel (per column of the last dimension, its amax over every other dimension) gives each
channel the whole range.

The learner writes ``fp8_per_channel(x)``: ``x`` quantised to e4m3 and back with one scale per channel.
``check_per_channel(fn)`` compares it with a channel-by-channel application of ``fp8_round_trip`` on tensors with
an outlier channel at 10^5x, an all-zero channel and a 3-D shape; a result that matches one of the classic mistakes
(one scale for the whole tensor, one per row instead of per column, no division after the cast, NaN from a zero
channel) is named. The reference solution is ``labs/solutions/nb05_fp8.py``, outside this package.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workbench.labs import LabCheckFailed, show_hint
from workbench.parallel.precision import FP8_FORWARD, fp8_round_trip

MORE = " (more help: hint(1), hint(2), hint(3))"
OUTLIER = 1e5  # where per-tensor scaling's damage to the other channels shows (notebook 05 sweeps up to it)

HINTS = {
    1: "Per-tensor scaling multiplies the whole tensor by 448 / amax(|x|). Per channel means one such scale for "
       "each channel: each column of the last dimension gets 448 / (its own largest |value|), taken over every "
       "other dimension (tokens, batch). Multiply, cast to e4m3, cast back, divide by the same scales.",
    2: "amax = x.abs().amax(dim=tuple(range(x.dim() - 1)), keepdim=True) has one value per channel (shape [1, ..., "
       "C]); 448 is torch.finfo(torch.float8_e4m3fn).max. A channel of zeros has amax 0: give it the scale 1 "
       "(torch.where), or 448 / 0 is inf and 0 * inf is NaN. Clamp to ±448 before the cast (e4m3fn has no inf: an "
       "out-of-range cast is NaN), and return x's dtype.",
    3: "def fp8_per_channel(x):\n"
       "    top = torch.finfo(torch.float8_e4m3fn).max\n"
       "    amax = x.abs().amax(dim=tuple(range(x.dim() - 1)), keepdim=True)\n"
       "    scale = torch.where(amax > 0, top / amax, torch.ones_like(amax))\n"
       "    q = (x * scale).clamp(-top, top).to(torch.float8_e4m3fn)\n"
       "    return (q.float() / scale).to(x.dtype)",
}


def hint(level: int = 1) -> str:
    """Print (and return) hint ``level`` (1: the idea, 2: the pieces, 3: nearly the code)."""
    return show_hint(HINTS, level)


def per_channel_reference(x: torch.Tensor) -> torch.Tensor:
    """``fp8_round_trip`` applied to each channel (column of the last dimension) on its own: slow, and the
    definition the exercise's vectorised answer is checked against."""
    columns = x.reshape(-1, x.shape[-1])
    out = torch.stack([fp8_round_trip(columns[:, c]) for c in range(columns.shape[1])], dim=1)
    return out.reshape(x.shape)


def other_channels_error(approx: torch.Tensor, exact: torch.Tensor, outlier: int = 0) -> float:
    """Relative error (Frobenius) over every channel but ``outlier``: what the outlier does to its neighbours."""
    keep = [c for c in range(exact.shape[-1]) if c != outlier]
    a, e = approx[..., keep], exact[..., keep]
    return float((a - e).norm() / e.norm())


def _cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device="cpu").manual_seed(5)
    acts = torch.randn(64, 32, generator=g, device="cpu")
    acts[:, 0] *= OUTLIER  # one outlier channel
    zero = torch.randn(4, 16, 24, generator=g, device="cpu") * 0.02  # small, like N(0, 0.02) weights
    zero[..., 3] = 0.0  # a channel of zeros (a dead feature)
    zero[..., 7] *= 300.0
    return [("activations [64, 32] with channel 0 at 1e5x", acts), ("a [4, 16, 24] tensor with a zero channel", zero)]


def _mistake(got: torch.Tensor, x: torch.Tensor) -> str | None:
    """The name of the classic mistake ``got`` reproduces, if any."""
    rows = x.reshape(-1, x.shape[-1])
    candidates = {
        "one scale for the whole tensor (per-tensor scaling: the outlier sets everyone's scale)": fp8_round_trip(x),
        "one scale per row (the amax over the last dimension): a channel is a column, its amax is over the other "
        "dimensions": torch.stack([fp8_round_trip(r) for r in rows]).reshape(x.shape),
        "no scaling at all": fp8_round_trip(x, scaled=False),
    }
    for name, want in candidates.items():
        if _close(got, want):
            return name
    ref = per_channel_reference(x)
    scale = 448.0 / x.abs().reshape(-1, x.shape[-1]).amax(0).clamp_min(1e-30)
    if _close(got, (ref * scale).reshape(x.shape)):
        return "the values were not divided by the scale after the cast back: the result is still in fp8's units"
    return None


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The same quantisation: every value within one e4m3 step of ``want`` (a scale computed in float32 rather than
    float64 may move a value that sits on a rounding boundary by one step, 2^-3 of it), and 99 % of them within
    float32 rounding of the division by the scale (1e-6 relative); a different scale moves far more of them."""
    if got.shape != want.shape or not bool(torch.isfinite(got).all()):
        return False
    step = want.abs() * 2.0 ** -3 + 2.0 ** -9 * want.abs().amax().clamp_min(1e-30) / 448.0
    diff = (got.float() - want.float()).abs()
    return bool((diff <= step + 1e-30).all()) and float((diff <= 1e-6 * want.abs()).double().mean()) > 0.99


def _call(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, what: str) -> torch.Tensor:
    try:
        got = fn(x.clone())
    except NotImplementedError as error:
        raise LabCheckFailed(f"fp8_per_channel is still the stub ({error}): write it, then run this cell again"
                             + MORE) from None
    except Exception as error:  # noqa: BLE001 -- explained to the learner
        raise LabCheckFailed(f"fp8_per_channel raised {type(error).__name__}: {error} (on {what})" + MORE) from None
    if not isinstance(got, torch.Tensor) or got.shape != x.shape or got.dtype != x.dtype:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise LabCheckFailed(f"on {what}: return a tensor of x's shape {tuple(x.shape)} and dtype {x.dtype}, got "
                             f"{shape}" + (f" {got.dtype}" if isinstance(got, torch.Tensor) else "") + MORE)
    return got


def check_per_channel(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Raise ``LabCheckFailed`` naming the mistake, or print what per-channel scaling saved under the outlier."""
    if not callable(fn):
        raise LabCheckFailed(f"check_per_channel wants your function fp8_per_channel, got {fn!r}")
    for what, x in _cases():
        got = _call(fn, x, what)
        if not bool(torch.isfinite(got).all()):
            raise LabCheckFailed(f"on {what} the result holds NaN or inf: a channel of zeros has amax 0, and "
                                 "448 / 0 = inf; give such a channel the scale 1 (torch.where)" + MORE)
        want = per_channel_reference(x)
        if _close(got, want):
            continue
        name = _mistake(got, x)
        if name:
            raise LabCheckFailed(f"on {what} your result matches a classic mistake: {name}." + MORE)
        bad = int(((got.float() - want.float()).abs() > 1e-6 * want.abs()).sum())
        raise LabCheckFailed(f"on {what}, {bad} of {x.numel()} values differ from e4m3 with one scale per channel "
                             "(448 / that channel's amax, cast, cast back, divided by the same scale)" + MORE)
    x = _cases()[0][1]
    tensor_err = other_channels_error(fp8_round_trip(x), x)
    channel_err = other_channels_error(fn(x.clone()), x)
    print(f"✓ per-channel e4m3 matches the definition. With channel 0 at {OUTLIER:.0e}x, the other channels' "
          f"relative error is {channel_err:.3f} with your per-channel scales against {tensor_err:.3f} with one scale "
          f"for the tensor ({float((fp8_round_trip(x)[:, 1:] == 0).double().mean()):.0%} of their values flushed "
          "to zero there).")


__all__ = ["FP8_FORWARD", "HINTS", "OUTLIER", "check_per_channel", "hint", "other_channels_error",
           "per_channel_reference"]
