"""Checker for lab 14: the online-softmax merge of two attention blocks, the step ring attention repeats.

The learner writes ``merge(out, lse, out_b, lse_b) -> (out, lse)``: given attention over one set of keys (``out``
[..., T, d], each row a softmax-weighted average of those keys' values, and ``lse`` [..., T], the log-sum-exp of
those scores) and the same for a new block of keys (``out_b``, ``lse_b``), return attention over the union of
the two sets. A row that saw no key has ``lse = -inf`` and ``out = 0``. That one merge, repeated block after
block, is how ring attention (``workbench.parallel.context``, Liu et al. 2023) and FlashAttention (Dao et al. 2022)
attend over a sequence no device holds whole (Milakov & Gimelshein 2018, "Online normalizer calculation for
softmax").

``check(merge)`` runs four cases, in this order, so that each kind of mistake is named by the first case that
shows it:

1. **the algebra**: two blocks of moderate scores (|s| of a few units, where any formula's exponentials are
   finite), merged once: a wrong ``lse`` (added, kept the larger, returned unchanged) or a wrong ``out`` (the
   running output not rescaled, the weights swapped or not normalised, the outputs summed or averaged);
2. **stability**: four blocks of scores up to ~±850, folded left to right: exp of a raw lse overflows float32
   above 88.7, and inf/inf is NaN;
3. **rows that saw no key** (``lse = -inf``): the empty start (zeros, -inf) merged with a block, a block whose
   rows are partly masked merged into a running result, and both sides empty: -inf − (-inf) is NaN;
4. **a ring on real ranks**: causal attention over a zigzag-split sequence on 4 gloo ranks (``launch``), the K/V
   blocks travelling by ``comm.isend``/``comm.irecv`` as in ``parallel.context``, each rank folding every block
   into its running result with the learner's ``merge``, starting from the empty state; the ranks' results,
   unsharded, against full attention on one process (large scores again, and rows a block hides entirely).

Every case compares with full attention computed in float64 from the same float32 scores (``attend``).

Tolerance: the merge runs in float32, and a merged weight e^(lse − lse_new) is exact only up to the rounding of
the lse's themselves, which is relative to their size (an lse of 400 carries an absolute error of ~400·eps), so a
merged output differs from full attention by a few eps × max|v| × max(1, max|lse|), and an lse by a few eps ×
max(1, max|lse|). The checker allows ``ROUNDING_UNITS`` such units (``workbench.labs.rounding_error`` with that
scale). Measured with the reference solution (x86 CPU, default ISA): at most 0.5 units for out and 1.3 for lse
(the ring's) over the four cases; every mistake the checker names is off by 10⁵ units or more (a missing
rescale, swapped weights) or turns into NaN / inf.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from workbench.labs import LabCheckFailed, rounding_error, show_hint

WORLD = 4  # ranks of the ring in case 4
RING_SEQ, RING_LAYOUT = 32, "zigzag"  # 4 tokens per chunk, 2 chunks per rank
BATCH, HEADS, HEAD_DIM = 2, 2, 8
ROWS, KEYS = 8, 8  # queries of the one-process cases, keys per block
LARGE = 200.0  # cases 2 and 4 multiply the queries by this: scores up to ~±850, exp overflows float32 above 88.7
ROUNDING_UNITS = 64  # see the module docstring: 1.3 measured, mistakes >= 1e5 or NaN
TIMEOUT = 60.0
MORE = " (more help: hint(1), hint(2), hint(3))"
NEG_INF = -math.inf

HINTS = {
    1: "Each block's out_b is already a weighted average of that block's values, with weights e^s / Σ e^s "
       "over its own keys, and e^(lse_b) is that block's denominator Σ e^s. Over the union of the two blocks "
       "the denominator is the sum of the two denominators, so each block's average keeps its place but counts "
       "in proportion to its share of the total. Then make it safe: never exponentiate an lse itself, only "
       "differences, and think about what a row with lse = -inf on both sides must give.",
    2: "With m = max(lse, lse_b): the merged lse is m + log(e^(lse - m) + e^(lse_b - m)) (the log of the summed "
       "denominators, with the larger factored out so that the largest exponential is e^0 = 1). The weights "
       "are w = e^(lse - lse_new) and w_b = e^(lse_b - lse_new); they sum to 1, and out_new = w * out + w_b * "
       "out_b (w, w_b broadcast over the last dimension of out). A row that has seen no key on either side has "
       "m = -inf, and -inf - (-inf) is NaN: shift such rows by 0 instead of m, so e^(-inf) = 0, the summed "
       "weight is 0, out stays 0 and lse stays log(0) = -inf.",
    3: "m = torch.maximum(lse, lse_b)\n"
       "m = m.masked_fill(m == float('-inf'), 0.0)          # rows with no key yet: shift by 0, no NaN\n"
       "w, w_b = torch.exp(lse - m), torch.exp(lse_b - m)   # <= 1: nothing overflows\n"
       "total = w + w_b\n"
       "lse_new = m + torch.log(total)                      # log(0) = -inf for rows still empty\n"
       "safe = torch.where(total > 0, total, torch.ones_like(total))\n"
       "out_new = (w[..., None] * out + w_b[..., None] * out_b) / safe[..., None]\n"
       "return out_new, lse_new",
}


def hint(level: int = 1) -> str:
    """Print (and return) hint ``level``: 1 the idea, 2 the formulas, 3 nearly the code."""
    return show_hint(HINTS, level)


# -- what the learner is given ------------------------------------------------------------------------------------

def attend(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over one block from its scores [..., T, K] (hidden pairs at -inf) and values [..., K, d]:
    (out [..., T, d], lse [..., T]), in the scores' dtype. A row with no visible key gets out 0 and lse -inf."""
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - lse.masked_fill(lse == NEG_INF, 0.0)[..., None])  # hidden pairs: e^(-inf) = 0
    return p @ v.to(scores.dtype), lse


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor | None = None,
                    k_pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_b, lse_b) of queries ``q`` [..., T, d] over one block of keys and values [..., K, d], scores
    q·k/√d; with positions, causal: key position > query position is hidden."""
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if q_pos is not None and k_pos is not None:
        scores = scores.masked_fill(q_pos[:, None] < k_pos[None, :], NEG_INF)
    return attend(scores, v)


def empty_state(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running (out, lse) before any block: zeros and -inf, for queries ``q`` [..., T, d]."""
    return torch.zeros_like(q), torch.full(q.shape[:-1], NEG_INF, dtype=q.dtype, device=q.device)


