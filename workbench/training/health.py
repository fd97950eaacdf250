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
* Silent data corruption (``fingerprint``, ``compare_fingerprints``): data-parallel replicas must hold the same
  bits; a flipped bit in one rank's memory changes no loss enough to be seen and crashes nothing. Every
  ``--sdc-check-every`` steps each replica fingerprints what must be identical, the fingerprints are gathered and
  compared, and the ranks that disagree with the majority are named (Meta and Google both report silent data
  corruption in their fleets at roughly one machine per thousand: Dixit et al. 2021, Hochschild et al. 2021).
* Corrupted batches, for teaching (``corrupted_corpus``): a copy of the corpus in which the windows the sampler
  serves at chosen steps are random characters, so a run's loss spikes (or, corrupted a little more each step,
  rises for good) from bad data, a real mechanism (notebook 11, lab 11's recorded runs).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

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


#: A tensor's words are summed in this many contiguous blocks, each then weighted by its index: one pass over memory
#: (a strided split costs up to 25x more on a CPU, measured), position-dependent across blocks.
_BLOCKS = 64


@lru_cache(maxsize=16)
def _block_weights(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(1, n + 1, dtype=torch.int32, device=device)  # cached: made once per length and device


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as a flat integer tensor of its widest whole word (int32 for fp32/fp64, int16 for bf16/fp16)."""
    flat = t.detach().reshape(-1)
    size = flat.element_size()
    return flat.view(torch.int32 if size % 4 == 0 else torch.int16 if size % 2 == 0 else torch.int8)


def fingerprint(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """An ``(len(tensors), 2)`` int32 fingerprint of the tensors' bits, on ``device``: per tensor, the sum of its
    words and the block-index-weighted sum of its 64 block sums. Integer sums wrap modulo 2**32, which keeps them
    exact and independent of the order the device adds in (equal bits: equal fingerprints, on any hardware), and a
    flipped bit changes one word by +-2**b, never 0 modulo 2**32: the first sum always sees it. Computed from the
    bits, not the values, so no tolerance is needed: replicas agree exactly or not at all. One pass per tensor
    (a float64 or int64 sum costs about 25x more on a CPU: it converts every element; this sum is vectorized)."""
    rows = []
    for t in tensors:
        words = _words(t)
        blocks = min(_BLOCKS, words.numel()) or 1
        whole = words.numel() // blocks * blocks
        parts = torch.cat([words[:whole].view(blocks, -1).sum(1, dtype=torch.int32),
                           words[whole:].to(torch.int32)])  # the tail: fewer than 64 words, each a part of its own
        weighted = (parts * _block_weights(parts.numel(), device)).sum(dtype=torch.int32)
        rows.append(torch.stack([parts.sum(dtype=torch.int32), weighted]))
    return torch.stack(rows) if rows else torch.zeros((0, 2), dtype=torch.int32, device=device)


def compare_fingerprints(per_rank: Sequence[Sequence[Sequence[int]]], names: Sequence[str]) -> list[dict[str, Any]]:
    """For each tensor whose fingerprints differ across ranks: its name, the ranks that disagree with the majority
    and whether there was one. With no strict majority (2 replicas, or a three-way split) every rank whose value
    is not shared by all is named: nothing says which side is right."""
    out = []
    for i, name in enumerate(names):
        values = [tuple(rank[i]) for rank in per_rank]
        top, count = Counter(values).most_common(1)[0]
        if count == len(values):
            continue
        majority = 2 * count > len(values)
        bad = [r for r, v in enumerate(values) if v != top] if majority else list(range(len(values)))
        out.append({"tensor": name, "ranks": bad, "majority": majority})
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

    ``sdc_verdict`` applies the same policy to a replica mismatch (``compare_fingerprints``) and records each
    detection in ``sdc`` (summary.json's ``health.sdc``).
    """

    on_spike: str = "warn"
    factor: float = 3.0
    events: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: int = 0
    sdc: list[dict[str, Any]] = field(default_factory=list)

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
        action = self._action(has_checkpoint)
        self.events.append({"step": metrics["step"], "problem": problem, "action": action})
        return problem, action

    def sdc_verdict(self, step: int, mismatches: Sequence[dict[str, Any]],
                    has_checkpoint: Callable[[], bool]) -> tuple[str, str] | None:
        """(problem, action) when replicas disagree after ``step`` (recorded in ``sdc`` and ``events``); None if
        they agree. The action is ``--on-spike``'s: a corrupted replica is as unhealthy as a spike, and the remedy
        is the same (rollback reloads the newest checkpoint, which was written only after a passing check)."""
        if not mismatches:
            return None
        ranks = sorted({r for m in mismatches for r in m["ranks"]})
        tensors = [m["tensor"] for m in mismatches]
        majority = all(m["majority"] for m in mismatches)
        who = (f"rank(s) {ranks} disagree with the majority" if majority else
               f"ranks {ranks} disagree (no majority to say which is wrong)")
        shown = ", ".join(tensors[:3]) + (f" and {len(tensors) - 3} more" if len(tensors) > 3 else "")
        problem = f"silent data corruption: {who} on {shown}"
        action = self._action(has_checkpoint)
        self.sdc.append({"step": step, "ranks": ranks, "tensors": tensors, "majority": majority, "action": action})
        self.events.append({"step": step, "problem": problem, "action": action})
        return problem, action

    def _action(self, has_checkpoint: Callable[[], bool]) -> str:
        """The configured action, except that a rollback with nothing to go back to, or too many, is a stop."""
        if self.on_spike == "rollback" and not (self.rollbacks < MAX_ROLLBACKS and has_checkpoint()):
            return "stop"
        return self.on_spike

    def rolled_back(self, to_step: int) -> None:
        """The rollback was done: the history restarts from ``to_step``'s checkpoint."""
        self.events[-1]["rolled_back_to_step"] = to_step
        self.detector.reset()
        self.rollbacks += 1


def step_windows(num_windows: int, global_batch: int, step: int, seed: int = 0) -> list[int]:
    """The windows the run's sampler serves at ``step`` (every data-parallel rank's, in rank order): the sampler is
    a pure function of (seed, step), so a batch can be found, and corrupted, before the run starts."""
    from workbench.data import ShardedSampler

    return ShardedSampler(num_windows, global_batch, seed=seed).global_indices(step)


def corrupt_windows(text: str, windows: Sequence[int], seq_len: int, seed: int = 0) -> str:
    """``text`` (ASCII: one byte per token) with the input tokens of ``windows`` replaced by random printable
    characters, a corrupted batch: what a bad shard or a broken decompressor feeds a run. Window i's inputs are
    tokens ``[i*T, (i+1)*T)``; the previous window's last target (token i*T) changes too, one token in T."""
    if not text.isascii():
        raise ValueError("corrupt_windows needs an ASCII text (one byte per token); this one has multi-byte "
                         "characters")
    g = torch.Generator(device="cpu").manual_seed(seed)
    chars = list(text)
    for w in windows:
        start, stop = w * seq_len, (w + 1) * seq_len
        if w < 0 or stop > len(chars):
            raise ValueError(f"window {w} of {seq_len} tokens lies outside the text's {len(chars)} tokens")
        noise = torch.randint(32, 127, (seq_len,), generator=g, device="cpu").tolist()
        chars[start:stop] = map(chr, noise)
    return "".join(chars)


def corrupted_corpus(cfg: Any, path: str, batches: Mapping[int, int], seed: int = 0) -> list[int]:
    """Write to ``path`` the corpus ``cfg`` trains on with ``batches[step]`` windows of each listed step's global
    batch corrupted (``corrupt_windows``; a count above the batch corrupts all of it), and return the corrupted
    windows. Run ``cfg`` with ``data=path`` and the loss responds to a real mechanism, bad data, not a planted
    number: one whole batch gives a spike at its step, a growing share of every batch a sustained rise. The
    train/validation split is ``cfg``'s, so the windows are the ones its sampler really serves."""
    from workbench.data import load_corpus

    seq_len = cfg.gpt_config().seq_len
    text = load_corpus(cfg.data)
    total = (len(text) - 1) // seq_len  # TokenDataset's window count: targets need one token more
    train = split_windows(total, cfg.val_fraction).train if cfg.val_every else total
    windows = [w for step, count in sorted(batches.items()) if count > 0
               for w in step_windows(train, cfg.batch_size, step, cfg.seed)[:count]]
    with open(path, "w", encoding="utf-8") as f:
        f.write(corrupt_windows(text, windows, seq_len, seed))
    return windows
