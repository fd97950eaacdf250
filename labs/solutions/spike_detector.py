"""Reference solution of lab 11 (``labs/11_spike_nan_detector.ipynb``): a spike/NaN/divergence detector over a
run's loss and gradient-norm stream. Kept beside the labs, outside the ``workbench`` package.

Three tests per step, cheapest and surest first: a non-finite loss or gradient norm (no history needed); a spike,
one loss far above the median of the recent healthy losses (a median, because the history it summarises may
itself hold an outlier); a divergence, the *level* of the loss (the median of the last few steps, which one spike
cannot move) risen well above the best level the run has reached. A spike's loss joins neither history, so it
cannot raise the baseline that the next spike is judged by. The gradient norm serves only the NaN test: healthy
runs show gradient-norm jumps of 10-25x with a steady loss.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class Detector:
    """``observe(loss, grad_norm)`` once per step: ``"nan"``, ``"spike"``, ``"divergence"`` or None."""

    def __init__(self, warmup: int = 10, window: int = 20, spike_factor: float = 1.5, level_steps: int = 5,
                 rise: float = 1.1) -> None:
        self.warmup, self.spike_factor, self.rise = warmup, spike_factor, rise
        self.recent: deque[float] = deque(maxlen=window)  # healthy losses: the spike test's baseline
        self.last: deque[float] = deque(maxlen=level_steps)  # the level: a median one outlier cannot move
        self.best = math.inf  # the lowest level so far
        self.steps = 0

    def observe(self, loss: float, grad_norm: float) -> str | None:
        self.steps += 1
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return "nan"
        warm = self.steps > self.warmup
        if warm and loss > self.spike_factor * statistics.median(self.recent):
            return "spike"
        self.recent.append(loss)
        self.last.append(loss)
        if len(self.last) == self.last.maxlen:
            level = statistics.median(self.last)
            if warm and level > self.rise * self.best:
                return "divergence"
            self.best = min(self.best, level)
        return None
