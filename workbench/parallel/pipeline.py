"""Pipeline parallelism: the GPT's layers cut into stages on the ranks of a pp group, run by one executor.

**The cut** (``split_gpt``). Stages are cut from the whole seeded model by keeping the modules a rank's
stages own, so pp=N starts exactly where pp=1 does, and parameters keep the names they have in the full
model (blocks stay keyed by their original index: stage 1 of a 4-layer model on 2 ranks holds
``blocks.2.*`` and ``blocks.3.*``, not a renumbered ``blocks.0``). Layers are balanced contiguously
(``theory.pipeline.stage_layers``); the token and position embeddings go with the first stage, the final
LayerNorm, LM head and loss with the last.

**The tied embedding/head.** The GPT ties ``lm_head.weight`` to ``wte.weight``, but the two ends of the
pipeline live on different ranks. As in Megatron-LM (Shoeybi et al. 2019; Narayanan et al. 2021), the
last stage keeps its own copy of the tied matrix (cut from the same seeded model, so it starts identical),
and after every backward the first and last stage exchange their gradients of it and both add them
(``sync_tied_grads``, a two-rank all-reduce done with one send and one receive each way). Both copies then
take the same optimizer step on the same gradient and stay identical; ``full_parameters`` reports the one
tensor as ``wte.weight``, as the full model does. When one rank holds both ends (pp=1) the tie is kept.

**The loss.** The last stage computes the cross-entropy of each micro-batch as a *sum* over its tokens
divided by the token count of the whole batch given to ``forward_backward``, so the micro-batches' losses
(and gradients) add up to one process's mean over that batch. The total is broadcast over the pp group,
so every rank reports the same loss.

**The executor** (``Pipeline``). A schedule is data: ``theory.pipeline.make_plan`` gives each rank a list
of actions, ``with_communication`` adds the receives each one needs and the sends it makes, and one loop
here runs any such list. Each run of consecutive send/recv actions is one batch: its receives are posted
first, then its sends, grouped per peer; the receives are waited for before the next compute, the sends
only when found complete later or at the end of the step (nothing ever waits for a send it does not need,
which is what makes any deadlock-free plan run without deadlock). Each action is a trace span named with
its micro-batch ("F mb3", "B mb0", "I mb2", "W mb2"; "F mb3 s2" when a rank holds several stages),
category forward or backward, so the timeline shows the bubble and ``measured_bubble`` measures it.
Activations saved for backward are counted into the ledger's ``activations`` as each forward saves them
and released when that micro-batch's backward has consumed them.

**Zero-bubble's split backward** (Qi et al. 2023). For a plan with I/W actions, each ``nn.Linear`` of
the stages is swapped (sharing its parameters and names) for one whose backward, during an I action,
computes only the input gradient dL/dx = g·W and stores (x, g); the W action later computes the weight
gradient gᵀx, which nothing downstream waits for. LayerNorm and embedding gradients are cheap and stay in I.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workbench import trace
from workbench.dist import comm
from workbench.dist.launch import rank_device
from workbench.parallel.grad_norm import clip_by_shares_
from workbench.theory import pipeline as theory
from workbench.theory.pipeline import Action

ACTIVATION_TAG = "pp_act"  # stage outputs travelling forward
GRADIENT_TAG = "pp_grad"  # their gradients travelling back
TIED_TAG = "pp_tied"  # the tied embedding/head gradient exchanged between first and last stage
LOSS_TAG = "pp_loss"  # the last stage's loss broadcast to the pp group
_ACTION_SPAN = re.compile(r"^[FBIW] mb\d+")


# ---------------------------------------------------------------------------------------------------------
# The cut: the modules one pp rank keeps.


class GPTStages(nn.Module):
    """The stages of a GPT one pipeline rank holds, with the parameter names of the full model.

    ``forward(x, stage)``: stage 0 takes token ids [b, T]; any other stage the hidden state [b, T, d]
    from the stage before. The last stage returns logits [b, T, V], the others the hidden state.
    """

    def __init__(self, model: nn.Module, stages: list[int], layers: list[range]) -> None:
        super().__init__()
        tied = model.cfg.tie_embeddings and model.lm_head.weight is model.wte.weight
        self.stages = list(stages)
        self.num_stages = len(layers)
        self.layers = {s: layers[s] for s in stages}
        first, last = 0 in stages, self.num_stages - 1 in stages
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for s in stages for i in layers[s]})
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
            if tied and not first:
                # Megatron's answer to the tie across ranks: the last stage owns a copy (see module doc).
                self.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
        self.tied = tied

    def forward(self, x: torch.Tensor, stage: int) -> torch.Tensor:
        if stage == 0:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.wte(x) + self.wpe(pos)  # [b, T, d]
        for i in self.layers[stage]:
            x = self.blocks[str(i)](x)
        if stage == self.num_stages - 1:
            return self.lm_head(self.ln_f(x))  # [b, T, V]
        return x


def split_gpt(model: nn.Module, rank: int, p: int, v: int = 1) -> GPTStages:
    """Keep the stages pipeline rank ``rank`` of ``p`` holds (``v`` per rank, interleaved) of ``model``.

    ``model`` is consumed: its modules move into the stages. ValueError if there are more stages than
    layers.
    """
    layers = theory.stage_layers(model.cfg.n_layer, p * v)
    return GPTStages(model, theory.rank_stages(rank, p, v), layers)


def stage_loss(logits: torch.Tensor, targets: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Cross-entropy summed over this micro-batch's tokens ÷ the whole batch's tokens (fp32), so that the
    micro-batches' losses add up to the mean one process computes over the batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") / total_tokens


# ---------------------------------------------------------------------------------------------------------
# Zero-bubble: the linear layers' weight gradients, deferred.


class WeightGradStore:
    """Where linear layers put (x, g) during an I action; ``apply`` turns them into weight gradients."""

    def __init__(self) -> None:
        self.collecting: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] | None = None

    @contextmanager
    def deferring(self) -> Iterator[list]:
        """Inside the block, linear backwards compute dL/dx only and store what dL/dW needs."""
        self.collecting = []
        try:
            yield self.collecting
        finally:
            self.collecting = None

    @staticmethod
    def apply(stored: list[tuple[nn.Module, torch.Tensor, torch.Tensor]]) -> None:
        """Accumulate dL/dW = gᵀx (and dL/db = Σg) of every stored linear into its ``.grad``."""
        with torch.no_grad():
            for linear, x, g in stored:
                g2, x2 = g.flatten(0, -2), x.flatten(0, -2)  # [tokens, out], [tokens, in]
                _accumulate(linear.weight, g2.t() @ x2)
                if linear.bias is not None:
                    _accumulate(linear.bias, g2.sum(0))


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _LinearDeferrable(torch.autograd.Function):
    """y = x Wᵀ + b whose backward may leave dL/dW for later (Qi et al. 2023, §2: B and W)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                linear: nn.Module) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.linear = linear
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        grad_x = g @ weight  # [.., out] @ [out, in]: what the previous layer (and stage) waits for
        store = ctx.linear.store.collecting
        if store is not None:
            store.append((ctx.linear, x, g))
            return grad_x, None, None, None
        g2 = g.flatten(0, -2)
        grad_b = g2.sum(0) if ctx.linear.bias is not None else None
        return grad_x, g2.t() @ x.flatten(0, -2), grad_b, None


