"""``parallelize``: the one place that composes the strategies.

Strategy files (``ddp``, ``zero``, ``tensor``, ``pipeline``) never import each other; this composer applies
them to a plain model from outside (torchtitan's shape) and hands the training loop one uniform
``Parallelized`` object, so the loop has no ``if zero == 3`` branches.

Mixed precision (``workbench.parallel.precision``; Micikevicius et al. 2018) is applied here too, to every strategy:
forward runs under ``torch.autocast`` to the compute dtype with the fp32 parameters as the masters (ZeRO-3
instead gathers its fp32 shards cast to the compute dtype, FSDP2's policy), the loss stays fp32, and with fp16
the loss is scaled before backward; ``Parallelized.optimizer_step`` then unscales the gradients this rank
holds, agrees on inf/NaN over the whole mesh, clips and steps or skips.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from workbench import trace
from workbench.parallel.precision import DynamicLossScaler, PrecisionPolicy, policy_from_names
from workbench.parallel.precision import autocast as precision_autocast
from workbench.parallel.recompute import apply_recompute
from workbench.parallel.recompute import check_mode as check_recompute_mode
from workbench.theory.composition import Combination, check_composition
from workbench.theory.memory import ZERO_STAGES

DDP_KINDS = ("naive", "flat", "overlap", "bucketed")
# ZERO_STAGES, PP_COMPOSES_WITH: defined once in workbench.theory (memory, composition).


@dataclass
class ParallelConfig:
    ddp: str = "bucketed"
    bucket_mb: float | None = 25.0  # BucketedDDP's cap; None: one bucket for every gradient
    grad_compression: str = "none"  # the DDP wrappers' reducer (parallel.compression); none: the plain all-reduce
    powersgd_rank: int = 4
    topk_ratio: float = 0.01
    compression_warmup: int = 0
    local_steps: int | None = None  # local SGD / DiLoCo (parallel.local_sgd): average parameters every H steps
    outer_optimizer: str = "nesterov"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    zero: int = 0
    #: ZeRO-3 only: parameters kept whole on every rank (FSDP's ignored parameters), their gradients all-reduced.
    #: Glob patterns matched against each parameter's name or, case-insensitively, its module's class name:
    #: ("*norm",) keeps every LayerNorm's weight and bias replicated (``replicated_names``).
    zero3_replicate: tuple[str, ...] = ()
    offload: bool = False
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    sp: bool = False  # sequence parallelism over the tp axis (needs tp > 1)
    ep: int = 1  # expert parallelism: a MoE model's experts split over ep of the dp ranks (parallel.expert)
    cp_layout: str = "zigzag"  # context parallelism's split of the sequence over the cp axis (parallel.context)
    grad_accum: int = 1  # micro-batches per step of the default forward_backward
    schedule: str = "1f1b"  # pipeline schedule over the pp axis (workbench.theory.pipeline.SCHEDULES)
    microbatches: int = 4  # the pipeline's micro-batches per step
    virtual_stages: int = 1  # stages per rank (interleaved schedule)
    recompute: str = "none"  # activation recomputation (workbench.recompute): none, selective, full
    precision: str = "fp32"  # compute dtype (workbench.precision): fp32, bf16, fp16 (fp16 adds a loss scaler)
    reduce_dtype: str = "fp32"  # gradient reduction dtype: fp32, or the compute dtype (ZeRO-3 only)
    init_loss_scale: float = 2.0 ** 16  # fp16's DynamicLossScaler: first scale and clean steps between growths
    loss_scale_growth_interval: int = 2000


@dataclass
class Parallelized:
    """What the training loop needs from any strategy."""

    model: nn.Module
    optimizer: Any
    no_sync: Callable[[], AbstractContextManager]
    finish_grad_sync: Callable[[], None]
    #: ``clip_grad_norm(max_norm) -> norm``: the global norm before clipping, a 0-dim tensor on the rank's device,
    #: never read here: turning it into a float would make the host wait for the whole backward before it may
    #: queue the optimizer's kernels (a host-device sync that costs GPU idle time every step).
    clip_grad_norm: Callable[[float], torch.Tensor]
    full_parameters: Callable[[], dict[str, torch.Tensor]]
    record_memory: Callable[[], None]
    describe: str
    #: ``forward_backward(x, y) -> loss``: run forward and backward over this rank's batch and return its
    #: (detached) mean loss. A pipeline owns its micro-batches here; every other strategy gets the default,
    #: gradient accumulation over ``grad_accum`` micro-batches (``_micro_batched``). So the loop has no
    #: ``if pp`` branch.
    forward_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    #: fp16's dynamic loss scaler (None in fp32/bf16): the trainer checkpoints its ``state_dict``.
    scaler: DynamicLossScaler | None = None
    #: the gradient compressor (None: plain all-reduce): its residuals and PowerSGD's Q go into each checkpoint.
    compressor: Any = None
    #: local SGD's outer loop (None: synchronous): run after every optimizer step; its state goes into checkpoints.
    outer: Any = None
    #: ``unscale_grads(factor) -> grads``: multiply the gradients this rank holds after ``finish_grad_sync``
    #: (``p.grad`` of a replicated model, ZeRO-2/3's gradient shards) by ``factor`` and return them.
    unscale_grads: Callable[[float], list[torch.Tensor]] | None = None
    device: torch.device | None = None  # where the inf/NaN flag is born (the rank's device)

    def optimizer_step(self, max_norm: float) -> dict[str, Any]:
        """After ``finish_grad_sync``: clip to ``max_norm`` and step, the same call for every strategy.

        With a loss scaler (fp16), first unscale this rank's gradients and agree with every rank of the world
        (one all-reduce MAX, tag "amp") whether any holds an inf/NaN; if so, skip the step on every rank, zero
        the gradients and back the scale off (a rank stepping alone would leave the replicas different).
        Returns ``{"grad_norm", "skipped", "loss_scale"}``: the norm before clipping as a 0-dim device tensor
        (the caller reads it once the optimizer's kernels are queued; NaN when skipped: there is no finite
        norm) and the scale this step's backward used. fp16's inf check is the one read before the step: every
        rank must agree whether to step (as ``torch.amp.GradScaler`` reads it for a non-fused optimizer)."""
        scale = 1.0
        if self.scaler is not None:
            scale = self.scaler.scale_value
            grads = self._unscale(1.0 / scale)
            if not self.scaler.update(self.scaler.found_inf(grads, (None,), device=self.device)):
                self.optimizer.zero_grad(set_to_none=True)
                return {"grad_norm": math.nan, "skipped": True, "loss_scale": scale}
        grad_norm = self.clip_grad_norm(max_norm).detach()
        self.optimizer.step()
        outer_step = self.outer.after_inner_step() if self.outer is not None else False
        return {"grad_norm": grad_norm, "skipped": False, "loss_scale": scale, "outer_step": outer_step}

    def _unscale(self, factor: float) -> list[torch.Tensor]:
        if self.unscale_grads is not None:
            return self.unscale_grads(factor)
        return _unscale_replicated(self.model)(factor)


def _optimizer_kwargs(cfg: ParallelConfig) -> dict[str, Any]:
    return {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "betas": cfg.betas}


def _named_trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters()}


def _record_replicated_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Ledger entries for a replicated model: what this rank really holds, measured from the tensors."""
    params = list(model.parameters())
    trace.ledger_set("parameters", trace.tensor_bytes(params))
    trace.ledger_set("gradients", trace.tensor_bytes(p.grad for p in params if p.grad is not None))
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    trace.ledger_set("optimizer_state", trace.tensor_bytes(state))