# -- the cases --------------------------------------------------------------------------------------------------

def _seeded(*shape: int, seed: int) -> torch.Tensor:
    # The checker's cases are drawn on the CPU, one process, so every run of the lab grades the same numbers.
    return torch.randn(*shape, generator=torch.Generator(device="cpu").manual_seed(seed), device="cpu")


def _problem(blocks: int, seed: int, large: bool) -> dict[str, Any]:
    """Queries, ``blocks`` blocks of keys and values, the fp32 scores of every block, and full attention over all
    of them in float64 from the same fp32 scores (the reference)."""
    q = _seeded(BATCH, HEADS, ROWS, HEAD_DIM, seed=seed) * (LARGE if large else 1.0)
    k = _seeded(BATCH, HEADS, blocks * KEYS, HEAD_DIM, seed=seed + 1)
    v = _seeded(BATCH, HEADS, blocks * KEYS, HEAD_DIM, seed=seed + 2)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
    return {"scores": scores, "v": v, "want": attend(scores.double(), v.double()),
            "blocks": [attend(scores[..., i * KEYS:(i + 1) * KEYS], v[..., i * KEYS:(i + 1) * KEYS, :])
                       for i in range(blocks)]}


def _call(merge: Callable, out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
          where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's merge on copies (an in-place update must not change the checker's inputs), its result
    checked for shape and type."""
    try:
        result = merge(out.clone(), lse.clone(), out_b.clone(), lse_b.clone())
    except NotImplementedError as error:
        raise LabCheckFailed(f"your merge is still the stub (NotImplementedError: {error}). Replace its body with "
                             "the merge.") from None
    except Exception as error:  # the learner's code: any error is theirs to see, pointed at the case
        raise LabCheckFailed(f"{where}: your merge raised {type(error).__name__}: {error}") from None
    if not (isinstance(result, tuple | list) and len(result) == 2
            and all(isinstance(t, torch.Tensor) for t in result)):
        got = (f"a {type(result).__name__} of {len(result)}" if isinstance(result, tuple | list)
               else type(result).__name__)
        raise LabCheckFailed(f"{where}: merge must return a pair (out, lse) of tensors, got {got}")
    got_out, got_lse = result
    if got_out.shape != out.shape or got_lse.shape != lse.shape:
        raise LabCheckFailed(f"{where}: merge returned out of shape {tuple(got_out.shape)} and lse of shape "
                             f"{tuple(got_lse.shape)}; they must keep the shapes of out {tuple(out.shape)} and lse "
                             f"{tuple(lse.shape)} (lse has no last dimension: one number per query row)")
    return got_out, got_lse


def _scales(want_out: torch.Tensor, want_lse: torch.Tensor) -> tuple[float, float]:
    """The rounding scales of the docstring: eps × max|out| × max(1, max|lse|) and eps × max(1, max|lse|)."""
    finite = want_lse[torch.isfinite(want_lse)]
    lse_size = max(1.0, finite.abs().max().item() if finite.numel() else 0.0)
    return max(want_out.abs().max().item(), 1e-30) * lse_size, lse_size


def _units(got_out: torch.Tensor, got_lse: torch.Tensor, want_out: torch.Tensor,
           want_lse: torch.Tensor) -> tuple[float, float]:
    """Differences in rounding units (out, lse); -inf rows of lse must be -inf exactly (out 0 there)."""
    out_scale, lse_scale = _scales(want_out, want_lse)
    empty = want_lse == NEG_INF
    if not torch.equal(got_lse == NEG_INF, empty):
        lse_units = math.inf
    else:
        lse_units = rounding_error(got_lse[~empty], want_lse[~empty].float(), lse_scale)
    return rounding_error(got_out, want_out.float(), out_scale), lse_units


def _bad(t: torch.Tensor) -> bool:
    return bool(torch.isnan(t).any() or (t == math.inf).any())


def _close(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return max(_units(*got, *want)) <= ROUNDING_UNITS


def _diagnose_algebra(got: tuple[torch.Tensor, torch.Tensor], a: tuple, b: tuple,
                      want: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """Case 1: name the mistake the learner's (out, lse) matches, or None when it is right."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    got_out, got_lse = got
    units_out, units_lse = _units(got_out, got_lse, *want)
    if units_out <= ROUNDING_UNITS and units_lse <= ROUNDING_UNITS:
        return None
    if _bad(got_out) or _bad(got_lse):
        return ("the merge gave NaN or inf on two ordinary blocks (scores of a few units, no -inf): look for a "
                "division by zero or a log of zero.")
    if units_lse > ROUNDING_UNITS:
        lse_candidates = {
            "the merged lse is lse + lse_b: adding two log-sum-exps multiplies their sums (log a + log b = "
            "log ab), but the keys of the two blocks add up: log(e^lse + e^lse_b)": lse_a + lse_b,
            "the merged lse is the larger of the two: the new keys' exponentials add to the old ones, so the "
            "merged lse is max + log(1 + e^(min - max)), larger than either": torch.maximum(lse_a, lse_b),
            "lse came back unchanged: the merged lse must count the new block's keys too": lse_a,
        }
        for why, candidate in lse_candidates.items():
            if _units(got_out, got_lse, want[0], candidate)[1] <= ROUNDING_UNITS:
                return why
    if units_out > ROUNDING_UNITS:
        lse_new = torch.logaddexp(lse_a, lse_b)
        w_a, w_b = torch.exp(lse_a - lse_new)[..., None], torch.exp(lse_b - lse_new)[..., None]
        m = torch.maximum(lse_a, lse_b)
        e_a, e_b = torch.exp(lse_a - m)[..., None], torch.exp(lse_b - m)[..., None]
        out_candidates = {
            "the running output was not rescaled: out holds weights normalised over the keys seen so far, and once "
            "the new block's keys join the sum every old weight shrinks by e^(lse - lse_new), so out must be "
            "multiplied by that factor too, not only out_b by its own": out_a + w_b * out_b,
            "the new block's output was not rescaled: out_b is normalised over its own keys only; multiply it by "
            "its share of the merged sum, e^(lse_b - lse_new)": w_a * out_a + out_b,
            "the weights are swapped: out must be weighted by its own share e^(lse - lse_new), out_b by "
            "e^(lse_b - lse_new)": w_b * out_a + w_a * out_b,
            "the weights are not normalised: after subtracting the max, e^(lse - m) and e^(lse_b - m) must still be "
            "divided by their sum (or take e^(lse - lse_new) directly)": e_a * out_a + e_b * out_b,
            "you added the two outputs: each is already an average over its own keys; weight each by its share "
            "of the merged sum, e^(lse - lse_new) and e^(lse_b - lse_new)": out_a + out_b,
            "you averaged the two outputs: that counts both blocks equally whatever their scores; weight each by "
            "its share of the merged sum, e^(lse - lse_new) and e^(lse_b - lse_new)": (out_a + out_b) / 2,
        }
        for why, candidate in out_candidates.items():
            if rounding_error(got_out, candidate, _scales(want[0], want[1])[0]) <= ROUNDING_UNITS:
                return why
    return (f"the merged {'out' if units_out > ROUNDING_UNITS else 'lse'} differs from attention over both blocks by "
            f"{max(units_out, units_lse):.3g} rounding units (allowed: {ROUNDING_UNITS}): out must be the average over "
            "all keys of both blocks, lse the log of the sum of all their exponentials.")


