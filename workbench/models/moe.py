"""A mixture-of-experts MLP: a top-k router, E expert MLPs, a capacity, and the load-balancing loss.

Shazeer et al. 2017 ("Outrageously Large Neural Networks") replace a dense layer by E experts and a gate that
sends each token to k of them; GShard (Lepikhin et al. 2020) and Switch Transformers (Fedus et al. 2021) add a
capacity per expert and an auxiliary loss that keeps the load even. Here each expert has exactly the shape of the
GPT's MLP (d → 4d → d), so a dense model is the E = k = 1 case without the router.

Per call, on N = B·T tokens x [N, d]:

1. route (``TopKRouter``): probs = softmax(x·W_g) [N, E] (fp32), the k largest per token, their weights
   renormalised to sum to 1 when k > 1 (Mixtral, Jiang et al. 2024, eq. 1: softmax over the top-k logits, which is
   the same thing); with k = 1 the weight is the raw probability p (Switch §2.1), since renormalising would make it
   1 and cut the router off from the task loss's gradient;
2. capacity (``capacity_plan``): expert i accepts at most ceil(C·N·k/E) assignments (``theory.expert``); the
   priority is position-major: assignments in the order (token, choice), so an earlier token keeps its place and
   a token's first choice comes before its second. A dropped assignment adds nothing (the token keeps its
   residual); the weights of the kept ones are not renormalised (Switch, GShard);
3. dispatch: the kept rows sorted expert-major (a stable sort, so token order within an expert), each expert's
   block run through it (``run_experts``: every expert is called, on zero rows if need be, so every expert has a
   gradient, zeros when unused), and the outputs scaled by their weights and added back per token.

Step 3's middle is pluggable: ``MoEMLP.run_experts`` (None: here, over all local experts) is what expert
parallelism replaces by an all-to-all to the experts' ranks and back (``workbench.parallel.expert``); the model
knows nothing of it. Experts live in a ``ModuleDict`` keyed by their global index, so parameter names survive
keeping only some of them (``experts.5.fc.weight`` on every layout).

The auxiliary loss (Switch eq. 4): α·E·Σ_i f_i·P_i, f_i the fraction of the k·T assignments that chose expert i
(before capacity), P_i the mean router probability of expert i; 1 when routing is even, E when all choose one.
It is computed per sequence and averaged over the batch, as DeepSeek-V3's sequence-wise balance loss (DeepSeek-AI
2024, §2.1.2) and GShard's per-group loss: a batch's loss is then the mean of its sequences', so data
parallelism, and expert parallelism which borrows its ranks, equals one process on the global batch.

Counters (``take_moe_stats``): per call, the tokens each expert was chosen by, what it kept, and the capacity.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workbench.theory.expert import check_moe, expert_capacity


@dataclass(frozen=True)
class MoEConfig:
    """``experts`` E, ``top_k`` k, ``capacity_factor`` C (None: no token is ever dropped), ``aux_loss_coef`` α
    (Switch's 1e-2)."""

    experts: int
    top_k: int = 2
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        check_moe(self.experts, self.top_k, self.capacity_factor)
        coef = self.aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < float("inf"):
            raise ValueError(f"moe aux_loss_coef must be a finite number >= 0 (Switch uses 0.01), got {coef!r}")


@dataclass
class Routing:
    """One call's routing of N tokens: ``probs`` [N, E] fp32, ``experts`` [N, k] chosen, ``weights`` [N, k]."""

    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor


@dataclass
class DispatchPlan:
    """The kept assignments in expert-major order: ``token`` [M] the row of each, ``weight`` [M] its gate weight,
    ``counts`` [E] kept per expert, ``chosen`` [E] chosen per expert (before capacity), ``capacity`` (or None)."""

    token: torch.Tensor
    weight: torch.Tensor
    counts: torch.Tensor
    chosen: torch.Tensor
    capacity: int | None


class TopKRouter(nn.Module):
    """A linear gate (no bias) and top-k selection; see the module docstring for the weights' rule."""

    def __init__(self, d_model: int, experts: int, top_k: int) -> None:
        super().__init__()
        check_moe(experts, top_k)
        self.experts, self.top_k = experts, top_k
        self.gate = nn.Linear(d_model, experts, bias=False)

    def forward(self, x: torch.Tensor) -> Routing:
        # Softmax in fp32 even for 16-bit activations: Switch's "selective precision" (§2.4) for the router.
        probs = F.softmax(self.gate(x).float(), dim=-1)  # [N, E]
        top, chosen = probs.topk(self.top_k, dim=-1)  # [N, k], largest first
        weights = top / top.sum(-1, keepdim=True) if self.top_k > 1 else top
        return Routing(probs, chosen, weights)


def capacity_plan(experts: torch.Tensor, weights: torch.Tensor, n_experts: int,
                  capacity: int | None) -> DispatchPlan:
    """Which assignments each expert keeps (position-major priority) and their expert-major order.

    ``experts``, ``weights``: [N, k]. Flattened row-major, assignment a = token·k + choice, so an expert's
    assignments are ranked by token, then choice; the first ``capacity`` of each expert are kept."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    onehot = F.one_hot(flat, n_experts)  # [N·k, E]
    chosen = onehot.sum(0)
    keep, counts = None, chosen  # counts from the one-hot, not bincount: on CUDA bincount waits for the GPU
    if capacity is not None:
        rank_in_expert = (onehot.cumsum(0) * onehot).sum(-1) - 1  # 0 for an expert's first assignment
        keep = rank_in_expert < capacity
        counts = (onehot * keep[:, None]).sum(0)
        flat = flat[keep]
    order = torch.argsort(flat, stable=True)  # expert-major; (token, choice) order within an expert
    token = torch.arange(n, device=experts.device).repeat_interleave(k)
    weight = weights.reshape(-1)
    if keep is not None:
        token, weight = token[keep], weight[keep]
    return DispatchPlan(token[order], weight[order], counts, chosen, capacity)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch's auxiliary loss E·Σ_i f_i·P_i per sequence, averaged over the batch (fp32 scalar).

    ``probs`` [B, T, E] the router's probabilities, ``experts`` [B, T, k] the choices. f_i (the share of the
    sequence's T·k assignments that chose i) is a count, so the gradient flows through P_i alone (Switch eq. 4-6)."""
    b, t, k = experts.shape
    f = F.one_hot(experts.reshape(b, t * k), n_experts).sum(1).to(probs.dtype) / (t * k)  # [B, E]
    p = probs.mean(1)  # [B, E]
    return (n_experts * (f * p).sum(-1)).mean()


class ExpertMLP(nn.Module):
    """One expert: the GPT's MLP (fc d→h, GELU-tanh, proj h→d), same names, same shapes."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


def run_experts(rows: torch.Tensor, counts: list[int], experts: nn.ModuleDict) -> torch.Tensor:
    """Rows sorted expert-major, ``counts[j]`` for the j-th expert of ``experts`` (in key order): each block through
    its expert, the outputs in the same order. Every expert runs, on zero rows if need be (a zero gradient, never
    None, so gradient reductions see the same tensors on every rank)."""
    modules = list(experts.values())
    if len(counts) != len(modules):
        raise ValueError(f"run_experts: {len(counts)} counts for {len(modules)} experts")
    return torch.cat([m(block) for m, block in zip(modules, rows.split(counts), strict=True)])


# -- counters (per process) -----------------------------------------------------------------------------------------

#: Calls kept until ``take_moe_stats``: a run that never takes them holds this many, not one per forward forever.
MAX_RECORDED_CALLS = 4096
_RECORDS: deque[tuple[torch.Tensor, torch.Tensor, int, int | None]] = deque(maxlen=MAX_RECORDED_CALLS)


def _note(plan: DispatchPlan, tokens: int) -> None:
    # Tensors kept as they are: read on the host in take_moe_stats, not here, so a GPU step is not synchronised.
    _RECORDS.append((plan.chosen.detach(), plan.counts.detach(), tokens, plan.capacity))


def take_moe_stats() -> dict:
    """What this process's MoE layers routed since the last call (forward calls, in order; the last
    ``MAX_RECORDED_CALLS`` of them), and start afresh:
    ``calls``: one dict per call (tokens, capacity, chosen and kept per expert, dropped); ``tokens_per_expert``
    (chosen) and ``kept_per_expert`` summed over calls; ``dropped`` the assignments dropped, summed."""
    global _RECORDS
    records, _RECORDS = list(_RECORDS), deque(maxlen=MAX_RECORDED_CALLS)
    # One copy to the host for every call's counts (one wait for a GPU, not two per layer and micro-batch).
    # Layers of other models may have recorded other E, so the counts travel flat, cut per call on the host.
    flat = torch.cat([t for c, k, _, _ in records for t in (c, k)]).tolist() if records else []
    calls, at = [], 0
    for chosen, _, tokens, capacity in records:
        e = chosen.numel()
        chosen_l, kept_l, at = flat[at:at + e], flat[at + e:at + 2 * e], at + 2 * e
        calls.append({"tokens": tokens, "capacity": capacity, "chosen": chosen_l, "kept": kept_l,
                      "dropped": sum(chosen_l) - sum(kept_l)})
    width = len(calls[0]["chosen"]) if calls else 0
    return {"calls": calls, "tokens_per_expert": [sum(c["chosen"][i] for c in calls) for i in range(width)],
            "kept_per_expert": [sum(c["kept"][i] for c in calls) for i in range(width)],
            "dropped": sum(c["dropped"] for c in calls)}


# -- the layer ------------------------------------------------------------------------------------------------------

#: ``(rows [M, d] sorted expert-major over all E experts, kept counts [E], the local experts) -> rows [M, d]``
ExpertRunner = Callable[[torch.Tensor, torch.Tensor, nn.ModuleDict], torch.Tensor]


class MoEMLP(nn.Module):
    """The MLP of a MoE block: ``router``, ``experts`` (ModuleDict keyed "0".."E-1"), ``run_experts`` (None: all
    experts here; expert parallelism sets a callable). ``aux_loss`` holds the last forward's balance loss."""

    def __init__(self, d_model: int, hidden: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = TopKRouter(d_model, cfg.experts, cfg.top_k)
        self.experts = nn.ModuleDict({str(i): ExpertMLP(d_model, hidden) for i in range(cfg.experts)})
        self.run_experts: ExpertRunner | None = None
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        routing = self.router(flat)
        self.aux_loss = load_balancing_loss(routing.probs.view(b, t, -1), routing.experts.view(b, t, -1),
                                            self.cfg.experts)
        capacity = expert_capacity(b * t, self.cfg.experts, self.cfg.top_k, self.cfg.capacity_factor)
        plan = capacity_plan(routing.experts, routing.weights, self.cfg.experts, capacity)
        _note(plan, b * t)
        rows = _autocast_rows(flat.index_select(0, plan.token))  # [M, d], expert-major
        if self.run_experts is None:
            out = run_experts(rows, plan.counts.tolist(), self.experts)
        else:
            out = self.run_experts(rows, plan.counts, self.experts)
        weighted = out * plan.weight.to(out.dtype)[:, None]
        # In the experts' output dtype, as a dense MLP returns under autocast; the residual add promotes it.
        return out.new_zeros(b * t, d).index_add(0, plan.token, weighted).view(b, t, d)


def _autocast_rows(rows: torch.Tensor) -> torch.Tensor:
    """Under autocast, the rows in its 16-bit dtype before they travel: an expert's first matmul would cast them
    anyway, so the result is the same and the all-to-all moves half the bytes (Megatron and DeepSpeed dispatch the
    activations' training dtype)."""
    kind = rows.device.type
    if torch.is_autocast_enabled(kind):
        return rows.to(torch.get_autocast_dtype(kind))
    return rows


def moe_layers(model: nn.Module) -> list[MoEMLP]:
    """The model's MoE layers, in module order."""
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def is_expert_param(name: str) -> bool:
    """Whether a parameter name belongs to an expert (``...mlp.experts.<i>....``), not to the router or the dense
    model: the parameters expert parallelism splits and reduces over the ranks holding the same expert shard."""
    return ".experts." in f".{name}"


__all__ = ["DispatchPlan", "ExpertMLP", "ExpertRunner", "MoEConfig", "MoEMLP", "Routing", "TopKRouter",
           "capacity_plan", "is_expert_param", "load_balancing_loss", "moe_layers", "run_experts", "take_moe_stats"]
