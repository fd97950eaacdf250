"""Checker for lab 13: error feedback for a gradient compressor.

A biased compressor (top-k, scaled sign) drops part of every gradient it sends. Error feedback keeps what was
dropped, per tensor, and adds it to that tensor's next gradient before compressing (Seide et al. 2014, "1-bit SGD";
Stich, Cordonnier & Jaggi 2018, "Sparsified SGD with Memory"; Karimireddy et al. 2019, "Error Feedback Fixes
SignSGD and other Gradient Compression Schemes"): nothing is lost, only delayed. ``workbench.parallel.compression``
does it inside ``TopKCompressor`` and ``SignCompressor``; the learner writes it on its own:

``ErrorFeedback(compress)``, ``compress(p) -> c`` a function giving what the receivers rebuild from the message
(``topk(ratio)``, ``scaled_sign``: same shape as ``p``); ``ef.step(key, grad) -> c``, what to send for this
gradient of tensor ``key``; ``ef.residual(key)``, that tensor's residual now (a key already stepped). Per key the
contract is p = grad + e, c = compress(p) (once), e ← p − c, return c; so after T steps, for every key,

    Σ_t c_t + e_T = Σ_t grad_t                                     (the invariant)

``check(ErrorFeedback)`` runs three cases, in this order, so that each mistake is named by the first that shows it:

1. **one tensor, top-k** (keep 8 of 64 entries), 12 steps; 2. **three tensors, scaled sign**, 10 steps, keys
   interleaved (two of the same shape, so one residual shared between them shows as a number, not a shape error).
   The compressor the learner's class is built with records every input and output, so each step is checked as it
   happens: one compress call; the step returns what compress returned; compress got grad plus *this key's*
   residual (zero the first time); ``residual(key)`` is p − c. A wrong value is compared with the classic mistakes
   (the residual not added, subtracted, or another key's; what was sent kept instead of what was not, the sign
   flipped, the old residual counted twice, the new one taken from the gradient alone, the whole input kept, the
   residual added after compressing) and the message names the one it matches. Then the invariant, per key.
3. **convergence on 2 gloo ranks** (``launch``): least squares, each rank the gradient of its own shard (the
   shards' optima differ a little: ``HETERO``), averaged by all-reduce; ``STEPS`` steps at ``LR`` of uncompressed
   descent, of top-k 1 % without error feedback, and of top-k 1 % through the learner's class, one instance per rank.
   Graded by the fraction of the initial loss gap left, (f(x_T) − f*) / (f(x_0) − f*), f* the least-squares
   optimum: with error feedback at most ``EF_BAND``; without, it must stay above ``NO_EF_FLOOR`` (a check of the
   setting, not of the learner).

Tolerance of the invariant: the learner's step rounds twice in fp32 (p = g + e, and e = p − c; top-k's e is exact,
its entries are p's or 0), each by at most eps/2 × |p|, so Σ c + e_T drifts from Σ g (summed in float64) by at most
about eps(fp32) × Σ_t max|p_t|. The checker allows ``ROUNDING_UNITS`` such units, and the same units (of eps ×
max|p_t|) for each step's input and residual. Measured with the reference solution (x86 CPU): at most 0.14 units on
the invariant and 0.47 on any step's comparison; every mistake above is off by 2·10⁶ units or more where it is named
(it drops or adds a residual whose size is that of p).

Convergence figures (``train_least_squares`` on 2 gloo ranks, ``STEPS`` = 300, ``LR`` = 0.05, d = 200, 800 rows
per rank, seeds 0, 1, 2 of the problem; the checker uses seed 0): the loss gap left after 300 steps is 1.6e-8 to
5.6e-8 uncompressed, 3.7e-3 to 5.2e-3 with top-k 1 % and error feedback, 0.35 to 0.39 with top-k 1 % alone (2 of
200 entries a step, the rest lost); scaled sign: 1.3e-5 to 2.9e-5 with error feedback, 7.3e-3 to 1.2e-2 without.
Hence ``EF_BAND`` = 0.02 (4× the worst measured) and ``NO_EF_FLOOR`` = 0.1 (3.5× below the best).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any

import torch

from workbench.labs import LabCheckFailed, show_hint
from workbench.theory.compression import topk_k

WORLD = 2  # ranks of the convergence case
TIMEOUT = 60.0
ROUNDING_UNITS = 16  # see the module docstring: 0.47 measured, mistakes >= 2e6
DIM, ROWS = 200, 800  # least squares: unknowns, rows of A per rank
HETERO, NOISE = 0.1, 0.1  # how far each rank's shard optimum is from the common one; noise on b
LR, STEPS = 0.05, 300
TOPK_RATIO = 0.01
EF_BAND = 0.02  # loss gap left with error feedback: measured 3.7e-3 to 5.2e-3
NO_EF_FLOOR = 0.1  # loss gap left by top-k 1 % without error feedback: measured 0.35 to 0.39
SEED = 0
EPS32 = torch.finfo(torch.float32).eps
MORE = " (more help: hint(1), hint(2), hint(3))"

HINTS = {
    1: "Think of the residual as a debt: what this tensor's gradients asked for that no message has carried yet. "
       "Each step, add the debt to the new gradient before compressing, so the compressor sees everything still "
       "owed; whatever the compressor leaves out of that sum is the new debt, replacing the old (which is now part "
       "of the sum). Every tensor owes its own debt: keep one per key.",
    2: "Keep a dict {key: residual}. In step(key, grad): e = the key's residual, or zeros shaped like grad the "
       "first time; p = grad + e; c = self.compress(p), called once; the new residual is p - c (what was "
       "compressed minus what was sent: not c, not c - p, not e + p - c, not grad - c); store it under key and "
       "return c. residual(key) returns what is stored. Then Σ returned + residual = Σ grad, step after step.",
    3: "class ErrorFeedback:\n"
       "    def __init__(self, compress):\n"
       "        self.compress = compress\n"
       "        self.residuals = {}\n"
       "    def step(self, key, grad):\n"
       "        p = grad + self.residuals.get(key, torch.zeros_like(grad))\n"
       "        c = self.compress(p)\n"
       "        self.residuals[key] = p - c\n"
       "        return c\n"
       "    def residual(self, key):\n"
       "        return self.residuals[key]",
}


def hint(level: int = 1) -> str:
    """Print (and return) hint ``level``: 1 the idea, 2 the steps, 3 nearly the code."""
    return show_hint(HINTS, level)


# -- what the learner is given ------------------------------------------------------------------------------------

def topk(ratio: float = TOPK_RATIO) -> Callable[[torch.Tensor], torch.Tensor]:
    """A compressor keeping the ⌈ratio·n⌉ largest-magnitude entries of a tensor of n and zeroing the rest: what the
    receivers rebuild from the values and indices ``parallel.compression.TopKCompressor`` sends."""
    def compress(p: torch.Tensor) -> torch.Tensor:
        flat = p.reshape(-1)
        idx = torch.topk(flat.abs(), topk_k(flat.numel(), ratio), sorted=False).indices
        out = torch.zeros_like(flat)
        out[idx] = flat[idx]
        return out.view_as(p)

    compress.__name__ = compress.__qualname__ = f"topk({ratio:g})"
    return compress


def scaled_sign(p: torch.Tensor) -> torch.Tensor:
    """EF-SignSGD's compressor (``parallel.compression.SignCompressor``): mean|p| · sign(p), sign(0) = +1; one bit
    per entry and one scale per tensor travel."""
    scale = p.abs().mean()
    return torch.where(p >= 0, scale, -scale)


# -- cases 1 and 2: one process, every step inspected -------------------------------------------------------------

class _Recorder:
    """The compressor the learner's class gets: the real one, remembering every input and output (copies: the
    learner may change either in place afterwards)."""

    def __init__(self, compress: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.compress = compress
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.__name__ = getattr(compress, "__name__", "compress")

    def __call__(self, p: torch.Tensor) -> torch.Tensor:
        if not isinstance(p, torch.Tensor):
            raise LabCheckFailed(f"compress was given a {type(p).__name__}; it takes a tensor (the gradient plus "
                                 "its residual)")
        c = self.compress(p.detach())
        self.calls.append((p.detach().clone(), c.clone()))
        return c


def _learner(what: str, fn: Callable[[], Any], where: str) -> Any:
    try:
        return fn()
    except LabCheckFailed:
        raise
    except NotImplementedError as error:
        raise LabCheckFailed(f"your ErrorFeedback is still the stub (NotImplementedError: {error}). Write __init__, "
                             "step and residual.") from None
    except Exception as error:  # the learner's code: any error is theirs to see, pointed at the case
        raise LabCheckFailed(f"{where}: {what} raised {type(error).__name__}: {error}") from None


def _units(got: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    """max|got − want|, compared in float64, in units of eps(fp32) × ``scale``; inf for another shape or a NaN."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return math.inf
    diff = (got.detach().double() - want.detach().double()).abs().max().item() if want.numel() else 0.0
    if diff != diff:  # NaN
        return math.inf
    return 0.0 if diff == 0 else diff / (EPS32 * scale) if scale > 0 else math.inf


