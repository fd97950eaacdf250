"""Lab 05: a dynamic loss scaler for fp16 training, checked on 2 real ranks against ``workbench.precision``.

Micikevicius et al. 2018, "Mixed Precision Training", §3.2: fp16 gradients below 2⁻²⁴ flush to zero, so the
loss is multiplied by a scale S before backward and the gradients divided by S (in fp32) after it. S is chosen
dynamically: after N clean steps it grows; when a gradient overflows to inf/NaN the step is skipped and S backs
off. With data parallelism the verdict must be the same on every rank, or one replica steps while another skips
and the replicas silently diverge.

The learner writes a class with ``scale(loss)``, ``unscale(grads, group)`` -> (fp32 grads, found_inf),
``update(found_inf)`` -> take the step?, ``get_scale()``, ``state_dict()`` and ``load_state_dict(state)``.
``check(LossScaler)`` runs it on 2 gloo ranks beside the reference ``DynamicLossScaler`` over a scripted
stream of gradients from a real fp16 backward: clean steps, an inf on ONE rank only, a NaN, and tiny gradients
that only survive fp16 because of the scale. Decisions and the scale trace must equal the reference's exactly;
the unscaled gradients must equal the reference's bit for bit (the scale is a power of two, so dividing by it
in fp32 is exact). Then the state is saved, loaded into a fresh scaler built with default arguments, and the
run continues: the trace must go on as if nothing happened. A wrong trace is compared with the traces of the
classic mistakes (simulated here), so the message names the mistake, not just the step.
"""

from __future__ import annotations

import io
import math
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from workbench.dist import comm
from workbench.labs import LabCheckFailed, show_hint

WORLD_SIZE = 2
TIMEOUT = 60.0
MORE = " (more help: hint(1), hint(2), hint(3))"
FP16_TINIEST = 2.0 ** -24  # the smallest fp16 subnormal: anything below half of it rounds to zero
CONFIG = {"init_scale": 2.0 ** 12, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3}
SHAPES = ((4, 8), (8,))  # the gradients of two parameters, per rank

# What each step's gradients hold, per rank: "clean", "tiny" (≈1e-8: zero in fp16 without the scale),
# "inf" (overflows fp16 at any scale above 64) or "nan". STREAM runs first; then the state is saved, loaded
# into a fresh scaler, and RESUMED runs on it.
STREAM = [
    ("clean", "clean"), ("tiny", "tiny"), ("clean", "clean"),   # 3 clean steps: grow
    ("clean", "inf"),                                            # an inf on rank 1 only
    ("clean", "clean"), ("clean", "clean"), ("inf", "clean"),    # an inf when the counter is one short of growth
    ("clean", "clean"), ("clean", "clean"), ("nan", "clean"),    # a NaN on rank 0 only
    ("clean", "clean"), ("tiny", "tiny"), ("clean", "clean"), ("clean", "clean"),
]
RESUMED = [("clean", "clean"), ("clean", "clean"), ("clean", "clean"), ("clean", "clean"), ("clean", "inf"),
           ("clean", "clean")]

