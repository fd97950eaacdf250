"""``RunConfig``: everything that defines a run, validated before any rank is spawned.

Flat for its users (``RunConfig(nproc=2, zero=3)``, the CLI's flags, summary.json, checkpoint manifests); the
trainer (``workbench.training.trainer``) runs one rank of it and ``workbench.run`` runs it start to end.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from workbench.checkpoint.resume import find_resume_point
from workbench.checkpoint.store import (
    ensure_writable,
)
from workbench.data import corpus_tokens
from workbench.dist.emulation import LinkEmulation, Straggler, check_time_scale, resolve_time_scale
from workbench.dist.faults import parse_faults
from workbench.models import PRESETS, GPTConfig
from workbench.parallel import DDP_KINDS, ZERO_STAGES, ParallelConfig
from workbench.parallel.recompute import check_mode as check_recompute_mode
from workbench.theory.checks import positive_int, positive_number
from workbench.theory.composition import Combination, check_composition
from workbench.theory.compression import check_rank, check_ratio, check_scheme
from workbench.theory.context import check_cp
from workbench.theory.elastic import check_elastic_batch
from workbench.training.health import SPIKE_ACTIONS, SpikeDetector, split_windows

S = TypeVar("S")

#: The fastest link ``netns`` will shape (bytes/s): the loopback under it moves a few GB/s at most on a small machine.
NETNS_MAX_RATE = 1e9


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
    cp: int = 1  # context parallelism: the sequence split over cp ranks, attention as a ring (parallel.context)
    cp_layout: str = "zigzag"  # cp's split: zigzag (chunks r and 2cp-1-r, balanced causal work) or contiguous
    moe_experts: int = 0  # a mixture of E experts in every block's MLP (models.moe); 0: the dense GPT
    moe_top_k: int = 2  # experts each token is routed to
    moe_capacity_factor: float | None = None  # capacity ceil(C x tokens x k / E) per expert; None: nothing dropped
    moe_aux_loss_coef: float = 0.01  # Switch's load-balancing loss coefficient
    ep: int = 1  # expert parallelism: the experts split over ep of the dp ranks (parallel.expert)
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
    grad_compression: str = "none"  # none, bf16, powersgd, topk, sign: the DDP wrappers' reducer (parallel.compression)
    powersgd_rank: int = 4  # grad_compression=powersgd: the rank r of each matrix's P Q^T
    topk_ratio: float = 0.01  # grad_compression=topk: the share of each gradient's entries sent
    compression_warmup: int = 0  # plain all-reduce for this many first steps (torch's start_powerSGD_iter)
    local_steps: int | None = None  # local SGD / DiLoCo: average parameters every H steps (None: DDP every step)
    outer_optimizer: str = "nesterov"  # local_steps: avg (model averaging), sgd or nesterov (DiLoCo's outer step)
    outer_lr: float = 0.7  # local_steps: the outer optimizer's learning rate (DiLoCo: 0.7)
    outer_momentum: float = 0.9  # local_steps with nesterov: the outer momentum (DiLoCo: 0.9)
    ps_servers: int | None = None  # a parameter server: the last S ranks serve, the rest are workers (None: none)
    ps_async: bool = False  # ps_servers: apply each worker's gradient on arrival instead of averaging each step
    max_staleness: int | None = None  # ps_async: a worker may run at most K steps ahead of the slowest (None: free)
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
    inject_fault: str | None = None  # KIND:rank=R:step=S, KIND in dist.faults.FAULT_KINDS, first attempt only
    min_nproc: int | None = None  # elastic: a rank lost for good -> go on with the survivors, down to M ranks
    val_every: int | None = None  # validation loss every K steps on a held-out split (and a duplicated-shard check)
    val_fraction: float = 0.1  # the corpus's last windows held out for validation when val_every is set
    on_spike: str = "warn"  # a NaN/Inf or loss spike: warn, rollback (to the newest checkpoint, skipping batches), stop
    spike_factor: float = 3.0  # a loss above this x the recent median is a spike
    sdc_check_every: int | None = None  # fingerprint the dp replicas every K steps and compare (silent corruption)
    nodes: int | None = None  # emulated nodes (node-major); None: no emulation unless a link is given (then 1 node)
    intra_link: str | None = None  # link inside a node: a preset (nvlink, pcie, ...) or GBPS,US; default nvlink
    inter_link: str | None = None  # link between nodes; default infiniband
    time_scale: float | str | None = None  # emulated seconds x this; a GPU name (h100-bf16) measures it; default 1
    distribution: str | None = None  # emulated nodes: block (node-major, the default) or cyclic (round-robin)
    netns: bool = False  # run each node's ranks in a network namespace, joined by real tbf-shaped links (root)
    straggler: str | None = None  # rank=R:factor=F: rank R computes F times slower (dist.emulation.Straggler)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = (self.tp, self.pp, self.cp)
        model_parallel = math.prod(sizes) if all(isinstance(v, int) and v > 0 for v in sizes) else 1
        if self.dp is None:  # a parameter server's ranks hold no batch: dp is its workers
            self.dp = max(1, (self.nproc - self._servers()) // model_parallel)
        if self.microbatches is None:
            self.microbatches = 2 * self.pp if isinstance(self.pp, int) and self.pp > 1 else 1
        self.validate()

    def _servers(self) -> int:
        """The parameter server's ranks, or 0 (before validation: a bad value counts 0 until it is refused)."""
        s = self.ps_servers
        return s if isinstance(s, int) and not isinstance(s, bool) and 0 < s < self.nproc else 0

    def validate(self) -> None:
        positive_int("nproc", self.nproc)
        if self.ps_servers is not None:
            from workbench.parallel.param_server import check_layout

            check_layout(self.nproc, self.ps_servers)
        positive_int("dp", self.dp)
        positive_int("steps", self.steps)
        positive_int("batch_size", self.batch_size)
        positive_int("grad_accum", self.grad_accum)
        if self.model not in PRESETS:
            raise ValueError(f"unknown model {self.model!r}; valid: {sorted(PRESETS)}")
        positive_int("tp", self.tp)
        positive_int("pp", self.pp)
        positive_int("cp", self.cp)
        if self.dp * self.tp * self.pp * self.cp != self.nproc - self._servers():
            cp = f" x cp={self.cp}" if self.cp > 1 else ""
            ps = f" - {self._servers()} parameter servers" if self._servers() else ""
            raise ValueError(f"dp x tp x pp{' x cp' if cp else ''} = {self.dp} x {self.tp} x {self.pp}{cp} = "
                             f"{self.dp * self.tp * self.pp * self.cp} but nproc={self.nproc}{ps}: the mesh must use "
                             f"every rank; leave --dp out to get nproc / (tp x pp{' x cp' if cp else ''})")
        self._validate_context_parallel()
        if self.sp and self.tp > 1:
            from workbench.parallel.tensor.sequence import check_sequence_parallel_sizes

            check_sequence_parallel_sizes(self.gpt_config(), self.tp)
        self._validate_pipeline()
        check_recompute_mode(self.recompute)
        self._validate_precision()
        check_composition(self.combination())  # what composes: one table (theory.composition)
        self._validate_moe()
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
        self._validate_gradient_sync()
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
        self._validate_links()
        if self.export is not None:
            ensure_writable(Path(self.export).parent)

    def _validate_gradient_sync(self) -> None:
        """The alternatives to one full all-reduce a step: compression, local SGD, a parameter server."""
        check_scheme(self.grad_compression)
        check_rank(self.powersgd_rank)
        check_ratio(self.topk_ratio)
        if isinstance(self.compression_warmup, bool) or not isinstance(self.compression_warmup, int) \
                or self.compression_warmup < 0:
            raise ValueError(f"compression_warmup must be an int >= 0 (steps of plain all-reduce first), got "
                             f"{self.compression_warmup!r}")
        self._validate_local_sgd()
        self._validate_parameter_server()

    def _validate_moe(self) -> None:
        """MoE flags and ep before any rank starts: E, k and C (``theory.expert.check_moe``), and ep dividing both the
        experts and the dp ranks it borrows (``check_ep``); what an expert-parallel run does not carry yet."""
        from workbench.theory.expert import check_ep, check_moe

        experts = self.moe_experts
        if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
            raise ValueError(f"moe_experts must be an int >= 0 (0: the dense GPT), got {experts!r}")
        positive_int("ep", self.ep)
        if experts == 0:
            plain = {"moe_top_k": 2, "moe_capacity_factor": None, "moe_aux_loss_coef": 0.01}
            given = [f"{k}={getattr(self, k)!r}" for k, v in plain.items() if getattr(self, k) != v]
            if given:
                raise ValueError(f"{', '.join(given)} set a mixture of experts' routing: it needs --moe-experts E > 0")
            return
        check_moe(experts, self.moe_top_k, self.moe_capacity_factor)
        self.gpt_config()  # the aux loss coefficient's own check (models.moe.MoEConfig)
        check_ep(experts, self.ep, self.dp)
        if self.ep > 1 and self.ckpt_dir is not None:
            raise ValueError(f"ckpt_dir with ep={self.ep}: each rank holds only its experts, and the checkpoint "
                             f"layer does not save or reshard expert shards yet; leave --ckpt-dir out")

    def _validate_local_sgd(self) -> None:
        if self.local_steps is None:
            return
        from workbench.theory.local_sgd import check_local_steps, check_outer, check_outer_lr, check_outer_momentum

        check_local_steps(self.local_steps)
        check_outer(self.outer_optimizer)
        check_outer_lr(self.outer_lr)
        check_outer_momentum(self.outer_momentum)

    def _validate_parameter_server(self) -> None:
        """A parameter server's layout and what its run path does not carry yet, each refused with the reason."""
        if self.ps_servers is None:
            for name in ("ps_async", "max_staleness"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(f"{name}={getattr(self, name)!r} needs a parameter server (--ps-servers S)")
            self._validate_ps_resume()
            return
        from workbench.parallel.param_server import check_staleness

        check_staleness(self.max_staleness)
        if self.max_staleness is not None and not self.ps_async:
            raise ValueError(f"max_staleness={self.max_staleness} bounds asynchronous workers: it needs --ps-async "
                             f"(a synchronous server is never stale)")
        unsupported = {"precision": (self.precision, "fp32"), "recompute": (self.recompute, "none"),
                       "val_every": (self.val_every, None), "inject_fault": (self.inject_fault, None),
                       "netns": (self.netns, False), "export": (self.export, None),
                       "async_ckpt": (self.async_ckpt, False)}
        for name, (value, plain) in unsupported.items():
            if value != plain:
                raise ValueError(f"{name}={value!r} with ps_servers={self.ps_servers}: the parameter server's run "
                                 f"path trains fp32 replicas without validation, faults, shaped links, export or "
                                 f"background checkpoint writes so far; leave --{name.replace('_', '-')} out")
        if self.ps_async and self.ckpt_dir is not None:
            raise ValueError(f"ckpt_dir={self.ckpt_dir!r} with ps_async: an asynchronous server applies each gradient "
                             f"in the order the pushes arrive, which differs run to run, so no step exists at which "
                             f"every rank could save and a resume could not replay the run; checkpoint a "
                             f"synchronous server (leave --ps-async out) or leave --ckpt-dir out")
        self._validate_ps_resume()
        if self.ps_async and (self.device == "cuda" or self.backend == "nccl"):
            raise ValueError(f"ps_async with device={self.device!r}, backend={self.backend!r}: an asynchronous server "
                             f"takes whichever push comes first (an any-source receive), which gloo has and NCCL "
                             f"does not; run it with --device cpu (or a synchronous server on GPUs)")
        if self.ps_async and self.emulates_links:
            raise ValueError("ps_async with emulated links (--nodes / --intra-link / --inter-link): an asynchronous "
                             "server takes whichever push comes first, and an emulated link must know a message's "
                             "sender before it arrives; use a synchronous server, or --straggler alone")

    def _validate_ps_resume(self) -> None:
        """A parameter server's checkpoint holds a server's shard or a worker's data position in each rank's file:
        only the same servers and workers read it back, and a trainer's checkpoint has no server in it (nor the
        other way round). Without a server only the newest manifest is read (no hashing: the trainer's own checks
        follow); with one, the checkpoint the resume will load."""
        if not self.resume or self.ckpt_dir is None:
            return
        from workbench.checkpoint.store import CheckpointError, list_steps, read_manifest, step_dir

        if self.ps_servers is None:
            try:
                newest = read_manifest(step_dir(self.ckpt_dir, list_steps(self.ckpt_dir)[-1]))
            except (IndexError, CheckpointError):
                return  # nothing complete to read: _validate_checkpointing says why
            saved = (newest.get("meta") or {}).get("run_config") or {}
        else:
            saved = (read_manifest(find_resume_point(self)).get("meta") or {}).get("run_config") or {}
        pair = (saved.get("nproc"), saved.get("ps_servers"))
        if saved.get("ps_servers") != self.ps_servers or (self.ps_servers is not None and pair[0] != self.nproc):
            def ps(n: Any, s: Any) -> str:
                return f"--nproc {n} " + (f"--ps-servers {s}" if s else "without a parameter server")

            raise ValueError(f"resume from {self.ckpt_dir!r} with {ps(self.nproc, self.ps_servers)}: its checkpoint "
                             f"was saved with {ps(*pair)}; a parameter server's checkpoint resumes on the same "
                             f"servers and workers only (each rank's file holds its own role's state), and a "
                             f"trainer's has no server in it; rerun with the saved values or start a fresh --ckpt-dir")

    def _validate_context_parallel(self) -> None:
        check_cp(self.gpt_config().seq_len, self.cp, self.cp_layout)
        if self.cp > 1 and self.val_every is not None:
            raise ValueError(f"val_every={self.val_every} with cp={self.cp}: validation runs the whole sequence on "
                             f"each rank, which a context-parallel model does not hold; leave --val-every out")

    def _validate_faults(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0 (restarts after a failure), got {self.max_restarts!r}")
        faults = parse_faults(self.inject_fault, self.nproc, self.steps)
        if self.min_nproc is not None:
            self._validate_elastic()
        elif lost := [f for f in faults if f.kind == "lose"]:
            raise ValueError(f"inject_fault={self.inject_fault!r} removes rank(s) {list(lost[0].ranks)} for good: it "
                             f"needs --min-nproc M (an elastic run goes on with the survivors); "
                             f"kill:rank={lost[0].rank}:step={lost[0].step} with --max-restarts shows a restart of "
                             f"the same world instead")
        if stall := next((f for f in faults if f.kind == "stall" and f.seconds >= self.timeout), None):
            raise ValueError(f"fault {stall} stalls rank(s) {list(stall.ranks)} for {stall.seconds:g} s, at least "
                             f"--timeout={self.timeout:g} s: the peers would time out, which is a hang "
                             f"(hang:rank={stall.rank}:step={stall.step}); stall for less than {self.timeout:g} s")

    def _validate_elastic(self) -> None:
        """``--min-nproc``'s rules (``training.elastic``), before any rank starts."""
        m = self.min_nproc
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= self.nproc:
            raise ValueError(f"min_nproc={m!r} must be an int in 1..nproc={self.nproc}: the fewest ranks the run may "
                             f"go on with after losing some")
        if self.ckpt_dir is None:
            raise ValueError(f"min_nproc={m} needs --ckpt-dir (and --ckpt-every): the survivors go on from the newest "
                             f"checkpoint, resharded to the smaller world")
        others = {"tp": (self.tp, 1), "pp": (self.pp, 1), "cp": (self.cp, 1), "ep": (self.ep, 1),
                  "ps_servers": (self.ps_servers, None), "local_steps": (self.local_steps, None),
                  "grad_compression": (self.grad_compression, "none"), "straggler": (self.straggler, None),
                  "nodes": (self.nodes, None), "netns": (self.netns, False)}
        given = [f"{name}={value!r}" for name, (value, plain) in others.items() if value != plain]
        if given:
            raise ValueError(f"min_nproc={m} shrinks a data-parallel world (DDP or ZeRO 1-3); {', '.join(given)} "
                             f"would need a layout or emulation planned for each world size, which this package "
                             f"does not do yet; leave them out")
        check_elastic_batch(self.batch_size, self.nproc, self.grad_accum, m)

    @property
    def emulates_links(self) -> bool:
        """Whether the run's links are emulated (``--nodes``, ``--intra-link`` or ``--inter-link`` given)."""
        return any(v is not None for v in (self.nodes, self.intra_link, self.inter_link, self.distribution))

    def _validate_links(self) -> None:
        """The emulated topology (``dist.emulation``): nodes dividing nproc, links that parse, a time scale that is a
        number > 0 or a known GPU, a straggler that exists; all before any rank starts, without measuring yet."""
        if self.straggler is not None:
            Straggler.parse(self.straggler, self.nproc)
        if self.netns:
            self._validate_netns()
            return
        if not self.emulates_links:
            if self.time_scale is not None:
                raise ValueError(f"time_scale={self.time_scale!r} scales emulated links: it needs --nodes N (or "
                                 f"--intra-link / --inter-link)")
            return
        check_time_scale(self.time_scale)
        LinkEmulation.build(self.nproc, 1 if self.nodes is None else self.nodes, self.intra_link or "nvlink",
                            self.inter_link or "infiniband", 1.0, self.distribution or "block")

    def _validate_netns(self) -> None:
        """``--netns`` runs the ranks over a real link (``dist.netns``): N >= 2 nodes (a veth pair for 2, a switch
        from 3), gloo, one shaped rate; what it cannot do is refused here (whether this machine lets us build it is
        checked when the run starts)."""
        if self.nodes is None or self.nodes < 2:
            raise ValueError(f"netns runs the ranks as N >= 2 nodes in network namespaces of their own: pass --nodes N "
                             f"(got nodes={self.nodes})")
        rate = (None if self.inter_link is None
                else LinkEmulation.build(self.nproc, self.nodes, inter_link=self.inter_link))
        if rate is None or rate.topology.inter.bandwidth > NETNS_MAX_RATE:
            raise ValueError(f"netns shapes the real link between the nodes with tc tbf: give --inter-link GBPS,US "
                             f"with GBPS <= {NETNS_MAX_RATE / 1e9:g} (the loopback underneath is no faster), got "
                             f"{self.inter_link!r}")
        unsupported = {"time_scale": self.time_scale, "straggler": self.straggler, "distribution": self.distribution,
                       "intra_link": self.intra_link}
        given = [f"{k}={v!r}" for k, v in unsupported.items() if v is not None]
        given += ["max_restarts"] if self.max_restarts else []
        given += ["device=cuda"] if self.device == "cuda" else []
        if given:
            raise ValueError(f"netns runs gloo ranks on a real link with no emulation and no restarts; leave out "
                             f"{', '.join(given)}")

    def link_emulation(self) -> LinkEmulation | None:
        """The run's emulated links, None without; a GPU-named time scale is measured on this machine now."""
        if not self.emulates_links or self.netns:  # netns: the link is real, nothing to emulate
            return None
        return LinkEmulation.build(self.nproc, 1 if self.nodes is None else self.nodes, self.intra_link or "nvlink",
                                   self.inter_link or "infiniband",
                                   resolve_time_scale(1.0 if self.time_scale is None else self.time_scale, self.nproc),
                                   self.distribution or "block")

    def _validate_health(self) -> None:
        if self.on_spike not in SPIKE_ACTIONS:
            raise ValueError(f"on_spike={self.on_spike!r}; valid: {', '.join(SPIKE_ACTIONS)}")
        if self.on_spike == "rollback" and self.ckpt_dir is None:
            raise ValueError("on_spike='rollback' needs ckpt_dir (--ckpt-dir DIR): it rolls back to the newest "
                             "checkpoint")
        SpikeDetector(factor=self.spike_factor)
        self._validate_sdc_check()
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

    def _validate_sdc_check(self) -> None:
        """``sdc_check_every`` compares data-parallel replicas, so it needs a run whose replicas hold the same bits:
        the whole model on every rank (plain DDP, ZeRO-1/2), all ranks one dp group (a verdict taken in one dp group
        of a tp/pp/cp mesh would have to be agreed with the others before any rank may stop; not built yet)."""
        if self.sdc_check_every is None:
            return
        positive_int("sdc_check_every", self.sdc_check_every)
        refused = {"zero": (self.zero, 3, "ZeRO-3 shards the parameters: no two ranks hold the same ones"),
                   "local_steps": (self.local_steps, None, "local SGD's replicas differ between outer steps by design"),
                   "ps_servers": (self.ps_servers, None, "a parameter server's workers hold no replicated state"),
                   "ep": (self.ep, 1, "expert parallelism gives each rank other experts"),
                   "tp": (self.tp, 1, "replicas are compared within one dp group spanning every rank"),
                   "pp": (self.pp, 1, "replicas are compared within one dp group spanning every rank"),
                   "cp": (self.cp, 1, "replicas are compared within one dp group spanning every rank")}
        for name, (value, plain, why) in refused.items():
            if (value == plain) if name == "zero" else (value != plain):
                raise ValueError(f"sdc_check_every={self.sdc_check_every} with {name}={value!r}: {why}; the check "
                                 f"runs on plain data parallelism (DDP, ZeRO-1/2) so far")

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
        """Precision and reduce dtype named before any rank starts (``workbench.precision``). The names are
        ``theory.precisions``' table, shared with `workbench calc`: an alias ("bf16-mixed") becomes its canonical
        name ("bf16") here, so summary.json and the trainer see one spelling."""
        from workbench.parallel.precision import policy_from_names
        from workbench.theory.precisions import PRECISION_ALIASES

        self.precision = PRECISION_ALIASES.get(self.precision, self.precision)
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

    def section(self, kind: type[S]) -> S:
        """The view of this config a lower floor receives: ``kind`` (a dataclass) built from the fields of the same
        name, so a section cannot drift from the flat config by a hand copy. Lists become tuples (sections are
        frozen or hashed); a field of ``kind`` that the run does not set keeps its default (``betas``)."""
        mine = {f.name for f in fields(self)}
        values = {f.name: getattr(self, f.name) for f in fields(kind) if f.name in mine}
        return kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})

    def parallel_config(self) -> ParallelConfig:
        """What ``parallelize`` receives: the strategy, optimizer and precision settings, nothing else of the run."""
        return self.section(ParallelConfig)

    def combination(self) -> Combination:
        """The settings the composition rules look at (``theory.composition``)."""
        return self.section(Combination)

    def gpt_config(self) -> GPTConfig:
        overrides: dict[str, Any] = {"seq_len": self.seq_len} if self.seq_len else {}
        if self.moe_experts:  # the dense GPT otherwise, built exactly as before
            overrides.update(moe_experts=self.moe_experts, moe_top_k=self.moe_top_k,
                             moe_capacity_factor=self.moe_capacity_factor, moe_aux_loss_coef=self.moe_aux_loss_coef)
        return GPTConfig.preset(self.model, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