def _match(got: torch.Tensor, candidates: dict[str, torch.Tensor | None], scale: float) -> str | None:
    for why, candidate in candidates.items():
        if candidate is not None and _units(got, candidate, scale) <= ROUNDING_UNITS:
            return why
    return None


class _Case:
    """One case's bookkeeping: the residual each key should hold (the learner's own, once checked), the last call's
    key and residual, and the per-key sums of the invariant."""

    def __init__(self, name: str, compress: Callable[[torch.Tensor], torch.Tensor], ef_class: type) -> None:
        self.name, self.recorder = name, _Recorder(compress)
        self.ef = _learner("ErrorFeedback(compress)", lambda: ef_class(self.recorder), name)
        if not (callable(getattr(self.ef, "step", None)) and callable(getattr(self.ef, "residual", None))):
            raise LabCheckFailed(f"{name}: an ErrorFeedback needs the methods step(key, grad) and residual(key)")
        self.residuals: dict[Hashable, torch.Tensor] = {}
        self.last: tuple[Hashable, torch.Tensor] | None = None
        self.sums: dict[Hashable, dict[str, Any]] = {}

    def call(self, key: Hashable, g: torch.Tensor, step: int) -> None:
        where = f"{self.name}, step {step} of key {key!r}"
        self.recorder.calls.clear()
        out = _learner(f"step({key!r}, grad)", lambda: self.ef.step(key, g.clone()), where)
        calls = self.recorder.calls
        if not calls:
            if isinstance(out, torch.Tensor) and out.shape == g.shape and torch.equal(out, g):
                raise LabCheckFailed(f"{where}: step returned the gradient without calling compress: nothing was "
                                     "compressed. Call self's compress once per step, on grad plus the residual.")
            raise LabCheckFailed(f"{where}: step never called the compressor the class was built with "
                                 "(ErrorFeedback(compress)): call it once per step, on grad plus the residual.")
        if len(calls) > 1:
            raise LabCheckFailed(f"{where}: step called compress {len(calls)} times for one gradient: compress once, "
                                 "the gradient plus the residual, and keep what that one call left out.")
        [(p, c)] = calls
        owed = self.residuals.get(key, torch.zeros_like(g, dtype=torch.float64))
        scale = p.abs().max().item() if p.shape == g.shape else 0.0
        self._check_return(out, p, c, g, owed, where)
        self._check_input(key, p, g, owed, scale, where)
        stored = _learner(f"residual({key!r})", lambda: self.ef.residual(key), where)
        stored = stored.detach().clone() if isinstance(stored, torch.Tensor) else stored
        self._check_residual(key, stored, p, c, g, owed, scale, where)
        self.residuals[key] = stored.double()
        self.last = (key, stored.double())
        sums = self.sums.setdefault(key, {"applied": torch.zeros_like(g, dtype=torch.float64),
                                          "true": torch.zeros_like(g, dtype=torch.float64), "scale": 0.0})
        sums["applied"] += out.double()
        sums["true"] += g.double()
        sums["scale"] += scale

    def _check_return(self, out: Any, p: torch.Tensor, c: torch.Tensor, g: torch.Tensor, owed: torch.Tensor,
                      where: str) -> None:
        if not isinstance(out, torch.Tensor):
            raise LabCheckFailed(f"{where}: step must return a tensor (what compress returned), got "
                                 f"{type(out).__name__}")
        if out.shape != g.shape:
            raise LabCheckFailed(f"{where}: step returned shape {tuple(out.shape)} for a gradient of shape "
                                 f"{tuple(g.shape)}: return what compress returned, shaped like the gradient")
        size = max(p.abs().max().item(), g.abs().max().item()) if p.shape == g.shape else g.abs().max().item()
        if _units(out, c, size) <= ROUNDING_UNITS:
            return
        why = _match(out, {
            "step returned its input (the gradient plus the residual), uncompressed: nothing was saved. Return what "
            "compress returned: that is what travels": p if p.shape == g.shape else None,
            "step returned the raw gradient. Return what compress returned: that is what travels": g,
            "step added the residual after compressing: then the residual travels uncompressed (and the message is "
            "not sparse or 1-bit any more). Add it to the gradient before compress, and return compress's output":
                c.double() + owed if c.shape == g.shape else None,
        }, size)
        if why is None:
            why = ("step must return exactly what compress returned (what the receivers rebuild, the only thing that "
                   "travels)")
        raise LabCheckFailed(f"{where}: {why}.")

    def _check_input(self, key: Hashable, p: torch.Tensor, g: torch.Tensor, owed: torch.Tensor, scale: float,
                     where: str) -> None:
        if p.shape != g.shape:
            raise LabCheckFailed(f"{where}: compress got a tensor of shape {tuple(p.shape)} for a gradient of shape "
                                 f"{tuple(g.shape)}: compress grad + residual, both shaped like the gradient")
        added = p.double() - g.double()
        if _units(added, owed, scale) <= ROUNDING_UNITS:
            return
        first = key not in self.residuals
        other = self.last[1] if self.last is not None and self.last[0] != key else None
        if other is not None and other.shape == added.shape and _units(added, other, scale) <= ROUNDING_UNITS:
            raise LabCheckFailed(f"{where}: compress got this gradient plus the residual key {self.last[0]!r} left "
                                 "on the call before: one residual is shared between tensors (one variable, or "
                                 "keyed by shape?). Each key owes its own residual: keep one per key, e.g. a dict.")
        if first:
            raise LabCheckFailed(f"{where}: the first time a key is stepped its residual must be zero (nothing is "
                                 f"owed yet), but compress got the gradient plus something off by "
                                 f"{_units(added, owed, scale):.3g} rounding units. Start from zeros like grad.")
        why = _match(added, {
            "compress got the gradient alone: the residual was kept (residual(key) returns it) but never added. "
            "Compress grad + residual": torch.zeros_like(owed),
            "compress got the gradient minus the residual: add it, p = grad + residual (the residual is what is "
            "still owed, so it is sent on top)": -owed,
        }, scale)
        if why is None:
            why = (f"compress got the gradient plus something that is not this key's residual (what residual(key) "
                   f"returned after the step before): off by {_units(added, owed, scale):.3g} rounding units")
        raise LabCheckFailed(f"{where}: {why}.")

    def _check_residual(self, key: Hashable, stored: Any, p: torch.Tensor, c: torch.Tensor, g: torch.Tensor,
                        owed: torch.Tensor, scale: float, where: str) -> None:
        if not isinstance(stored, torch.Tensor) or stored.shape != g.shape:
            got = (f"shape {tuple(stored.shape)}" if isinstance(stored, torch.Tensor) else type(stored).__name__)
            raise LabCheckFailed(f"{where}: residual({key!r}) returned {got}: it must be a tensor shaped like the "
                                 f"gradient ({tuple(g.shape)})")
        want = p.double() - c.double()
        if _units(stored, want, scale) <= ROUNDING_UNITS:
            return
        carried = bool(owed.abs().max() > 0)
        why = _match(stored, {
            "the residual kept is what was sent (compress's output). It must be what was NOT sent: p - compress(p), "
            "p = grad + old residual": c,
            "the residual has the wrong sign: compress(p) - p. It is what is still owed, p - compress(p), so that "
            "adding it next step sends the missing part": c.double() - p.double(),
            "the residual kept the whole input p = grad + residual and never let go of what was sent: subtract "
            "it, e = p - compress(p)": p,
            "the residual was accumulated, e + (p - c): p already contains the old residual, so it is counted "
            "twice. Replace it: e = p - c": owed + want if carried else None,
            "the new residual was taken from the gradient alone, grad - compress(p): the old residual was part of "
            "what was compressed, and what of it was not sent is lost. Use e = p - compress(p), p = grad + "
            "old residual": g.double() - c.double() if carried else None,
            "the residual is zero after a step: nothing was kept of what compress left out (stored under another "
            "key? reset after use?)": torch.zeros_like(want),
        }, scale)
        if why is None:
            why = (f"residual(key) after a step must be p - compress(p), the gradient plus the old residual minus "
                   f"what was sent; yours is off by {_units(stored, want, scale):.3g} rounding units")
        raise LabCheckFailed(f"{where}: {why}.")

    def invariant(self) -> float:
        """The worst key's |Σ applied + residual − Σ grad| in units of eps(fp32) × Σ_t max|p_t|."""
        worst = 0.0
        for key, sums in self.sums.items():
            units = _units(sums["applied"] + self.residuals[key], sums["true"], sums["scale"])
            if units > ROUNDING_UNITS:
                raise LabCheckFailed(f"{self.name}: for key {key!r}, Σ sent + final residual differs from Σ gradients "
                                     f"by {units:.3g} rounding units (allowed {ROUNDING_UNITS}): something the "
                                     "compressor left out was lost or counted twice.")
            worst = max(worst, units)
        return worst