def _case_algebra(merge: Callable) -> None:
    problem = _problem(2, seed=10, large=False)
    a, b = problem["blocks"]
    got = _call(merge, *a, *b, "two blocks of moderate scores")
    why = _diagnose_algebra(got, a, b, problem["want"])
    if why is not None:
        raise LabCheckFailed(f"two blocks of moderate scores, merged once: {why}.")


def _fold(merge: Callable, blocks: list, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    state = blocks[0]
    for i, block in enumerate(blocks[1:], start=1):
        state = _call(merge, *state, *block, f"{where}, block {i}")
    return state


def _case_large(merge: Callable) -> None:
    problem = _problem(4, seed=20, large=True)
    got = _fold(merge, problem["blocks"], "four blocks of large scores")
    biggest = problem["scores"].abs().max().item()
    if _bad(got[0]) or _bad(got[1]):
        raise LabCheckFailed(f"four blocks of large scores (up to ±{biggest:.0f}) folded one by one: the result holds "
                             "NaN or inf. exp(lse) overflows float32 once lse > 88.7, and inf/inf is NaN: never "
                             "exponentiate an lse itself; subtract the larger of the two lse first, so that every "
                             "exponential is at most e^0 = 1.")
    units = _units(*got, *problem["want"])
    if max(units) > ROUNDING_UNITS:
        raise LabCheckFailed(f"four blocks of large scores (up to ±{biggest:.0f}) folded one by one: finite, but "
                             f"off by {max(units):.3g} rounding units (out {units[0]:.3g}, lse {units[1]:.3g}; allowed "
                             f"{ROUNDING_UNITS}). Two blocks of moderate scores merged right, so look for a step that "
                             "loses precision at large lse: clamping, or an exponent taken before subtracting the max.")


def _case_empty(merge: Callable) -> None:
    problem = _problem(2, seed=30, large=False)
    (out_a, lse_a), (out_b, lse_b) = problem["blocks"]
    empty = empty_state(out_a)
    hidden = torch.zeros(ROWS, dtype=torch.bool, device="cpu")
    hidden[: ROWS // 2] = True  # the block hides every key from the first half of the rows (a causal block)
    masked_scores = problem["scores"][..., KEYS:].masked_fill(hidden[:, None], NEG_INF)
    out_m, lse_m = attend(masked_scores, problem["v"][..., KEYS:, :])
    full_scores = torch.cat([problem["scores"][..., :KEYS], masked_scores], -1)
    cases = [
        ("the empty start (out 0, lse -inf) merged with a block", (*empty, out_b, lse_b), (out_b, lse_b),
         "a row that has seen no key yet (lse = -inf, out = 0) merged with a block gave NaN, where the result must "
         "be the block itself: look for an expression that computes -inf - (-inf) or 0 * inf"),
        ("a block that hides every key from half of the rows (their lse_b = -inf, out_b = 0) merged into a "
         "running result", (out_a, lse_a, out_m, lse_m), attend(full_scores.double(), problem["v"].double()),
         "rows the new block hides entirely (lse_b = -inf) came out NaN: they must keep the running out and lse "
         "unchanged (their new weight is e^(-inf) = 0)"),
        ("two empty states (both lse -inf) merged", (*empty, *empty_state(out_a)), empty,
         "rows where neither side has seen a key (lse = lse_b = -inf) came out NaN: max(lse, lse_b) is -inf there "
         "and -inf - (-inf) is NaN; shift such rows by 0 instead, so both weights are e^(-inf) = 0, out stays 0 "
         "and lse stays -inf"),
    ]
    for where, args, want, nan_why in cases:
        got = _call(merge, *args, where)
        if torch.isnan(got[0]).any() or torch.isnan(got[1]).any():
            raise LabCheckFailed(f"{where}: {nan_why}.")
        units = _units(*got, *(w.double() for w in want))
        if max(units) > ROUNDING_UNITS:
            what = ("lse must be -inf exactly where no key was seen, and finite elsewhere" if units[1] == math.inf
                    else f"off by {max(units):.3g} rounding units (out {units[0]:.3g}, lse {units[1]:.3g})")
            raise LabCheckFailed(f"{where}: no NaN, but {what}. A side with lse = -inf has seen no key: it must "
                                 "contribute nothing, and the other side must come through unchanged.")


# -- the ring ---------------------------------------------------------------------------------------------------

def _ring_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = _seeded(1, HEADS, RING_SEQ, HEAD_DIM, seed=40) * LARGE
    return q, _seeded(1, HEADS, RING_SEQ, HEAD_DIM, seed=41), _seeded(1, HEADS, RING_SEQ, HEAD_DIM, seed=42)


def _ring_rank(merge: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank of a causal ring (forward): this rank's queries stay, the K/V blocks travel to the next rank,
    each block folded in with the learner's merge, from the empty state."""
    from workbench.dist import comm
    from workbench.parallel.context import chunk_positions

    rank, cp = comm.group_rank(), comm.group_size()
    q, k, v = (t.index_select(2, chunk_positions(RING_SEQ, cp, rank, RING_LAYOUT, "cpu")) for t in _ring_inputs())
    q_pos = chunk_positions(RING_SEQ, cp, rank, RING_LAYOUT, "cpu")
    kv, state = torch.stack([k, v]), empty_state(q)
    for step in range(cp):
        source = (rank - step) % cp  # blocks travel to the next rank: step s holds rank (r - s)'s block
        works = []
        if step < cp - 1:
            incoming = torch.empty_like(kv)
            works = [comm.isend(kv, (rank + 1) % cp, tag="lab14_kv"), comm.irecv(incoming, (rank - 1) % cp,
                                                                                 tag="lab14_kv")]
        block = block_attention(q, kv[0], kv[1], q_pos, chunk_positions(RING_SEQ, cp, source, RING_LAYOUT, "cpu"))
        state = merge(*state, *block)
        for work in works:
            work.wait()
        if works:
            kv = incoming
    return state[0].detach(), state[1].detach()


def _case_ring(merge: Callable, timeout: float) -> dict[str, float]:
    from workbench import RankError
    from workbench.dist.launch import launch
    from workbench.parallel.context import unshard_sequence

    try:
        results = launch(_ring_rank, WORLD, merge, device="cpu", timeout=timeout)
    except RankError as error:
        text = str(error)
        raise LabCheckFailed(f"the ring on {WORLD} ranks failed: {text.splitlines()[0]}\n(full traceback below)\n"
                             f"{text}") from None
    got_out = unshard_sequence([r[0] for r in results], RING_LAYOUT, dim=2)
    got_lse = unshard_sequence([r[1] for r in results], RING_LAYOUT, dim=2)
    q, k, v = _ring_inputs()
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.ones(RING_SEQ, RING_SEQ, dtype=torch.bool, device="cpu").triu(1), NEG_INF)
    want = attend(scores.double(), v.double())
    units = _units(got_out, got_lse, *want)
    if max(units) > ROUNDING_UNITS:
        bad = (got_out.double() - want[0]).abs().amax(dim=(0, 1, 3))
        token = int(bad.argmax())
        raise LabCheckFailed(f"the ring on {WORLD} ranks (causal, {RING_LAYOUT} layout, scores up to "
                             f"±{scores[torch.isfinite(scores)].abs().max():.0f}): the merged result is off by "
                             f"{max(units):.3g} rounding units, worst at token {token}. Every one-process case passed, "
                             "so check what your merge assumes about its inputs (a ring folds blocks in any order, "
                             "and a block may hide every key from some rows).")
    return {"out": units[0], "lse": units[1], "max_score": scores[torch.isfinite(scores)].abs().max().item()}


def check(merge: Callable[..., Any], timeout: float = TIMEOUT) -> None:
    """Check ``merge(out, lse, out_b, lse_b) -> (out, lse)``; print a success message or raise ``LabCheckFailed``
    naming the mistake."""
    try:
        if not callable(merge):
            raise LabCheckFailed(f"pass your function itself, e.g. check(merge), not {type(merge).__name__}")
        _case_algebra(merge)
        _case_large(merge)
        _case_empty(merge)
        ring = _case_ring(merge, timeout)
    except LabCheckFailed as error:
        raise LabCheckFailed(f"{error}{MORE}") from None
    print(f"Correct: two blocks merge to attention over both; large scores (exp would overflow float32) stay finite "
          f"and exact to rounding; rows with no key stay out = 0, lse = -inf; and on a ring of {WORLD} gloo ranks "
          f"(causal, scores up to ±{ring['max_score']:.0f}) the folded result equals full attention within "
          f"{max(ring['out'], ring['lse']):.2g} rounding units (allowed {ROUNDING_UNITS}).")


__all__ = ["HINTS", "attend", "block_attention", "check", "empty_state", "hint"]
