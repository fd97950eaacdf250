"""Pipeline schedules as data: per-rank action lists, a simulator, closed-form bubbles and a text grid.

A pipeline cuts the model's layers into ``S`` stages placed on ``p`` ranks. A *schedule* says, for each
rank, in which order it runs the forward (``F``) and backward passes of every (stage, micro-batch). Here a
schedule is nothing but that order: one small function per schedule returns ``plan[rank] = [Action, ...]``.
Everything else reads the same lists: ``simulate`` lays them on a rank x time grid (so theory derives each
schedule's bubble and activation memory from exactly what the executor runs), ``format_plan`` prints the
grid, ``with_communication`` adds the send/recv actions the executor posts, and
``workbench.parallel.pipeline`` runs them. Adding a schedule is adding one function.

Action kinds (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §2, split the backward in two):

- ``F``  forward of one micro-batch through one stage;
- ``B``  full backward: gradient w.r.t. the stage's input *and* its weights;
- ``I``  input-gradient half of ``B`` (the paper's "B"): all the previous stage waits for;
- ``W``  weight-gradient half of ``B``: nothing downstream needs it, so it may be deferred to fill idle time;
- ``SEND_F`` / ``RECV_F`` / ``SEND_B`` / ``RECV_B``: activations (forward) and their gradients (backward)
  crossing a stage boundary, added by ``with_communication``.

Stages and ranks: with ``v`` virtual stages per rank (interleaved 1F1B) there are ``S = p·v`` stages and
stage ``s`` lives on rank ``s % p`` (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", §2.2.2), so rank 0 holds stages 0, p, 2p, ... Without interleaving,
stage ``s`` is rank ``s``.

Bubble fraction here is idle time over ``p x makespan`` (all ranks' time), which for GPipe and 1F1B is
(p−1)/(m+p−1); Narayanan et al. quote the same idle time relative to the ideal compute, (p−1)/m.

Pure Python: no torch, no workbench imports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from workbench.theory.checks import positive_int

COMPUTE_KINDS: tuple[str, ...] = ("F", "B", "I", "W")
COMM_KINDS: tuple[str, ...] = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
#: Time of one action in units of a forward. Matmul FLOPs: a backward costs two forwards, split evenly
#: between the input gradient and the weight gradient (Qi et al. 2023, Table 1: T_B + T_W = 2 T_F).
DEFAULT_DURATIONS: dict[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Action:
    """One step of one rank's plan: ``kind`` on micro-batch ``microbatch`` of pipeline stage ``stage``.

    For communication, ``stage`` is the local stage: ``SEND_F`` sends stage s's output to s+1, ``RECV_F``
    receives stage s's input from s−1, ``SEND_B`` sends the gradient of s's input to s−1, ``RECV_B``
    receives the gradient of s's output from s+1.
    """

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; valid: {', '.join(COMPUTE_KINDS + COMM_KINDS)}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}s{self.stage}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


Plan = list[list[Action]]  # plan[rank] = that rank's actions, in order


# ---------------------------------------------------------------------------------------------------------
# Layout: which rank holds which stage, which layers a stage holds.


def stage_rank(stage: int, p: int) -> int:
    """The rank holding ``stage`` (round robin: interleaved chunks of one rank are p stages apart)."""
    return stage % p


def rank_stages(rank: int, p: int, v: int = 1) -> list[int]:
    """The stages rank ``rank`` holds, in pipeline order."""
    return [chunk * p + rank for chunk in range(v)]


def stage_layers(n_layer: int, n_stages: int) -> list[range]:
    """Contiguous, balanced layer ranges per stage; when they don't divide, the first stages get one more.

    Extra layers go first because the last stage also carries the final norm, the LM head and the loss
    (a V x d matmul per token), while the first stage's extra work, the embedding, is only a lookup.
    """
    if n_stages > n_layer:
        layers = f"{n_layer} layer" + ("s" if n_layer != 1 else "")
        raise ValueError(f"{n_stages} pipeline stages but the model has only {layers}: every stage needs "
                         f"at least one layer; use pp x virtual stages <= {n_layer} or a deeper model")
    base, extra = divmod(n_layer, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [range(bounds[s], bounds[s + 1]) for s in range(n_stages)]


# ---------------------------------------------------------------------------------------------------------
# The schedules: one small function each, returning plan[rank].


def naive(p: int, m: int) -> Plan:
    """One micro-batch at a time through all stages and back: only one rank ever works (bubble (p−1)/p)."""
    return [[Action(r, kind, mb) for mb in range(m) for kind in ("F", "B")] for r in range(p)]


def gpipe(p: int, m: int) -> Plan:
    """All forwards, then all backwards (Huang et al. 2019, "GPipe"): every rank holds m micro-batches'
    activations at the turn."""
    return [[Action(r, "F", mb) for mb in range(m)] + [Action(r, "B", mb) for mb in range(m)] for r in range(p)]


def _one_f_one_b_order(p: int, m: int, r: int) -> list[tuple[str, int]]:
    """(kind, micro-batch) order of 1F1B on rank r: p−r−1 warm-up forwards, then alternate, then drain."""
    warmup = min(p - r - 1, m)
    order = [("F", mb) for mb in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", mb) for mb in range(m - warmup, m)]


def one_f_one_b(p: int, m: int) -> Plan:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021, §2.2.1): same bubble as GPipe, but a backward starts as
    soon as the last stage can run it, so rank r holds at most p−r micro-batches' activations, not m."""
    return [[Action(r, kind, mb) for kind, mb in _one_f_one_b_order(p, m, r)] for r in range(p)]


