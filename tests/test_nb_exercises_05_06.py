"""The checked exercises of notebooks 05 (fp8 with one scale per channel) and 06 (MFU against HFU): the notebook's
stub fails its checker with a hint, each classic mistake gets its pointed message, the reference solution passes,
and the notebook wires them as the labs do (USE_SOLUTION, a check cell ``workbench labs check`` grades). Also what
notebook 06 measures with lab 06's machinery: save-matmuls keeps less than none and recomputes no matmul FLOP."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
import torch

from workbench.labs import LabCheckFailed
from workbench.labs.grading import EXERCISE
from workbench.labs.nb05_fp8 import check_per_channel, other_channels_error, per_channel_reference
from workbench.labs.nb06_utilisation import check_utilisation, compare_policies
from workbench.parallel.precision import fp8_round_trip

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "labs") not in sys.path:  # the reference solutions live beside the labs, outside the workbench package
    sys.path.insert(0, str(ROOT / "labs"))

from solutions.nb05_fp8 import fp8_per_channel  # noqa: E402
from solutions.nb06_utilisation import utilisation  # noqa: E402

pytestmark = pytest.mark.timeout(240)  # single-process checks: a second each, more on a loaded CPU
E4M3_MAX = 448.0
NOTEBOOKS = {"05": ("05_mixed_precision.ipynb", "fp8_per_channel", check_per_channel),
             "06": ("06_activation_recomputation.ipynb", "utilisation", check_utilisation)}


def _cells(number: str) -> list:
    return nbformat.read(ROOT / "notebooks" / NOTEBOOKS[number][0], as_version=4).cells


def _stub(number: str):
    """The notebook's own stub, executed from its cell."""
    name = NOTEBOOKS[number][1]
    (source,) = [c.source for c in _cells(number) if c.cell_type == "code" and c.source.startswith(f"def {name}(")]
    namespace = {"torch": torch}
    exec(source, namespace)  # noqa: S102 -- the notebook's stub cell, from this repository
    return namespace[name]


@pytest.mark.parametrize("number", sorted(NOTEBOOKS))
def test_notebook_stub_fails_its_checker_with_a_hint(number):
    check = NOTEBOOKS[number][2]
    with pytest.raises(LabCheckFailed, match=r"still the stub.*hint\(1\)"):
        check(_stub(number))


@pytest.mark.parametrize("number", sorted(NOTEBOOKS))
def test_notebook_wires_the_exercise_as_the_labs_do(number):
    """USE_SOLUTION is a parameter, its cell imports the solution, and the check cell is an exercise for
    ``workbench labs check`` that a headless run steps past (tagged raises-exception)."""
    cells, name, check = _cells(number), NOTEBOOKS[number][1], NOTEBOOKS[number][2]
    (params,) = [c for c in cells if "parameters" in c.metadata.get("tags", [])]
    assert "USE_SOLUTION = False" in params.source
    assert any(f"import {name}" in c.source and "if USE_SOLUTION:" in c.source for c in cells)
    (check_cell,) = [c for c in cells if c.cell_type == "code" and c.source.startswith(f"{check.__name__}(")]
    assert EXERCISE.search(check_cell.source)
    assert "raises-exception" in check_cell.metadata.get("tags", [])


# -- notebook 05: fp8 with one scale per channel ----------------------------------------------------------------

def test_fp8_solution_passes_and_matches_the_definition(capsys):
    check_per_channel(fp8_per_channel)
    assert "✓" in capsys.readouterr().out
    x = torch.randn(16, 8, device="cpu")
    x[:, 2] *= 1e5
    got, want = fp8_per_channel(x), per_channel_reference(x)
    # The same e4m3 values; the divisions by a float32 against a float64 scale differ by float32 rounding only.
    assert torch.allclose(got, want, rtol=1e-6, atol=0)


