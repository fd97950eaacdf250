"""The training loop: AdamW, warmup + cosine LR, gradient clipping, accumulation, metrics per step.

One loop for every strategy. ``train_rank(cfg)`` runs on each rank (or alone, for ``nproc=1``): it
builds the mesh, the seeded model and the sharded data, lets ``parallelize`` apply the strategy from
outside (the model knows nothing of parallelism), and steps. ``--batch-size`` is the *global* batch, split
across data-parallel ranks and then into ``grad_accum`` micro-batches, so the loss of every step is the
loss of the same global batch whatever the strategy, and ``nproc=1`` is the baseline for all of them.

Checkpoints (``ckpt_dir``, ``ckpt_every``, ``keep``, ``resume``; the store is ``workbench.checkpoint``): each rank
saves what its strategy holds (its model's and optimizer's state dicts, shards included), the step, its RNG
states and the sampler's position; a resume reloads them on the *same* layout and continues at the next step.
The data order needs nothing more: ``ShardedSampler.indices(step)`` is a pure function of (seed, step), and the
LR is ``lr_at(step)``.
"""

from __future__ import annotations

import hashlib
import math
import time
import warnings
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from workbench import comm, trace
from workbench.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    discard_newer,
    ensure_writable,
    export_full_state_dict,
    latest_good,
    list_steps,
    load,
    read_manifest,
    rng_state,
    save,
    set_rng_state,
    step_dir,
    write_atomic,
)
from workbench.data import ShardedSampler, corpus_tokens, make_lm_data
from workbench.faults import maybe_inject, parse_fault, restart_count
from workbench.health import SPIKE_ACTIONS, SpikeDetector, check_disjoint, check_split, split_windows
from workbench.launch import report
from workbench.mesh import Mesh
from workbench.models import PRESETS, GPTConfig, build_gpt
from workbench.parallel import DDP_KINDS, ZERO_STAGES, ParallelConfig, parallelize
from workbench.recompute import check_mode as check_recompute_mode
from workbench.theory.checks import positive_int, positive_number
from workbench.theory.composition import Combination, check_composition