def _unscale_replicated(model: nn.Module) -> Callable[[float], list[torch.Tensor]]:
    """A replicated model's (or a ZeRO-1 rank's, before its optimizer slices them) averaged ``.grad``."""

    @torch.no_grad()
    def unscale(factor: float) -> list[torch.Tensor]:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for g in grads:
            g.mul_(factor)
        return grads

    return unscale


@dataclass(frozen=True)
class _Precision:
    """What ``parallelize`` applies of a ``PrecisionPolicy``: autocast around forward (not for ZeRO-3 with a
    policy, whose units compute in the gathered low-precision parameters) and fp16's loss scaling."""

    policy: PrecisionPolicy
    scaler: DynamicLossScaler | None
    device_type: str
    autocast_forward: bool = True

    def autocast(self) -> AbstractContextManager:
        return precision_autocast(self.policy, self.device_type) if self.autocast_forward else nullcontext()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def loss_scale(self) -> float:
        return 1.0 if self.scaler is None else self.scaler.scale_value


def _precision(mesh: Any, cfg: ParallelConfig) -> _Precision:
    """The run's policy and scaler; reducing gradients in the compute dtype is refused where no strategy does it."""
    policy = policy_from_names(cfg.precision, cfg.reduce_dtype)  # composition checked by parallelize
    scaler = None
    if policy.needs_scaler:
        scaler = DynamicLossScaler(init_scale=cfg.init_loss_scale, growth_interval=cfg.loss_scale_growth_interval,
                                   max_scale=max(2.0 ** 24, cfg.init_loss_scale))
    sharded_policy = cfg.zero == 3 and mesh.pp_size == 1
    return _Precision(policy, scaler, torch.device(mesh.device).type, autocast_forward=not sharded_policy)




