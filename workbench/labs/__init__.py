"""Lab checkers (one module per lab notebook in the repository's ``labs/``) and ``LabCheckFailed``.

Each checker module offers ``check(...)``, which runs the learner's code on real ranks and raises
``LabCheckFailed`` with a message pointed at the mistake, and ``hint(level)``, tiered hints. The reference
solutions are not here: they live beside the notebooks, in ``labs/solutions/``. ``grading`` runs a learner's
notebook headless and reports each exercise (``workbench labs check``).

Float comparisons: where the learner's ranks and the single-process reference add the same terms in another
order (a sum split over ranks, a matmul cut in blocks, another SIMD width: ``ATEN_CPU_CAPABILITY=avx512`` adds
16 floats at a time where avx2 adds 8), results differ by rounding, and rounding scales with the size of what
is summed, not with an absolute number. So the checkers measure a difference in units of ``eps(dtype) ×
max|reference|`` (``rounding_error``; the reference is the whole model's gradients where one tensor's exact value
is zero) and allow a few dozen such units (``within_rounding``): a bound that holds on any CPU, while a mistake
(a factor N, a missing term, a stale value) is off by 10⁵ units or more. Bit-exact
comparisons (``torch.equal``) stay where both sides do the very same operations, or where every partial sum
is exact (small integers in float32), so that no order can round.
"""

from __future__ import annotations

import torch


class LabCheckFailed(AssertionError):
    """A lab answer is wrong; the message is a hint pointing at the mistake."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback: the learner sees the pointed message, not the
        # checker's internals (the raise happens deep inside it, often in a rank's result).
        return [f"\x1b[31mLabCheckFailed\x1b[0m: {self}"]


def rounding_error(got: torch.Tensor, want: torch.Tensor, scale: float | None = None) -> float:
    """max|got − want| in units of ``eps(want.dtype) × scale``, ``scale`` the size of the quantity compared:
    by default max|want|; pass a larger one where ``want`` is itself rounding noise (a gradient that is zero in
    exact arithmetic, such as an attention key bias's: the whole model's largest gradient is then the scale).
    0.0 when equal; inf for another shape, a NaN, or a nonzero difference at scale 0."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return float("inf")
    diff = (got.detach().double() - want.detach().double()).abs().max().item() if want.numel() else 0.0
    if diff != diff:  # NaN
        return float("inf")
    if scale is None:
        scale = want.detach().double().abs().max().item() if want.numel() else 0.0
    unit = torch.finfo(want.dtype).eps * scale
    return 0.0 if diff == 0 else diff / unit if unit > 0 else float("inf")


def within_rounding(got: torch.Tensor, want: torch.Tensor, units: float, scale: float | None = None) -> bool:
    """``got`` has ``want``'s shape and differs from it by at most ``units`` × eps(dtype) × ``scale`` (default
    max|want|) everywhere (``rounding_error``): equal up to summation order, whatever order the CPU adds in."""
    return rounding_error(got, want, scale) <= units


def show_hint(hints: dict[int, str], level: int) -> str:
    """Print (and return) tier ``level`` of a lab's ``hints`` (1 the idea ... 3 nearly the code): every
    checker's ``hint(level)`` is this, with its own hints."""
    if level not in hints:
        raise ValueError(f"hint level {level!r}: choose one of {sorted(hints)} (each says more than the one before)")
    print(f"hint {level}/{len(hints)}:\n{hints[level]}")
    return hints[level]
