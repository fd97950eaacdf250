"""The training loop: AdamW, warmup + cosine LR, gradient clipping, accumulation, metrics per step.

One loop for every strategy. ``train_rank(cfg)`` runs on each rank (or alone, for ``nproc=1``): it
builds the mesh, the seeded model and the sharded data, lets ``parallelize`` apply the strategy from
outside (the model knows nothing of parallelism), and steps. ``--batch-size`` is the *global* batch, split
across data-parallel ranks and then into ``grad_accum`` micro-batches, so the loss of every step is the
loss of the same global batch whatever the strategy, and ``nproc=1`` is the baseline for all of them.

Checkpoints (``ckpt_dir``, ``ckpt_every``, ``keep``, ``async_ckpt``, ``resume``): the ``Trainer`` hands them to a
``workbench.checkpoint.manager.CheckpointManager`` (``trainer.checkpoints``), which saves what each rank's strategy
holds (its model's and optimizer's state dicts, shards included), the step, its RNG states and the sampler's
position; a resume reloads them and continues at the next step (on another layout through the full state that
``prepare_resharded_resume``, here, gathers first). The data order needs nothing more:
``ShardedSampler.indices(step)`` is a pure function of (seed, step), and the LR is ``lr_at(step)``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from workbench import trace
from workbench.checkpoint.manager import CheckpointManager, CheckpointSettings
from workbench.checkpoint.resume import FULL_STATE, find_resume_point, layout_changes
from workbench.checkpoint.store import export_full_state_dict, list_steps, load, read_manifest, write_atomic
from workbench.data import ShardedSampler, make_lm_data
from workbench.dist import comm
from workbench.dist.faults import (
    FaultSpec,
    bitflip_due,
    flip_bit,
    maybe_inject,
    parse_faults,
    restart_count,
    stall_seconds,
)
from workbench.dist.launch import report
from workbench.dist.mesh import Mesh
from workbench.dist.notices import notice
from workbench.models import build_gpt
from workbench.models.moe import take_moe_stats
from workbench.parallel import parallelize
from workbench.training.config import RunConfig
from workbench.training.health import (
    HealthMonitor,
    check_disjoint,
    check_split,
    compare_fingerprints,
    fingerprint,
    split_windows,
)
from workbench.training.schedule import lr_at, params_sha256  # noqa: F401 (params_sha256: callers import it here)


def prepare_resharded_resume(cfg: RunConfig) -> str | None:
    """In the caller, before the ranks start: if ``cfg`` resumes on another layout than its checkpoint was saved
    with, gather that checkpoint into full tensors once, on CPU ranks of the saved layout (``FULL_STATE``
    beside the shards, written atomically). Returns a line saying what changes, or None for the same layout."""
    path = find_resume_point(cfg)
    saved = read_manifest(path)["meta"]["run_config"]
    changes = layout_changes(cfg, saved)
    if not changes:
        return None
    if not (path / FULL_STATE).is_file():
        consolidate_checkpoint(path)
    return f"resharding {path.name} ({'; '.join(changes)})"


def consolidate_checkpoint(path: str | Path) -> Path:
    """Gather the checkpoint at ``path`` (a ``step-*`` folder) into full tensors on CPU ranks of its saved layout and
    write them beside its shards (``FULL_STATE``, atomically); returns that file. ``workbench ckpt export`` and a
    resharded resume both call it."""
    from workbench.dist.launch import launch

    saved = read_manifest(path)["meta"]["run_config"]
    if saved.get("ps_servers"):  # a parameter server's files hold whole tensors: no ranks to launch
        from workbench.training.param_server_run import consolidate_ps_checkpoint

        return consolidate_ps_checkpoint(path)
    keep = {k: v for k, v in saved.items() if k in RunConfig.__dataclass_fields__}
    source = RunConfig(**{**keep, "device": "cpu", "backend": None, "port": 0, "ckpt_dir": None,
                          "ckpt_every": None, "keep": None, "resume": False, "async_ckpt": False, "export": None,
                          "max_restarts": 0, "inject_fault": None, "min_nproc": None, "extra": {}})
    launch(_consolidate_rank, source.nproc, source, str(path), device="cpu", timeout=source.timeout)
    return Path(path) / FULL_STATE


def _consolidate_rank(cfg: RunConfig, path: str) -> None:
    """One rank of the saved layout: load its shard, gather the full state; rank 0 writes it."""
    from workbench.checkpoint.reshard import full_training_state

    trainer = Trainer(cfg)
    state = load(path, map_location=trainer.device)
    trainer.strategy.model.load_state_dict(state["model"])
    trainer.strategy.optimizer.load_state_dict(state["optim"])
    full = full_training_state(trainer.strategy)
    if comm.group_rank() == 0:
        extra = {k: state[k] for k in ("step", "sampler", "rng", "scaler") if k in state}
        write_atomic(Path(path) / FULL_STATE, {**full, **extra})



def _read_scalars(*values: torch.Tensor | float) -> list[float]:
    """The step's scalar metrics as floats, read in ONE device-to-host copy, after the optimizer's kernels are
    queued: the step's only host-device sync (the loss and grad norm stay on the device until here; reading the
    norm before ``optimizer.step()`` made the host wait for the backward, and the GPU then wait for the host)."""
    tensors = [v for v in values if torch.is_tensor(v)]
    if not tensors:
        return [float(v) for v in values]
    read = iter(torch.stack([t.detach().reshape(()).double() for t in tensors]).tolist())
    return [next(read) if torch.is_tensor(v) else float(v) for v in values]


class Trainer:
    """Steps a parallelized model on the sharded global batch; records spans, metrics and memory."""

    def __init__(self, cfg: RunConfig, mesh: Mesh | None = None) -> None:
        self.cfg = cfg
        self.mesh = mesh or Mesh(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp)
        self.device = self.mesh.device
        model_cfg = cfg.gpt_config()
        self.dataset = make_lm_data(model_cfg.seq_len, cfg.data)  # host memory; each batch moves to the device
        self.split = split_windows(len(self.dataset), cfg.val_fraction) if cfg.val_every else None
        if self.split is not None:
            check_split(self.split, model_cfg.seq_len)
        train_windows = len(self.dataset) if self.split is None else self.split.train
        self.data_skip = 0  # batches skipped by spike rollbacks: step s trains on batch s + data_skip
        self.data_stall_s = 0.0  # an injected stall (dist.faults) the next step's data span waits out
        self.sampler = ShardedSampler(train_windows, cfg.batch_size, self.mesh.dp_rank, self.mesh.dp_size,
                                      seed=cfg.seed)
        model = build_gpt(model_cfg, seed=cfg.seed, device=self.device)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.parallel_config = cfg.parallel_config()
        self.strategy = parallelize(model, self.mesh, self.parallel_config)
        self.step_index = 0
        self.checkpoints = CheckpointManager(cfg.section(CheckpointSettings), cfg, self.strategy, self.sampler,
                                             self.device, self._shard_like_params)
        self._memory_probed = False  # see step(): memory is probed on the first step and on traced steps
        self.tokens_per_step = cfg.batch_size * model_cfg.seq_len
        self.moe = model_cfg.moe is not None

    def step(self) -> dict[str, Any]:
        cfg, s = self.cfg, self.strategy
        tracer = trace.current()
        trace.set_step(self.step_index)
        if tracer is not None:
            tracer.enabled = self.step_index >= cfg.steps - cfg.trace_steps
            # Memory is measured on traced steps and on this attempt's first (so ledger peaks, which a live
            # dashboard streams, hold from the start); other steps carry no probe and no NVML query.
            tracer.probe_memory = tracer.enabled or not self._memory_probed
            self._memory_probed = True
        t0 = time.time()
        if tracer is not None:
            tracer.take_compute_s()  # this step's compute starts from zero
        lr = lr_at(self.step_index, cfg)
        for group in s.optimizer.param_groups:
            group["lr"] = lr
        with trace.span("data", "data"):  # the input pipeline's share of the step (a starved GPU waits here)
            if self.data_stall_s:  # an injected stall (dist.faults): a slow filesystem, a stuck loader worker
                time.sleep(self.data_stall_s)
                self.data_stall_s = 0.0
            windows = self.sampler.indices(self.step_index + self.data_skip)
            x, y = self.dataset.get(windows, device=self.device)
        data_wait = time.time() - t0
        # The last step's gradients are dropped here, at the top of the step as a plain loop does, not at its end:
        # freed at the end, the host allocator gave their pages back and backward faulted them in afresh (12 % of
        # a CPU step of the bench GPT, measured beside the plain loop: bench_trainer_step).
        s.optimizer.zero_grad(set_to_none=True)
        if self.moe:  # count this step's routing only (not a validation forward's, nor a checkpoint's)
            take_moe_stats()
        local_loss = s.forward_backward(x, y)  # the strategy owns its micro-batches (accumulation or a pipeline)
        with trace.span("grad sync wait", "wait"):
            s.finish_grad_sync()
        with trace.span("optimizer", "optimizer"):  # fp16: unscale, agree on inf/NaN, then step or skip
            stepped = s.optimizer_step(cfg.clip if cfg.clip is not None else math.inf)
        if tracer is not None and tracer.probe_memory:  # untraced (no tracer): nothing would record them
            s.record_memory()  # gradients and optimizer state are both alive here
            trace.record_device_memory(self.device, batch_bytes=x.nbytes + y.nbytes)
        loss = local_loss.clone()  # the mean over this rank's tokens; cp ranks hold equal shares of each sequence
        comm.all_reduce(loss, op="avg", group=self.mesh.dp_cp_group, tag="metrics")
        loss_value, grad_norm = _read_scalars(loss, stepped["grad_norm"])
        elapsed = time.time() - t0
        metrics = {"step": self.step_index, "loss": loss_value, "grad_norm": grad_norm, "lr": lr,
                   "step_time_s": elapsed, "data_wait_s": data_wait, "tokens_per_s": self.tokens_per_step / elapsed,
                   "loss_scale": stepped["loss_scale"], "skipped": stepped["skipped"],
                   "windows": windows}  # the sampler's record: which windows this rank trained on (elastic runs prove
        # with it that a world change dropped or repeated none)
        if tracer is not None:  # this rank's forward, backward and optimizer; the rest of the step it waited
            metrics["compute_s"] = tracer.take_compute_s()
        if s.outer is not None:  # local SGD: whether this step ended an outer step (the only communication)
            metrics["outer_step"] = stepped.get("outer_step", False)  # an fp16 skip is no inner step
        if s.compressor is not None and s.compressor.history:  # bytes this rank's gradients took, and the saving
            sent = s.compressor.history[-1]
            metrics.update(grad_bytes_sent=sent.sent, compression_ratio=sent.ratio)
        if self.moe:
            metrics.update(moe_metrics(take_moe_stats()))
        if tracer is not None:
            tracer.record_metrics(metrics)
        self.step_index += 1
        return metrics

    # -- checkpoints (workbench.checkpoint.manager does the work) -------------------------------------------------
    # These delegates stay because code outside this module calls them on a Trainer: tests/test_precision_training.py
    # (resume, checkpoint_due, save_checkpoint) and notebook 10 (save_checkpoint).

    def checkpoint_due(self) -> bool:
        """After every ``ckpt_every``-th step and after the last (so a finished run can be extended)."""
        return self.checkpoints.due(self.step_index)

    def save_checkpoint(self) -> int:
        """Every rank saves the state its strategy holds after the step just taken; returns that step's index."""
        return self.checkpoints.save(self.step_index, self.data_skip)

    def resume(self, after_restart: bool = False) -> tuple[int | None, list[str]]:
        """Load the newest good checkpoint; the next ``step()`` is the one after it. Returns (its step, warnings).

        ``after_restart``: this attempt follows a failure; with no checkpoint written yet it starts from step 0
        (returns ``(None, [])``). See ``CheckpointManager.resume``."""
        resumed = self.checkpoints.resume(after_restart)
        if resumed.step is not None:
            self.step_index, self.data_skip = resumed.next_step, resumed.data_skip
        return resumed.step, resumed.skipped

    def _shard_like_params(self, values: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """This layout's strategy built on a model whose parameters are ``values``: what its optimizer's tensors
        hold is each value's shard (``reshard.load_full_training_state``). Traced into a throwaway tracer.
        Here, not in the manager: building the model and parallelizing it is the trainer's business."""
        from workbench.checkpoint.reshard import optimizer_slots

        model = build_gpt(self.cfg.gpt_config(), seed=self.cfg.seed, device=self.device)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(values[name])
        with trace.tracing(rank=comm.group_rank(), world_size=comm.group_size()):
            strategy = parallelize(model, self.mesh, self.parallel_config)
        return [s.detach().clone() for s in optimizer_slots(strategy.optimizer)]

    # -- health -------------------------------------------------------------------------------------------

    def validation_loss(self) -> float:
        """Mean loss over the first global batch of held-out windows, sharded over dp like a training batch."""
        assert self.split is not None, "validation_loss needs val_every (a held-out split)"
        windows = list(self.split.val_windows)[: self.cfg.batch_size]
        per_rank = -(-len(windows) // self.mesh.dp_size)
        mine = windows[self.mesh.dp_rank * per_rank:(self.mesh.dp_rank + 1) * per_rank] or windows[:1]
        x, y = self.dataset.get(mine, device=self.device)
        with torch.no_grad(), trace.span("validation", "other"):
            loss = self.strategy.model(x, y).detach().reshape(1).float()
        comm.all_reduce(loss, op="avg", group=self.mesh.dp_group, tag="health")
        return float(loss.item())

    def check_data_shards(self) -> None:
        """Gather the windows every data-parallel rank drew for the step just taken; ``ValueError`` on overlap."""
        mine = self.sampler.indices(self.step_index - 1 + self.data_skip)
        drawn = comm.all_gather_object(mine, group=self.mesh.dp_group) if comm.is_distributed() else [mine]
        check_disjoint(drawn, self.step_index - 1)

    def poison_parameters(self) -> None:
        """Fill this rank's first parameter with NaN (the ``nan:`` fault): a corrupted weight, as after a bad
        update or a flipped bit, which the gradient all-reduce then spreads to every rank."""
        with torch.no_grad():
            next(p for p in self.strategy.model.parameters() if p.requires_grad).fill_(float("nan"))

    def flip_bit(self) -> str:
        """Flip one bit of this rank's first parameter (the ``bitflip:`` fault); returns the parameter's name."""
        name, param = next((n, p) for n, p in self.strategy.model.named_parameters() if p.requires_grad)
        before, after = flip_bit(param)
        notice(f"injected bitflip on rank {comm.group_rank()}: {name}[0] {before:.6g} -> {after:.6g}")
        return name

    def replicated_state(self) -> tuple[list[str], list[torch.Tensor]]:
        """What every data-parallel replica must hold bit for bit: the parameters and, where it is replicated (plain
        DDP: full AdamW state on every rank), the optimizer's state. With ZeRO-1/2 each rank's optimizer state is
        its own shard, so only the parameters are compared (RunConfig refuses the layouts where even those differ)."""
        named = list(self.strategy.model.named_parameters())
        names, tensors = [n for n, _ in named], [p for _, p in named]
        state = getattr(self.strategy.optimizer, "state", None) if self.cfg.zero == 0 else None
        for name, param in named if isinstance(state, Mapping) else ():
            for key, value in sorted(state.get(param, {}).items()):
                # exp_avg, exp_avg_sq: shaped like the parameter. AdamW's step counter is left out: a scalar that
                # may live on the CPU beside a GPU parameter, and the step index every rank shares anyway.
                if torch.is_tensor(value) and value.shape == param.shape:
                    names.append(f"{name}:{key}")
                    tensors.append(value)
        return names, tensors

    def check_replicas(self) -> list[dict[str, Any]]:
        """Fingerprint ``replicated_state`` here, gather every dp rank's fingerprints (one small all-gather, tag
        "sdc") and compare: the mismatches (``health.compare_fingerprints``), ranks as global ranks."""
        group = self.mesh.dp_group
        world = comm.group_size(group) if comm.is_distributed() else 1
        names, tensors = self.replicated_state()
        if world == 1 or not tensors:
            return []  # one replica agrees with itself
        with trace.span("sdc check", "other"):
            mine = fingerprint(tensors, self.device)
            gathered = torch.empty((world * mine.shape[0], 2), dtype=mine.dtype, device=self.device)
            comm.all_gather(gathered, mine, group=group, tag="sdc")
            mismatches = compare_fingerprints(gathered.view(world, -1, 2).tolist(), names)
        for m in mismatches:
            m["ranks"] = [comm.global_rank(group, r) for r in m["ranks"]]
        return mismatches

    def roll_back(self, bad_step: int, skip_data: bool = True) -> int:
        """Reload the newest checkpoint and, for a loss spike, skip the batches from there to ``bad_step`` (PaLM's
        remedy, Chowdhery et al. 2022 §5.1); returns the step rolled back to. A corrupted replica (``skip_data``
        False) replays the same batches: they were not what went wrong, and the replay then ends where the
        uncorrupted run would have."""
        self.checkpoints.finish()  # the newest checkpoint may still be being written
        step, _ = self.resume()  # without after_restart it finds a checkpoint or raises
        if skip_data:
            self.data_skip += bad_step - step
        return step


def moe_metrics(stats: dict[str, Any]) -> dict[str, Any]:
    """A step's routing on this rank (``models.moe.take_moe_stats``): assignments each expert was chosen for and
    kept, summed over the MoE layers and micro-batches, the dropped ones and their share, and each call's (one per
    layer per micro-batch, in order) chosen and kept counts and capacity, from which the all-to-all's exact bytes
    follow (``theory.expert.measured_all_to_all_bytes``)."""
    chosen = sum(stats["tokens_per_expert"])
    return {"moe_tokens_per_expert": stats["tokens_per_expert"], "moe_kept_per_expert": stats["kept_per_expert"],
            "moe_dropped": stats["dropped"], "moe_dropped_fraction": stats["dropped"] / chosen if chosen else 0.0,
            "moe_calls": [{k: c[k] for k in ("tokens", "capacity", "chosen", "kept")} for c in stats["calls"]]}


def train_rank(cfg: RunConfig) -> dict[str, Any]:
    """Run ``cfg.steps`` steps on this rank; rank 0's result carries the full-parameter hash."""
    if cfg.ps_servers is not None:  # servers and workers run different loops (training/param_server_run.py)
        from workbench.training.param_server_run import train_ps_rank

        return train_ps_rank(cfg)
    torch.manual_seed(cfg.seed)
    trainer = Trainer(cfg)
    restarted = restart_count() > 0 and cfg.ckpt_dir is not None
    resumed, skipped = trainer.resume(after_restart=restarted) if cfg.resume or restarted else (None, [])
    faults = parse_faults(cfg.inject_fault)  # each fires once: the rolled-back run replays a step with other batches
    stop = StopSignal(cfg.extra.get("stop_file"), trainer.device)
    health = HealthMonitor(on_spike=cfg.on_spike, factor=cfg.spike_factor)
    history, written, stopped_after = [], [], None
    while trainer.step_index < cfg.steps:
        faults = _strike_before_step(faults, trainer)
        metrics = trainer.step()
        if cfg.val_every and (trainer.step_index % cfg.val_every == 0 or trainer.step_index == cfg.steps):
            trainer.check_data_shards()
            metrics["val_loss"] = trainer.validation_loss()
        history.append(metrics)
        report(_streamed(metrics))
        if flips := [f for f in faults if bitflip_due(f, comm.group_rank(), metrics["step"])]:
            trainer.flip_bit()
            faults = [f for f in faults if f not in flips]
        action, data_suspect = _health_action(trainer, health, metrics,
                                              lambda: bool(written) or bool(list_steps(cfg.ckpt_dir)))
        if action == "stop":
            stopped_after = metrics["step"]
            break
        if action == "rollback":
            back_to = trainer.roll_back(metrics["step"], skip_data=data_suspect)
            health.rolled_back(back_to)
            history = [m for m in history if m["step"] <= back_to]
            continue
        if trainer.checkpoint_due():
            written.append(trainer.save_checkpoint())
        # not after the last step: that run is finished, not preempted (a requeued job would find nothing to train)
        if trainer.step_index < cfg.steps and stop.requested():
            stopped_after = metrics["step"]
            if cfg.ckpt_dir is not None and written[-1:] != [stopped_after]:
                written.append(trainer.save_checkpoint())  # what was trained is kept: a later --resume goes on
            break
    trainer.checkpoints.finish()
    checkpoint = None if cfg.ckpt_dir is None else {
        "dir": cfg.ckpt_dir, "every": cfg.ckpt_every, "keep": cfg.keep, "written_steps": written,
        "resumed_from_step": resumed, "skipped_on_resume": skipped, "async": cfg.async_ckpt,
        "stalls": trainer.checkpoints.stalls}
    full = trainer.strategy.full_parameters()
    if cfg.export is not None and comm.group_rank() == 0:
        export_full_state_dict(build_gpt(cfg.gpt_config(), seed=cfg.seed), full, cfg.export)
    backend = torch.distributed.get_backend() if comm.is_distributed() else "none"
    return {"history": history, "n_params": trainer.n_params, "strategy": trainer.strategy.describe,
            "final_params_sha256": params_sha256(full) if comm.group_rank() == 0 else None,
            "placement": {"backend": backend, "device": str(trainer.device),
                          "device_name": _device_name(trainer.device)},
            "final_params": {k: v.detach().cpu().clone() for k, v in full.items()} if cfg.extra.get("return_params")
            else None,
            "checkpoint": checkpoint, "stopped_after_step": stopped_after, "attempt": restart_count(),
            "health": {"events": health.events, "data_skip": trainer.data_skip,
                       "sdc": None if cfg.sdc_check_every is None else {
                           "check_every": cfg.sdc_check_every, "detections": health.sdc},
                       "val_split": None if trainer.split is None else {
                           "train_windows": trainer.split.train, "val_windows": len(trainer.split.val_windows)}}}


_SEVERITY = {None: 0, "warn": 1, "rollback": 2, "stop": 3}


def _health_action(trainer: Trainer, health: HealthMonitor, metrics: dict[str, Any],
                   has_checkpoint: Callable[[], bool]) -> tuple[str | None, bool]:
    """The step's health verdicts, said once (rank 0; every rank reaches the same ones): the stronger action, and
    whether the data is suspect (a loss verdict asked for it: a rollback then skips the batches; a replica
    mismatch alone replays them).

    The replica check runs every ``sdc_check_every`` steps, and also before every checkpoint and after the last
    step: a checkpoint is then written only after a passing check, so a rollback never reloads a corrupted replica.
    Every rank takes the same decision to check (step, due checkpoint), so the all-gather inside is matched."""
    cfg = trainer.cfg
    verdicts = [(health.verdict(metrics, has_checkpoint), True)]
    every = cfg.sdc_check_every
    if every and (metrics["step"] % every == 0 or trainer.checkpoint_due() or trainer.step_index == cfg.steps):
        verdicts.append((health.sdc_verdict(metrics["step"], trainer.check_replicas(), has_checkpoint), False))
    actions, data_suspect = [], False
    for verdict, from_loss in verdicts:
        if verdict is None:
            continue
        problem, action = verdict
        if comm.group_rank() == 0:
            notice(f"step {metrics['step']}: {problem}; action: {action}")
        actions.append(action)
        data_suspect |= from_loss
    return max(actions, key=_SEVERITY.__getitem__, default=None), data_suspect


def _strike_before_step(faults: list[FaultSpec], trainer: Trainer) -> list[FaultSpec]:
    """Fire the faults due on this rank before the trainer's next step; returns those still to fire."""
    rank, step = comm.group_rank(), trainer.step_index
    left = []
    for fault in faults:
        if fault.kind == "bitflip" or not fault.strikes(rank, step):  # a bitflip strikes after its step
            left.append(fault)
        elif maybe_inject(fault, rank, step):  # kill, lose, raise and hang never return
            trainer.poison_parameters()
        else:  # spent in the next step's data span: its data_wait_s shows it
            trainer.data_stall_s = stall_seconds(fault, rank, step)
    return left


class StopSignal:
    """A request to stop, seen by every rank at the same step: the live dashboard's Stop button, or SIGTERM/SIGINT
    caught by ``workbench.run`` (a preemption), both of which create ``stop_file``. Every rank looks for it after
    each step and a MAX all-reduce of one flag tells the others, so all ranks leave the loop together (a rank
    leaving alone would leave its peers waiting in the next collective). Every rank looks, not only rank 0: under
    torchrun each process catches its own signal and has a stop file of its own. Without a file: no-op."""

    def __init__(self, stop_file: str | None, device: torch.device) -> None:
        self.stop_file, self.device = stop_file, device

    def requested(self) -> bool:
        if self.stop_file is None:
            return False
        flag = torch.tensor([1.0 if Path(self.stop_file).exists() else 0.0], device=self.device)
        if comm.group_size() > 1:
            # torch.distributed itself, not ``comm``: this control byte runs after every step of every run, and
            # through ``comm`` it would land in the traffic a report sets beside theory and pay emulated link time.
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item() > 0)


def _streamed(metrics: dict[str, Any]) -> dict[str, Any]:
    """What a rank streams to the caller after each step (``launch.report``): the step's metrics, this rank's
    ledger peaks by category and the bytes each collective moved since the last step (for a live dashboard)."""
    tracer = trace.current()
    if tracer is None:
        return metrics
    return {**metrics, "rank": tracer.trace.rank, "attempt": restart_count(), "memory_peak": dict(tracer.memory.peak),
            "comm_bytes": tracer.take_comm_totals()}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