HINTS = {
    1: "Three rules, and one agreement. Rule 1: a step whose gradients hold an inf or a NaN anywhere must not "
       "be taken, and the scale shrinks. Rule 2: after growth_interval clean steps in a row the scale grows, and "
       "'in a row' starts again after every growth and every overflow. Rule 3: the gradients you hand to the "
       "optimizer are the true ones, in fp32. The agreement: 'anywhere' means on ANY rank. If rank 1 overflows "
       "and rank 0 does not, both must skip, or the replicas stop being copies of each other.",
    2: "unscale: first decide found_inf on this rank (torch.isfinite(g).all() is False for inf AND NaN), then "
       "make it global: a 0/1 flag tensor all-reduced with op='max' (workbench.comm.all_reduce(flag, op='max', "
       "group=group)) is 1 on every rank if it was 1 on any. Cast each gradient to fp32 BEFORE dividing by the "
       "scale: an fp16 division rounds 1e-8 to zero. update(found_inf): on overflow multiply the scale by "
       "backoff_factor, reset the clean counter, return False; otherwise count the clean step, grow (and reset) "
       "when the counter reaches growth_interval, return True. state_dict: every number the schedule depends "
       "on, the counter included, as plain python.",
    3: "def unscale(self, grads, group=None):\n"
       "    local = any(not bool(torch.isfinite(g).all()) for g in grads)\n"
       "    flag = torch.tensor([1.0 if local else 0.0], device=grads[0].device)\n"
       "    comm.all_reduce(flag, op='max', group=group)\n"
       "    return [g.float() / self._scale for g in grads], bool(flag.item() > 0)\n"
       "def update(self, found_inf):\n"
       "    if found_inf:\n"
       "        self._scale *= self.backoff_factor; self._clean = 0; return False\n"
       "    self._clean += 1\n"
       "    if self._clean >= self.growth_interval:\n"
       "        self._scale *= self.growth_factor; self._clean = 0\n"
       "    return True\n"
       "def state_dict(self): return {'scale': self._scale, 'clean': self._clean, 'growth_interval': ..., ...}",
}


def hint(level: int = 1) -> str:
    """Print (and return) hint ``level`` (1: the rules, 2: how each is done, 3: nearly the code)."""
    return show_hint(HINTS, level)


# ---------------------------------------------------------------------------------------------------------
# The scripted gradients: a real fp16 backward of loss = Σ c·w, so dL/dw = c·S rounded to fp16.


def coefficients(step: int, rank: int, kind: str, device: torch.device | None = None) -> list[torch.Tensor]:
    """The fp32 coefficients c of step ``step`` on ``rank``: the gradient of the unscaled loss."""
    device = device or torch.device("cpu")
    gen = torch.Generator(device="cpu").manual_seed(1000 * step + rank)
    out = [(0.02 * torch.randn(s, generator=gen, device="cpu")).to(device) for s in SHAPES]
    if kind == "tiny":
        out = [c * 1e-6 for c in out]  # ≈1e-8: below fp16's smallest subnormal unless scaled
    elif kind == "inf":
        out[0][1, 2] = 1e3  # 1e3·S > 65504 for any S > 64
    elif kind == "nan":
        out[1][3] = math.nan
    return out


def fp16_grads(coeffs: list[torch.Tensor], scaled_loss_fn: Any) -> list[torch.Tensor]:
    """The fp16 gradients a real backward produces: parameters in fp16, loss in fp32, scaled by the scaler."""
    params = [torch.ones(c.shape, dtype=torch.float16, device=c.device, requires_grad=True) for c in coeffs]
    loss = sum((p.float() * c).sum() for p, c in zip(params, coeffs, strict=True))
    scaled_loss_fn(loss).backward()
    return [p.grad for p in params]


# ---------------------------------------------------------------------------------------------------------
# What runs on each rank: the learner's scaler and the reference, side by side, on the same stream.


def _record(scaler: Any, stream: list[tuple[str, str]], rank: int, first: int) -> list[dict[str, Any]]:
    from workbench.dist.launch import rank_device

    trace = []
    for i, kinds in enumerate(stream):
        step = first + i
        coeffs = coefficients(step, rank, kinds[rank], rank_device())
        used: list[float | None] = []

        def scaled(loss: torch.Tensor, used: list[float] = used) -> torch.Tensor:
            out = scaler.scale(loss)
            ratio = float(out.detach().float() / loss.detach())
            used.append(ratio if math.isfinite(ratio) else None)  # a NaN step's loss is NaN: no ratio to read
            return out

        before = _scale_of(scaler)
        grads16 = fp16_grads(coeffs, scaled)
        out = scaler.unscale(grads16, None)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise LabCheckFailed(f"unscale returned {type(out).__name__}: return a pair (list of fp32 gradients, "
                                 "found_inf)" + MORE)
        grads, found = out
        take = scaler.update(bool(found))
        trace.append({"step": step, "used": used[0], "scale_before": before, "found": found, "take": take,
                      "scale": _scale_of(scaler),
                      "grads": [g.detach().clone() for g in grads], "raw_zero": _raw_zero_fraction(coeffs)})
    return trace


