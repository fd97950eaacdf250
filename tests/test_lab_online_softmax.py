"""Lab 14 checker: the stub and each typical mistake in the online-softmax merge get their pointed message (all
on one process, before the ring); the reference solution passes every case, the ring on 4 gloo ranks included."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from workbench.labs import LabCheckFailed
from workbench.labs.online_softmax import ROUNDING_UNITS, check

LABS = Path(__file__).resolve().parent.parent / "labs"
if str(LABS) not in sys.path:  # the reference solutions live beside the labs, outside the workbench package
    sys.path.insert(0, str(LABS))

from solutions.online_softmax import merge  # noqa: E402

pytestmark = pytest.mark.timeout(240)
NEG_INF = float("-inf")


def stub(out, lse, out_b, lse_b):
    raise NotImplementedError("merge the two blocks")


def _safe_max(lse, lse_b):
    m = torch.maximum(lse, lse_b)
    return m.masked_fill(m == NEG_INF, 0.0)


def no_rescale_of_old(out, lse, out_b, lse_b):
    """The new block weighted by its share, the running output left as it was."""
    lse_new = torch.logaddexp(lse, lse_b)
    return out + torch.exp(lse_b - lse_new)[..., None] * out_b, lse_new


def exp_without_subtracting(out, lse, out_b, lse_b):
    """The max is taken for the lse, but the weights exponentiate the raw lse: right until e^lse overflows."""
    m = _safe_max(lse, lse_b)
    lse_new = m + torch.log(torch.exp(lse - m) + torch.exp(lse_b - m))
    w, w_b = torch.exp(lse)[..., None], torch.exp(lse_b)[..., None]
    return (w * out + w_b * out_b) / (w + w_b), lse_new


def adds_lse(out, lse, out_b, lse_b):
    lse_new = lse + lse_b
    return torch.exp(lse - lse_new)[..., None] * out + torch.exp(lse_b - lse_new)[..., None] * out_b, lse_new


def keeps_max(out, lse, out_b, lse_b):
    right_out, _ = merge(out, lse, out_b, lse_b)
    return right_out, torch.maximum(lse, lse_b)


def nan_on_empty_rows(out, lse, out_b, lse_b):
    """Stable, but the max of two -inf rows is not guarded: -inf - (-inf) = NaN."""
    m = torch.maximum(lse, lse_b)
    w, w_b = torch.exp(lse - m), torch.exp(lse_b - m)
    return (w[..., None] * out + w_b[..., None] * out_b) / (w + w_b)[..., None], m + torch.log(w + w_b)


def swapped_weights(out, lse, out_b, lse_b):
    lse_new = torch.logaddexp(lse, lse_b)
    return torch.exp(lse_b - lse_new)[..., None] * out + torch.exp(lse - lse_new)[..., None] * out_b, lse_new


def unnormalised(out, lse, out_b, lse_b):
    m = _safe_max(lse, lse_b)
    w, w_b = torch.exp(lse - m), torch.exp(lse_b - m)
    return w[..., None] * out + w_b[..., None] * out_b, m + torch.log(w + w_b)


def averages(out, lse, out_b, lse_b):
    return (out + out_b) / 2, torch.logaddexp(lse, lse_b)


def one_tensor(out, lse, out_b, lse_b):
    return merge(out, lse, out_b, lse_b)[0]


def keepdim_lse(out, lse, out_b, lse_b):
    out_new, lse_new = merge(out, lse, out_b, lse_b)
    return out_new, lse_new[..., None]


def fails_on_ranks(out, lse, out_b, lse_b):
    if torch.distributed.is_initialized():
        raise RuntimeError("only on a rank")
    return merge(out, lse, out_b, lse_b)


def test_the_reference_solution_passes(capsys) -> None:
    check(merge)
    out = capsys.readouterr().out
    assert out.startswith("Correct:") and f"(allowed {ROUNDING_UNITS})" in out


@pytest.mark.parametrize("fn, message", [
    (stub, "still the stub"),
    (no_rescale_of_old, "the running output was not rescaled"),
    (exp_without_subtracting, "exp\\(lse\\) overflows float32"),
    (adds_lse, "lse \\+ lse_b: adding two log-sum-exps multiplies"),
    (keeps_max, "the merged lse is the larger of the two"),
    (nan_on_empty_rows, "neither side has seen a key .* came out NaN"),
    (swapped_weights, "the weights are swapped"),
    (unnormalised, "the weights are not normalised"),
    (averages, "you averaged the two outputs"),
    (one_tensor, "must return a pair \\(out, lse\\) of tensors, got Tensor"),
    (keepdim_lse, "lse has no last dimension"),
], ids=lambda v: getattr(v, "__name__", "msg"))
def test_each_mistake_gets_its_message(fn, message: str) -> None:
    with pytest.raises(LabCheckFailed, match=message) as info:
        check(fn)
    assert "hint(1)" in str(info.value)


def test_an_error_on_the_ranks_is_reported_with_its_traceback() -> None:
    # Every rank raises; which one the launcher reports first is a race, so any rank's name will do.
    with pytest.raises(LabCheckFailed, match=r"the ring on 4 ranks failed: rank \d failed: RuntimeError") as info:
        check(fails_on_ranks)
    assert "only on a rank" in str(info.value)


def test_a_side_with_no_key_must_contribute_nothing() -> None:
    """Rows that saw no key merged without NaN but not as the other side alone: named as such."""
    def zero_lse_for_empty(out, lse, out_b, lse_b):
        return merge(out, lse.clamp_min(0.0), out_b, lse_b.clamp_min(0.0))

    with pytest.raises(LabCheckFailed, match="A side with lse = -inf has seen no key"):
        check(zero_lse_for_empty)
