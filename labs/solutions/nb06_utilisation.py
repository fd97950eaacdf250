"""Reference solution of notebook 06's exercise (``notebooks/06_activation_recomputation.ipynb``): model and hardware
FLOPs utilisation. Kept beside the labs, outside the ``workbench`` package."""

from __future__ import annotations


def utilisation(forward_flops: float, executed_flops: float, seconds: float,
                peak_flops: float) -> tuple[float, float]:
    """(MFU, HFU) as fractions: the model's 3 x forward FLOPs, and the FLOPs executed (recomputation included),
    each over what the peak allows in ``seconds``."""
    budget = seconds * peak_flops
    return 3 * forward_flops / budget, executed_flops / budget