def replicated_names(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The trainable parameters of ``model`` that ``patterns`` pick (``ParallelConfig.zero3_replicate``): a pattern
    is a glob (``fnmatch``) matched against the parameter's qualified name (``"ln_f.*"``, ``"blocks.*.ln1.*"``)
    or, case-insensitively, against the class name of the module that holds it (``"*norm"``: every LayerNorm).
    A pattern that picks nothing is a ValueError naming it."""
    if isinstance(patterns, str) or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"zero3_replicate must be a tuple of non-empty glob patterns (e.g. ('*norm',)), "
                         f"got {patterns!r}")
    owned = [(f"{mod_name}.{local}" if mod_name else local, type(mod).__name__.lower(), p)
             for mod_name, mod in model.named_modules() for local, p in mod.named_parameters(recurse=False)]
    names = []
    for pattern in patterns:
        hits = [name for name, cls, p in owned if p.requires_grad
                and (fnmatchcase(name, pattern) or fnmatchcase(cls, pattern.lower()))]
        if not hits:
            classes = sorted({cls for _, cls, _ in owned})
            raise ValueError(f"zero3_replicate pattern {pattern!r} matches no trainable parameter; match a name "
                             f"such as {owned[0][0]!r} or a module class among {classes}")
        names += [n for n in hits if n not in names]
    return names


def _mp_policy(amp: _Precision) -> Any:
    """ZeRO-3's FSDP2-style policy, or None in fp32 (the sharded model then runs exactly as without one)."""
    return None if amp.policy.name == "fp32" else amp.policy.sharded()


def _clip_replicated(model: nn.Module) -> Callable[[float], torch.Tensor]:
    return lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)




def parallelize(model: nn.Module, mesh: Any, cfg: ParallelConfig) -> Parallelized:
    """Apply ``cfg`` over ``mesh``: tensor parallelism over the tp axis first (it changes the model's layers),
    then activation recomputation (its regions call the split layers), then the data-parallel strategy over
    the dp axis (or the pipeline cut), and build the optimizer."""
    check_recompute_mode(cfg.recompute)
    if cfg.zero not in ZERO_STAGES:
        raise ValueError(f"zero stage {cfg.zero!r}; valid: {ZERO_STAGES}")
    check_composition(Combination(tp=mesh.tp_size, pp=mesh.pp_size, sp=cfg.sp, zero=cfg.zero,
                                  grad_accum=cfg.grad_accum, zero3_replicate=tuple(cfg.zero3_replicate),
                                  reduce_dtype=cfg.reduce_dtype, offload=cfg.offload, cp=mesh.size("cp"),
                                  recompute=cfg.recompute, grad_compression=cfg.grad_compression,
                                  local_steps=cfg.local_steps, ep=cfg.ep,
                                  moe_experts=getattr(getattr(model, "cfg", None), "moe_experts", 0)))
    amp = _precision(mesh, cfg)
    if mesh.size("cp") > 1:
        strategy = _with_context_parallel(model, mesh, cfg, amp)
    elif mesh.pp_size > 1:
        strategy = _with_pipeline(model, mesh, cfg, amp)
    else:
        if mesh.tp_size > 1:
            strategy = _with_tensor_parallel(model, mesh, cfg, amp)
        elif cfg.ep > 1:
            strategy = _with_expert_parallel(apply_recompute(model, cfg.recompute), mesh, cfg)
        else:
            strategy = _data_parallel(apply_recompute(model, cfg.recompute), mesh, cfg, amp)
        strategy = replace(strategy, forward_backward=_micro_batched(strategy, cfg.grad_accum, amp))
    return replace(strategy, scaler=amp.scaler, device=mesh.device)


#: ``shard(x, y) -> (x, y, model keywords)``: what of a batch this rank's model sees (context parallelism: its
#: part of each sequence and those tokens' positions; otherwise all of it).
BatchShard = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]