def _scale_of(scaler: Any) -> float:
    return float(scaler.get_scale() if hasattr(scaler, "get_scale") else scaler.scale_value)


def _raw_zero_fraction(coeffs: list[torch.Tensor]) -> float:
    """How many of this step's true gradients would be zero in fp16 without a scale."""
    flat = torch.cat([c.reshape(-1) for c in coeffs])
    return float(((flat.half() == 0) & (flat != 0)).float().mean())


class _Reference:
    """``workbench.precision.DynamicLossScaler`` behind the lab's interface."""

    def __init__(self, **kwargs: Any) -> None:
        from workbench.parallel.precision import DynamicLossScaler

        self.inner = DynamicLossScaler(**kwargs, min_scale=1.0, max_scale=2.0 ** 24)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.inner.scale(loss)

    def unscale(self, grads: list[torch.Tensor], group: Any = None) -> tuple[list[torch.Tensor], bool]:
        grads32 = [g.float() for g in grads]  # to the fp32 masters first: an fp16 division would flush tiny values
        found = self.inner.found_inf(grads32, groups=(group,))
        self.inner.unscale_(grads32)
        return grads32, found

    def update(self, found_inf: bool) -> bool:
        return self.inner.update(found_inf)

    def get_scale(self) -> float:
        return self.inner.scale_value