def _interleaved_action(kind: str, k: int, r: int, p: int, v: int) -> Action:
    """The k-th forward (or backward) of rank r: micro-batches go in groups of p through chunk 0, then the
    same group through chunk 1, ...; backwards visit the chunks in reverse."""
    chunk = (k // p) % v
    if kind == "B":
        chunk = v - 1 - chunk
    microbatch = (k // (p * v)) * p + k % p
    return Action(chunk * p + r, kind, microbatch)


def interleaved_1f1b(p: int, m: int, v: int) -> Plan:
    """Interleaved 1F1B (Narayanan et al. 2021, §2.2.2): each rank holds v chunks of 1/v of its layers, so
    the pipeline fills and drains v times faster and the bubble shrinks by v: (p−1)/(v·m + p−1).

    Warm-up follows Megatron-LM: (v−1)·p forwards to fill every chunk once, plus 2·(p−r−1) so that a
    round trip of point-to-point latency does not stall the steady state.
    """
    plan = []
    for r in range(p):
        total = m * v
        warmup = min((v - 1) * p + 2 * (p - r - 1), total)
        actions = [_interleaved_action("F", k, r, p, v) for k in range(warmup)]
        for i in range(total - warmup):
            actions += [_interleaved_action("F", warmup + i, r, p, v), _interleaved_action("B", i, r, p, v)]
        actions += [_interleaved_action("B", k, r, p, v) for k in range(total - warmup, total)]
        plan.append(actions)
    return plan


def zero_bubble_h1(p: int, m: int) -> Plan:
    """ZB-H1 (Qi et al. 2023, §2.1): 1F1B with each backward split into I then W, W run r micro-batches late.

    Only I is on the critical path (the previous stage waits for it), so backwards travel up the pipeline
    faster; rank r defers its weight gradients by r, the number of micro-batches by which its 1F1B tail
    bubble is longer than the last rank's, and the deferred W's fill that tail. In-flight activations stay
    1F1B's (p−r on rank r), and the bubble drops to (p−1)(T_F + T_I − T_W), a third of 1F1B's when
    T_F = T_I = T_W.
    """
    plan = []
    for r in range(p):
        actions = []
        for kind, mb in _one_f_one_b_order(p, m, r):
            if kind == "F":
                actions.append(Action(r, "F", mb))
                continue
            actions.append(Action(r, "I", mb))
            if mb >= r:
                actions.append(Action(r, "W", mb - r))
        actions += [Action(r, "W", mb) for mb in range(max(m - r, 0), m)]
        plan.append(actions)
    return plan


#: Schedule name (as ``workbench run --schedule`` spells it) → the function that builds its plan.
SCHEDULES: dict[str, Callable[..., Plan]] = {
    "naive": naive,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb": zero_bubble_h1,
}


def validate(name: str, p: int, m: int, v: int = 1, n_layer: int | None = None) -> None:
    """Raise ValueError, naming the fix, for a schedule that cannot run with these sizes."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    for what, value in (("pipeline stages (pp)", p), ("micro-batches", m), ("virtual stages", v)):
        positive_int(what, value)
    if n_layer is not None:
        stage_layers(n_layer, p * v)  # more stages than layers: the first thing to fix
    if name == "interleaved":
        _validate_interleaved(p, m, v, n_layer)
    elif v != 1:
        raise ValueError(f"schedule {name!r} runs one stage per rank, got virtual stages v={v}; "
                         f"use schedule 'interleaved' for v > 1")
    if name in ("1f1b", "zb") and m < p:
        raise ValueError(f"schedule {name!r} needs at least as many micro-batches as stages: m={m} < p={p}; "
                         f"use m >= {p} (or 'gpipe')")


def _validate_interleaved(p: int, m: int, v: int, n_layer: int | None) -> None:
    if v < 2:
        raise ValueError(f"interleaved needs virtual stages v >= 2, got v={v} (with v=1 it is '1f1b')")
    if m % p != 0:
        raise ValueError(f"interleaved sends micro-batches through the chunks in groups of p: micro-batches "
                         f"m={m} must be a multiple of pp={p}")
    if n_layer is not None and n_layer % (p * v) != 0:
        raise ValueError(f"interleaved cuts {n_layer} layers into pp x v = {p} x {v} = {p * v} equal chunks: "
                         f"layers must be divisible by {p * v}")


def make_plan(name: str, p: int, m: int, v: int = 1, n_layer: int | None = None) -> Plan:
    """Validate, then build the named schedule's plan: ``plan[rank]`` is that rank's list of actions."""
    validate(name, p, m, v, n_layer)
    return interleaved_1f1b(p, m, v) if name == "interleaved" else SCHEDULES[name](p, m)


def check_plan(plan: Plan, m: int) -> None:
    """Every (stage, micro-batch) runs F, and B or I+W, exactly once, on the rank holding the stage, and
    its W after its I. ValueError otherwise (a hand-written plan in a lab gets told what is wrong)."""
    p, n_stages = len(plan), num_stages(plan)
    seen: dict[tuple[int, str, int], int] = {}
    for rank, actions in enumerate(plan):
        for a in (a for a in actions if a.is_compute):
            if stage_rank(a.stage, p) != rank:
                raise ValueError(f"rank {rank} runs {a} but stage {a.stage} lives on rank {stage_rank(a.stage, p)}")
            if (a.stage, a.kind, a.microbatch) in seen:
                raise ValueError(f"{a} appears twice on rank {rank}")
            if a.kind == "W" and (a.stage, "I", a.microbatch) not in seen:
                raise ValueError(f"rank {rank} runs {a} before its input-gradient I{a.microbatch}s{a.stage}")
            seen[(a.stage, a.kind, a.microbatch)] = rank
    for s in range(n_stages):
        for mb in range(m):
            _check_once(seen, s, mb)


def _check_once(seen: Mapping[tuple[int, str, int], int], s: int, mb: int) -> None:
    has = {k for k in COMPUTE_KINDS if (s, k, mb) in seen}
    if "F" not in has:
        raise ValueError(f"no forward F{mb}s{s}")
    if has - {"F"} not in ({"B"}, {"I", "W"}):
        raise ValueError(f"stage {s} micro-batch {mb} needs B, or I and W, got {sorted(has - {'F'})}")


def num_stages(plan: Plan) -> int:
    return 1 + max(a.stage for actions in plan for a in actions)


def num_microbatches(plan: Plan) -> int:
    return 1 + max(a.microbatch for actions in plan for a in actions)


# ---------------------------------------------------------------------------------------------------------
# Simulation: lay a plan on a rank x time grid.


@dataclass
class Timed:
    action: Action
    start: float
    end: float


@dataclass
class Simulation:
    """A plan laid out in time. ``timeline[rank]`` lists that rank's actions with start/end times."""

    timeline: list[list[Timed]]
    makespan: float
    busy: list[float]
    bubble_fraction: float
    peak_in_flight: list[int]  # per rank: most (stage, micro-batch) pairs with F done and B/I not yet
    durations: dict[str, float] = field(default_factory=dict)


def _dependencies(a: Action, n_stages: int) -> list[tuple[int, str, int]]:
    """What ``a`` waits for, as (stage, kind, micro-batch); kind "grad" means B or I of that stage."""
    if a.kind == "F":
        return [(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
    if a.kind in ("B", "I"):
        after = [(a.stage + 1, "grad", a.microbatch)] if a.stage < n_stages - 1 else []
        return [(a.stage, "F", a.microbatch), *after]
    return [(a.stage, "I", a.microbatch)]  # W needs its own I (the stored output gradients)


def _finished_keys(a: Action) -> list[tuple[int, str, int]]:
    """What ``a`` provides: B and I both provide the input gradient ("grad"); I also lets W run."""
    keys = [(a.stage, a.kind, a.microbatch)]
    return keys + [(a.stage, "grad", a.microbatch)] if a.kind in ("B", "I") else keys


def simulate(plan: Plan, durations: Mapping[str, float] | None = None, latency: float = 0.0) -> Simulation:
    """Run every rank's actions in order, each as soon as its rank is free and its inputs exist.

    F of stage s needs F of s−1; B or I of s needs F of s and B or I of s+1; W needs I of its stage.
    ``latency`` is added to every dependency that crosses ranks (a point-to-point message). A plan whose
    ranks wait on each other forever raises ValueError naming what each rank waits for.
    """
    dur = {**DEFAULT_DURATIONS, **(durations or {})}
    p, n_stages = len(plan), num_stages(plan)
    compute = [[a for a in actions if a.is_compute] for actions in plan]
    finished: dict[tuple[int, str, int], tuple[float, int]] = {}  # key -> (end time, rank)
    timeline: list[list[Timed]] = [[] for _ in range(p)]
    free, nxt = [0.0] * p, [0] * p
    while any(nxt[r] < len(compute[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while nxt[r] < len(compute[r]):
                a = compute[r][nxt[r]]
                ready = _ready_time(a, r, n_stages, finished, latency)
                if ready is None:
                    break
                start = max(free[r], ready)
                free[r] = start + dur[a.kind]
                finished.update(dict.fromkeys(_finished_keys(a), (free[r], r)))
                timeline[r].append(Timed(a, start, free[r]))
                nxt[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("plan deadlocks: " + "; ".join(
                f"rank {r} waits at {compute[r][nxt[r]]}" for r in range(p) if nxt[r] < len(compute[r])))
    return _summarise(timeline, dur)


def _ready_time(a: Action, rank: int, n_stages: int, finished: Mapping, latency: float) -> float | None:
    ready = 0.0
    for dep in _dependencies(a, n_stages):
        if dep not in finished:
            return None
        end, dep_rank = finished[dep]
        ready = max(ready, end + (latency if dep_rank != rank else 0.0))
    return ready


def _summarise(timeline: list[list[Timed]], dur: dict[str, float]) -> Simulation:
    makespan = max((t.end for row in timeline for t in row), default=0.0)
    busy = [sum(t.end - t.start for t in row) for row in timeline]
    bubble = 1.0 - sum(busy) / (len(timeline) * makespan) if makespan else 0.0
    peaks = [peak_in_flight([t.action for t in row]) for row in timeline]
    return Simulation(timeline, makespan, busy, bubble, peaks, dict(dur))


def peak_in_flight(actions: Iterable[Action]) -> int:
    """Most micro-batches (per stage) whose activations one rank holds: F done, B or I not yet."""
    held, peak = 0, 0
    for a in actions:
        held += 1 if a.kind == "F" else -1 if a.kind in ("B", "I") else 0
        peak = max(peak, held)
    return peak


def peak_held_layers(actions: Iterable[Action], layers_per_stage: Sequence[int]) -> int:
    """``peak_in_flight`` weighted by layers: the most layer-micro-batches whose activations one rank holds.

    A forward of stage s adds ``layers_per_stage[s]`` layers' activations of one micro-batch, its B (or I)
    frees them. With equal stages this is ``peak_in_flight × layers per stage``; with uneven ones (the
    first stages get the extra layers, ``stage_layers``) it weighs each held micro-batch by its stage.
    """
    held, peak = 0, 0
    for a in actions:
        sign = 1 if a.kind == "F" else -1 if a.kind in ("B", "I") else 0
        held += sign * layers_per_stage[a.stage]
        peak = max(peak, held)
    return peak


# ---------------------------------------------------------------------------------------------------------
# Closed forms, beside the simulated values.


def bubble_fraction(name: str, p: int, m: int, v: int = 1, durations: Mapping[str, float] | None = None) -> float:
    """Theory's idle fraction of p x makespan for the named schedule.

    naive: (p−1)/p, only one stage busy at a time. GPipe and 1F1B: (p−1)/(m+p−1), the pipeline fills and
    drains once (Huang et al. 2019; Narayanan et al. 2021). Interleaved: fill/drain shrink by v,
    (p−1)/(v·m+p−1) (Narayanan et al. 2021, §2.2.2). ZB-H1: idle (p−1)(T_F+T_I−T_W) per rank beside
    m(T_F+T_I+T_W) of work (Qi et al. 2023, Table 2).
    """
    validate(name, p, m, v)
    if name == "naive":
        return (p - 1) / p
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    d = {**DEFAULT_DURATIONS, **(durations or {})}
    idle = (p - 1) * (d["F"] + d["I"] - d["W"])
    return idle / (m * (d["F"] + d["I"] + d["W"]) + idle)


def analyze(name: str, p: int, m: int, v: int = 1, durations: Mapping[str, float] | None = None,
            n_layer: int | None = None) -> dict:
    """The named schedule's plan, simulated, beside its closed-form bubble."""
    plan = make_plan(name, p, m, v, n_layer)
    sim = simulate(plan, durations)
    return {"schedule": name, "p": p, "m": m, "v": v, "plan": plan, "simulation": sim,
            "bubble_simulated": sim.bubble_fraction, "bubble_theory": bubble_fraction(name, p, m, v, durations),
            "peak_in_flight": sim.peak_in_flight}


def measured_bubble(busy: Mapping[int, Iterable[tuple[float, float]]]) -> float:
    """Idle fraction of p x makespan from measured busy intervals per rank (e.g. a trace's compute spans).

    The makespan runs from the first interval's start to the last one's end over all ranks, as in
    ``simulate``, where the first forward starts at 0.
    """
    intervals = {r: list(iv) for r, iv in busy.items()}
    starts = [t0 for iv in intervals.values() for t0, _ in iv]
    ends = [t1 for iv in intervals.values() for _, t1 in iv]
    if not starts:
        raise ValueError("no busy intervals to measure a bubble from")
    makespan = max(ends) - min(starts)
    work = sum(t1 - t0 for iv in intervals.values() for t0, t1 in iv)
    return 1.0 - work / (len(intervals) * makespan)


# ---------------------------------------------------------------------------------------------------------
# The grid as text.


def _label(a: Action, multi_stage: bool) -> str:
    return f"{a.kind}{a.microbatch}" + (f"s{a.stage}" if multi_stage else "")


def format_plan(plan_or_simulation: Plan | Simulation, durations: Mapping[str, float] | None = None) -> str:
    """The plan as a rank x time grid, one column per time unit ("." idle, a B of 2 units fills 2 cells).

    Interleaved plans label each action with its stage (``F3s2``: forward of micro-batch 3 in stage 2).
    Durations must be whole numbers of time units.
    """
    sim = plan_or_simulation if isinstance(plan_or_simulation, Simulation) else simulate(plan_or_simulation,
                                                                                         durations)
    if any(float(d) != int(d) for d in sim.durations.values()):
        raise ValueError(f"format_plan draws whole time units; durations were {sim.durations}")
    multi = num_stages([[t.action for t in row] for row in sim.timeline]) > len(sim.timeline)
    cells = [["."] * int(sim.makespan) for _ in sim.timeline]
    for r, row in enumerate(sim.timeline):
        for t in row:
            for u in range(int(t.start), int(t.end)):
                cells[r][u] = _label(t.action, multi)
    width = max(len(c) for row in cells for c in row)
    lines = [f"rank {r} | " + " ".join(c.ljust(width) for c in row).rstrip() for r, row in enumerate(cells)]
    lines.append(f"bubble {sim.bubble_fraction:.3f}, peak in-flight micro-batches per rank {sim.peak_in_flight}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Communication made explicit: the send/recv actions the executor posts.


def message_peer(a: Action, p: int) -> int:
    """The rank on the other end of a communication action."""
    offset = {"SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1}[a.kind]
    return stage_rank(a.stage + offset, p)


def needed_message(a: Action, n_stages: int) -> Action | None:
    """The receive a compute action needs first (its input activation, or its output's gradient)."""
    if a.kind == "F" and a.stage > 0:
        return Action(a.stage, "RECV_F", a.microbatch)
    if a.kind in ("B", "I") and a.stage < n_stages - 1:
        return Action(a.stage, "RECV_B", a.microbatch)
    return None


def produced_message(a: Action, n_stages: int) -> Action | None:
    """The send a compute action makes when done (its output forward, its input's gradient back)."""
    if a.kind == "F" and a.stage < n_stages - 1:
        return Action(a.stage, "SEND_F", a.microbatch)
    if a.kind in ("B", "I") and a.stage > 0:
        return Action(a.stage, "SEND_B", a.microbatch)
    return None


def matching_receive(send: Action) -> Action:
    """The receive that matches ``send`` on the other end."""
    if send.kind == "SEND_F":
        return Action(send.stage + 1, "RECV_F", send.microbatch)
    return Action(send.stage - 1, "RECV_B", send.microbatch)


def with_communication(plan: Plan) -> Plan:
    """Insert, around each compute action, the receive it needs (before) and the send it makes (after).

    Point-to-point messages between two ranks are matched in the order they were posted, so a rank posts
    its receives from a peer in the order that peer sends: when it needs a message, it first posts any
    earlier ones from the same peer that it has not posted yet. (With p=2 and interleaving, activations and
    gradients share one link, and their orders on the two ends need not agree.) The executor batches each
    run of consecutive communication actions: receives posted before sends, waited before the next compute.
    """
    p, n_stages = len(plan), num_stages(plan)
    channels: dict[tuple[int, int], list[Action]] = {}  # (src, dst) -> receives, in the sender's order
    for rank, actions in enumerate(plan):
        for a in actions:
            send = produced_message(a, n_stages) if a.is_compute else None
            if send is not None and message_peer(send, p) != rank:
                channels.setdefault((rank, message_peer(send, p)), []).append(matching_receive(send))
    return [_lower_rank(rank, actions, channels, p, n_stages) for rank, actions in enumerate(plan)]


def _lower_rank(rank: int, actions: list[Action], channels: Mapping[tuple[int, int], list[Action]], p: int,
                n_stages: int) -> list[Action]:
    posted: dict[int, int] = {}  # peer -> how many of its messages to us are already posted
    out: list[Action] = []
    for a in (a for a in actions if a.is_compute):
        need = needed_message(a, n_stages)
        if need is not None and message_peer(need, p) != rank:  # a message to oneself is handed over locally
            src = message_peer(need, p)
            queue = channels[(src, rank)]
            upto = queue.index(need) + 1
            out += queue[posted.get(src, 0):upto]
            posted[src] = max(posted.get(src, 0), upto)
        out.append(a)
        send = produced_message(a, n_stages)
        if send is not None and message_peer(send, p) != rank:
            out.append(send)
    return out