def _whole_batch(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    return x, y, {}


def _micro_batched(s: Parallelized, grad_accum: int, amp: _Precision,
                   shard: BatchShard = _whole_batch) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Gradient accumulation: ``grad_accum`` forward/backward passes, all but the last inside ``no_sync``
    (only the last backward synchronises); each loss scaled by 1/grad_accum so the sum is the batch mean."""

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=x.device)
        pieces = zip(x.chunk(grad_accum), y.chunk(grad_accum), strict=True)
        for i, (xm, ym) in enumerate(pieces):
            with s.no_sync() if i < grad_accum - 1 else nullcontext():
                total += _forward_then_backward(s.model, *shard(xm, ym), grad_accum, amp)
        return total

    return forward_backward


def _forward_then_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, model_kwargs: dict[str, Any],
                           scale: int, amp: _Precision) -> torch.Tensor:
    """One pass, traced: spans for forward and backward, saved activations counted into the ledger. Forward
    runs under the policy's autocast (the model returns an fp32 loss); backward starts from the loss times
    fp16's loss scale (no-ops in fp32)."""
    tracer = trace.current()
    probe = tracer is not None and tracer.probe_memory
    with trace.span("forward", "forward"), tracer.activations() if probe else nullcontext():
        with amp.autocast():
            loss = model(x, y, **model_kwargs) / scale
    with trace.span("backward", "backward"):
        amp.scale(loss).backward()
    if probe:
        tracer.release_activations()
    return loss.detach()




@dataclass(frozen=True)
class _FoldedMesh:
    """The mesh as the data-parallel strategies see it under context parallelism: cp ranks hold the same
    parameters, so gradients are averaged (and ZeRO shards) over dp x cp (Megatron-LM's data-parallel group
    with context parallelism)."""

    mesh: Any

    dp_group = property(lambda self: self.mesh.dp_cp_group)
    dp_size = property(lambda self: self.mesh.dp_cp_size)
    dp_rank = property(lambda self: self.mesh.dp_cp_rank)
    device = property(lambda self: self.mesh.device)
    tp_size = property(lambda self: 1)
    pp_size = property(lambda self: 1)


def _with_context_parallel(model: nn.Module, mesh: Any, cfg: ParallelConfig, amp: _Precision) -> Parallelized:
    """Context parallelism over the cp axis (``parallel.context``: ring attention, each rank a part of every
    sequence), data parallelism or ZeRO over dp x cp, and a data path that gives each rank its tokens, their
    targets and their positions. Each rank's loss is the mean over its tokens; every rank holds as many, so the
    average over dp x cp of the gradients is the gradient of the global batch's mean loss."""
    from workbench.parallel import context

    context.apply_context_parallel(model, mesh.cp_group, cfg.cp_layout)
    inner = _data_parallel(apply_recompute(model, cfg.recompute), _FoldedMesh(mesh), cfg, amp)
    cp, rank, layout = mesh.size("cp"), mesh.index("cp"), cfg.cp_layout

    def shard(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        positions = context.chunk_positions(x.shape[1], cp, rank, layout, device=x.device)
        return x.index_select(1, positions), y.index_select(1, positions), {"positions": positions}

    inner = replace(inner, describe=f"CP={cp} ({layout} ring attention) + {inner.describe} over dp x cp")
    return replace(inner, forward_backward=_micro_batched(inner, cfg.grad_accum, amp, shard))


class _OptimizerPair:
    """Two optimizers stepped as one (EP with ZeRO-1: the dense parameters' state sharded over dp, each expert's
    over its expert-data group): what the loop touches, ``param_groups`` (the LR reaches both), ``zero_grad``,
    ``step`` and the state dicts."""

    def __init__(self, *optimizers: Any) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        for opt in self.optimizers:
            opt.step()

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for opt, s in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(s)


def _with_expert_parallel(model: nn.Module, mesh: Any, cfg: ParallelConfig) -> Parallelized:
    """Expert parallelism over ep of the dp ranks (``parallel.expert``; DeepSpeed-MoE and torchtitan borrow EP from
    DP): each rank keeps E/ep experts per layer and sends tokens to the others' by all-to-all. No DDP wrapper: after
    the last backward, the dense gradients are averaged over dp and each expert's summed over the ranks holding it
    and divided by dp (a DDP over all dp would average different experts). ZeRO-1 shards the dense parameters'
    optimizer state over dp and the experts' over their expert-data group; clipping takes the global norm."""
    from workbench.parallel import expert

    ep_group, data_group = expert.expert_process_groups(cfg.ep, mesh.dp_group)  # every rank, same order
    expert.apply_expert_parallel(model, ep_group)
    dense, experts = expert.split_expert_params(model)
    if cfg.zero == 1:
        from workbench.parallel.zero import ZeroOptimizer

        shards = ((dense, mesh.dp_group), (experts, data_group))
        optimizer: Any = _OptimizerPair(*(
            ZeroOptimizer(list(params.values()), torch.optim.AdamW, group=group, stage=1, offload=cfg.offload,
                          **_optimizer_kwargs(cfg)) for params, group in shards))
        record = lambda: None  # noqa: E731 (ZeroOptimizer records its own shards)
    else:
        optimizer = torch.optim.AdamW([*dense.values(), *experts.values()], **_optimizer_kwargs(cfg))
        record = lambda: _record_replicated_memory(model, optimizer)  # noqa: E731
    dp = mesh.dp_size
    what = (f"EP={cfg.ep} x DP={dp} ({dp // cfg.ep} cop{'y' if dp == cfg.ep else 'ies'} of each expert shard)"
            + (" + ZeRO-1" if cfg.zero == 1 else "") + (" + offload" if cfg.offload else ""))
    return Parallelized(model, optimizer, nullcontext,
                        lambda: expert.reduce_expert_parallel_grads(model, mesh.dp_group, data_group),
                        lambda max_norm: expert.clip_expert_parallel_grad_norm_(model, max_norm, ep_group),
                        lambda: expert.full_expert_parallel_parameters(model, ep_group), record, what)


def _with_pipeline(model: nn.Module, mesh: Any, cfg: ParallelConfig, amp: _Precision) -> Parallelized:
    """3D: tensor parallelism inside each layer first, then the layers cut into pipeline stages, then data
    parallelism over the stages (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", §2.3). The pipeline owns forward and backward over its micro-batches; each
    rank steps its own stage's shards. Over dp, each stage's gradients are averaged once after the schedule's
    last backward (one flat all-reduce, as ``FlatDDP``: hooks would fire once per micro-batch); ZeRO-1 then
    shards the stage's optimizer state."""
    from workbench.parallel import pipeline
    from workbench.parallel.ddp import FlatDDP

    tp = _tensor_parallel_for_pipeline(model, mesh, cfg.sp)
    apply_recompute(model, cfg.recompute)  # on the whole model's blocks, before the cut into stages
    pipe = pipeline.Pipeline(model, mesh.pp_group, cfg.schedule, cfg.microbatches, cfg.virtual_stages,
                             loss_fn=tp["loss_fn"], seq_shards=mesh.tp_size if cfg.sp else 1,
                             autocast=amp.autocast, loss_scale=amp.loss_scale if amp.scaler is not None else None)
    dp = FlatDDP(pipe.module, group=mesh.dp_group) if mesh.dp_size > 1 else None
    optimizer, record = _stage_optimizer(pipe, mesh, cfg)
    what = (f"PP={mesh.pp_size} {cfg.schedule} m={cfg.microbatches}"
            + (f" v={cfg.virtual_stages}" if cfg.virtual_stages > 1 else "")
            + (f" + TP={mesh.tp_size}" if mesh.tp_size > 1 else "") + (" + SP" if cfg.sp else "")
            + (f" + DP={mesh.dp_size} (flat all-reduce after the schedule)" if dp is not None else "")
            + (" + ZeRO-1" if cfg.zero == 1 else ""))

    def clip(max_norm: float) -> float:
        weights = tp["norm_weights"](pipe.module) if tp["norm_weights"] else None
        return pipeline.clip_grad_norm_(pipe, max_norm, weights, tp["groups"])

    def finish() -> None:  # dp's average, then (SP) the partial gradients' sum over tp: the two commute
        if dp is not None:
            dp.synchronize_external_backward()
        tp["sum_partial_grads"](pipe.module)

    return Parallelized(pipe.module, optimizer, nullcontext, finish, clip, lambda: pipe.full_parameters(tp["full"]),
                        record, what, forward_backward=pipe.forward_backward,
                        unscale_grads=_unscale_replicated(pipe.module))


def _tensor_parallel_for_pipeline(model: nn.Module, mesh: Any, sp: bool) -> dict[str, Any]:
    """With tp > 1: split the layers before the cut (with sequence parallelism if ``sp``), and what the
    pipeline then needs from ``tensor``/``sequence``: the vocab-parallel loss on the last stage, clip weights
    and group, summing SP's partial gradients over tp, and gathering shards into full tensors."""
    if mesh.tp_size == 1:
        return {"loss_fn": None, "norm_weights": None, "groups": (), "full": None,
                "sum_partial_grads": lambda stages: None}
    from workbench.parallel import tensor
    from workbench.parallel.tensor import sequence

    (sequence.apply_sequence_parallel if sp else tensor.apply_tensor_parallel)(model, mesh)

    def loss_fn(local_logits: torch.Tensor, targets: torch.Tensor, total_tokens: int) -> torch.Tensor:
        summed = tensor.vocab_parallel_cross_entropy(local_logits, targets, mesh.tp_group, reduction="sum")
        return summed / total_tokens

    return {"loss_fn": loss_fn, "norm_weights": lambda stages: tensor.norm_weights(stages, mesh),
            "groups": (mesh.tp_group,), "full": lambda stages: tensor.full_parameters(stages, mesh),
            "sum_partial_grads": lambda stages: sequence.all_reduce_sequence_parallel_grads(stages, mesh)}


def _stage_optimizer(pipe: Any, mesh: Any, cfg: ParallelConfig) -> tuple[Any, Callable[[], None]]:
    params = [p for p in pipe.parameters() if p.requires_grad]
    if cfg.zero == 1:
        from workbench.parallel.zero import ZeroOptimizer

        optimizer = ZeroOptimizer(params, torch.optim.AdamW, group=mesh.dp_group, stage=1, offload=cfg.offload,
                                  **_optimizer_kwargs(cfg))
        return optimizer, lambda: None  # ZeroOptimizer records its own shards
    optimizer = torch.optim.AdamW(params, **_optimizer_kwargs(cfg))
    return optimizer, lambda: _record_replicated_memory(pipe.module, optimizer)


def _data_parallel(model: nn.Module, mesh: Any, cfg: ParallelConfig, amp: _Precision) -> Parallelized:
    if cfg.local_steps is not None:
        return _local_sgd(model, mesh, cfg)
    if mesh.dp_size == 1 and cfg.zero == 0:
        return _single(model, cfg)
    if cfg.zero in (0, 1):
        return _ddp(model, mesh, cfg)
    if cfg.zero == 2:
        return _zero2(model, mesh, cfg)
    return _zero3(model, mesh, cfg, amp)


def _with_tensor_parallel(model: nn.Module, mesh: Any, cfg: ParallelConfig, amp: _Precision) -> Parallelized:
    """TP inside, DP/ZeRO-1 outside (Megatron's order: tp groups are the fastest-varying ranks). The data
    parallel wrapper sees this rank's shards as ordinary parameters; clipping and the full parameters need
    the tp group, so those two come from ``tensor``. With ``cfg.sp`` the same plan is applied with sequence
    parallelism, and ``finish_grad_sync`` also sums the sequence-sharded parameters' gradients over tp."""
    from workbench.parallel import tensor
    from workbench.parallel.tensor import sequence

    (sequence.apply_sequence_parallel if cfg.sp else tensor.apply_tensor_parallel)(model, mesh)
    apply_recompute(model, cfg.recompute)  # after the split (the regions call the split layers), before DP
    if cfg.zero == 3:
        return _zero3_tensor_parallel(model, mesh, cfg, amp)
    if cfg.zero == 2:  # gradients live only as dp shards: the optimizer clips and sums SP's partials itself
        inner = _zero2(model, mesh, cfg, _tensor_parallel_param_groups(model, mesh), (mesh.tp_group,))
        finish, clip = inner.finish_grad_sync, inner.clip_grad_norm
    else:
        inner = _data_parallel(model, mesh, cfg, amp)
        finish = inner.finish_grad_sync
        if cfg.sp:  # sum the sequence-sharded parameters' partial gradients over tp once the dp sync is done
            finish = lambda: (inner.finish_grad_sync(), sequence.all_reduce_sequence_parallel_grads(model, mesh))  # noqa: E731
        # Clip the unsplit gradients across tp, in place, before the optimizer (ZeRO-1 builds its shard at step).
        clip = lambda max_norm: tensor.clip_grad_norm_(model, max_norm, mesh)  # noqa: E731
    return replace(inner, finish_grad_sync=finish, clip_grad_norm=clip,
                   full_parameters=lambda: tensor.full_parameters(model, mesh),
                   describe=f"TP={mesh.tp_size}{' + SP' if cfg.sp else ''} + {inner.describe}")


def _zero3_tensor_parallel(model: nn.Module, mesh: Any, cfg: ParallelConfig, amp: _Precision) -> Parallelized:
    """FSDP over dp of a TP model: each unit's tp-local parameters sharded over dp. Clipping weighs each
    segment of a shard by its tp share; SP's partial gradients are summed over tp on their shard segments."""
    from workbench.parallel import tensor
    from workbench.parallel.tensor import sequence
    from workbench.parallel.zero import FullyShardedModel, ZeroOptimizer

    shares = tensor.norm_weights(model, mesh)  # by the original names: read before the wrapper re-homes them
    partial = [n for n, _ in sequence.sequence_parallel_parameters(model)]
    sharded = FullyShardedModel(model, group=mesh.dp_group, offload_params=cfg.offload, mp_policy=_mp_policy(amp),
                                replicate=replicated_names(model, cfg.zero3_replicate) or None)
    sharded.set_norm_shares(shares)
    optimizer = ZeroOptimizer(sharded.parameters(), torch.optim.AdamW, group=mesh.dp_group, stage=3,
                              offload=cfg.offload, model_parallel_groups=(mesh.tp_group,), **_optimizer_kwargs(cfg))
    finish = lambda: sharded.sum_partial_grads(partial, mesh.tp_group, sequence.SP_GRAD_TAG)  # noqa: E731
    what = (f"TP={mesh.tp_size}{' + SP' if cfg.sp else ''} + ZeRO-3" + (" + offload" if cfg.offload else "")
            + (f" (replicated: {', '.join(cfg.zero3_replicate)})" if cfg.zero3_replicate else ""))
    return Parallelized(sharded, optimizer, sharded.no_sync, finish, optimizer.clip_grad_norm_,
                        lambda: tensor.gather_full(model, sharded.full_parameters(), mesh), lambda: None, what,
                        unscale_grads=optimizer.unscale_grads_)


def _tensor_parallel_param_groups(model: nn.Module, mesh: Any) -> list[dict[str, Any]]:
    """The model's parameters grouped for a ZeroOptimizer under TP: by this rank's share of their squared
    gradient norm (``tensor.norm_weights``) and whether their gradient is a partial sum over tp (SP)."""
    from workbench.parallel import tensor
    from workbench.parallel.tensor import sequence
    from workbench.parallel.zero.optimizer import NORM_SHARE, PARTIAL_GRADS

    shares = tensor.norm_weights(model, mesh)
    partial = {n for n, _ in sequence.sequence_parallel_parameters(model)}
    groups: dict[tuple[float, bool], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault((shares[name], name in partial), []).append(p)
    return [{"params": params, NORM_SHARE: share,
             PARTIAL_GRADS: (mesh.tp_group, sequence.SP_GRAD_TAG) if is_partial else None}
            for (share, is_partial), params in groups.items()]


def _single(model: nn.Module, cfg: ParallelConfig) -> Parallelized:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **_optimizer_kwargs(cfg))
    return Parallelized(model, optimizer, nullcontext, lambda: None, _clip_replicated(model),
                        lambda: _named_trainable(model), lambda: _record_replicated_memory(model, optimizer),
                        "single process")


def _ddp(model: nn.Module, mesh: Any, cfg: ParallelConfig) -> Parallelized:
    """ZeRO-0: a DDP wrapper + AdamW. ZeRO-1: the same wrapper + the sharded optimizer."""
    from workbench.parallel.ddp import make_ddp

    wrapped = make_ddp(model, cfg.ddp, group=mesh.dp_group, bucket_mb=cfg.bucket_mb, compressor=_compressor(cfg))
    params = [p for p in wrapped.parameters() if p.requires_grad]
    if cfg.zero == 1:
        from workbench.parallel.zero import ZeroOptimizer

        optimizer = ZeroOptimizer(params, torch.optim.AdamW, group=mesh.dp_group, stage=1, offload=cfg.offload,
                                  **_optimizer_kwargs(cfg))
        clip, record, what = optimizer.clip_grad_norm_, lambda: None, f"{cfg.ddp} DDP + ZeRO-1"
    else:
        optimizer = torch.optim.AdamW(params, **_optimizer_kwargs(cfg))
        clip, what = _clip_replicated(wrapped), f"{cfg.ddp} DDP"
        record = lambda: _record_replicated_memory(wrapped, optimizer)  # noqa: E731
    if wrapped.compressor is not None:
        what += f" ({_compression_name(cfg)} gradients)"
    return Parallelized(wrapped, optimizer, wrapped.no_sync, wrapped.finish_gradient_synchronization, clip,
                        lambda: _named_trainable(wrapped), record, what + (" + offload" if cfg.offload else ""),
                        compressor=wrapped.compressor)


def _compressor(cfg: ParallelConfig) -> Any:
    """The DDP wrappers' reducer (``parallel.compression``), or None for the plain all-reduce."""
    if cfg.grad_compression == "none":
        return None
    from workbench.parallel.compression import make_compressor

    return make_compressor(cfg.grad_compression, powersgd_rank=cfg.powersgd_rank, topk_ratio=cfg.topk_ratio,
                           warmup_steps=cfg.compression_warmup)


def _compression_name(cfg: ParallelConfig) -> str:
    detail = {"powersgd": f" rank {cfg.powersgd_rank}", "topk": f" {cfg.topk_ratio:g}"}.get(cfg.grad_compression, "")
    return f"{cfg.grad_compression}{detail}"


def _local_sgd(model: nn.Module, mesh: Any, cfg: ParallelConfig) -> Parallelized:
    """Local SGD / DiLoCo (``parallel.local_sgd``): every rank steps its own replica with its own gradients (AdamW,
    the inner optimizer); every ``local_steps`` steps the replicas' parameters are averaged and an outer step taken.
    No gradient is communicated, so there is nothing to wait for after backward."""
    from workbench.parallel.local_sgd import LocalSGD

    outer = LocalSGD(model, mesh.dp_group, cfg.local_steps, cfg.outer_optimizer, cfg.outer_lr, cfg.outer_momentum)
    single = _single(model, cfg)
    what = (f"local SGD (H={cfg.local_steps}, outer {cfg.outer_optimizer}"
            + (f" lr {cfg.outer_lr:g}" if cfg.outer_optimizer != "avg" else "") + f") over dp={mesh.dp_size}")
    return replace(single, describe=what, outer=outer)


def _zero2(model: nn.Module, mesh: Any, cfg: ParallelConfig, param_groups: list[dict[str, Any]] | None = None,
           model_parallel_groups: tuple[Any, ...] = ()) -> Parallelized:
    from workbench.parallel.collectives import broadcast_module_state
    from workbench.parallel.zero import ZeroOptimizer

    params = param_groups or [p for p in model.parameters() if p.requires_grad]
    optimizer = ZeroOptimizer(params, torch.optim.AdamW, group=mesh.dp_group, stage=2, offload=cfg.offload,
                              model_parallel_groups=model_parallel_groups, **_optimizer_kwargs(cfg))
    broadcast_module_state(model, mesh.dp_group)  # no wrapper does it at stage 2: start every replica alike
    return Parallelized(model, optimizer, optimizer.no_sync, optimizer.finish_gradient_synchronization,
                        optimizer.clip_grad_norm_, lambda: _named_trainable(model), lambda: None,
                        "ZeRO-2" + (" + offload" if cfg.offload else ""), unscale_grads=optimizer.unscale_grads_)


def _zero3(model: nn.Module, mesh: Any, cfg: ParallelConfig, amp: _Precision) -> Parallelized:
    from workbench.parallel.zero import FullyShardedModel, ZeroOptimizer

    sharded = FullyShardedModel(model, group=mesh.dp_group, offload_params=cfg.offload, mp_policy=_mp_policy(amp),
                                replicate=replicated_names(model, cfg.zero3_replicate) or None)
    optimizer = ZeroOptimizer(sharded.parameters(), torch.optim.AdamW, group=mesh.dp_group, stage=3,
                              offload=cfg.offload, **_optimizer_kwargs(cfg))
    return Parallelized(sharded, optimizer, sharded.no_sync, sharded.finish_gradient_synchronization,
                        optimizer.clip_grad_norm_, sharded.full_parameters, lambda: None,
                        "ZeRO-3" + (" + offload" if cfg.offload else "")
                        + (f" (replicated: {', '.join(cfg.zero3_replicate)})" if cfg.zero3_replicate else ""),
                        unscale_grads=optimizer.unscale_grads_)
