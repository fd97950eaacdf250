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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench import comm, trace
from workbench.checkpoint import (
    CheckpointError,
    discard_newer,
    ensure_writable,
    latest_good,
    load,
    read_manifest,
    rng_state,
    save,
    set_rng_state,
    step_dir,
)
from workbench.data import ShardedSampler, corpus_tokens, make_lm_data
from workbench.launch import report
from workbench.mesh import Mesh
from workbench.models import PRESETS, GPTConfig, build_gpt
from workbench.parallel import DDP_KINDS, ZERO_STAGES, ParallelConfig, parallelize
from workbench.recompute import check_mode as check_recompute_mode


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
    bucket_mb: float = 25.0
    zero: int = 0
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
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        model_parallel = self.tp * self.pp if all(isinstance(v, int) and v > 0 for v in (self.tp, self.pp)) else 1
        if self.dp is None:
            self.dp = max(1, self.nproc // model_parallel)
        if self.microbatches is None:
            self.microbatches = 2 * self.pp if isinstance(self.pp, int) and self.pp > 1 else 1
        self.validate()

    def validate(self) -> None:
        _positive_int("nproc", self.nproc)
        _positive_int("dp", self.dp)
        _positive_int("steps", self.steps)
        _positive_int("batch_size", self.batch_size)
        _positive_int("grad_accum", self.grad_accum)
        if self.model not in PRESETS:
            raise ValueError(f"unknown model {self.model!r}; valid: {sorted(PRESETS)}")
        _positive_int("tp", self.tp)
        _positive_int("pp", self.pp)
        if self.dp * self.tp * self.pp != self.nproc:
            raise ValueError(f"dp x tp x pp = {self.dp} x {self.tp} x {self.pp} = {self.dp * self.tp * self.pp} but "
                             f"nproc={self.nproc}: the mesh must use every rank; leave --dp out to get "
                             f"nproc / (tp x pp)")
        if self.sp and self.tp == 1:
            raise ValueError("sp (sequence parallelism) needs tp > 1: it shards what tensor parallelism leaves "
                             "replicated along the sequence")
        if self.sp:
            from workbench.parallel.sequence import check_sequence_parallel_sizes

            check_sequence_parallel_sizes(self.gpt_config(), self.tp)
        self._validate_pipeline()
        check_recompute_mode(self.recompute)
        if self.tp > 1:
            from workbench.parallel import TP_ZERO_STAGES
            from workbench.parallel.tensor import check_tensor_parallel_sizes

            check_tensor_parallel_sizes(self.gpt_config(), self.tp)
            if self.zero not in TP_ZERO_STAGES:
                raise ValueError(f"zero={self.zero} with tp={self.tp} is not composed; valid with tp > 1: zero in "
                                 f"{TP_ZERO_STAGES}")
        per_rank, rem = divmod(self.batch_size, self.dp * self.grad_accum)
        if rem or per_rank == 0:
            raise ValueError(f"batch_size={self.batch_size} must be a positive multiple of dp x grad_accum = "
                             f"{self.dp} x {self.grad_accum} = {self.dp * self.grad_accum}")
        if self.ddp not in DDP_KINDS:
            raise ValueError(f"ddp={self.ddp!r}; valid: {', '.join(DDP_KINDS)}")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero={self.zero!r}; valid: {ZERO_STAGES}")
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.offload and self.zero == 0:
            raise ValueError("offload needs a ZeRO stage (--zero 1, 2 or 3): stage 0 keeps everything replicated")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be > 0 (or None to disable), got {self.clip}")
        _positive_finite("lr", self.lr)
        _positive_finite("timeout", self.timeout)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0 (steps of linear warm-up), got {self.warmup!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.seq_len is not None:
            _positive_int("seq_len", self.seq_len)
        self._validate_data()
        self._validate_checkpointing()

    def _validate_checkpointing(self) -> None:
        """Checkpoint flags, the directory, and (``resume``) the checkpoint to resume from, before any rank starts."""
        if self.ckpt_dir is None:
            for name in ("ckpt_every", "keep"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}={getattr(self, name)!r} needs ckpt_dir (--ckpt-dir DIR): "
                                     "the directory checkpoints are written to")
            if self.resume:
                raise ValueError("resume needs ckpt_dir (--ckpt-dir DIR): the directory to resume from")
            return
        if self.ckpt_every is not None:
            _positive_int("ckpt_every", self.ckpt_every)
        if self.keep is not None and (isinstance(self.keep, bool) or not isinstance(self.keep, int)
                                      or self.keep < 1):
            raise ValueError(f"keep must be an int >= 1 (how many checkpoints to keep), got {self.keep!r}")
        if self.resume:
            find_resume_point(self)
        ensure_writable(self.ckpt_dir)

    def _validate_pipeline(self) -> None:
        """Schedule, micro-batches and stages checked here, before any rank starts."""
        from workbench.parallel import PP_COMPOSES_WITH
        from workbench.theory.pipeline import validate

        _positive_int("microbatches", self.microbatches)
        _positive_int("virtual_stages", self.virtual_stages)
        if self.pp == 1:
            if self.schedule != "1f1b" or self.microbatches != 1 or self.virtual_stages != 1:
                raise ValueError("schedule, microbatches and virtual_stages are pipeline settings: they need pp > 1")
            return
        validate(self.schedule, self.pp, self.microbatches, self.virtual_stages, self.gpt_config().n_layer)
        if self.zero > 1 or self.grad_accum != 1:
            raise ValueError(f"pipeline parallelism composes with {PP_COMPOSES_WITH}; got "
                             f"zero={self.zero}, grad_accum={self.grad_accum}")
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
        windows = (n_tokens - 1) // seq_len
        if windows < self.batch_size:
            longest = (n_tokens - 1) // self.batch_size
            raise ValueError(f"seq_len={seq_len} leaves {windows} window(s) of the {n_tokens}-token corpus, fewer "
                             f"than batch_size={self.batch_size}; use seq_len <= {longest} or a smaller batch size")

    def gpt_config(self) -> GPTConfig:
        overrides = {"seq_len": self.seq_len} if self.seq_len else {}
        return GPTConfig.preset(self.model, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: RunConfig fields a resume must share with the checkpoint: they fix the tensors' shapes, which shard each rank
#: holds (same-layout resume only) or the data order. Others (steps, lr, warmup, clip, timeout...) may change.
RESUME_MUST_MATCH = ("model", "seq_len", "nproc", "dp", "tp", "pp", "sp", "zero", "offload", "schedule",
                     "microbatches", "virtual_stages", "batch_size", "grad_accum", "seed", "data")


def checkpoint_config(cfg: RunConfig) -> dict[str, Any]:
    """The run config as it goes into a checkpoint's manifest (JSON: ``extra`` may hold anything, so it is left out)."""
    return {k: v for k, v in cfg.to_dict().items() if k != "extra"}


def find_resume_point(cfg: RunConfig) -> Path:
    """The newest good checkpoint in ``cfg.ckpt_dir``, checked against ``cfg``; ``ValueError`` saying why not.

    Newer checkpoints that fail verification are skipped with a warning (``checkpoint.latest_good``)."""
    try:
        path = latest_good(cfg.ckpt_dir)
    except CheckpointError as e:
        raise ValueError(f"cannot resume: {e}") from e
    manifest = read_manifest(path)
    check_resumable(cfg, manifest.get("meta", {}).get("run_config"), path)
    step = manifest["step"]
    if step + 1 >= cfg.steps:
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
                         f"layout and the data order (fields {', '.join(RESUME_MUST_MATCH)}); rerun with the saved "
                         f"values or start a fresh --ckpt-dir")


def _effective(config: dict[str, Any], key: str) -> Any:
    """``seq_len=None`` means the preset's: compare what the model gets, not how it was spelt."""
    if key == "seq_len" and config.get(key) is None and config.get("model") in PRESETS:
        return GPTConfig.preset(config["model"]).seq_len
    return config.get(key)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _positive_finite(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


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


class Trainer:
    """Steps a parallelized model on the sharded global batch; records spans, metrics and memory."""

    def __init__(self, cfg: RunConfig, mesh: Mesh | None = None) -> None:
        self.cfg = cfg
        self.mesh = mesh or Mesh(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp)
        self.device = self.mesh.device
        model_cfg = cfg.gpt_config()
        self.dataset = make_lm_data(model_cfg.seq_len, cfg.data)  # host memory; each batch moves to the device
        self.sampler = ShardedSampler(len(self.dataset), cfg.batch_size, self.mesh.dp_rank, self.mesh.dp_size,
                                      seed=cfg.seed)
        model = build_gpt(model_cfg, seed=cfg.seed, device=self.device)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.strategy = parallelize(model, self.mesh, ParallelConfig(
            ddp=cfg.ddp, bucket_mb=cfg.bucket_mb, zero=cfg.zero, offload=cfg.offload, lr=cfg.lr,
            weight_decay=cfg.weight_decay, sp=cfg.sp, grad_accum=cfg.grad_accum, schedule=cfg.schedule,
            microbatches=cfg.microbatches, virtual_stages=cfg.virtual_stages, recompute=cfg.recompute))
        self.step_index = 0
        self.tokens_per_step = cfg.batch_size * model_cfg.seq_len

    def step(self) -> dict[str, Any]:
        cfg, s = self.cfg, self.strategy
        tracer = trace.current()
        trace.set_step(self.step_index)
        if tracer is not None:
            tracer.enabled = self.step_index >= cfg.steps - cfg.trace_steps
        t0 = time.time()
        lr = lr_at(self.step_index, cfg)
        for group in s.optimizer.param_groups:
            group["lr"] = lr
        with trace.span("data", "data"):
            x, y = self.dataset.get(self.sampler.indices(self.step_index), device=self.device)
        local_loss = s.forward_backward(x, y)  # the strategy owns its micro-batches (accumulation or a pipeline)
        with trace.span("grad sync wait", "wait"):
            s.finish_grad_sync()
        with trace.span("optimizer", "optimizer"):
            grad_norm = s.clip_grad_norm(cfg.clip if cfg.clip is not None else math.inf)
            s.optimizer.step()
        s.record_memory()  # before zero_grad: gradients and optimizer state are both alive here
        trace.record_device_memory(self.device)
        s.optimizer.zero_grad(set_to_none=True)
        loss = local_loss.clone()
        comm.all_reduce(loss, op="avg", group=self.mesh.dp_group, tag="metrics")
        elapsed = time.time() - t0
        metrics = {"step": self.step_index, "loss": loss.item(), "grad_norm": float(grad_norm), "lr": lr,
                   "step_time_s": elapsed, "tokens_per_s": self.tokens_per_step / elapsed}
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
                 "rng": rng_state(), "sampler": {**self.sampler.state_dict(), "step": self.step_index}}
        save(self.cfg.ckpt_dir, step, state, meta={"run_config": checkpoint_config(self.cfg), "strategy": s.describe},
             keep=self.cfg.keep)
        return step

    def resume(self) -> tuple[int, list[str]]:
        """Load the newest good checkpoint; the next ``step()`` is the one after it. Returns (its step, warnings).

        Rank 0 alone picks the checkpoint and broadcasts its step: ``latest_good`` hashes every shard, and ranks
        picking on their own could disagree (a file changing between their reads) and load different steps.
        Rank 0 also removes newer, unusable checkpoints (``discard_newer``) before any rank saves again."""
        cfg = self.cfg
        step, problem, skipped = -1, "", []
        if comm.group_rank() == 0:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    step = read_manifest(find_resume_point(cfg))["step"]
                    discard_newer(cfg.ckpt_dir, step)
                except ValueError as e:
                    problem = str(e)
            skipped = [str(w.message) for w in caught]
        step = self._broadcast_step(step)
        if step < 0:
            raise ValueError(problem or "rank 0 found no checkpoint to resume from (its error says why)")
        state = load(step_dir(cfg.ckpt_dir, step), map_location=self.device)
        if state["step"] != step:
            raise CheckpointError(f"{step_dir(cfg.ckpt_dir, step)} holds step {state['step']}, not {step}")
        self.strategy.model.load_state_dict(state["model"])
        self.strategy.optimizer.load_state_dict(state["optim"])
        self.sampler.load_state_dict(state["sampler"])  # refuses another seed or global batch
        set_rng_state(state["rng"])
        self.step_index = step + 1
        return step, skipped

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
    resumed, skipped = trainer.resume() if cfg.resume else (None, [])
    history, written = [], []
    for _ in range(trainer.step_index, cfg.steps):
        metrics = trainer.step()
        history.append(metrics)
        report(metrics)
        if trainer.checkpoint_due():
            written.append(trainer.save_checkpoint())
    checkpoint = None if cfg.ckpt_dir is None else {
        "dir": cfg.ckpt_dir, "every": cfg.ckpt_every, "keep": cfg.keep, "written_steps": written,
        "resumed_from_step": resumed, "skipped_on_resume": skipped}
    full = trainer.strategy.full_parameters()
    backend = torch.distributed.get_backend() if comm.is_distributed() else "none"
    return {"history": history, "n_params": trainer.n_params, "strategy": trainer.strategy.describe,
            "final_params_sha256": params_sha256(full) if comm.group_rank() == 0 else None,
            "placement": {"backend": backend, "device": str(trainer.device),
                          "device_name": _device_name(trainer.device)},
            "final_params": {k: v.detach().cpu().clone() for k, v in full.items()} if cfg.extra.get("return_params")
            else None,
            "checkpoint": checkpoint}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