def _stage(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except LabCheckFailed as e:
        return {"error": f"LabCheckFailed: {e}", "traceback": ""}
    except Exception as e:  # noqa: BLE001 -- reported to the caller, which explains it
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def _run_learner(scaler_cls: type, rank: int) -> dict[str, Any]:
    scaler = scaler_cls(**CONFIG)
    first = _record(scaler, STREAM, rank, 0)
    state = scaler.state_dict()
    buffer = io.BytesIO()
    try:
        torch.save(state, buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
    except Exception as e:  # noqa: BLE001 -- explained
        raise LabCheckFailed(f"state_dict() holds something torch.load(weights_only=True) refuses ({type(e).__name__}"
                             "): keep it to plain python numbers (or tensors), as checkpoints are loaded that way"
                             + MORE) from None
    fresh = scaler_cls()  # default arguments: everything the schedule needs must come from the state
    fresh.load_state_dict(state)
    return {"first": first, "restored_scale": _scale_of(fresh),
            "resumed": _record(fresh, RESUMED, rank, len(STREAM))}


def _run_reference(rank: int) -> dict[str, Any]:
    ref = _Reference(**CONFIG)
    first = _record(ref, STREAM, rank, 0)
    state = ref.inner.state_dict()
    fresh = _Reference(**{k: v for k, v in CONFIG.items() if k != "init_scale"}, init_scale=1.0)
    fresh.inner.load_state_dict(state)
    return {"first": first, "restored_scale": fresh.get_scale(), "resumed": _record(fresh, RESUMED, rank, len(STREAM))}


def _rank_run(scaler_cls: type) -> dict[str, Any]:
    torch.set_num_threads(1)
    rank = comm.group_rank()
    # The reference first: its collectives are all matched before the learner's code can hang or skip one.
    return {"reference": _run_reference(rank), "learner": _stage(_run_learner, scaler_cls, rank)}


# ---------------------------------------------------------------------------------------------------------
# The classic mistakes, simulated on the same stream (found per rank from the same fp16 casts).


@dataclass
class _Sim:
    scale: float
    clean: int
    interval: int


MISTAKES: dict[str, str] = {
    "local": "each rank decided found_inf from its own gradients only: at step {step} the {kind} was on rank "
             "{where} only, so rank {where} skipped while the other stepped, and the replicas are no longer "
             "copies. All-reduce the verdict (a 0/1 flag, op='max') over the group before returning it",
    "no_skip": "the step that overflowed was taken (update returned True at step {step}): an inf/NaN gradient "
               "would have reached the weights. On found_inf return False (skip) and back off",
    "no_backoff": "the scale did not shrink after the overflow at step {step}: multiply it by backoff_factor, "
                  "or the next step overflows again",
    "no_reset": "after the overflow at step {step} the clean-step counter kept counting, so the scale grew too "
                "early: reset the counter to 0 on backoff ('N clean steps in a row')",
    "grow_on_overflow": "the step that overflowed (step {step}) was counted as clean and made the scale grow "
                        "before backing off: count a step as clean only when found_inf is False",
    "inf_only": "the NaN at step {step} was not caught (torch.isinf misses NaN): test with torch.isfinite, which "
                "is False for inf and NaN alike",
    "late_growth": "the scale grew one step late: grow when the counter REACHES growth_interval (>=, not >)",
    "early_growth": "the scale grew one step early: grow only after growth_interval clean steps",
}


def _local_found(step: int, rank: int, kind: str, scale: float, inf_only: bool = False) -> bool:
    grads = [(c * scale).half() for c in coefficients(step, rank, kind)]
    return any(bool((torch.isinf(g) if inf_only else ~torch.isfinite(g)).any()) for g in grads)


def _simulate(variant: str, stream: list[tuple[str, str]], sim: _Sim, first: int = 0) -> list[list[tuple]]:
    """Per rank, per step: (found, take, scale after), as the ``variant`` mistake would produce."""
    sims = [_Sim(sim.scale, sim.clean, sim.interval) for _ in range(WORLD_SIZE)]
    out: list[list[tuple]] = [[] for _ in range(WORLD_SIZE)]
    for i, kinds in enumerate(stream):
        local = [_local_found(first + i, r, kinds[r], sims[r].scale, variant == "inf_only")
                 for r in range(WORLD_SIZE)]
        for r, s in enumerate(sims):
            found = local[r] if variant == "local" else any(local)
            take = _advance(variant, s, found)
            out[r].append((found, take, s.scale))
    return out


def _advance(variant: str, s: _Sim, found: bool) -> bool:
    growth, backoff = CONFIG["growth_factor"], CONFIG["backoff_factor"]
    need = s.interval + (variant == "late_growth") - (variant == "early_growth")
    if variant == "grow_on_overflow":
        s.clean += 1
        if s.clean >= need:
            s.scale, s.clean = s.scale * growth, 0
        if found:
            s.scale *= backoff
        return not found
    if found:
        if variant != "no_backoff":
            s.scale *= backoff
        if variant != "no_reset":
            s.clean = 0
        return variant == "no_skip"
    s.clean += 1
    if s.clean >= need:
        s.scale, s.clean = s.scale * growth, 0
    return True


def _trace_of(run: list[dict[str, Any]]) -> list[tuple]:
    return [(bool(t["found"]), bool(t["take"]), float(t["scale"])) for t in run]


def _event(step: int, stream: list[tuple[str, str]], first: int = 0) -> tuple[str, int | None]:
    kinds = stream[step - first]
    bad = [r for r, k in enumerate(kinds) if k in ("inf", "nan")]
    return ((kinds[bad[0]] if bad else kinds[0]), (bad[0] if len(bad) == 1 else None))


# ---------------------------------------------------------------------------------------------------------
# Explaining what went wrong.


def _explain_error(stage: dict[str, Any]) -> LabCheckFailed:
    text = stage["error"]
    if text.startswith("LabCheckFailed: "):
        return LabCheckFailed(text.removeprefix("LabCheckFailed: "))
    if text.startswith("NotImplementedError"):
        detail = text.partition(":")[2].strip()
        return LabCheckFailed("your scaler is still the stub" + (f": {detail}" if detail else "") + MORE)
    last = stage["traceback"].strip().splitlines()
    where = next((line.strip() for line in reversed(last) if line.strip().startswith("File ")), "")
    return LabCheckFailed(f"your scaler raised {text}" + (f"\n  at {where}" if where else "") + MORE)


def _check_agreement(runs: list[list[dict[str, Any]]], stream: list[tuple[str, str]], first: int) -> None:
    for i in range(len(stream)):
        views = [_trace_of(run)[i] for run in runs]
        if len(set(views)) > 1:
            kind, where = _event(first + i, stream, first)
            if where is not None:
                raise LabCheckFailed(MISTAKES["local"].format(step=first + i, kind=kind, where=where) + MORE)
            raise LabCheckFailed(f"the ranks disagree at step {first + i}: (found_inf, take, scale) = "
                                 f"{views}; every rank must reach the same verdict and scale" + MORE)


def _diagnose(got: list[tuple], want: list[tuple], stream: list[tuple[str, str]], start: _Sim, first: int) -> None:
    if got == want:
        return
    step = first + next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    for variant in MISTAKES:
        if variant != "local" and _simulate(variant, stream, start, first)[0] == got:
            event_step = _last_event(step, stream, first)
            raise LabCheckFailed(MISTAKES[variant].format(step=event_step) + MORE)
    g, w = got[step - first], want[step - first]
    kinds = stream[step - first]
    raise LabCheckFailed(f"step {step} (gradients: {kinds[0]} on rank 0, {kinds[1]} on rank 1): your scaler gave "
                         f"found_inf={g[0]}, take={g[1]}, scale after={g[2]:g}; the reference gives "
                         f"found_inf={w[0]}, take={w[1]}, scale after={w[2]:g} (growth_interval="
                         f"{start.interval}, growth ×{CONFIG['growth_factor']:g}, backoff "
                         f"×{CONFIG['backoff_factor']:g})" + MORE)


def _last_event(step: int, stream: list[tuple[str, str]], first: int) -> int:
    """The overflow the mistake is about: the latest inf/NaN step at or before ``step``."""
    bad = [first + i for i, k in enumerate(stream) if first + i <= step and {"inf", "nan"} & set(k)]
    return bad[-1] if bad else step


def _check_scale_used(run: list[dict[str, Any]]) -> None:
    """scale(loss) must multiply by the scaler's own current scale (what get_scale said before the step)."""
    for t in run:
        if t["used"] is not None and t["used"] != t["scale_before"]:
            if t["used"] == 1.0:
                raise LabCheckFailed("scale(loss) returned the loss unchanged: it must return loss × the current "
                                     "scale, so that backward's fp16 gradients are scaled too" + MORE)
            raise LabCheckFailed(f"at step {t['step']} scale(loss) multiplied the loss by {t['used']:g}, but "
                                 f"get_scale() said {t['scale_before']:g}" + MORE)


def _check_grads(run: list[dict[str, Any]], ref: list[dict[str, Any]], rank: int) -> None:
    for t, r in zip(run, ref, strict=True):
        if not r["take"]:
            continue  # a skipped step's gradients hold the inf; nobody uses them
        for got, want in zip(t["grads"], r["grads"], strict=True):
            _check_grad(got, want, t, rank)


def _check_grad(got: Any, want: torch.Tensor, t: dict[str, Any], rank: int) -> None:
    step, scale = t["step"], t["scale_before"]
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        raise LabCheckFailed(f"unscale must return the gradients in the order given, same shapes (step {step}, "
                             f"got {type(got).__name__} {tuple(getattr(got, 'shape', ()))})" + MORE)
    if got.dtype != torch.float32:
        raise LabCheckFailed(f"unscale returned {got.dtype} gradients: return fp32 ones (the master weights' "
                             "dtype); in fp16 the true gradients of this step round to zero" + MORE)
    if torch.equal(got, want):
        return
    if torch.equal(got, want * scale):
        raise LabCheckFailed(f"the gradients were not unscaled (step {step}: they are still × {scale:g}): divide "
                             "them by the scale, or the optimizer takes steps S times too large" + MORE)
    in_fp16 = ((want * scale).half() / scale).float()  # want·S is the fp16 gradient, exactly
    if (torch.equal(got, in_fp16) or bool((got == 0).all())) and bool((want != 0).any()):
        raise LabCheckFailed(f"the tiny gradients of step {step} (≈1e-8) came back as zeros: they were unscaled "
                             "in fp16, where anything below 6e-8 rounds to zero. Cast to fp32 first, then divide "
                             "by the scale" + MORE)
    diff = (got - want).abs().max().item()
    raise LabCheckFailed(f"rank {rank}'s unscaled gradients at step {step} differ from the reference's by up to "
                         f"{diff:.3g}: they must be the fp16 gradients, in fp32, divided by the scale used in "
                         "that step's backward (exact: the scale is a power of two)" + MORE)


def _check_resume(results: list[dict], ref: list[dict]) -> None:
    mine, want = results[0]["restored_scale"], ref[0]["restored_scale"]
    if mine != want:
        raise LabCheckFailed(f"after load_state_dict a fresh scaler's scale is {mine:g}, not the saved {want:g}: "
                             "load_state_dict must restore the scale" + MORE)
    got, expected = _trace_of(results[0]["resumed"]), _trace_of(ref[0]["resumed"])
    if got == expected:
        return
    saved = _Sim(CONFIG["init_scale"], 0, CONFIG["growth_interval"])
    for found in (any(_local_found(i, r, k[r], saved.scale) for r in range(WORLD_SIZE)) for i, k in enumerate(STREAM)):
        _advance("correct", saved, found)
    default_interval = _Sim(want, 0, 2000)
    for start, why in ((_Sim(want, 0, CONFIG["growth_interval"]), "the clean-step counter"),
                       (default_interval, "growth_interval (the fresh scaler kept its default)")):
        if _simulate("correct", RESUMED, start, len(STREAM))[0] == got:
            raise LabCheckFailed(f"after a save and load the schedule went on differently: the state did not "
                                 f"carry {why}. Resuming mid-run must continue exactly where the saved scaler "
                                 f"was (scale {saved.scale:g}, {saved.clean} clean step(s) counted)" + MORE)
    raise LabCheckFailed("after state_dict → load_state_dict into a fresh scaler the trace differs from the "
                         f"reference's: got {got}, want {expected}; save every number the schedule depends on"
                         + MORE)


def _ship_by_value(*objects: Any) -> None:
    """Classes from a module the ranks may not import (labs/solutions/..., a script) travel by value."""
    import cloudpickle

    for obj in objects:
        module = sys.modules.get(getattr(obj, "__module__", ""))
        if module is not None and module.__name__ != "__main__" and not module.__name__.startswith("workbench"):
            cloudpickle.register_pickle_by_value(module)


def check(scaler_cls: Any) -> None:
    """Run ``scaler_cls`` beside the reference on 2 ranks over the scripted stream; raise ``LabCheckFailed``
    naming the mistake, or print what works."""
    from workbench.dist.launch import RankError, launch

    if not isinstance(scaler_cls, type):
        raise LabCheckFailed(f"check() wants your scaler class (not an instance), got {scaler_cls!r}")
    _ship_by_value(scaler_cls)
    try:
        results = launch(_rank_run, WORLD_SIZE, scaler_cls, device="cpu", timeout=TIMEOUT)
    except RankError as e:
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise LabCheckFailed("a collective timed out: every rank must make the same collectives in the same "
                                 "order (no `if found: all_reduce(...)` that only some ranks reach)" + MORE) from None
        raise LabCheckFailed(f"your code raised on a rank:\n{e}" + MORE) from None
    for r in results:
        if "error" in r["learner"]:
            raise _explain_error(r["learner"])
    mine = [r["learner"] for r in results]
    ref = [r["reference"] for r in results]
    _check_scale_used(mine[0]["first"])
    _check_agreement([m["first"] for m in mine], STREAM, 0)
    start = _Sim(CONFIG["init_scale"], 0, CONFIG["growth_interval"])
    _diagnose(_trace_of(mine[0]["first"]), _trace_of(ref[0]["first"]), STREAM, start, 0)
    for rank in range(WORLD_SIZE):
        _check_grads(mine[rank]["first"], ref[rank]["first"], rank)
    _check_agreement([m["resumed"] for m in mine], RESUMED, len(STREAM))
    _check_resume(mine, ref)
    trace = _trace_of(ref[0]["first"]) + _trace_of(ref[0]["resumed"])
    tiny = [t for t in ref[0]["first"] if t["raw_zero"] > 0]
    print(f"✓ on {WORLD_SIZE} ranks over {len(trace)} steps your scaler made the reference's decisions: "
          f"{sum(not t[1] for t in trace)} steps skipped (an inf on one rank only, twice; a NaN), the scale went "
          f"{' → '.join(f'{s:g}' for s in _changes(trace))}, and it resumed exactly from its state_dict. At the "
          f"tiny steps {100 * max(t['raw_zero'] for t in tiny):.0f}% of the true gradients are zero in fp16 "
          "without a scale; with yours they all came back, bit for bit.")


def _changes(trace: list[tuple]) -> list[float]:
    scales = [CONFIG["init_scale"]] + [t[2] for t in trace]
    return [s for i, s in enumerate(scales) if i == 0 or s != scales[i - 1]]


# ---------------------------------------------------------------------------------------------------------
# The notebook's live demo: a tiny fp16 regression model, data parallel on real ranks, with the learner's scaler.


def _demo_rank(scaler_cls: type, steps: int, init_scale: float, growth_interval: int) -> dict[str, Any]:
    from workbench.dist.launch import rank_device

    torch.set_num_threads(1)
    device, rank = rank_device(), comm.group_rank()
    gen = torch.Generator(device="cpu").manual_seed(0)
    masters = [(torch.randn(32, 64, generator=gen, device="cpu") / 8).to(device), torch.zeros(64, device=device),
               (torch.randn(64, 1, generator=gen, device="cpu") / 8).to(device)]
    true_w = torch.randn(32, 1, generator=gen, device="cpu").to(device)
    scaler = scaler_cls(init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
                        growth_interval=growth_interval)
    data = torch.Generator(device="cpu").manual_seed(100 + rank)  # each rank its own batches, as in DDP
    log: dict[str, list] = {"scale": [], "take": [], "loss": []}
    for _ in range(steps):
        x = torch.randn(16, 32, generator=data, device="cpu").to(device)
        y = x @ true_w
        params = [m.detach().half().requires_grad_() for m in masters]  # the fp16 compute copy
        hidden = torch.relu(x.half() @ params[0] + params[1])
        loss = ((hidden @ params[2]).float() - y).pow(2).mean()
        scaler.scale(loss).backward()
        grads, found = scaler.unscale([p.grad for p in params], None)
        grads = comm.all_reduce_coalesced(grads, op="avg")  # DDP's average, in fp32
        take = scaler.update(bool(found))
        if take:
            for m, g in zip(masters, grads, strict=True):
                m.sub_(0.05 * g)
        log["scale"].append(_scale_of(scaler))
        log["take"].append(bool(take))
        log["loss"].append(float(loss.detach()))
    log["masters"] = [m.clone() for m in masters]
    return log


def run_fp16_demo(scaler_cls: Any, steps: int = 60, world_size: int = WORLD_SIZE, init_scale: float = 2.0 ** 24,
                  growth_interval: int = 8) -> list[dict[str, Any]]:
    """Train a tiny fp16 two-layer regression model data-parallel on ``world_size`` ranks with ``scaler_cls``;
    per rank: the scale after each step, whether it was taken, the loss, and the final fp32 masters."""
    from workbench.dist.launch import launch

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    _ship_by_value(scaler_cls)
    return launch(_demo_rank, world_size, scaler_cls, steps, init_scale, growth_interval, device="cpu",
                  timeout=TIMEOUT)


__all__ = ["CONFIG", "HINTS", "MISTAKES", "RESUMED", "STREAM", "WORLD_SIZE", "check", "coefficients", "hint",
           "run_fp16_demo"]