@dataclass
class RunConfig:
    """Everything that defines a run; validated before any rank is spawned."""

    model: str = "tiny"
    seq_len: int | None = None
    nproc: int = 1
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"  # pipeline schedule: naive, gpipe, 1f1b, interleaved, zb
    microbatches: int | None = None  # the pipeline's micro-batches per step (default: 2 x pp)
    virtual_stages: int = 1  # stages per rank (interleaved)
    sp: bool = False  # sequence parallelism (needs tp > 1)
    recompute: str = "none"  # activation recomputation: none, selective (attention core), full (every block)
    precision: str = "fp32"  # compute dtype: fp32, bf16, fp16 (fp32 masters and optimizer state; fp16: loss scaler)
    reduce_dtype: str = "fp32"  # gradient reduction dtype: fp32, or the compute dtype (needs zero=3)
    init_loss_scale: float = 2.0 ** 16  # fp16's dynamic loss scaler: the first scale (Micikevicius et al. 2018)
    loss_scale_growth_interval: int = 2000  # fp16: clean steps before the scale doubles
    steps: int = 50
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 5
    weight_decay: float = 0.1
    clip: float | None = 1.0
    seed: int = 0
    ddp: str = "bucketed"
    bucket_mb: float | None = 25.0  # None: one bucket for every gradient
    zero: int = 0
    zero3_replicate: list[str] = field(default_factory=list)  # ZeRO-3: glob patterns of parameters kept whole
    offload: bool = False
    data: str | None = None
    timeout: float = 120.0
    trace_steps: int = 5
    device: str | None = None  # auto / cpu / cuda (None: $WORKBENCH_DEVICE or auto); see launch.resolve_placement
    backend: str | None = None  # gloo / nccl (None: follows the device)
    port: int = 0  # rendezvous port on 127.0.0.1 (0: the OS picks)
    ckpt_dir: str | None = None  # where checkpoints go (workbench.checkpoint); None: no checkpoints
    ckpt_every: int | None = None  # save after every K-th step (and after the last); None: after the last only
    keep: int | None = None  # keep the newest K checkpoints; None: keep them all
    resume: bool = False  # continue from the newest good checkpoint in ckpt_dir (same layout only)
    async_ckpt: bool = False  # snapshot to CPU and write in a background thread while training goes on
    export: str | None = None  # write the trained model's full state dict here (a plain model loads it)
    max_restarts: int = 0  # restart every rank after a failure, up to K times, resuming from the newest checkpoint
    inject_fault: str | None = None  # KIND:rank=R:step=S, KIND in kill/raise/hang (workbench.faults), first attempt
    val_every: int | None = None  # validation loss every K steps on a held-out split (and a duplicated-shard check)
    val_fraction: float = 0.1  # the corpus's last windows held out for validation when val_every is set
    on_spike: str = "warn"  # a NaN/Inf or loss spike: warn, rollback (to the newest checkpoint, skipping batches), stop
    spike_factor: float = 3.0  # a loss above this x the recent median is a spike
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        model_parallel = self.tp * self.pp if all(isinstance(v, int) and v > 0 for v in (self.tp, self.pp)) else 1
        if self.dp is None:
            self.dp = max(1, self.nproc // model_parallel)
        if self.microbatches is None:
            self.microbatches = 2 * self.pp if isinstance(self.pp, int) and self.pp > 1 else 1
        self.validate()

    def validate(self) -> None:
        positive_int("nproc", self.nproc)
        positive_int("dp", self.dp)
        positive_int("steps", self.steps)
        positive_int("batch_size", self.batch_size)
        positive_int("grad_accum", self.grad_accum)
        if self.model not in PRESETS:
            raise ValueError(f"unknown model {self.model!r}; valid: {sorted(PRESETS)}")
        positive_int("tp", self.tp)
        positive_int("pp", self.pp)
        if self.dp * self.tp * self.pp != self.nproc:
            raise ValueError(f"dp x tp x pp = {self.dp} x {self.tp} x {self.pp} = {self.dp * self.tp * self.pp} but "
                             f"nproc={self.nproc}: the mesh must use every rank; leave --dp out to get "
                             f"nproc / (tp x pp)")
        if self.sp and self.tp > 1:
            from workbench.parallel.sequence import check_sequence_parallel_sizes

            check_sequence_parallel_sizes(self.gpt_config(), self.tp)
        self._validate_pipeline()
        check_recompute_mode(self.recompute)
        self._validate_precision()
        check_composition(self.combination())  # what composes: one table (theory.composition)
        if self.tp > 1:
            from workbench.parallel.tensor import check_tensor_parallel_sizes

            check_tensor_parallel_sizes(self.gpt_config(), self.tp)
        per_rank, rem = divmod(self.batch_size, self.dp * self.grad_accum)
        if rem or per_rank == 0:
            raise ValueError(f"batch_size={self.batch_size} must be a positive multiple of dp x grad_accum = "
                             f"{self.dp} x {self.grad_accum} = {self.dp * self.grad_accum}")
        if self.ddp not in DDP_KINDS:
            raise ValueError(f"ddp={self.ddp!r}; valid: {', '.join(DDP_KINDS)}")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero={self.zero!r}; valid: {ZERO_STAGES}")
        mib = self.bucket_mb
        if mib is not None and (isinstance(mib, bool) or not isinstance(mib, (int, float)) or not mib > 0):
            raise ValueError(f"bucket_mb must be > 0 MiB, or None for one bucket, got {self.bucket_mb}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be > 0 (or None to disable), got {self.clip}")
        positive_number("lr", self.lr)
        positive_number("timeout", self.timeout)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0 (steps of linear warm-up), got {self.warmup!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.seq_len is not None:
            positive_int("seq_len", self.seq_len)
        self._validate_data()
        self._validate_checkpointing()
        self._validate_faults()
        self._validate_health()
        if self.export is not None:
            ensure_writable(Path(self.export).parent)

    def _validate_faults(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0 (restarts after a failure), got {self.max_restarts!r}")
        if self.inject_fault is not None:
            parse_fault(self.inject_fault, self.nproc, self.steps)

    def _validate_health(self) -> None:
        if self.on_spike not in SPIKE_ACTIONS:
            raise ValueError(f"on_spike={self.on_spike!r}; valid: {', '.join(SPIKE_ACTIONS)}")
        if self.on_spike == "rollback" and self.ckpt_dir is None:
            raise ValueError("on_spike='rollback' needs ckpt_dir (--ckpt-dir DIR): it rolls back to the newest "
                             "checkpoint")
        SpikeDetector(factor=self.spike_factor)
        vf = self.val_fraction  # checked even without val_every: a value that could never work is a typo now
        if isinstance(vf, bool) or not isinstance(vf, (int, float)) or not 0 < vf < 1:
            raise ValueError(f"val_fraction must be a number in (0, 1) (the share of the corpus's windows held out "
                             f"for validation, e.g. 0.1), got {vf!r}")
        if self.val_every is None:
            return
        positive_int("val_every", self.val_every)
        if self.pp > 1:
            raise ValueError("val_every with pp > 1 is not supported yet: validation runs a plain forward, and a "
                             "pipeline's forward needs its schedule; leave --val-every out")
        total = (corpus_tokens(self.data) - 1) // self.gpt_config().seq_len
        split = split_windows(total, self.val_fraction)
        if split.train < self.batch_size:
            raise ValueError(f"holding out val_fraction={self.val_fraction} leaves {split.train} training windows, "
                             f"fewer than batch_size={self.batch_size}; use a smaller val_fraction or batch")

    def _validate_checkpointing(self) -> None:
        """Checkpoint flags, the directory, and (``resume``) the checkpoint to resume from, before any rank starts."""
        if self.ckpt_dir is None:
            for name in ("ckpt_every", "keep", "async_ckpt"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(f"{name}={getattr(self, name)!r} needs ckpt_dir (--ckpt-dir DIR): "
                                     "the directory checkpoints are written to")
            if self.resume:
                raise ValueError("resume needs ckpt_dir (--ckpt-dir DIR): the directory to resume from")
            return
        if self.ckpt_every is not None:
            positive_int("ckpt_every", self.ckpt_every)
        if self.keep is not None and (isinstance(self.keep, bool) or not isinstance(self.keep, int)
                                      or self.keep < 1):
            raise ValueError(f"keep must be an int >= 1 (how many checkpoints to keep), got {self.keep!r}")
        if self.resume:
            find_resume_point(self)
        ensure_writable(self.ckpt_dir)

    def _validate_precision(self) -> None:
        """Precision and reduce dtype named before any rank starts (``workbench.precision``)."""
        from workbench.precision import policy_from_names

        policy_from_names(self.precision, self.reduce_dtype)
        scale = self.init_loss_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 1 <= scale < math.inf:
            raise ValueError(f"init_loss_scale must be a finite number >= 1 (fp16 starts its dynamic loss scale "
                             f"there; 2**16 is the usual start), got {scale!r}")
        positive_int("loss_scale_growth_interval", self.loss_scale_growth_interval)

    def _validate_pipeline(self) -> None:
        """Schedule, micro-batches and stages checked here, before any rank starts."""
        from workbench.theory.pipeline import validate

        positive_int("microbatches", self.microbatches)
        positive_int("virtual_stages", self.virtual_stages)
        if self.pp == 1:
            if self.schedule != "1f1b" or self.microbatches != 1 or self.virtual_stages != 1:
                raise ValueError("schedule, microbatches and virtual_stages are pipeline settings: they need pp > 1")
            return
        validate(self.schedule, self.pp, self.microbatches, self.virtual_stages, self.gpt_config().n_layer)
        if self.batch_size % (self.dp * self.microbatches):
            raise ValueError(f"batch_size={self.batch_size} must divide into dp x microbatches = {self.dp} x "
                             f"{self.microbatches}; use a multiple of {self.dp * self.microbatches}")

    def _validate_data(self) -> None:
        """The corpus must hold at least one global batch of windows, checked here rather than in a rank."""
        if self.data is not None and not Path(self.data).is_file():
            raise ValueError(f"data file not found: {self.data!r}; pass an existing text file or leave --data out "
                             f"to use the bundled corpus")
        n_tokens = corpus_tokens(self.data)
        seq_len = self.gpt_config().seq_len
        if n_tokens < 2:  # one window needs its inputs and the next token as a target
            raise ValueError(f"data file {self.data!r} holds {n_tokens} token(s) (bytes): too few to train on; a "
                             f"global batch of {self.batch_size} window(s) of seq_len={seq_len} needs at least "
                             f"{self.batch_size * seq_len + 1}")
        windows = (n_tokens - 1) // seq_len
        if windows < self.batch_size:
            longest = (n_tokens - 1) // self.batch_size
            raise ValueError(f"seq_len={seq_len} leaves {windows} window(s) of the {n_tokens}-token corpus, fewer "
                             f"than batch_size={self.batch_size}; use seq_len <= {longest} or a smaller batch size")

    def combination(self) -> Combination:
        """The settings the composition rules look at (``theory.composition``)."""
        return Combination(tp=self.tp, pp=self.pp, sp=self.sp, zero=self.zero, grad_accum=self.grad_accum,
                           zero3_replicate=tuple(self.zero3_replicate), reduce_dtype=self.reduce_dtype,
                           offload=self.offload)

    def gpt_config(self) -> GPTConfig:
        overrides = {"seq_len": self.seq_len} if self.seq_len else {}
        return GPTConfig.preset(self.model, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: RunConfig fields a resume must share with the checkpoint: they fix the tensors' shapes, which shard each rank
#: holds (same-layout resume only) or the data order. Others (steps, lr, warmup, clip, timeout...) may change.
RESUME_MUST_MATCH = ("model", "seq_len", "batch_size", "seed", "data", "val_every", "val_fraction")
#: RunConfig fields a resume may change: the layout. The checkpoint is then resharded (``workbench.reshard``):
#: gathered into full tensors on the saved layout once (``full-state.pt`` beside its shards), then sharded the new
#: way by every rank of the new one.
LAYOUT_FIELDS = ("nproc", "dp", "tp", "pp", "sp", "zero", "zero3_replicate", "offload", "schedule", "microbatches",
                 "virtual_stages", "grad_accum")
FULL_STATE = "full-state.pt"


def checkpoint_config(cfg: RunConfig) -> dict[str, Any]:
    """The run config as it goes into a checkpoint's manifest (JSON: ``extra`` may hold anything, so it is left out)."""
    return {k: v for k, v in cfg.to_dict().items() if k != "extra"}


def find_resume_point(cfg: RunConfig, finished_ok: bool = False) -> Path:
    """The newest good checkpoint in ``cfg.ckpt_dir``, checked against ``cfg``; ``ValueError`` saying why not.

    Newer checkpoints that fail verification are skipped with a warning (``checkpoint.latest_good``).
    ``finished_ok``: a checkpoint of the last step is fine (a restart after the final save has nothing left to do);
    a ``--resume`` asking for no more steps than were done is an error."""
    try:
        path = latest_good(cfg.ckpt_dir)
    except CheckpointError as e:
        raise ValueError(f"cannot resume: {e}") from e
    manifest = read_manifest(path)
    check_resumable(cfg, manifest.get("meta", {}).get("run_config"), path)
    step = manifest["step"]
    if step + 1 >= cfg.steps and not finished_ok:
        raise ValueError(f"cannot resume from {path}: it holds the state after step {step} ({step + 1} steps done) "
                         f"and steps={cfg.steps} leaves nothing to train; pass --steps > {step + 1}")
    return path


def check_resumable(cfg: RunConfig, saved: dict[str, Any] | None, path: str | Path) -> None:
    """``ValueError`` naming every field of ``RESUME_MUST_MATCH`` in which the checkpoint's config differs."""
    if not isinstance(saved, dict):
        raise ValueError(f"cannot resume from {path}: its manifest holds no run_config (not saved by the trainer)")
    mine = checkpoint_config(cfg)
    differ = [f"{k}={saved.get(k)!r} (this run: {mine[k]!r})" for k in RESUME_MUST_MATCH
              if _effective(saved, k) != _effective(mine, k)]
    if differ:
        raise ValueError(f"cannot resume from {path}: it was saved with {', '.join(differ)}; a resume must keep the "
                         f"model and the data order (fields {', '.join(RESUME_MUST_MATCH)}; the layout may change: "
                         f"{', '.join(LAYOUT_FIELDS)}); rerun with the saved values or start a fresh --ckpt-dir")


def layout_changes(cfg: RunConfig, saved: dict[str, Any]) -> list[str]:
    """The layout fields in which ``cfg`` differs from a checkpoint's run config (empty: same layout)."""
    mine = checkpoint_config(cfg)
    return [f"{k}: {_effective(saved, k)!r} -> {mine[k]!r}" for k in LAYOUT_FIELDS
            if _effective(saved, k) != _effective(mine, k)]


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
        from workbench.launch import launch

        keep = {k: v for k, v in saved.items() if k in RunConfig.__dataclass_fields__}
        source = RunConfig(**{**keep, "device": "cpu", "backend": None, "port": 0, "ckpt_dir": None,
                              "ckpt_every": None, "keep": None, "resume": False, "async_ckpt": False, "export": None,
                              "max_restarts": 0, "inject_fault": None, "extra": {}})
        launch(_consolidate_rank, source.nproc, source, str(path), device="cpu", timeout=source.timeout)
    return f"resharding {path.name} ({'; '.join(changes)})"


def _consolidate_rank(cfg: RunConfig, path: str) -> None:
    """One rank of the saved layout: load its shard, gather the full state; rank 0 writes it."""
    from workbench.reshard import full_training_state

    trainer = Trainer(cfg)
    state = load(path, map_location=trainer.device)
    trainer.strategy.model.load_state_dict(state["model"])
    trainer.strategy.optimizer.load_state_dict(state["optim"])
    full = full_training_state(trainer.strategy)
    if comm.group_rank() == 0:
        extra = {k: state[k] for k in ("step", "sampler", "rng", "scaler") if k in state}
        write_atomic(Path(path) / FULL_STATE, {**full, **extra})


def _effective(config: dict[str, Any], key: str) -> Any:
    """``seq_len=None`` means the preset's: compare what the model gets, not how it was spelt. A field the config
    lacks (a checkpoint saved before the field existed) has the field's default."""
    if key == "seq_len" and config.get(key) is None and config.get("model") in PRESETS:
        return GPTConfig.preset(config["model"]).seq_len
    if key not in config:
        f = next(f for f in fields(RunConfig) if f.name == key)
        return f.default_factory() if f.default_factory is not MISSING else f.default
    return config[key]


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup - 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def params_sha256(named_params: dict[str, torch.Tensor]) -> str:
    """SHA-256 over (name, fp32 little-endian bytes) of every parameter, names sorted."""
    digest = hashlib.sha256()
    for name in sorted(named_params):
        digest.update(name.encode())
        digest.update(named_params[name].detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def _read_scalars(*values: torch.Tensor | float) -> list[float]:
    """The step's scalar metrics as floats, read in ONE device-to-host copy, after the optimizer's kernels are
    queued: the step's only host-device sync (the loss and grad norm stay on the device until here; reading the
    norm before ``optimizer.step()`` made the host wait for the backward, and the GPU then wait for the host)."""
    tensors = [v for v in values if torch.is_tensor(v)]
    if not tensors:
        return [float(v) for v in values]
    read = iter(torch.stack([t.detach().reshape(()).double() for t in tensors]).tolist())
    return [next(read) if torch.is_tensor(v) else float(v) for v in values]


_NOTHING_SAVED = -2  # rank 0's answer to a restart that finds no checkpoint: start from step 0


class Trainer:
    """Steps a parallelized model on the sharded global batch; records spans, metrics and memory."""

    def __init__(self, cfg: RunConfig, mesh: Mesh | None = None) -> None:
        self.cfg = cfg
        self.mesh = mesh or Mesh(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp)
        self.device = self.mesh.device
        model_cfg = cfg.gpt_config()
        self.dataset = make_lm_data(model_cfg.seq_len, cfg.data)  # host memory; each batch moves to the device
        self.split = split_windows(len(self.dataset), cfg.val_fraction) if cfg.val_every else None
        if self.split is not None:
            check_split(self.split, model_cfg.seq_len)
        train_windows = len(self.dataset) if self.split is None else self.split.train
        self.data_skip = 0  # batches skipped by spike rollbacks: step s trains on batch s + data_skip
        self.checkpointer: AsyncCheckpointer | None = None  # --async-ckpt's writer, made at the first save
        self.checkpoint_stalls: list[dict[str, float]] = []  # how long each save held the training loop
        self.sampler = ShardedSampler(train_windows, cfg.batch_size, self.mesh.dp_rank, self.mesh.dp_size,
                                      seed=cfg.seed)
        model = build_gpt(model_cfg, seed=cfg.seed, device=self.device)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.parallel_config = ParallelConfig(
            ddp=cfg.ddp, bucket_mb=cfg.bucket_mb, zero=cfg.zero, zero3_replicate=tuple(cfg.zero3_replicate),
            offload=cfg.offload, lr=cfg.lr,
            weight_decay=cfg.weight_decay, sp=cfg.sp, grad_accum=cfg.grad_accum, schedule=cfg.schedule,
            microbatches=cfg.microbatches, virtual_stages=cfg.virtual_stages, recompute=cfg.recompute,
            precision=cfg.precision, reduce_dtype=cfg.reduce_dtype, init_loss_scale=cfg.init_loss_scale,
            loss_scale_growth_interval=cfg.loss_scale_growth_interval)
        self.strategy = parallelize(model, self.mesh, self.parallel_config)
        self.step_index = 0
        self._memory_probed = False  # see step(): memory is probed on the first step and on traced steps
        self.tokens_per_step = cfg.batch_size * model_cfg.seq_len

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
        lr = lr_at(self.step_index, cfg)
        for group in s.optimizer.param_groups:
            group["lr"] = lr
        with trace.span("data", "data"):  # the input pipeline's share of the step (a starved GPU waits here)
            x, y = self.dataset.get(self.sampler.indices(self.step_index + self.data_skip), device=self.device)
        data_wait = time.time() - t0
        # The last step's gradients are dropped here, at the top of the step as a plain loop does, not at its end:
        # freed at the end, the host allocator gave their pages back and backward faulted them in afresh (12 % of
        # a CPU step of the bench GPT, measured beside the plain loop: bench_trainer_step).
        s.optimizer.zero_grad(set_to_none=True)
        local_loss = s.forward_backward(x, y)  # the strategy owns its micro-batches (accumulation or a pipeline)
        with trace.span("grad sync wait", "wait"):
            s.finish_grad_sync()
        with trace.span("optimizer", "optimizer"):  # fp16: unscale, agree on inf/NaN, then step or skip
            stepped = s.optimizer_step(cfg.clip if cfg.clip is not None else math.inf)
        if tracer is not None and tracer.probe_memory:  # untraced (no tracer): nothing would record them
            s.record_memory()  # gradients and optimizer state are both alive here
            trace.record_device_memory(self.device, batch_bytes=x.nbytes + y.nbytes)
        loss = local_loss.clone()
        comm.all_reduce(loss, op="avg", group=self.mesh.dp_group, tag="metrics")
        loss_value, grad_norm = _read_scalars(loss, stepped["grad_norm"])
        elapsed = time.time() - t0
        metrics = {"step": self.step_index, "loss": loss_value, "grad_norm": grad_norm, "lr": lr,
                   "step_time_s": elapsed, "data_wait_s": data_wait, "tokens_per_s": self.tokens_per_step / elapsed,
                   "loss_scale": stepped["loss_scale"], "skipped": stepped["skipped"]}
        if tracer is not None:
            tracer.record_metrics(metrics)
        self.step_index += 1
        return metrics

    # -- checkpoints ----------------------------------------------------------------------------------------

    def checkpoint_due(self) -> bool:
        """After every ``ckpt_every``-th step and after the last (so a finished run can be extended)."""
        cfg = self.cfg
        every = cfg.ckpt_every or cfg.steps
        return cfg.ckpt_dir is not None and (self.step_index % every == 0 or self.step_index == cfg.steps)

    def save_checkpoint(self) -> int:
        """Every rank saves the state its strategy holds after the step just taken; returns that step's index."""
        s, step = self.strategy, self.step_index - 1
        state = {"model": s.model.state_dict(), "optim": s.optimizer.state_dict(), "step": step,
                 "rng": rng_state(), "sampler": {**self.sampler.state_dict(), "step": self.step_index,
                                                 "data_skip": self.data_skip}}
        if s.scaler is not None:
            state["scaler"] = s.scaler.state_dict()
        meta = {"run_config": checkpoint_config(self.cfg), "strategy": s.describe}
        t0 = time.perf_counter()
        with trace.span(f"checkpoint step {step}", "other"):
            if self.cfg.async_ckpt:  # snapshot to CPU here, write in a background thread (checkpoint.AsyncCheckpointer)
                if self.checkpointer is None:
                    self.checkpointer = AsyncCheckpointer(self.cfg.ckpt_dir, keep=self.cfg.keep)
                self.checkpointer.save(step, state, meta=meta)
            else:
                save(self.cfg.ckpt_dir, step, state, meta=meta, keep=self.cfg.keep)
        self.checkpoint_stalls.append({"step": step, "stall_s": time.perf_counter() - t0})
        return step

    def finish_checkpoints(self) -> None:
        """Wait for an async save in flight (its errors surface here) and stop its writer thread."""
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None

    def resume(self, after_restart: bool = False) -> tuple[int | None, list[str]]:
        """Load the newest good checkpoint; the next ``step()`` is the one after it. Returns (its step, warnings).

        ``after_restart``: this attempt follows a failure (``faults.restart_count() > 0``); with no checkpoint
        written yet it starts from step 0 (returns ``(None, [])``), as the seeded run it replaces did.

        Rank 0 alone picks the checkpoint and broadcasts its step: ``latest_good`` hashes every shard, and ranks
        picking on their own could disagree (a file changing between their reads) and load different steps.
        Rank 0 also removes newer, unusable checkpoints (``discard_newer``) before any rank saves again."""
        cfg = self.cfg
        step, problem, skipped = -1, "", []
        if comm.group_rank() == 0:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    if after_restart and not list_steps(cfg.ckpt_dir):
                        step = _NOTHING_SAVED
                    else:
                        step = read_manifest(find_resume_point(cfg, finished_ok=after_restart))["step"]
                        discard_newer(cfg.ckpt_dir, step)
                except ValueError as e:
                    problem = str(e)
            skipped = [str(w.message) for w in caught]
        step = self._broadcast_step(step)
        if step == _NOTHING_SAVED:
            return None, skipped
        if step < 0:
            raise ValueError(problem or "rank 0 found no checkpoint to resume from (its error says why)")
        folder = step_dir(cfg.ckpt_dir, step)
        if layout_changes(cfg, read_manifest(folder)["meta"]["run_config"]):
            self._load_resharded(folder)
            return step, skipped
        state = load(folder, map_location=self.device)
        if state["step"] != step:
            raise CheckpointError(f"{step_dir(cfg.ckpt_dir, step)} holds step {state['step']}, not {step}")
        self.strategy.model.load_state_dict(state["model"])
        self.strategy.optimizer.load_state_dict(state["optim"])
        self._restore_progress(state)
        return step, skipped

    def _restore_progress(self, state: dict[str, Any]) -> None:
        """What a checkpoint holds besides the model and optimizer: the sampler's position and the batches rollbacks
        skipped, fp16's loss scaler, the RNG states; the next ``step()`` is the one after the checkpoint's."""
        self.sampler.load_state_dict(state["sampler"])  # refuses another seed or global batch
        self.data_skip = int(state["sampler"].get("data_skip", 0))
        if self.strategy.scaler is not None and state.get("scaler"):  # absent: saved in fp32/bf16, start afresh
            self.strategy.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"])
        self.step_index = int(state["step"]) + 1

    def _load_resharded(self, folder: Path) -> None:
        """Another layout saved this checkpoint: load its full state (``prepare_resharded_resume`` wrote it) and
        shard it this layout's way. The RNG state is rank 0's on every rank: per-rank streams of another world
        size have no counterpart here (the tiny GPT's dropout is off, so training does not draw from them)."""
        from workbench.reshard import load_full_training_state

        file = folder / FULL_STATE
        if not file.is_file():
            raise CheckpointError(f"{folder} was saved on another layout and has no {FULL_STATE}; resume through "
                                  f"workbench run / run_training, which writes it before the ranks start")
        full = torch.load(file, map_location="cpu", weights_only=True)
        load_full_training_state(self.strategy, full, self._shard_like_params)
        self._restore_progress(full)

    def _shard_like_params(self, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """This layout's strategy built on a model whose parameters are ``values``: what its optimizer's tensors
        hold is each value's shard (``reshard.load_full_training_state``). Traced into a throwaway tracer."""
        from workbench.reshard import optimizer_slots

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

    def roll_back(self, bad_step: int) -> int:
        """Reload the newest checkpoint and skip the batches from there to ``bad_step`` (PaLM's remedy for a
        spike, Chowdhery et al. 2022 §5.1); returns the step rolled back to."""
        self.finish_checkpoints()  # the newest checkpoint may still be being written
        step, _ = self.resume()  # without after_restart it finds a checkpoint or raises
        self.data_skip += bad_step - step
        return step

    def _broadcast_step(self, step: int) -> int:
        if not comm.is_distributed():
            return step
        t = torch.tensor([step], dtype=torch.int64, device=self.device)
        comm.broadcast(t, src=0, tag="checkpoint")
        return int(t.item())


def train_rank(cfg: RunConfig) -> dict[str, Any]:
    """Run ``cfg.steps`` steps on this rank; rank 0's result carries the full-parameter hash."""
    torch.manual_seed(cfg.seed)
    trainer = Trainer(cfg)
    restarted = restart_count() > 0 and cfg.ckpt_dir is not None
    resumed, skipped = trainer.resume(after_restart=restarted) if cfg.resume or restarted else (None, [])
    fault = parse_fault(cfg.inject_fault) if cfg.inject_fault else None
    stop = StopSignal(cfg.extra.get("stop_file"), trainer.device)
    detector, events, rollbacks = SpikeDetector(factor=cfg.spike_factor), [], 0
    history, written, stopped_after = [], [], None
    while trainer.step_index < cfg.steps:
        if maybe_inject(fault, comm.group_rank(), trainer.step_index):
            trainer.poison_parameters()
            fault = None  # once: the rolled-back run replays this step index with other batches
        metrics = trainer.step()
        if cfg.val_every and (trainer.step_index % cfg.val_every == 0 or trainer.step_index == cfg.steps):
            trainer.check_data_shards()
            metrics["val_loss"] = trainer.validation_loss()
        history.append(metrics)
        report(_streamed(metrics))
        problem = detector.check(metrics["loss"], metrics["grad_norm"])
        if problem is not None:
            action = _spike_action(cfg, written, rollbacks)
            events.append({"step": metrics["step"], "problem": problem, "action": action})
            if comm.group_rank() == 0:  # every rank reaches the same verdict: say it once
                warnings.warn(f"step {metrics['step']}: {problem}; action: {action}", stacklevel=1)
            if action == "stop":
                stopped_after = metrics["step"]
                break
            if action == "rollback":
                back_to = trainer.roll_back(metrics["step"])
                events[-1]["rolled_back_to_step"] = back_to
                detector.reset()
                rollbacks += 1
                history = [m for m in history if m["step"] <= back_to]
                continue
        if trainer.checkpoint_due():
            written.append(trainer.save_checkpoint())
        if stop.requested():
            stopped_after = metrics["step"]
            if cfg.ckpt_dir is not None and written[-1:] != [stopped_after]:
                written.append(trainer.save_checkpoint())  # what was trained is kept: a later --resume goes on
            break
    trainer.finish_checkpoints()
    checkpoint = None if cfg.ckpt_dir is None else {
        "dir": cfg.ckpt_dir, "every": cfg.ckpt_every, "keep": cfg.keep, "written_steps": written,
        "resumed_from_step": resumed, "skipped_on_resume": skipped, "async": cfg.async_ckpt,
        "stalls": trainer.checkpoint_stalls}
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
            "health": {"events": events, "data_skip": trainer.data_skip,
                       "val_split": None if trainer.split is None else {
                           "train_windows": trainer.split.train, "val_windows": len(trainer.split.val_windows)}}}


MAX_ROLLBACKS = 3  # a spike that comes back after this many rollbacks stops the run: it is not transient


def _spike_action(cfg: RunConfig, written: list[int], rollbacks: int) -> str:
    """What to do about an unhealthy step: the configured action, unless a rollback has nothing to go back to
    (no checkpoint saved in this attempt or before) or has been tried ``MAX_ROLLBACKS`` times: then stop."""
    if cfg.on_spike != "rollback":
        return cfg.on_spike
    has_checkpoint = bool(written) or bool(list_steps(cfg.ckpt_dir))
    return "rollback" if has_checkpoint and rollbacks < MAX_ROLLBACKS else "stop"


class StopSignal:
    """A Stop button's request, seen by every rank at the same step: rank 0 looks for ``stop_file`` after each
    step and a MAX all-reduce of one flag tells the others, so all ranks leave the loop together (a rank leaving
    alone would leave its peers waiting in the next collective). Without a file (no live dashboard): no-op."""

    def __init__(self, stop_file: str | None, device: torch.device) -> None:
        self.stop_file, self.device = stop_file, device

    def requested(self) -> bool:
        if self.stop_file is None:
            return False
        flag = torch.tensor([1.0 if comm.group_rank() == 0 and Path(self.stop_file).exists() else 0.0],
                            device=self.device)
        if comm.is_distributed():
            comm.all_reduce(flag, op="max", tag="control")
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