class DeferrableLinear(nn.Module):
    """An ``nn.Linear``'s parameters (same objects, same names) with a backward that can defer dL/dW."""

    def __init__(self, linear: nn.Linear, store: WeightGradStore) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.store = store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearDeferrable.apply(x, self.weight, self.bias, self)


def defer_weight_grads(module: nn.Module) -> WeightGradStore:
    """Swap every ``nn.Linear`` inside ``module`` for a ``DeferrableLinear`` sharing one store."""
    store = WeightGradStore()
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, DeferrableLinear(child, store))
    return store


# ---------------------------------------------------------------------------------------------------------
# Activation memory per stage, into the ledger.


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


class ActivationMeter:
    """Bytes each (stage, micro-batch) holds for backward: saved by its forward, then (after an I action)
    the (x, g) pairs its W will need. The rank's total goes to the ledger's ``activations``."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, int], int] = {}
        self.peak_per_stage: dict[int, int] = {}

    @contextmanager
    def saving(self, stage: int, mb: int) -> Iterator[None]:
        """Count what autograd saves inside the block: not parameters, views of them, or autocast's copies of
        them in the compute dtype (``trace.is_parameter_bytes``, the ledger's own rule)."""
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not trace.is_parameter_bytes(t):
                saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.hold(stage, mb, _storage_bytes(saved))

    def hold(self, stage: int, mb: int, nbytes: int) -> None:
        self.release(stage, mb)
        self.held[(stage, mb)] = nbytes
        trace.ledger_add("activations", nbytes)
        now = sum(b for (s, _), b in self.held.items() if s == stage)
        self.peak_per_stage[stage] = max(self.peak_per_stage.get(stage, 0), now)

    def release(self, stage: int, mb: int) -> None:
        trace.ledger_add("activations", -self.held.pop((stage, mb), 0))


# ---------------------------------------------------------------------------------------------------------
# The tied embedding/head across the first and last stage.


def sync_tied_grads(stages: GPTStages, group: Any = None) -> None:
    """Sum the first stage's ``wte.weight`` gradient and the last stage's ``lm_head.weight`` gradient on
    both (they are one tied matrix in the full model). A no-op where one rank holds both ends or neither."""
    if not stages.tied or (hasattr(stages, "wte") == hasattr(stages, "lm_head")):
        return
    p = comm.group_size(group)
    mine = stages.wte.weight if hasattr(stages, "wte") else stages.lm_head.weight
    peer = comm.global_rank(group, p - 1 if hasattr(stages, "wte") else 0)
    if mine.grad is None:
        mine.grad = torch.zeros_like(mine)
    theirs = torch.empty_like(mine.grad)
    works = [comm.irecv(theirs, peer, group, tag=TIED_TAG), comm.isend(mine.grad, peer, group, tag=TIED_TAG)]
    for work in works:
        work.wait()
    mine.grad.add_(theirs)  # a + b == b + a in IEEE arithmetic: both ends hold the same bits


# ---------------------------------------------------------------------------------------------------------
# The executor.


@dataclass
class _StepState:
    """Everything one ``forward_backward`` keeps between actions, keyed by (stage, micro-batch)."""

    idx: tuple[torch.Tensor, ...]
    targets: tuple[torch.Tensor, ...]
    total_tokens: int
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    inbox: dict[Action, torch.Tensor] = field(default_factory=dict)  # RECV_* action -> received tensor
    outbox: dict[Action, torch.Tensor] = field(default_factory=dict)  # SEND_* action -> tensor to send
    deferred: dict[tuple[int, int], list] = field(default_factory=dict)  # I's (x, g) pairs awaiting W
    sends: list[comm.Work] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0


class Pipeline:
    """One rank's share of a pipeline-parallel GPT and the executor that runs its schedule.

    ``group`` is the pp process group (``mesh.pp_group``; None: the world, or one process). Every pp rank
    calls ``forward_backward(idx, targets)`` with the same batch: the first stage reads ``idx``, the last
    ``targets``. It returns the loss on every rank and leaves each parameter's gradient in ``.grad``; step
    the optimizer on ``parameters()`` afterwards.
    """

    def __init__(self, model: nn.Module, group: Any = None, schedule: str = "1f1b", microbatches: int = 4,
                 virtual_stages: int = 1, loss_fn: Callable[..., torch.Tensor] | None = None,
                 seq_shards: int = 1, plan: theory.Plan | None = None,
                 autocast: Callable[[], AbstractContextManager] | None = None,
                 loss_scale: Callable[[], float] | None = None) -> None:
        """``loss_fn(logits, targets, total_tokens)`` is the last stage's loss (default ``stage_loss``; a
        tensor-parallel model passes its vocab-parallel loss, its head giving this rank's vocab slice).
        ``seq_shards``: the hidden state between stages holds seq_len/seq_shards positions (sequence
        parallelism over tp: each tp rank sends only its positions to the same tp rank of the next stage, so
        the p2p volume drops by tp, Megatron-LM's scatter/gather across stages, Narayanan et al. 2021 §4.1).
        ``plan``: a hand-written plan (every rank's action list, one stage per rank and ``microbatches``
        micro-batches) to run instead of ``schedule``'s; it is checked (``check_plan``, then ``simulate``,
        which names the actions a deadlocking order would wait on) before anything runs.
        Mixed precision (``workbench.precision``): ``autocast()`` is entered around each forward action (the
        stage and, on the last, its fp32 loss), and the last stage calls backward on its micro-batch's loss
        times ``loss_scale()`` (fp16's loss scaling); messages between stages keep the parameters' dtype."""
        p, rank = comm.group_size(group), comm.group_rank(group)
        self.loss_fn = loss_fn or stage_loss
        self.autocast = autocast or nullcontext
        self.loss_scale = loss_scale
        if plan is None:
            plan = theory.make_plan(schedule, p, microbatches, virtual_stages, model.cfg.n_layer)
        else:
            _check_custom_plan(plan, p, microbatches, virtual_stages)
            schedule = "custom"
        self.group, self.p, self.rank = group, p, rank
        self.schedule, self.microbatches, self.virtual_stages = schedule, microbatches, virtual_stages
        self.plan = plan[rank]
        self.steps = theory.with_communication(plan)[rank]
        self.segments = _segments(self.steps)
        self.full_names = [name for name, _ in model.named_parameters()]
        self.d_model = model.cfg.d_model
        self.seq_shards = seq_shards
        self.module = split_gpt(model, rank, p, virtual_stages)
        self.store = defer_weight_grads(self.module) if any(a.kind == "I" for a in self.plan) else None
        self.meter = ActivationMeter()
        self.device = rank_device()
        self.last_stage = p * virtual_stages - 1
        self.peak_in_flight = 0

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    # -- one step -------------------------------------------------------------------------------------

    def forward_backward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run this rank's plan over ``microbatches`` slices of the batch; return the batch's mean loss."""
        if idx.shape[0] % self.microbatches != 0:
            raise ValueError(f"a batch of {idx.shape[0]} sequences is not divisible into {self.microbatches} "
                             f"micro-batches")
        st = _StepState(idx.chunk(self.microbatches), targets.chunk(self.microbatches), targets.numel())
        self._run(st)
        sync_tied_grads(self.module, self.group)
        self.peak_in_flight = st.peak_in_flight
        return self._broadcast_loss(st)

    def _run(self, st: _StepState) -> None:
        """Each segment: a batch of messages, then (but for the last) one compute action. The receives of
        the *next* batch are posted before this compute, so their transfers run while it computes; posting a
        receive never blocks, and batches are posted in plan order, so every link still matches in order."""
        early: dict[Action, comm.Work] = {}
        for i, (batch, action) in enumerate(self.segments):
            self._communicate(batch, st, early)
            if action is not None:
                if i + 1 < len(self.segments):
                    for a in self._receives(self.segments[i + 1][0]):
                        early[a] = self._post_recv(a, st)
                self._compute(action, st)
        for work in st.sends:  # the late wait: by now every send has a receiver
            work.wait()

    def _broadcast_loss(self, st: _StepState) -> torch.Tensor:
        loss = torch.zeros((), device=self.device, dtype=torch.float32)
        for part in st.losses:
            loss += part
        comm.broadcast(loss, src=comm.global_rank(self.group, theory.stage_rank(self.last_stage, self.p)),
                       group=self.group, tag=LOSS_TAG)
        return loss

    # -- communication --------------------------------------------------------------------------------

    def _receives(self, batch: list[Action]) -> list[Action]:
        """The batch's receives grouped per peer (a stable sort: each link keeps its order)."""
        return sorted((a for a in batch if a.kind.startswith("RECV")), key=lambda a: theory.message_peer(a, self.p))

    def _communicate(self, batch: list[Action], st: _StepState, early: dict[Action, comm.Work]) -> None:
        """Post the batch's receives (grouped per peer; those posted ``early`` already are not posted again),
        then its sends; wait for the receives only."""
        if not batch:
            return
        peer = lambda a: theory.message_peer(a, self.p)  # noqa: E731
        recvs = self._receives(batch)
        sends = sorted((a for a in batch if a.kind.startswith("SEND")), key=peer)
        with trace.span(" ".join(map(_message_name, recvs + sends)), "comm"):
            works = [early.pop(a) if a in early else self._post_recv(a, st) for a in recvs]
            st.sends += [comm.isend(st.outbox.pop(a), self._global(peer(a)), self.group, tag=_tag(a))
                         for a in sends]
            for work in works:
                work.wait()
        st.sends = _reap(st.sends)

    def _post_recv(self, a: Action, st: _StepState) -> comm.Work:
        mb = st.idx[a.microbatch]
        buf = torch.empty((mb.shape[0], mb.shape[1] // self.seq_shards, self.d_model), device=self.device,
                          dtype=self._dtype())
        st.inbox[a] = buf
        return comm.irecv(buf, self._global(theory.message_peer(a, self.p)), self.group, tag=_tag(a))

    def _deliver(self, a: Action, tensor: torch.Tensor, st: _StepState) -> None:
        """Queue a produced message: for the peer's rank, or straight into our own inbox (p=1 interleaved)."""
        send = theory.produced_message(a, self.last_stage + 1)
        if send is None:
            return
        if theory.message_peer(send, self.p) == self.rank:
            st.inbox[theory.matching_receive(send)] = tensor
        else:
            st.outbox[send] = tensor

    def _global(self, pp_rank: int) -> int:
        return comm.global_rank(self.group, pp_rank)

    def _dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    # -- compute --------------------------------------------------------------------------------------

    def _compute(self, a: Action, st: _StepState) -> None:
        name = f"{a.kind} mb{a.microbatch}" + (f" s{a.stage}" if self.virtual_stages > 1 else "")
        with trace.span(name, "forward" if a.kind == "F" else "backward"):
            if a.kind == "F":
                self._forward(a, st)
            elif a.kind == "W":
                WeightGradStore.apply(st.deferred.pop((a.stage, a.microbatch)))
                self.meter.release(a.stage, a.microbatch)
            else:
                self._backward(a, st)

    def _forward(self, a: Action, st: _StepState) -> None:
        s, mb = a.stage, a.microbatch
        x = st.idx[mb] if s == 0 else st.inbox.pop(Action(s, "RECV_F", mb)).requires_grad_()
        with self.meter.saving(s, mb), self.autocast():
            out = self.module(x, s)
            if s == self.last_stage:
                out = self.loss_fn(out, st.targets[mb], st.total_tokens)
                st.losses.append(out.detach())
        st.inputs[(s, mb)], st.outputs[(s, mb)] = x, out
        st.in_flight += 1
        st.peak_in_flight = max(st.peak_in_flight, st.in_flight)
        # Under autocast a stage may emit a low-precision hidden state; the receiver's buffer has the parameters'
        # dtype (``_post_recv``), so the message is cast to it (a no-op in fp32, and for the GPT, whose residual
        # stream stays fp32 under autocast).
        self._deliver(a, out.detach().to(self._dtype()), st)

    def _backward(self, a: Action, st: _StepState) -> None:
        """B: the full backward. I: the same pass with the linear layers' weight gradients deferred to W."""
        s, mb = a.stage, a.microbatch
        x, out = st.inputs.pop((s, mb)), st.outputs.pop((s, mb))
        if s == self.last_stage:
            grad = None
            if self.loss_scale is not None:  # fp16: backward of the scaled loss (the reported loss is unscaled)
                out = out * self.loss_scale()
        else:
            grad = st.inbox.pop(Action(s, "RECV_B", mb)).to(out.dtype)
        if a.kind == "I":
            with self.store.deferring() as stored:
                torch.autograd.backward(out, grad)
            st.deferred[(s, mb)] = stored
            self.meter.hold(s, mb, _storage_bytes(t for _, x_, g in stored for t in (x_, g)))
        else:
            torch.autograd.backward(out, grad)
            self.meter.release(s, mb)
        st.in_flight -= 1
        if s > 0:
            self._deliver(a, x.grad, st)

    # -- results --------------------------------------------------------------------------------------

    def full_parameters(self, local: Callable[[nn.Module], dict[str, torch.Tensor]] | None = None
                        ) -> dict[str, torch.Tensor]:
        """Every stage's parameters gathered over the pp group, under the full model's names and order
        (CPU copies; the last stage's copy of the tied matrix is not repeated). ``local(stages)`` gives this
        rank's full tensors first (e.g. gathered over tp); default: its parameters as they are."""
        own = local(self.module) if local is not None else dict(self.module.named_parameters())
        mine = {n: t.detach().cpu() for n, t in own.items()}
        merged: dict[str, torch.Tensor] = {}
        for part in comm.all_gather_object(mine, self.group):
            merged.update(part)
        return {name: merged[name] for name in self.full_names}


@torch.no_grad()
def clip_grad_norm_(pipe: Pipeline, max_norm: float, weights: dict[str, float] | None = None,
                    other_groups: tuple = ()) -> torch.Tensor:
    """Clip by the norm of the whole model's gradient, as one process would; return that norm (a 0-dim tensor).

    Each rank holds different layers, so the squared norms of its stages are summed over the pp group; the
    last stage's copy of the tied embedding/head carries the same gradient as the first stage's
    (``sync_tied_grads``) and is counted once. ``weights``/``other_groups`` let another split inside the
    stages take part (tensor parallelism: ``tensor.norm_weights`` and the tp group). Same formula as
    ``torch.nn.utils.clip_grad_norm_``."""
    stages = pipe.module
    shares = dict(weights or {})
    if stages.tied and hasattr(stages, "lm_head") and not hasattr(stages, "wte"):
        shares["lm_head.weight"] = 0.0  # the first stage's wte.weight holds the same gradient
    named = [(n, p.grad) for n, p in stages.named_parameters() if p.grad is not None]
    return clip_by_shares_(named, shares, (*other_groups, pipe.group), max_norm, pipe.device)


def _check_custom_plan(plan: theory.Plan, p: int, microbatches: int, virtual_stages: int) -> None:
    if len(plan) != p or virtual_stages != 1 or theory.num_stages(plan) != p:
        raise ValueError(f"a hand-written plan runs one stage per rank: got {len(plan)} action lists and "
                         f"{theory.num_stages(plan)} stages for {p} pp ranks (virtual_stages={virtual_stages})")
    theory.check_plan(plan, microbatches)
    theory.simulate(plan)


def _segments(steps: list[Action]) -> list[tuple[list[Action], Action | None]]:
    """``steps`` cut into (messages before a compute action, that action); the last has no action."""
    out: list[tuple[list[Action], Action | None]] = []
    batch: list[Action] = []
    for a in steps:
        if a.is_compute:
            out.append((batch, a))
            batch = []
        else:
            batch.append(a)
    return [*out, (batch, None)]


def _reap(sends: list[comm.Work]) -> list[comm.Work]:
    """Wait (and so log) the sends that have already completed; return those still in flight."""
    pending = []
    for work in sends:
        if work.is_completed():
            work.wait()
        else:
            pending.append(work)
    return pending


def _message_name(a: Action) -> str:
    verb = "recv" if a.kind.startswith("RECV") else "send"
    what = "F" if a.kind.endswith("F") else "B"
    return f"{verb} {what} mb{a.microbatch}"


def _tag(a: Action) -> str:
    return ACTIVATION_TAG if a.kind.endswith("F") else GRADIENT_TAG


# ---------------------------------------------------------------------------------------------------------
# Measuring the bubble from traces.


def busy_intervals(traces: Iterable[Any], step: int | None = None) -> dict[int, list[tuple[float, float]]]:
    """Per rank, the (t0, t1) of every pipeline action span (F/B/I/W) of ``step`` (all steps if None)."""
    return {t.rank: [(s.t0, s.t1) for s in t.spans if _ACTION_SPAN.match(s.name)
                     and s.category in ("forward", "backward") and (step is None or s.step == step)]
            for t in traces}


def measured_bubble(traces: Iterable[Any], step: int | None = None) -> float:
    """Idle fraction of the ranks' time from their first action to the last, measured from trace spans
    (``theory.pipeline.measured_bubble``): compare with ``theory.pipeline.bubble_fraction``."""
    return theory.measured_bubble(busy_intervals(traces, step))
