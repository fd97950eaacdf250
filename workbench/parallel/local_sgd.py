"""Local SGD and DiLoCo: replicas that train alone for H steps, then meet in one all-reduce.

Data parallelism (``parallel.ddp``) all-reduces the gradients every step, so the replicas never differ. Local SGD
(Stich 2019, "Local SGD Converges Fast and Communicates Little", ICLR; Lin et al. 2020, "Don't Use Large
Mini-Batches, Use Local SGD", ICLR) lets each rank take H = ``local_steps`` steps of its own *inner* optimizer on its
own gradients, with no communication at all, and only then synchronises the models. DiLoCo (Douillard et al. 2023,
"DiLoCo: Distributed Low-Communication Training of Language Models", Algorithm 1) treats that synchronisation as an
optimizer step of its own: with θ_g the global parameters every replica started the round from and θ_i replica i's
parameters after its H inner steps,

    Δ = mean_i (θ_g − θ_i)              the *pseudo-gradient*: one all-reduce of every trainable parameter
    θ_g ← OuterOpt(θ_g, Δ)              the *outer* step, the same on every rank
    θ_i ← θ_g                           every replica starts the next round from the same point, bit for bit

with the outer optimizers (``OUTERS``):

``avg``       θ_g ← θ_g − Δ = mean_i θ_i: plain periodic model averaging (local SGD).
``sgd``       θ_g ← θ_g − outer_lr · Δ (``outer_lr=1`` is ``avg``; > 1 extrapolates, < 1 damps).
``nesterov``  SGD with Nesterov momentum on Δ, DiLoCo's choice (the paper: inner AdamW, H = 500, outer lr 0.7,
              momentum 0.9, this class's defaults). Implemented explicitly with torch.optim.SGD's formulas
              (dampening 0): b ← μ·b + Δ (b starts at 0, so the first b is Δ as torch's clone), θ_g ← θ_g −
              lr·(Δ + μ·b).

What is communicated, and when. Construction broadcasts every parameter and buffer from the group's rank 0 (tag
``"init"``), so the replicas start equal. Inner steps communicate nothing: no gradient is ever all-reduced, each rank
steps on its own shard's gradient. Every ``local_steps``-th ``after_inner_step()`` runs the outer step: the
trainable parameters' Δ, flattened into one fp32 buffer, goes through ONE ``comm.all_reduce(..., "avg",
tag="outer")``, so the comm log shows one all-reduce of all trainable parameters (fp32 bytes: the element count
of DDP's gradient all-reduce) per H inner steps: 1/H of DDP's bytes per step and per token
(``theory.local_sgd.bytes_per_step``). ``history`` records each outer step's bytes.

State. θ_g is kept in fp32 on the model's device whatever the model's dtype (one flat buffer; ``global_params()``
gives per-parameter views), with the Nesterov buffer beside it. The inner optimizer is the caller's and keeps its
own state across outer steps (DiLoCo does not reset AdamW's moments). ``state_dict()`` holds the step counters,
θ_g and the momentum buffer; a resumed run also needs the model's own state_dict (the replica's θ_i, which differs
between ranks in mid-round) and the inner optimizer's, loaded *after* constructing the LocalSGD (construction
broadcasts rank 0's model). Frozen parameters (``requires_grad=False``) and buffers are broadcast at construction
and never averaged; a tied Parameter is one parameter.

Equivalences (tests/test_local_sgd.py checks each):

1. ``local_steps=1``, inner plain SGD (no momentum, no weight decay), ``outer="avg"`` is DDP with the same SGD on
   the global batch: mean_i (θ − lr·g_i) = θ − lr·mean_i g_i. Equal up to rounding only: DDP rounds lr·mean g
   once, here each θ − lr·g_i is rounded at the parameters' scale and then subtracted back, so the two differ by a
   few eps of max|θ| per step.
2. ``outer="sgd", outer_lr=1.0`` is ``outer="avg"`` bit for bit: multiplying by 1 is exact in IEEE arithmetic, so
   θ_g + (−1)·Δ rounds once, exactly as θ_g − Δ does.
3. H = 4: one all-reduce tagged ``"outer"`` per 4 inner steps, of the trainable parameters' fp32 bytes; replicas
   differ between outer steps and are bit-identical right after one.
4. The Nesterov outer step is the formula above (a hand computation in fp64, to rounding).
5. ``state_dict`` round trip: a run saved in mid-round and resumed is bit-identical to an uninterrupted one.

Replicas start alike through ``parallel.collectives.broadcast_module_state``, the helper DDP and ZeRO-2 use (a
strategy imports no sibling strategy: tests/test_import_layers.py, rule b).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workbench.dist import comm
from workbench.parallel.collectives import broadcast_module_state
from workbench.theory import local_sgd as theory
from workbench.theory.local_sgd import OUTERS

TAG = "outer"
HISTORY_STEPS = 10_000  # outer-step byte records kept (the newest)


@dataclass(frozen=True)
class OuterStep:
    """One outer step on this rank: its index, the inner step it followed (1-based count of inner steps so far),
    ``sent`` (the all-reduced tensor's bytes, what ``comm`` logs as nbytes) and ``bus`` (ring wire bytes this rank
    sent, ``theory.comm.bus_bytes``; 0 in a group of one)."""

    outer_step: int
    inner_step: int
    sent: int
    bus: float


class LocalSGD:
    """Local SGD / DiLoCo over ``group`` (None: the world; ``mesh.dp_group`` when data parallelism is one axis).

    Protocol per inner step: forward, backward, ``inner_optimizer.step()`` on the bare model (no gradient
    synchronisation), then ``after_inner_step()``, which returns True when it has just run the outer step (every
    rank must call it the same number of times: it may communicate). See the module docstring.
    """

    def __init__(self, model: nn.Module, group: Any = None, local_steps: int = 1, outer: str = "avg",
                 outer_lr: float = 0.7, outer_momentum: float = 0.9) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.local_steps = theory.check_local_steps(local_steps)
        self.outer = theory.check_outer(outer)
        self.outer_lr = theory.check_outer_lr(outer_lr)
        self.outer_momentum = theory.check_outer_momentum(outer_momentum)
        # named_parameters() yields a tied Parameter once, under its first name.
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("model has no trainable parameters (requires_grad=True): nothing to average")
        self.model = model
        self.group = group
        self.world_size = comm.group_size(group)
        self.names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.device = self._params[0].device
        self.numel = sum(p.numel() for p in self._params)

        broadcast_module_state(model, group)
        # θ_g, fp32 on the model's device, one flat buffer; the pseudo-gradient buffer and the momentum beside it.
        self._global = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        self._delta = torch.empty_like(self._global)
        self._momentum = torch.zeros_like(self._global) if self.outer == "nesterov" else None
        self._global_views = self._views(self._global)
        self._delta_views = self._views(self._delta)
        self.inner_steps = 0  # inner steps counted so far (after_inner_step calls)
        self.outer_steps = 0
        self.history: deque[OuterStep] = deque(maxlen=HISTORY_STEPS)
        self.restart_from_model()

    def restart_from_model(self) -> None:
        """Start a new outer round from the model's parameters as they are now: θ_g ← θ, momentum 0. The
        constructor does this; so does a resume on another layout, whose replicas all load one full state (there
        is no per-rank replica or outer state of that world to carry over)."""
        with torch.no_grad():
            for g, p in zip(self._global_views, self._params, strict=True):
                g.copy_(p.detach())
        if self._momentum is not None:
            self._momentum.zero_()
        self.since_outer = 0  # inner steps since the last outer step

    def __repr__(self) -> str:
        extra = "" if self.outer == "avg" else f", outer_lr={self.outer_lr}"
        extra += f", outer_momentum={self.outer_momentum}" if self.outer == "nesterov" else ""
        return (f"LocalSGD(local_steps={self.local_steps}, outer={self.outer!r}{extra}, world={self.world_size}, "
                f"inner_steps={self.inner_steps}, outer_steps={self.outer_steps})")

    # -- the protocol ---------------------------------------------------------------------------------------

    def after_inner_step(self) -> bool:
        """Count one inner optimizer step; on every ``local_steps``-th call run the outer step and return True."""
        self.inner_steps += 1
        self.since_outer += 1
        if self.since_outer < self.local_steps:
            return False
        self.outer_step()
        return True

    def outer_step(self) -> None:
        """Average the pseudo-gradients (one all-reduce), step θ_g, copy it into the model. Collective: every rank
        calls it together. ``after_inner_step`` calls it; call it directly to synchronise early (at the end of a
        run, say): the round restarts from here."""
        with torch.no_grad():
            for d, g, p in zip(self._delta_views, self._global_views, self._params, strict=True):
                torch.sub(g, p.detach(), out=d)  # Δ = θ_g − θ_local, in fp32 whatever the model's dtype
            nbytes = self._delta.numel() * self._delta.element_size()
            comm.all_reduce(self._delta, "avg", group=self.group, tag=TAG)
            self._apply(self._delta)
            for g, p in zip(self._global_views, self._params, strict=True):
                p.copy_(g)
        self.since_outer = 0
        self.outer_steps += 1
        self.history.append(OuterStep(self.outer_steps, self.inner_steps, nbytes,
                                      comm.bus_bytes("all_reduce", nbytes, self.world_size)))

    def _apply(self, delta: torch.Tensor) -> None:
        """The outer optimizer: θ_g ← OuterOpt(θ_g, Δ), in place on the flat fp32 buffer."""
        if self.outer == "avg":
            self._global.sub_(delta)
        elif self.outer == "sgd":
            self._global.add_(delta, alpha=-self.outer_lr)
        else:  # nesterov, torch.optim.SGD(nesterov=True, dampening=0)'s arithmetic
            self._momentum.mul_(self.outer_momentum).add_(delta)
            self._global.add_(delta.add(self._momentum, alpha=self.outer_momentum), alpha=-self.outer_lr)

    # -- what callers read ------------------------------------------------------------------------------------

    @property
    def last_outer_bytes(self) -> int:
        """Bytes of the last outer step's all-reduce (its tensor, as ``comm`` logs it), 0 before any."""
        return self.history[-1].sent if self.history else 0

    def global_params(self) -> dict[str, torch.Tensor]:
        """θ_g by parameter name: fp32 views of the live buffer (read, don't write)."""
        return dict(zip(self.names, self._global_views, strict=True))

    def bytes_per_step(self) -> dict[str, float]:
        """What theory predicts for this configuration: ``theory.local_sgd.bytes_per_step``."""
        return theory.bytes_per_step(self.numel, self.world_size, self.local_steps)

    # -- checkpoints ------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Counters, θ_g and the outer momentum (empty unless nesterov), as copies keyed by parameter name."""
        momentum = {} if self._momentum is None else dict(zip(self.names, self._views(self._momentum), strict=True))
        return {"local_steps": self.local_steps, "outer": self.outer, "inner_steps": self.inner_steps,
                "since_outer": self.since_outer, "outer_steps": self.outer_steps,
                "global_params": {n: t.detach().clone() for n, t in self.global_params().items()},
                "momentum": {n: t.detach().clone() for n, t in momentum.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output (checked first: nothing changes when a check fails). ``local_steps``
        may differ from the saved run's if the round in progress has not already reached it."""
        missing = {"outer", "inner_steps", "since_outer", "outer_steps", "global_params", "momentum"} - set(state)
        if missing:
            raise ValueError(f"LocalSGD state lacks {sorted(missing)}")
        if state["outer"] != self.outer:
            raise ValueError(f"state of a LocalSGD with outer={state['outer']!r} cannot be loaded into one with "
                             f"outer={self.outer!r}")
        since = int(state["since_outer"])
        if not 0 <= since < self.local_steps:
            raise ValueError(f"state is {since} inner steps into a round; this LocalSGD has local_steps="
                             f"{self.local_steps}")
        self._check_tensors("global_params", state["global_params"])
        if self._momentum is not None:
            self._check_tensors("momentum", state["momentum"])
        elif state["momentum"]:
            raise ValueError(f"state has outer momentum but outer={self.outer!r} keeps none")
        with torch.no_grad():
            for view, name in zip(self._global_views, self.names, strict=True):
                view.copy_(state["global_params"][name])
            if self._momentum is not None:
                for view, name in zip(self._views(self._momentum), self.names, strict=True):
                    view.copy_(state["momentum"][name])
        self.inner_steps, self.since_outer = int(state["inner_steps"]), since
        self.outer_steps = int(state["outer_steps"])

    def _check_tensors(self, what: str, tensors: dict[str, torch.Tensor]) -> None:
        if list(tensors) != self.names:
            raise ValueError(f"state's {what} are for parameters {list(tensors)}, this model's trainable ones are "
                             f"{self.names}")
        for name, p in zip(self.names, self._params, strict=True):
            if tuple(tensors[name].shape) != tuple(p.shape):
                raise ValueError(f"state's {what}[{name!r}] has shape {tuple(tensors[name].shape)}, the parameter "
                                 f"{tuple(p.shape)}")

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        sizes = [p.numel() for p in self._params]
        return [piece.view(p.shape) for piece, p in zip(flat.split(sizes), self._params, strict=True)]


__all__ = ["HISTORY_STEPS", "OUTERS", "TAG", "LocalSGD", "OuterStep"]
