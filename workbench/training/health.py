"""Training health: is this run learning, and is it learning from the right data?

The signals a course on training at scale asks a learner to watch, each measured here:

* NaN/Inf and loss spikes (``SpikeDetector``): a loss far above the recent median, or a non-finite loss or
  gradient norm. The actions are the ones large runs use: ``warn``; ``rollback`` to the newest checkpoint and
  skip the batches that led to the spike (PaLM restarted about 100 steps before a spike and skipped 200-500
  batches, Chowdhery et al. 2022 §5.1; OPT-175B's logbook shows the same by hand); ``stop``.
* A validation split the sampler never serves (``split_windows``): the corpus's last windows, after a guard
  window, so no training window shares a token with it (a contaminated eval set looks like learning). The
  split is checked from token ranges (``check_split``), not assumed.
* Duplicated data shards (``check_disjoint``): the windows each data-parallel rank really drew in a step,
  gathered and checked disjoint (a rank with the wrong dp rank or seed trains on its neighbour's data and the
  run silently sees a smaller batch).
* Stragglers (``stragglers``): each rank's median step time against the others'.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

SPIKE_ACTIONS = ("warn", "rollback", "stop")
GUARD_WINDOWS = 1  # window i's targets end on the first token of window i+1: one window apart, nothing shared


@dataclass(frozen=True)
class Split:
    """Windows ``[0, train)`` train; ``[val_start, total)`` validate; the guard in between is unused."""

    train: int
    val_start: int
    total: int

    @property
    def val_windows(self) -> range:
        return range(self.val_start, self.total)


def split_windows(total: int, val_fraction: float) -> Split:
    """Hold out the last ``val_fraction`` of ``total`` windows (at least one) behind a guard window."""
    if not (isinstance(val_fraction, (int, float)) and 0 < val_fraction < 1):
        raise ValueError(f"val_fraction must be a number in (0, 1), got {val_fraction!r}")
    n_val = max(1, int(total * val_fraction))
    train = total - n_val - GUARD_WINDOWS
    if train < 1:
        raise ValueError(f"{total} windows leave none to train on after holding out {n_val} for validation; "
                         f"use a smaller val_fraction or a shorter seq_len")
    return Split(train, total - n_val, total)


def window_tokens(index: int, seq_len: int) -> range:
    """The token positions window ``index`` reads: inputs ``[i*T, (i+1)*T)`` and targets shifted by one."""
    return range(index * seq_len, (index + 1) * seq_len + 1)


def check_split(split: Split, seq_len: int) -> None:
    """``ValueError`` if any training window shares a token position with a validation window."""
    last_train = window_tokens(split.train - 1, seq_len)[-1]
    first_val = window_tokens(split.val_start, seq_len)[0]
    if last_train >= first_val:
        raise ValueError(f"contaminated validation split: training window {split.train - 1} reads token "
                         f"{last_train}, validation starts at token {first_val}")


def check_disjoint(per_rank: Sequence[Sequence[int]], step: int) -> None:
    """``ValueError`` naming the ranks and windows when data-parallel ranks drew the same windows in a step."""
    owner: dict[int, int] = {}
    for rank, windows in enumerate(per_rank):
        for w in windows:
            if w in owner and owner[w] != rank:
                raise ValueError(f"duplicated data shard at step {step}: data-parallel ranks {owner[w]} and {rank} "
                                 f"both drew window {w}; check each rank's dp rank and the sampler's seed")
            owner[w] = rank


def stragglers(step_times: Sequence[Sequence[float]], factor: float = 1.2,
               compute_times: Sequence[Sequence[float]] | None = None) -> dict[str, Any]:
    """Each rank's median step time; ranks slower than ``factor`` x the median of medians are stragglers.

    In synchronous training every rank's step lasts as long as the slowest one's (they all wait for it at each
    collective), so step times cannot name the straggler. With ``compute_times`` (each rank's forward, backward and
    optimizer seconds per step) the verdict is made on those, and each rank's median wait (step minus compute) says
    who waited for it and for how long."""
    medians = _medians(step_times)
    judged = medians if compute_times is None else _medians(compute_times)
    finite = [m for m in judged if math.isfinite(m)]
    typical = statistics.median(finite) if finite else math.nan
    slow = [r for r, m in enumerate(judged) if math.isfinite(m) and m > factor * typical]
    out = {"median_step_time_s": medians, "typical_s": typical, "factor": factor, "stragglers": slow,
           "judged_on": "step_time" if compute_times is None else "compute"}
    if compute_times is not None:
        out["median_compute_s"] = judged
        out["median_wait_s"] = [s - c for s, c in zip(medians, judged, strict=True)]
    return out


def _medians(per_rank: Sequence[Sequence[float]]) -> list[float]:
    return [statistics.median(times) if times else math.nan for times in per_rank]


@dataclass
class SpikeDetector:
    """Flags a step whose loss is non-finite, whose gradient norm is non-finite, or whose loss exceeds
    ``factor`` x the median of the last ``window`` healthy losses (after ``warmup`` healthy steps).

    Every rank sees the same (data-parallel averaged) loss, so every rank reaches the same verdict without
    communicating.
    """

    factor: float = 2.0
    window: int = 20
    warmup: int = 5
    recent: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        if not (isinstance(self.factor, (int, float)) and self.factor > 1):
            raise ValueError(f"spike factor must be a number > 1, got {self.factor!r}")
        for name in ("window", "warmup"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"spike {name} must be an int >= 1, got {value!r}")
        self.recent = deque(self.recent, maxlen=self.window)

    def check(self, loss: float, grad_norm: float) -> str | None:
        """The reason this step is unhealthy, or None (and the loss joins the healthy history)."""
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if not math.isfinite(grad_norm):
            return f"gradient norm is {grad_norm}"
        if len(self.recent) >= self.warmup:
            median = statistics.median(self.recent)
            if loss > self.factor * median:
                return f"loss spike: {loss:.4g} > {self.factor:g} x the recent median {median:.4g}"
        self.recent.append(loss)
        return None

    def reset(self) -> None:
        self.recent.clear()


MAX_ROLLBACKS = 3  # a spike that comes back after this many rollbacks stops the run: it is not transient


@dataclass
class HealthMonitor:
    """The run's policy on an unhealthy step (``--on-spike``), and the record of what it did.

    ``verdict`` checks a step's metrics with a ``SpikeDetector`` and returns None (healthy) or the action: the
    configured one, except that a rollback with no checkpoint to go back to, or after ``MAX_ROLLBACKS`` tries,
    becomes a stop (PaLM rolls back and skips batches, Chowdhery et al. 2022 §5.1; a spike that keeps coming back
    is not transient). ``events`` is what summary.json reports under ``health``.
    """

    on_spike: str = "warn"
    factor: float = 3.0
    events: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: int = 0

    def __post_init__(self) -> None:
        if self.on_spike not in SPIKE_ACTIONS:
            raise ValueError(f"on_spike={self.on_spike!r}; valid: {', '.join(SPIKE_ACTIONS)}")
        self.detector = SpikeDetector(factor=self.factor)

    def verdict(self, metrics: dict[str, Any], has_checkpoint: Callable[[], bool]) -> tuple[str, str] | None:
        """(problem, action) for an unhealthy step, recorded in ``events``; None for a healthy one.
        ``has_checkpoint`` is asked only when a rollback is due (it may read the checkpoint folder)."""
        problem = self.detector.check(metrics["loss"], metrics["grad_norm"])
        if problem is None:
            return None
        action = self.on_spike
        if action == "rollback" and not (self.rollbacks < MAX_ROLLBACKS and has_checkpoint()):
            action = "stop"
        self.events.append({"step": metrics["step"], "problem": problem, "action": action})
        return problem, action

    def rolled_back(self, to_step: int) -> None:
        """The rollback was done: the history restarts from ``to_step``'s checkpoint."""
        self.events[-1]["rolled_back_to_step"] = to_step
        self.detector.reset()
        self.rollbacks += 1