def _seeded(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator(device="cpu").manual_seed(seed), device="cpu")


def _case_one_tensor(ef_class: type) -> float:
    case = _Case("one tensor, top-k (8 of 64 entries)", topk(0.125), ef_class)
    for step in range(1, 13):
        case.call("w", _seeded(4, 16, seed=100 + step) * (1 + step / 4), step)
    return case.invariant()


def _case_several_tensors(ef_class: type) -> float:
    case = _Case("three tensors, scaled sign", scaled_sign, ef_class)
    shapes = {"a.weight": (8, 8), "b.weight": (8, 8), "a.bias": (8,)}
    for step in range(1, 11):
        for i, (key, shape) in enumerate(shapes.items()):
            case.call(key, _seeded(*shape, seed=200 + 10 * step + i) * (i + 1), step)
    return case.invariant()


# -- case 3 and the notebook's runs: least squares on ranks -------------------------------------------------------

def least_squares(world_size: int = WORLD, seed: int = SEED) -> dict[str, Any]:
    """The problem of case 3: ``As[r]`` [ROWS, DIM], ``bs[r]`` per rank r, each shard's optimum the common one plus
    ``HETERO`` × noise. The loss is f(x) = mean_r |A_r x − b_r|² / (2·ROWS); ``x_star`` its optimum, ``hessian`` H =
    mean_r A_rᵀA_r / ROWS (float64), so that f(x) − f* = ½ (x − x*)ᵀ H (x − x*) (``loss_gap``), with no cancellation."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    common = torch.randn(DIM, generator=gen, device="cpu")  # the problem is drawn on the CPU, as gpt_batch is
    As, bs = [], []
    for _ in range(world_size):
        a = torch.randn(ROWS, DIM, generator=gen, device="cpu")
        own = common + HETERO * torch.randn(DIM, generator=gen, device="cpu")
        As.append(a)
        bs.append(a @ own + NOISE * torch.randn(ROWS, generator=gen, device="cpu"))
    a64, b64 = torch.cat(As).double(), torch.cat(bs).double()
    x_star = torch.linalg.lstsq(a64, b64.unsqueeze(1)).solution.squeeze(1)
    return {"As": As, "bs": bs, "x_star": x_star, "hessian": a64.t() @ a64 / a64.shape[0]}


def loss_gap(problem: dict[str, Any], x: torch.Tensor) -> float:
    """f(x) − f*, in float64."""
    d = x.double() - problem["x_star"]
    return 0.5 * float(d @ problem["hessian"] @ d)


def _descend(runs: dict[str, tuple[Callable | None, type | None]], steps: int, lr: float, seed: int) -> dict:
    """On each rank: every run in turn from x = 0, the rank's gradient compressed (through a fresh error-feedback
    object of the given class, if any), averaged by all-reduce, x -= lr × average."""
    from workbench.dist import comm

    world, rank = comm.group_size(), comm.group_rank()
    problem = least_squares(world, seed)
    a, b = problem["As"][rank], problem["bs"][rank]
    gap0 = loss_gap(problem, a.new_zeros(DIM))
    results = {}
    for name, (compress, ef_class) in runs.items():
        ef = ef_class(compress) if ef_class is not None else None
        x = a.new_zeros(DIM)
        gaps, grad_norms, residual_norms, scale, owed = [], [], [], 0.0, 0.0
        applied, true = a.new_zeros(DIM, dtype=torch.float64), a.new_zeros(DIM, dtype=torch.float64)
        for _ in range(steps):
            g = a.t() @ (a @ x - b) / ROWS
            grad_norms.append(g.norm().item())
            if compress is None:
                sent = g.clone()
            elif ef is None:
                sent = compress(g).clone()
            else:
                sent = ef.step("x", g.clone()).clone()
                residual = ef.residual("x")
                residual_norms.append(residual.norm().item())
                scale += g.abs().max().item() + owed  # >= max|grad + old residual|: the docstring's unit
                owed = residual.abs().max().item()
            applied += sent.double()
            true += g.double()
            comm.all_reduce(sent, "avg")
            x -= lr * sent
            gaps.append(loss_gap(problem, x) / gap0)
        result = {"gap": gaps, "grad_norm": grad_norms}  # |grad_t| of this rank's shard
        if ef is not None:
            result["residual_norm"] = residual_norms  # |e_t| on this rank, after step t
            result["invariant_units"] = _units(applied + ef.residual("x").double(), true, scale)
        results[name] = result
    return results


def train_least_squares(runs: dict[str, tuple[Callable | None, type | None]], steps: int = STEPS,
                        world_size: int = WORLD, lr: float = LR, seed: int = SEED,
                        timeout: float = TIMEOUT) -> list[dict[str, dict[str, list[float] | float]]]:
    """Least squares on ``world_size`` gloo ranks (``launch``), once per entry of ``runs``: {name: (compress or
    None, error-feedback class or None)}; None, None is uncompressed descent. Per rank, per run: ``gap``, the
    fraction of the initial loss gap left after each step (the same on every rank: the loss is the whole
    problem's) and ``grad_norm`` (|grad_t| of the rank's shard); with error feedback also ``residual_norm`` (|e_t|
    on that rank, after step t) and ``invariant_units`` (|Σ sent + e_T − Σ grad| in units of eps(fp32) ×
    Σ_t max|grad_t + e_(t-1)|, as in ``check``)."""
    from workbench.dist.launch import launch

    return launch(_descend, world_size, runs, steps, lr, seed, device="cpu", timeout=timeout)


def _case_convergence(ef_class: type, timeout: float) -> dict[str, float]:
    from workbench import RankError

    label = f"top-k {TOPK_RATIO:.0%}"
    try:
        results = train_least_squares({"none": (None, None), label: (topk(TOPK_RATIO), None),
                                       f"{label} + yours": (topk(TOPK_RATIO), ef_class)}, timeout=timeout)
    except RankError as error:
        text = str(error)
        raise LabCheckFailed(f"least squares on {WORLD} ranks failed: {text.splitlines()[0]}\n(full traceback "
                             f"below)\n{text}") from None
    final = {name: run["gap"][-1] for name, run in results[0].items()}
    if final["none"] > 1e-6 or final[label] < NO_EF_FLOOR:  # the setting itself, not the learner's code
        raise RuntimeError(f"lab 13's least-squares setting no longer shows the effect: {final}")
    if not final[f"{label} + yours"] <= EF_BAND:
        raise LabCheckFailed(f"least squares on {WORLD} ranks, {STEPS} steps: with your error feedback top-k "
                             f"{TOPK_RATIO:.0%} left {final[f'{label} + yours']:.3g} of the initial loss gap "
                             f"(uncompressed: {final['none']:.2g}, top-k alone: {final[label]:.2g}; required <= "
                             f"{EF_BAND}). Every one-process case passed, so look for state the ranks share or a "
                             "step that depends on more than (key, grad).")
    return final


def check(ErrorFeedback: type, timeout: float = TIMEOUT) -> None:  # noqa: N803 (the learner's class)
    """Check the class ``ErrorFeedback(compress)`` with ``step(key, grad)`` and ``residual(key)``; print a success
    message or raise ``LabCheckFailed`` naming the mistake."""
    try:
        if not isinstance(ErrorFeedback, type):
            raise LabCheckFailed(f"pass your class itself, e.g. check(ErrorFeedback), not "
                                 f"{type(ErrorFeedback).__name__}")
        one = _case_one_tensor(ErrorFeedback)
        several = _case_several_tensors(ErrorFeedback)
        final = _case_convergence(ErrorFeedback, timeout)
    except LabCheckFailed as error:
        raise LabCheckFailed(f"{error}{MORE}") from None
    label = f"top-k {TOPK_RATIO:.0%}"
    print(f"Correct: every step compresses grad + this key's residual once, returns what was sent and keeps what was "
          f"not; Σ sent + residual = Σ gradients within {max(one, several):.2g} rounding units (allowed "
          f"{ROUNDING_UNITS}) for one tensor (top-k) and for three (scaled sign). On {WORLD} gloo ranks, "
          f"{STEPS} steps of least squares left {final[f'{label} + yours']:.2g} of the loss gap with your error "
          f"feedback and {label} (required <= {EF_BAND}; uncompressed {final['none']:.1g}, {label} alone "
          f"{final[label]:.2f}).")


__all__ = ["HINTS", "check", "hint", "least_squares", "loss_gap", "scaled_sign", "topk", "train_least_squares"]