def test_per_tensor_scaling_damages_the_other_channels_at_1e5():
    """The demo's claim: at 1000x an outlier the other channels do not notice, at 1e5x their error is 10x."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(128, 64, generator=g, device="cpu")
    base = other_channels_error(fp8_round_trip(x), x)
    errors = {}
    for factor in (1e3, 1e5):
        y = x.clone()
        y[:, 0] *= factor
        errors[factor] = other_channels_error(fp8_round_trip(y), y)
        assert other_channels_error(fp8_per_channel(y), y) < 1.2 * base  # per channel: unaffected
    assert errors[1e3] < 1.2 * base < 5 * base < errors[1e5]


def _scaled(x: torch.Tensor, amax_dims, divide: bool = True, zero_guard: bool = True) -> torch.Tensor:
    amax = x.abs().amax(dim=amax_dims, keepdim=True)
    scale = torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax)) if zero_guard else E4M3_MAX / amax
    q = (x * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return q / scale if divide else q


FP8_MISTAKES = {
    "per-tensor": (lambda x: fp8_round_trip(x), "one scale for the whole tensor"),
    "per-row": (lambda x: _scaled(x, -1), "one scale per row"),
    "no division": (lambda x: _scaled(x, tuple(range(x.dim() - 1)), divide=False), "not divided by the scale"),
    "zero channel": (lambda x: _scaled(x, tuple(range(x.dim() - 1)), zero_guard=False), "channel of zeros"),
    "no scaling": (lambda x: fp8_round_trip(x, scaled=False), "no scaling at all"),
    "half dtype": (lambda x: fp8_per_channel(x).half(), "dtype torch.float32"),
    "identity": (lambda x: x.clone(), "values differ from e4m3"),
}


@pytest.mark.parametrize("mistake", sorted(FP8_MISTAKES))
def test_fp8_mistakes_are_named(mistake):
    fn, message = FP8_MISTAKES[mistake]
    with pytest.raises(LabCheckFailed, match=message):
        check_per_channel(fn)


# -- notebook 06: MFU against HFU --------------------------------------------------------------------------------

def test_utilisation_solution_passes(capsys):
    check_utilisation(utilisation)
    out = capsys.readouterr().out
    assert "MFU  30.0%   HFU  40.0%" in out  # full recomputation: 6e14 / (2.02 s · 989.4e12) and 8e14 / the same


UTIL_MISTAKES = {
    "mfu from executed": (lambda f, e, t, p: (e / (t * p), e / (t * p)), "MFU counted the executed FLOPs"),
    "no backward": (lambda f, e, t, p: (f / (t * p), e / (t * p)), "left the backward out"),
    "percent": (lambda f, e, t, p: (300 * f / (t * p), 100 * e / (t * p)), "returned percent"),
    "hfu is mfu": (lambda f, e, t, p: (3 * f / (t * p), 3 * f / (t * p)), "HFU equals MFU"),
    "hfu is 4F": (lambda f, e, t, p: (3 * f / (t * p), 4 * f / (t * p)), "HFU assumed 4 x forward_flops"),
    "swapped": (lambda f, e, t, p: (e / (t * p), 3 * f / (t * p)), "wrong way round"),
    "not a pair": (lambda f, e, t, p: 0.3, "return a pair"),
}


@pytest.mark.parametrize("mistake", sorted(UTIL_MISTAKES))
def test_utilisation_mistakes_are_named(mistake):
    fn, message = UTIL_MISTAKES[mistake]
    with pytest.raises(LabCheckFailed, match=message):
        check_utilisation(fn)


def test_save_matmuls_sits_between_none_and_full():
    """What notebook 06 asserts, on a smaller block: save-matmuls keeps 50-80 % of none's bytes and recomputes no
    matmul FLOP, full recomputes exactly one forward, and every policy's gradients equal none's bit for bit."""
    from workbench.labs.nb06_utilisation import forward_flops
    from workbench.models import GPTConfig, build_gpt

    cfg = GPTConfig.preset("tiny", seq_len=32)
    block = build_gpt(cfg, seed=0).blocks[0]
    x = torch.randn(2, 32, cfg.d_model, generator=torch.Generator(device="cpu").manual_seed(0), device="cpu")
    runs = compare_policies(block, x, repeats=1)
    none, full, sac = runs["none"], runs["full"], runs["save matmuls"]
    assert all(r.grads_equal for r in runs.values())
    assert sac.recomputed_flops == 0 and full.recomputed_flops == forward_flops(block, x) > 0
    assert full.kept_bytes < sac.kept_bytes and 0.5 < sac.kept_bytes / none.kept_bytes < 0.8
    with pytest.raises(ValueError, match="repeats"):
        compare_policies(block, x, repeats=0)
