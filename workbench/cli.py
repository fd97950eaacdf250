"""``workbench`` command line: ``run`` parses its flags into a ``RunConfig`` and hands it to ``workbench.run``,
which trains on N ranks (gloo on the CPU, or NCCL with one GPU per rank) and writes a summary and a report;
``env`` says what this machine offers a run; ``calc`` prints the per-rank memory of a training configuration;
``bench`` runs the benchmarks; ``ckpt`` lists, verifies and exports a run's checkpoints; ``labs`` and ``course``
give a learner the labs and the notebooks to work in."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from workbench.dist.launch import VALID_BACKENDS, VALID_DEVICES
from workbench.parallel import DDP_KINDS, ZERO_STAGES
from workbench.parallel.recompute import RECOMPUTE_MODES as RUN_RECOMPUTE_MODES
from workbench.run import PREEMPTED_EXIT_CODE, comm_group_labels, run_training, summarize, write_outputs
from workbench.theory.compression import COMPRESSIONS
from workbench.theory.pipeline import SCHEDULES
from workbench.theory.precisions import PRECISION_NAMES, parse_precision

#: The run itself lives in ``workbench.run``; these names are kept here, where notebooks and scripts import them.
__all__ = ["build_parser", "comm_group_labels", "main", "run_training", "summarize", "write_outputs"]

PIPELINE_SCHEDULES = tuple(SCHEDULES)


def _strategy_flags(p: argparse.ArgumentParser) -> None:
    """How the ranks split the training: defined once, for ``run`` and ``calc`` alike, so the two cannot drift.

    ``calc`` changes two defaults (``set_defaults`` in ``_calc_parser``): no --batch-size (activations are then
    left out) and, without --nproc or --dp, one node of 8 data-parallel ranks."""
    p.add_argument("--nproc", type=int, default=None,
                   help="number of ranks = dp x tp x pp x cp (run: default 1, the single-process baseline, or "
                        "torchrun's WORLD_SIZE; calc: default dp x tp x pp x cp)")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel size (default: nproc / (tp x pp x cp); calc without --nproc: 8)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (heads, MLP and vocabulary split)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism over the tp ranks (needs --tp > 1)")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel size: each sequence split over cp ranks, attention as a ring (K/V blocks "
                        "passed to the neighbour); composes with dp and --zero")
    p.add_argument("--cp-layout", choices=("zigzag", "contiguous"), default="zigzag",
                   help="how --cp splits a sequence: zigzag (rank r holds chunks r and 2cp-1-r: equal causal work) "
                        "or contiguous (rank r holds chunk r: the last rank does ~2cp-1 times the first's)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages of layers)")
    p.add_argument("--schedule", choices=PIPELINE_SCHEDULES, default="1f1b", help="pipeline schedule")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches per step (default 2 x pp)")
    p.add_argument("--virtual-stages", type=int, default=1, help="stages per rank (--schedule interleaved)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="GLOBAL batch, split across data-parallel ranks (and into micro-batches); run: default 16; "
                        "calc: default none, activations left out")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--zero", type=int, choices=ZERO_STAGES, default=0, help="ZeRO stage")
    p.add_argument("--moe-experts", type=int, default=0, metavar="E",
                   help="a mixture of E experts in every block's MLP, each the MLP's shape (run: default 0, the "
                        "dense GPT; calc: default the preset's)")
    p.add_argument("--moe-top-k", type=int, default=2, metavar="K", help="experts each token is routed to (1..E)")
    p.add_argument("--moe-capacity-factor", type=_capacity_factor, default=None, metavar="C|none",
                   help="an expert takes at most ceil(C x tokens x K / E) assignments per layer call, the rest are "
                        "dropped (Switch: 1.25); 'none' (default): no token is ever dropped")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallelism: the experts split over ep of the data-parallel ranks, tokens sent to "
                        "them by all-to-all (EP borrows from DP: --nproc 4 --ep 2 is dp 4, two copies of each shard)")
    p.add_argument("--offload", action="store_true", help="offload optimizer state (and stage-3 params) to CPU")


def _run_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="train the tiny GPT on N ranks; write summary.json and report.html",
                       epilog=f"SIGTERM or SIGINT (Ctrl-C) preempts the run: every rank finishes its step, a "
                              f"checkpoint is saved there (with --ckpt-dir), summary.json and report.html say "
                              f"'preempted' and the exit status is {PREEMPTED_EXIT_CODE} (rerun with --resume to "
                              f"go on); a second signal stops at once (exit 128 + the signal's number). See "
                              f"docs/preemption.md.")
    _strategy_flags(p)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per rank per step")
    p.add_argument("--model", default="tiny", help="GPT preset: tiny, small, bench")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--clip", type=float, default=1.0, help="max global grad norm (0 disables)")
    p.add_argument("--seed", type=int, default=0, help="fixes model init and data order")
    p.add_argument("--ddp", choices=DDP_KINDS, default="bucketed", help="gradient synchronisation")
    p.add_argument("--grad-compression", choices=COMPRESSIONS, default="none",
                   help="compress the DDP wrappers' gradient all-reduce (zero 0 or 1): bf16, powersgd (Vogels et al. "
                        "2019), topk or sign (EF-SignSGD), the last three with error feedback")
    p.add_argument("--powersgd-rank", type=int, default=4, help="--grad-compression powersgd: rank r of P Q^T")
    p.add_argument("--topk-ratio", type=float, default=0.01,
                   help="--grad-compression topk: share of each gradient's entries sent, in (0, 1]")
    p.add_argument("--local-steps", type=int, default=None, metavar="H",
                   help="local SGD / DiLoCo: each rank steps its own replica, parameters averaged every H steps "
                        "(no gradient sync); default: synchronous data parallelism")
    p.add_argument("--outer-optimizer", choices=("avg", "sgd", "nesterov"), default="nesterov",
                   help="--local-steps: the outer step on the averaged pseudo-gradient: avg (model averaging), sgd, "
                        "or nesterov (DiLoCo, Douillard et al. 2023)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="--local-steps: the outer learning rate (DiLoCo 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="--local-steps with nesterov: the outer momentum (DiLoCo 0.9)")
    p.add_argument("--ps-servers", type=int, default=None, metavar="S",
                   help="a parameter server: the last S ranks hold the parameters (sharded by tensor) and step them; "
                        "the other ranks are workers that pull parameters and push gradients")
    p.add_argument("--ps-async", action="store_true",
                   help="--ps-servers: apply each worker's gradient on arrival (asynchronous SGD), not averaged once "
                        "a step; every update's staleness is recorded")
    p.add_argument("--max-staleness", type=int, default=None, metavar="K",
                   help="--ps-async: a worker may start a step at most K steps ahead of the slowest (stale "
                        "synchronous parallel; 0: lock-step); default: no bound")
    p.add_argument("--compression-warmup", type=int, default=0,
                   help="plain all-reduce for this many first steps before compressing (torch's start_powerSGD_iter)")
    p.add_argument("--bucket-mb", type=_bucket_mb, default=25.0, metavar="MIB|none",
                   help="--ddp bucketed: cap of a gradient bucket in MiB; 'none': one bucket for every gradient")
    p.add_argument("--zero3-replicate", nargs="+", default=[], metavar="PATTERN",
                   help="--zero 3: keep the parameters these globs pick (a name such as 'ln_f.*', or a module class "
                        "such as '*norm') whole on every rank, their gradients all-reduced (FSDP's ignored params)")
    p.add_argument("--recompute", choices=RUN_RECOMPUTE_MODES, default="none",
                   help="activation recomputation: selective (the attention core) or full (every block)")
    p.add_argument("--moe-aux-loss-coef", type=float, default=0.01,
                   help="--moe-experts: the load-balancing loss's coefficient (Switch Transformers: 0.01)")
    p.add_argument("--precision", type=parse_precision, choices=PRECISION_NAMES, default="fp32",
                   help="compute dtype; fp32 master weights and optimizer state; fp16 adds a dynamic loss scaler "
                        "(bf16-mixed and fp16-mixed are accepted for bf16 and fp16: theory.precisions, shared with "
                        "calc)")
    p.add_argument("--reduce-dtype", choices=PRECISION_NAMES, default="fp32",
                   help="dtype gradients are reduced in: fp32 (default) or the compute dtype (needs --zero 3)")
    p.add_argument("--init-loss-scale", type=float, default=2.0 ** 16,
                   help="fp16: the dynamic loss scaler's first scale (halved on inf/NaN, doubled after clean steps)")
    p.add_argument("--loss-scale-growth-interval", type=int, default=2000,
                   help="fp16: clean steps before the loss scale doubles")
    p.add_argument("--data", default=None, help="a text file to train on instead of the bundled corpus")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout in seconds")
    p.add_argument("--device", choices=VALID_DEVICES, default=None,
                   help="auto (default, or $WORKBENCH_DEVICE): CUDA + NCCL when every rank gets a GPU, else gloo "
                        "on the CPU; cpu; cuda (one GPU per rank, or an error)")
    p.add_argument("--backend", choices=("auto", *VALID_BACKENDS), default="auto",
                   help="process-group backend (auto follows the device)")
    p.add_argument("--port", type=int, default=0, help="rendezvous port on 127.0.0.1 (0: the OS picks a free one)")
    p.add_argument("--out", default="runs/latest", help="directory for summary.json and report.html")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--ckpt-dir", default=None, help="save checkpoints here (one step-* folder per save, a shard per "
                   "rank and a manifest with checksums)")
    p.add_argument("--ckpt-every", type=int, default=None,
                   help="save after every K-th step (and after the last); default: after the last only")
    p.add_argument("--keep", type=int, default=None, help="keep the newest K checkpoints (default: all)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint in --ckpt-dir (same layout and data flags)")
    p.add_argument("--export", default=None, metavar="PATH",
                   help="write the trained model's full state dict to PATH (torch.save; a plain model loads it)")
    p.add_argument("--async-ckpt", action="store_true",
                   help="snapshot each checkpoint to CPU and write it in a background thread while training goes on")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="after a rank fails, restart all ranks up to K times, resuming from the newest checkpoint")
    p.add_argument("--inject-fault", default=None, metavar="KIND:rank=R:step=S",
                   help="plant a failure in the first attempt: kill (SIGKILL), raise, hang (caught by --timeout), "
                        "nan (weights turn NaN: caught by --on-spike), bitflip (one bit of rank R's first "
                        "parameter flips after step S: caught by --sdc-check-every), lose (rank R's node is "
                        "gone for good: needs --min-nproc) or stall (rank R's data stalls; :seconds=T, default 2). "
                        "rank=R1,R2 strikes several ranks at once (a node); join specs with ';' for several faults")
    p.add_argument("--min-nproc", type=int, default=None, metavar="M",
                   help="elastic: when a rank is lost for good, go on with the survivors (down to M ranks) from the "
                        "newest checkpoint, with the same global batch (gradient accumulation makes up the lost "
                        "ranks); needs --ckpt-dir")
    p.add_argument("--val-every", type=int, default=None,
                   help="validation loss every K steps on a held-out split the sampler never serves for training, "
                        "with a check that data-parallel ranks drew disjoint windows")
    p.add_argument("--val-fraction", type=float, default=0.1, help="the corpus's last windows held out (default 0.1)")
    p.add_argument("--on-spike", choices=("warn", "rollback", "stop"), default="warn",
                   help="on a NaN/Inf or a loss spike: warn; rollback to the newest checkpoint and skip the batches "
                        "since; or stop")
    p.add_argument("--spike-factor", type=float, default=3.0, help="a loss above this x the recent median is a spike")
    _sdc_flag(p)
    _run_topology_flags(p)
    # Flags whose default is RunConfig's own (argparse.SUPPRESS: left out of the namespace unless given).
    p.add_argument("--weight-decay", type=float, default=argparse.SUPPRESS, help="AdamW's decoupled weight decay "
                   "(default 0.1)")
    p.add_argument("--min-lr-ratio", type=float, default=argparse.SUPPRESS,
                   help="the cosine schedule ends at this x --lr (default 0.1)")
    p.add_argument("--trace-steps", type=int, default=argparse.SUPPRESS,
                   help="trace (spans, collectives, memory) the last K steps for the report (default 5)")


def _sdc_flag(p: argparse.ArgumentParser) -> None:
    """``--sdc-check-every`` (workbench.training.health: silent data corruption), beside the spike flags."""
    p.add_argument("--sdc-check-every", type=int, default=None, metavar="K",
                   help="every K steps (and before each checkpoint) fingerprint what data-parallel replicas must hold "
                        "alike, compare, and name the ranks that disagree (silent data corruption); the action is "
                        "--on-spike's")


#: RunConfig fields with no ``run`` flag: set from Python only (the live dashboard's stop file rides in ``extra``).
NOT_FLAGS = ("extra",)


def _config_from_args(args: argparse.Namespace) -> Any:
    """The parsed ``run`` flags as a ``RunConfig``, field by field under the same names (no hand copy to drift):
    every field but ``NOT_FLAGS`` has a flag (``tests/test_train_cli.py`` checks it; a flag left out keeps
    RunConfig's default, where it has ``argparse.SUPPRESS``), and three flags are spelt
    for the command line: ``--nproc`` defaults to torchrun's WORLD_SIZE, ``--clip 0`` disables clipping (None),
    ``--backend auto`` follows the device (None)."""
    from dataclasses import fields

    from workbench.dist.launch import under_torchrun
    from workbench.training.config import RunConfig

    values = {f.name: getattr(args, f.name) for f in fields(RunConfig) if hasattr(args, f.name)}
    if values["nproc"] is None:
        values["nproc"] = int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1
    if args.clip is not None and args.clip < 0:
        raise ValueError(f"clip must be >= 0 (0 disables clipping), got {args.clip}")
    values["clip"] = args.clip or None
    values["backend"] = None if args.backend == "auto" else args.backend
    return RunConfig(**values)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Validate everything before a rank starts (a bad flag is one line, exit 2); a rank's failure is one
    paragraph naming the rank and where it failed (exit 1), not a traceback of the launcher."""
    from workbench.dist.launch import RankError, resolve_placement, under_torchrun

    try:
        cfg = _config_from_args(args)
        placement = resolve_placement(cfg.nproc, cfg.device, cfg.backend)
    except ValueError as exc:
        parser.error(str(exc))
    lead = not under_torchrun() or os.environ.get("RANK") == "0"  # the rule run_training writes outputs by
    if not under_torchrun():
        print(f"workbench: {placement.describe(cfg.nproc)}", file=sys.stderr)
    try:
        summary = run_training(cfg, args.out, progress=not args.no_progress)
    except ValueError as exc:  # found only at launch (e.g. the rendezvous port is taken)
        parser.error(str(exc))
    except RankError as exc:
        print(f"workbench run: {_rank_failure(exc)}", file=sys.stderr)
        return 1
    if lead:
        _print_summary(summary, args.out)
    if summary.get("preempted"):  # stopped by SIGTERM/SIGINT at a step boundary, checkpointed: rerun with --resume
        return PREEMPTED_EXIT_CODE
    return 0


def _rank_failure(exc: Any) -> str:
    """The rank's message and the last frames of its traceback: where it failed, not the whole stack."""
    lines = [line for line in exc.remote_traceback.strip().splitlines()
             if line.strip() and not line.startswith("Traceback")]
    tail = lines[-3:-1]  # the innermost frame and its code line; the last line repeats the message
    where = "".join(f"\n  {line.strip()}" for line in tail)
    return f"rank {exc.rank} failed: {exc.message}{where}"


def _print_summary(summary: dict[str, Any], out: str) -> None:
    losses = summary["losses"]
    print(f"{summary['strategy']}: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"median {summary['tokens_per_s']:.0f} tokens/s, {summary['step_time_s'] * 1e3:.1f} ms/step")
    print(f"final_params_sha256 {summary['final_params_sha256']}")
    print(f"wrote {out}/summary.json and {out}/report.html")


CALC_DEFAULT_DP = 8  # calc without --nproc or --dp: one node of 8 devices


def _bucket_mb(text: str) -> float | None:
    """``--bucket-mb``: a positive number of MiB, or ``none`` for one bucket (``BucketedDDP(bucket_mb=None)``)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of MiB or 'none' (one bucket), got {text!r}")
    return value


def _capacity_factor(text: str) -> float | None:
    """``--moe-capacity-factor``: a number (checked > 0 with the other MoE flags, before any rank starts) or
    ``none``, no capacity: no token is ever dropped."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0 (e.g. 1.25) or 'none' (no token dropped), "
                                         f"got {text!r}") from None


def _link(text: str) -> Any:
    """A link flag: a preset (``nvlink``, ``pcie``, ``infiniband``, ``ethernet``) or ``GBPS,US``, e.g. ``50,10``
    (``theory.topology.parse_link``; its ValueError becomes argparse's one-line error)."""
    from workbench.theory.topology import parse_link

    try:
        return parse_link(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _link_spec(text: str) -> str:
    """A ``run`` link flag, checked like calc's (``_link``) but kept as written: summary.json records the spec."""
    _link(text)
    return text


def _run_topology_flags(p: argparse.ArgumentParser) -> None:
    """Emulated nodes and links (``workbench.dist.emulation``): every collective and message waits the time the
    α-β model gives over the links it crosses, so a one-machine run shows a cluster's slow links."""
    p.add_argument("--nodes", type=int, default=None,
                   help="emulate this many nodes, ranks placed node-major as torchrun and Slurm place them (default: "
                        "no emulation; 1 when --intra-link or --inter-link is given)")
    p.add_argument("--intra-link", type=_link_spec, default=None, metavar="SPEC",
                   help="emulated link between ranks of one node: a preset (nvlink, pcie, infiniband, ethernet) or "
                        "GBPS,US (default nvlink)")
    p.add_argument("--inter-link", type=_link_spec, default=None, metavar="SPEC",
                   help="emulated link between nodes (default infiniband)")
    p.add_argument("--distribution", choices=("block", "cyclic"), default=None,
                   help="how ranks are dealt to the emulated nodes, as Slurm's --distribution: block (node-major, "
                        "default) or cyclic (round-robin: puts each tp group across nodes)")
    p.add_argument("--netns", action="store_true",
                   help="instructors with root: run the ranks of each of --nodes N (>= 2) nodes in a network namespace "
                        "of its own, joined by real links shaped with tc tbf to --inter-link's bandwidth (a veth pair "
                        "for 2 nodes, a switch from 3), not emulated")
    p.add_argument("--straggler", default=None, metavar="rank=R:factor=F",
                   help="emulate a straggler: rank R's forward, backward and optimizer take F times as long, and "
                        "synchronous training waits for it")
    p.add_argument("--time-scale", default=None, metavar="X|GPU",
                   help="multiply emulated link times by X, or by how much slower a rank here computes than GPU "
                        "(h100-bf16, a100-bf16, ...), measured, to keep that cluster's compute:communication ratio")


def _calc_parser(sub: Any) -> None:
    from workbench.theory.memory import DEFAULT_LAYOUT, MEMORY_LAYOUTS, OPTIMIZERS, RECOMPUTE_MODES
    from workbench.theory.parallelism import DEFAULT_LINKS

    p = sub.add_parser("calc", help="per-rank memory, pipeline bubble and communication of a layout (theory)",
                       description="Theory for the layout that `workbench run` takes the same flags for, on a "
                                   "model of any size: per-rank memory by category (the worst pipeline rank), "
                                   "whether it fits, the pipeline bubble and an α-β communication estimate per "
                                   "axis (workbench.theory.parallelism).")
    _strategy_flags(p)
    p.set_defaults(batch_size=None, moe_experts=None, moe_top_k=None)  # None: the preset's (a dense one: 0)
    p.add_argument("--model", default="llama-7B", help="a preset of workbench.theory.models.MODEL_PRESETS")
    p.add_argument("--precision", type=parse_precision, choices=PRECISION_NAMES, default="bf16",
                   help="compute dtype, the names `workbench run` takes (bf16-mixed and fp16-mixed are accepted "
                        "for bf16 and fp16)")
    p.add_argument("--memory-layout", choices=list(MEMORY_LAYOUTS), default=DEFAULT_LAYOUT,
                   help="where bf16/fp16 keep model states: classic (16-bit parameters and gradients + fp32 master, "
                        "2+2+4+8 bytes a parameter; Megatron, DeepSpeed) or amp (fp32 parameters and gradients "
                        "under autocast, 4+4+8: what `workbench run` trains); they differ under ZeRO-1/2")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
    p.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none", help="activation recomputation")
    p.add_argument("--device-gb", type=float, default=80.0, help="device memory in GiB, for 'fits'")
    for axis, link in DEFAULT_LINKS.items():
        p.add_argument(f"--{axis}-link", type=_link, default=None, metavar="SPEC",
                       help=f"{axis} axis link: a preset (nvlink, pcie, infiniband, ethernet) or bandwidth (GB/s) "
                            f"and latency (µs) as GBPS,US; default {link.name}, or the topology's with --nodes")
    _calc_topology_flags(p)
    _calc_scaling_flags(p)


def _worlds(text: str) -> list[int]:
    try:
        worlds = [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU counts separated by commas, e.g. 8,64,512,1024; "
                                         f"got {text!r}") from None
    if not worlds or any(w < 1 for w in worlds):
        raise argparse.ArgumentTypeError(f"GPU counts must be >= 1, got {text!r}")
    return worlds


def _calc_scaling_flags(p: argparse.ArgumentParser) -> None:
    """``--scaling``: data-parallel efficiency at other world sizes (``theory.scaling``), with its assumptions."""
    from workbench.theory.topology import GPU_PEAK_FLOPS

    p.add_argument("--scaling", type=_worlds, default=None, metavar="N,N,...",
                   help="data-parallel scaling efficiency at these GPU counts (weak: the per-rank batch fixed; "
                        "strong: the global batch fixed), over --nodes' links (needs --batch-size)")
    p.add_argument("--gpu", choices=sorted(GPU_PEAK_FLOPS), default="h100-bf16",
                   help="the GPU whose dense peak prices a step's compute for --scaling (default h100-bf16)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for --scaling (default 0.4)")
    p.add_argument("--overlap", type=float, default=0.0,
                   help="share of the gradient all-reduce hidden behind the backward for --scaling (default 0)")
    p.add_argument("--allreduce", choices=("ring", "hierarchical"), default="ring",
                   help="the data-parallel all-reduce --scaling prices (default ring)")


def _calc_topology_flags(p: argparse.ArgumentParser) -> None:
    """--nodes and the two links of ``theory.topology.Topology``. Their defaults are None so that a calc without
    them prints what it always did (the per-axis DEFAULT_LINKS); any of them places the ranks on nodes."""
    p.add_argument("--nodes", type=int, default=None,
                   help="nodes the ranks are spread over, node-major as torchrun and Slurm place them (default 1 "
                        "when --intra-link or --inter-link is given); each axis then gets the link its groups cross")
    p.add_argument("--intra-link", type=_link, default=None, metavar="SPEC",
                   help="link between ranks of one node (default nvlink)")
    p.add_argument("--inter-link", type=_link, default=None, metavar="SPEC",
                   help="link between ranks of different nodes (default infiniband)")
    p.add_argument("--distribution", choices=("block", "cyclic"), default=None,
                   help="how ranks are dealt to nodes (Slurm's --distribution): block, node-major (default), or "
                        "cyclic, round-robin")


def _calc_layout(args: argparse.Namespace) -> Any:
    """The run flags as a ``theory.parallelism.Layout``, with ``run``'s defaults for dp and micro-batches."""
    from workbench.theory.composition import check_composition
    from workbench.theory.parallelism import Layout

    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {args.nproc}")
    sizes_ok = all(isinstance(v, int) and v > 0 for v in (args.tp, args.pp, args.cp))
    model_parallel = args.tp * args.pp * args.cp if sizes_ok else 1
    if args.dp is not None:
        dp = args.dp
    else:
        dp = max(1, args.nproc // model_parallel) if args.nproc is not None else CALC_DEFAULT_DP
    pp = args.pp if sizes_ok else 1
    microbatches = args.microbatches if args.microbatches is not None else (2 * pp if pp > 1 else 1)
    layout = Layout(dp=dp, tp=args.tp, pp=args.pp, sp=args.sp, zero_stage=args.zero, schedule=args.schedule,
                    microbatches=microbatches, virtual_stages=args.virtual_stages, offload=args.offload, cp=args.cp,
                    cp_layout=args.cp_layout)
    layout.validate(args.model, args.seq_len, nproc=args.nproc)
    experts, top_k = _calc_moe(args)
    if experts:  # E, k, C and ep dividing the experts and the dp ranks it borrows (theory.expert)
        from workbench.theory.expert import check_ep, check_moe

        check_moe(experts, top_k, args.moe_capacity_factor)
        check_ep(experts, args.ep, dp)
    # what `run` refuses, calc refuses (theory.composition); a MoE model and ep are not Layout's, so added here
    check_composition(dataclasses.replace(layout.combination(), moe_experts=experts, ep=args.ep))
    return layout


def _calc_moe(args: argparse.Namespace) -> tuple[int, int]:
    """(experts, top_k) of the calc: the flags', else the preset's (0 experts for a dense one)."""
    from workbench.theory.models import resolve_preset

    preset = resolve_preset(args.model)
    experts = args.moe_experts if args.moe_experts is not None else preset.get("moe_experts", 0)
    top_k = args.moe_top_k if args.moe_top_k is not None else preset.get("moe_top_k", 2)
    return experts, top_k


def _print_calc_moe(args: argparse.Namespace, layout: Any, micro: int) -> None:
    """Expert parallelism's rows (``theory.expert.moe_layout``): experts per rank, their memory, capacity and the
    all-to-all. The memory table above already holds E/ep experts per rank (``calculator_table``'s ``ep``)."""
    from workbench.theory.expert import moe_layout, preset_expert_params
    from workbench.theory.models import resolve_preset

    experts, top_k = _calc_moe(args)
    if not experts:
        return
    preset = resolve_preset(args.model)
    d, per_expert = preset["d_model"], preset_expert_params(preset)
    hidden = preset.get("ffn_hidden", 4 * d)
    seq = args.seq_len or preset["seq_len"]
    value = 4 if args.precision.startswith("fp32") else 2
    row = moe_layout(preset["n_layer"], d, per_expert, experts, top_k, args.ep, layout.dp, micro * seq,
                     args.moe_capacity_factor, bytes_per_value=value, bytes_per_param=value)
    from workbench.theory.parallelism import DEFAULT_LINKS

    link = _calc_links(args, layout)[0].get("dp", DEFAULT_LINKS["dp"])  # the all-to-all runs over dp ranks
    print(f"mixture of experts (theory.expert): {experts} experts of {per_expert / 1e6:,.1f}M parameters per layer "
          f"(MLP hidden {hidden}), top-{top_k}, ep={args.ep} over dp={layout.dp}")
    print(f"  experts per rank {row['experts_per_rank']} of {experts}, {row['copies_of_each_shard']} cop"
          f"{'y' if row['copies_of_each_shard'] == 1 else 'ies'} of each shard; expert weights per rank "
          f"{row['expert_param_bytes'] / 2**30:.2f} GiB ({row['expert_param_bytes_unsplit'] / 2**30:.2f} GiB "
          f"unsplit; the table above holds this rank's share, its ZeRO states sharded over the "
          f"{layout.shard_group // args.ep} rank(s) holding the same experts)")
    if not micro:
        print("  capacity and all-to-all: pass --batch-size (tokens per rank decide them)")
        return
    cap = "unbounded (--moe-capacity-factor none: no token dropped)" if row["capacity"] is None else \
        f"{row['capacity']} assignments per layer call (C={args.moe_capacity_factor:g})"
    print(f"  tokens per rank per micro-batch {micro * seq}, each expert's capacity {cap}")
    a2a = row["all_to_all_bytes_per_step"]
    time = ""
    if link is not None and a2a:
        time = f", {(2 * preset['n_layer'] * link.alpha + a2a / link.bandwidth) * 1e3:.2f} ms [{link.name}]"
    print(f"  all-to-all (dispatch + combine, forward and backward, even routing) per micro-batch: "
          f"{row['all_to_all_bytes_per_layer'] / 1e6:.2f} MB sent per rank per layer, {a2a / 1e9:.3f} GB over "
          f"{preset['n_layer']} layers{time}")


def _calc(args: argparse.Namespace) -> None:
    from workbench.theory.calculator import calculator_table
    from workbench.theory.models import MODEL_PRESETS
    from workbench.theory.parallelism import micro_batch_size

    if args.model not in MODEL_PRESETS:
        raise ValueError(f"unknown model {args.model!r}; valid choices: {', '.join(sorted(MODEL_PRESETS))}")
    if args.seq_len is not None and (args.seq_len < 1):
        raise ValueError(f"seq_len must be a positive int, got {args.seq_len}")
    layout = _calc_layout(args)
    micro = micro_batch_size(args.batch_size, layout.dp, layout.microbatches) if args.batch_size is not None else 0
    links, placement = _calc_links(args, layout)
    kwargs = dict(model=args.model, dp=layout.dp, zero_stage=layout.zero_stage, precision=args.precision,
                  optimizer=args.optimizer, offload=layout.offload, seq_len=args.seq_len, recompute=args.recompute,
                  device_gb=args.device_gb, tp=layout.tp, sp=layout.sp, pp=layout.pp, schedule=layout.schedule,
                  microbatches=layout.microbatches, virtual_stages=layout.virtual_stages, links=links, cp=layout.cp,
                  cp_layout=layout.cp_layout, ep=args.ep, moe_experts=_calc_moe(args)[0],
                  memory_layout=args.memory_layout)
    table = calculator_table(batch=micro, **kwargs)
    _print_calc(args, layout, table, micro)
    if not micro:
        one = calculator_table(batch=1, **kwargs)  # the fullest rank may change once activations count
        print(f"  activations not counted: pass --batch-size (the global batch, as for run); with one sequence\n"
              f"  per micro-batch (--batch-size {layout.dp * layout.microbatches}) the fullest rank holds "
              f"{one['per_rank']['activations'] / 2**30:.2f} GiB of them, {one['total_gib']:.2f} GiB in all")
    if placement:
        print(f"topology: {placement}")
    _print_calc_pipeline_and_comm(table, layout)
    _print_calc_moe(args, layout, micro)
    if args.scaling:
        _print_scaling(args, layout, table, links)


def _calc_links(args: argparse.Namespace, layout: Any) -> tuple[dict[str, Any], str | None]:
    """The per-axis links calc prices and, with a topology, the line saying where each axis runs.

    Without --nodes/--intra-link/--inter-link: only the explicit --dp/tp/pp-link (the rest are DEFAULT_LINKS, as
    before topologies). With them: ``axis_links`` of the topology, each explicit --AXIS-link still overriding."""
    from workbench.theory.topology import LINK_PRESETS, Topology, axis_links, describe_placement, link_label

    explicit = {axis: getattr(args, f"{axis}_link") for axis in ("dp", "cp", "tp", "pp")
                if getattr(args, f"{axis}_link")}
    if args.nodes is None and args.intra_link is None and args.inter_link is None and args.distribution is None:
        return explicit, None
    topology = Topology.from_nproc(layout.nproc, 1 if args.nodes is None else args.nodes,
                                   intra=args.intra_link or LINK_PRESETS["nvlink"],
                                   inter=args.inter_link or LINK_PRESETS["infiniband"],
                                   distribution=args.distribution or "block")
    sizes = dict(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp)
    placement = describe_placement(topology, **sizes)
    overrides = [f"--{axis}-link {link_label(link, detail=True)}" for axis, link in explicit.items()]
    if overrides:
        placement += f" (overridden by {', '.join(overrides)})"
    return {**axis_links(topology, **sizes), **explicit}, placement


def _layout_label(args: argparse.Namespace) -> str:
    """" (classic layout)" after a mixed precision: the header says which memory layout the formula prices."""
    return "" if args.precision == "fp32" else f" ({args.memory_layout} layout)"


def _print_calc(args: argparse.Namespace, layout: Any, table: dict[str, Any], micro: int) -> None:
    cp = f" x cp {layout.cp} ({layout.cp_layout})" if layout.cp > 1 else ""
    axes = f"dp {layout.dp}{cp} x tp {layout.tp}{' (+sp)' if layout.sp else ''} x pp {layout.pp}"
    print(f"{table['model']}: {table['n_params']:,} parameters, nproc={layout.nproc} = {axes}, ZeRO-{layout.zero_stage}"
          f"{' + offload' if layout.offload else ''}, {args.precision}{_layout_label(args)}, {args.optimizer}  "
          f"[{table['formula']}]")
    worst = table["stages"][table["worst_stage"]]
    if layout.pp > 1:
        print(f"per rank on pipeline rank {worst['pp_rank']} (stages {worst['stages']}, {worst['layers']} layers; "
              f"the fullest of {layout.pp}):")
    if micro:
        print(f"  micro-batch: {micro} sequence(s) per rank, {layout.microbatches} per step, "
              f"recompute={args.recompute}")
    for category, nbytes in table["per_rank"].items():
        print(f"  {category:<16} {nbytes / 2**30:10.2f} GiB")
    print(f"  {'total per rank':<16} {table['total_gib']:10.2f} GiB")
    print(f"  fits in {table['device_gib']:g} GiB: {'yes' if table['fits'] else 'NO'}"
          + (f"  (offloaded to CPU: {table['cpu_gib']:.2f} GiB per rank)" if table["cpu_gib"] else ""))
    for note in table["notes"]:  # the memory layout, a Llama shape, K/V heads replicated past tp = n_kv_head
        print(f"  note: {note}")


def _print_calc_pipeline_and_comm(table: dict[str, Any], layout: Any) -> None:
    print(f"pipeline: {layout.schedule}, pp={layout.pp}, {layout.microbatches} micro-batch(es), "
          f"v={layout.virtual_stages}: bubble {table['bubble']:.1%}, peak in-flight "
          f"{'(stage, micro-batch) pairs' if layout.virtual_stages > 1 else 'micro-batches'} per pipeline rank "
          f"{table['peak_in_flight']}")
    comm = table["comm"]
    print(f"communication per step (α-β ring model, {table['comm_micro_batch']} sequence(s) per micro-batch, "
          f"nothing overlapped), on the slowest pipeline rank:")
    for axis in ("dp", "expert_dp", "cp", "tp", "pp"):
        if axis not in comm:  # expert_dp: a mixture of experts only
            continue
        c = comm[axis]
        if c["group_size"] == 1:
            print(f"  {axis}     1 rank   no traffic")
            continue
        print(f"  {axis}  {c['group_size']:>4} ranks  {c['wire_bytes'] / 1e9:10.3f} GB sent per rank  "
              f"{c['time_s'] * 1e3:10.2f} ms  [{c['link']['name']}]")
    print(f"  {'total':<45}{comm['total_time_s'] * 1e3:10.2f} ms")


def _print_scaling(args: argparse.Namespace, layout: Any, table: dict[str, Any], links: dict[str, Any]) -> None:
    """Weak and strong data-parallel efficiency at ``--scaling``'s GPU counts, the assumptions printed first."""
    from workbench.theory.models import MODEL_PRESETS
    from workbench.theory.scaling import scaling_curve
    from workbench.theory.topology import GPU_PEAK_FLOPS, LINK_PRESETS

    if args.batch_size is None:
        raise ValueError("--scaling prices each step's compute from the tokens per rank: pass --batch-size")
    if not 0 < args.mfu <= 1 or not 0 <= args.overlap <= 1:
        raise ValueError(f"--mfu must be in (0, 1] and --overlap in [0, 1], got {args.mfu} and {args.overlap}")
    if layout.cp > 1:
        raise ValueError(f"--scaling grows data parallelism over a fixed tp x pp; with --cp {layout.cp} each step's "
                         f"compute also depends on the ring's overlap, which it does not model: leave --cp out")
    model_parallel = layout.tp * layout.pp
    seq = args.seq_len or MODEL_PRESETS[args.model]["seq_len"]
    shard = table["n_params"] / model_parallel  # parameters (and gradients) per rank
    compute = 6 * shard * (args.batch_size / layout.dp) * seq / (GPU_PEAK_FLOPS[args.gpu] * args.mfu)
    # the gradients' dtype: 16-bit only in the classic mixed layout (amp's gradients are fp32, reduced in fp32)
    grad_bytes = shard * (2 if args.precision != "fp32" and args.memory_layout == "classic" else 4)
    per_node = layout.nproc // (args.nodes or 1) if args.nodes else 8
    dp_per_node = max(1, per_node // model_parallel)
    intra, inter = args.intra_link or LINK_PRESETS["nvlink"], args.inter_link or LINK_PRESETS["infiniband"]
    print(f"scaling (α-β, theory.scaling): data parallel over tp x pp = {model_parallel}; compute {args.gpu} at "
          f"{args.mfu:.0%} MFU = {compute:.3f} s per step; {grad_bytes / 1e9:.2f} GB of gradients all-reduced per "
          f"rank ({args.allreduce}), {args.overlap:.0%} of it overlapped; {per_node} GPUs per node, intra "
          f"{intra.name}, inter {inter.name}")
    worlds = [w for w in args.scaling if w % model_parallel == 0]
    dps = [w // model_parallel for w in worlds]
    common = dict(grad_bytes=grad_bytes, ranks_per_node=dp_per_node, intra=intra, inter=inter, overlap=args.overlap,
                  algorithm=args.allreduce)
    try:
        weak = scaling_curve(compute, worlds=dps, mode="weak", **common)
        strong = scaling_curve(compute * layout.dp, worlds=dps, mode="strong", **common)
    except ValueError as exc:
        raise ValueError(f"--scaling: {exc} (GPU counts are dp x tp x pp; use multiples of {per_node})") from None
    print(f"  {'GPUs':>6} {'nodes':>6} {'all-reduce':>11} {'weak eff':>9} {'strong eff':>11}")
    for world, dp, w, s in zip(worlds, dps, weak, strong, strict=True):
        nodes = max(1, world // per_node)
        # strong scaling splits the global batch: past one sequence per data-parallel rank there is nothing to split
        strong_eff = f"{s.efficiency:>11.1%}" if dp <= args.batch_size else f"{'n/a':>11}"
        print(f"  {world:>6} {nodes:>6} {w.allreduce_s * 1e3:>8.1f} ms {w.efficiency:>9.1%} {strong_eff}")
    if any(dp > args.batch_size for dp in dps):
        print(f"  (strong n/a: more data-parallel ranks than the {args.batch_size} sequences of --batch-size)")
    skipped = [w for w in args.scaling if w % model_parallel]
    if skipped:
        print(f"  (left out: {', '.join(map(str, skipped))}, not multiples of tp x pp = {model_parallel})")


def _bench(rest: list[str]) -> int:
    """The benchmarks of the installed course (the wheel's, or the checkout's ``benchmarks/``)."""
    import subprocess

    from workbench.course import benchmarks_dir

    try:
        script = benchmarks_dir() / "run.py"
    except FileNotFoundError as exc:
        print(f"workbench bench: {exc}", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *rest])


def _course_parser(sub: Any) -> None:
    p = sub.add_parser("course", help="copy the course's notebooks and labs into a folder of yours to work in")
    p.add_argument("folder", help="where to put them (notebooks/ and labs/ inside it)")
    p.add_argument("--force", action="store_true",
                   help="into a folder that is not empty: overwrite the course's files there, keep every other file")


def _course(args: argparse.Namespace) -> int:
    from workbench.course import copy_course

    try:
        copies = copy_course(args.folder, force=args.force)
    except (FileExistsError, FileNotFoundError, NotADirectoryError) as exc:
        print(f"workbench course: {exc}", file=sys.stderr)
        return 2
    folder = Path(args.folder)
    print(f"copied {len(copies)} notebooks and labs to {folder}/ (no lab solution among them)\n"
          f"open them:     jupyter lab {folder}\nstart a lab:   workbench labs start 02 {folder / 'work'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``workbench`` parser with its run, calc, bench and env subcommands."""
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    _calc_parser(sub)
    sub.add_parser("bench", help="run benchmarks/run.py (ours beside PyTorch's built-ins); flags pass through")
    env = sub.add_parser("env", help="what this machine offers a run: torch, backends, GPUs, cores, sensible --nproc")
    env.add_argument("--json", action="store_true", help="print the facts as JSON")
    _labs_parser(sub)
    _course_parser(sub)
    _ckpt_parser(sub)
    _report_parser(sub)
    return parser


def _labs_parser(sub: Any) -> None:
    labs = sub.add_parser("labs", help="list the labs, copy one to work in, grade a notebook headless, "
                                       "export them for nbgrader")
    verbs = labs.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", help="the labs and what each asks you to write")
    start = verbs.add_parser("start", help="copy a lab into a folder of yours (the original stays untouched)")
    start.add_argument("name", help="lab number or name, e.g. 02 or ring_allreduce")
    start.add_argument("folder", help="where to put your copy")
    check = verbs.add_parser("check", help="run your lab notebook headless and grade each exercise (exit 0: all pass)")
    check.add_argument("notebook", help="path of your lab notebook (.ipynb)")
    check.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    export = verbs.add_parser("export", help="write the labs as an nbgrader course source, with the reference "
                                             "solutions marked and each checker an autograded test (instructors)")
    export.add_argument("--nbgrader", required=True, metavar="DIR", help="the nbgrader course folder: writes "
                        "DIR/source/<lab>/<lab>.ipynb and DIR/nbgrader_config.py")
    export.add_argument("names", nargs="*", metavar="LAB", help="lab numbers or names (default: every lab)")
    export.add_argument("--solutions", metavar="PATH", help="the folder of reference solutions (default: the "
                        "checkout's labs/solutions; they never ship in the wheel)")
    export.add_argument("--points", type=_positive_int, default=1, help="points per exercise (default 1)")
    export.add_argument("--force", action="store_true", help="overwrite source notebooks already in DIR")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _labs_export(args: argparse.Namespace) -> None:
    from workbench.labs.nbgrader_export import export

    written = export(args.nbgrader, args.names, solutions=args.solutions, points=args.points, force=args.force)
    for path in written:
        print(f"wrote {path}")
    first = written[0].parent.name
    print(f"next, in {args.nbgrader}:  nbgrader generate_assignment {first}   (the release: "
          f"release/{first}/, solutions cut out)")


def _labs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from workbench.labs import grading

    try:
        if args.verb == "list":
            for stem, path in grading.available().items():
                print(f"{stem[:2]}  {stem:<32} {grading.title(path)}")
        elif args.verb == "start":
            copy = grading.start(args.name, args.folder)
            print(f"copied to {copy}\nopen it:   jupyter lab {copy}\ngrade it:  workbench labs check {copy}")
        elif args.verb == "export":
            _labs_export(args)
        else:
            verdicts = grading.grade(args.notebook, timeout=args.timeout)
            print(grading.report(verdicts))
            exercises = [v for v in verdicts if v.exercise]
            return 0 if exercises and all(v.passed for v in verdicts) else 1
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        parser.error(str(exc))
    return 0


def _step_arg(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        step = -1
    if step < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step: give an int >= 0 "
                                         f"(`workbench ckpt ls DIR` lists them)")
    return step


def _ckpt_parser(sub: Any) -> None:
    ckpt = sub.add_parser("ckpt", help="list a run's checkpoints, verify that they restore, export a full model")
    verbs = ckpt.add_subparsers(dest="verb", required=True)
    ls = verbs.add_parser("ls", help="each checkpoint's step, layout, size and status (exit 1: one is not good)")
    ls.add_argument("dir", help="the run's checkpoint directory (its --ckpt-dir)")
    verify = verbs.add_parser("verify", help="check every checksum and load every shard on the CPU against the "
                                             "model (exit 0: all restore)")
    verify.add_argument("dir", help="the run's checkpoint directory (its --ckpt-dir)")
    verify.add_argument("--step", type=_step_arg, help="verify this step's checkpoint only (default: every one)")
    export = verbs.add_parser("export", help="write one full (unsharded) model state dict, for torch.load and the "
                                             "model's load_state_dict")
    export.add_argument("dir", help="the run's checkpoint directory (its --ckpt-dir)")
    export.add_argument("--out", required=True, help="the .pt file to write")
    export.add_argument("--step", type=_step_arg, help="export this step (default: the newest good checkpoint)")


def _ckpt_model(run_config: dict[str, Any]) -> Any:
    """The unwrapped model a checkpoint's run config names, on the CPU: only the fields ``gpt_config`` and
    ``build_gpt`` read, so a config saved for another machine (its device, export path...) is not re-validated."""
    from workbench.models import build_gpt
    from workbench.training.config import RunConfig

    model_fields = ("model", "seq_len", "seed", "moe_experts", "moe_top_k", "moe_capacity_factor",
                    "moe_aux_loss_coef")
    cfg = RunConfig(**{k: run_config[k] for k in model_fields if k in run_config}, nproc=1, device="cpu")
    return build_gpt(cfg.gpt_config(), seed=cfg.seed, device="cpu")


def _ckpt_consolidate(folder: Path) -> None:
    """Gather a sharded checkpoint into ``FULL_STATE`` beside its shards, as a resharded resume gathers it."""
    from workbench.training.trainer import consolidate_checkpoint

    consolidate_checkpoint(folder)


def _ckpt(args: argparse.Namespace) -> int:
    """Exit 0: all good; 1: a checkpoint is corrupt, incomplete or does not restore; 2: DIR or --step is wrong."""
    from workbench.checkpoint import inspect as ckpt
    from workbench.checkpoint.store import CheckpointError

    try:
        if args.verb == "ls":
            infos = ckpt.list_checkpoints(args.dir)
            print(ckpt.format_listing(infos))
            return 0 if all(i.status == ckpt.GOOD for i in infos) else 1
        if args.verb == "verify":
            return _ckpt_verify_report(ckpt.verify_checkpoints(args.dir, args.step, _ckpt_model))
        folder = ckpt.select(args.dir, args.step)
        out = ckpt.export_model(folder, args.out, _ckpt_model, _ckpt_consolidate)
        print(f"exported {folder} to {out}: a full model state dict (torch.load(weights_only=True), "
              f"then model.load_state_dict)")
        return 0
    except ValueError as exc:
        print(f"workbench ckpt {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, RuntimeError, OSError) as exc:  # RankError too: a shard the gather could not load
        print(f"workbench ckpt {args.verb}: {exc}", file=sys.stderr)
        return 1


def _ckpt_verify_report(results: dict[Path, list[str]]) -> int:
    for folder, problems in results.items():
        print(f"{'OK  ' if not problems else 'FAIL'} {folder}")
        for problem in problems:
            print(f"     {problem}")
    bad = [folder.name for folder, problems in results.items() if problems]
    if bad:
        print(f"workbench ckpt verify: {len(bad)} of {len(results)} checkpoint(s) failed: {', '.join(bad)}",
              file=sys.stderr)
        return 1
    print(f"all {len(results)} checkpoint(s) verify and load")
    return 0


def _report_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="compare runs side by side in one offline page (loss, speed, memory, bytes)",
                       description="One self-contained HTML page comparing the runs that `workbench run --out DIR` "
                                   "wrote: loss curves overlaid, step time, tokens/s, peak memory per category, "
                                   "bytes moved per collective, and the settings that differ.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a directory written by `workbench run --out`")
    p.add_argument("--out", default="report-compare.html",
                   help="where to write the page (default: report-compare.html in the current directory)")


def _report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Every run directory is checked before anything is written: a bad one is one line naming it (exit 2)."""
    from workbench.viz.compare import RunDirError, write_compare

    try:
        out = write_compare(args.out, args.run_dirs)
    except RunDirError as exc:
        print(f"workbench report: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(args.run_dirs)} run(s) side by side)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # every later flag belongs to benchmarks/run.py
        return _bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        return _run(parser, args)
    if args.command == "labs":
        return _labs(parser, args)
    if args.command == "ckpt":
        return _ckpt(args)
    if args.command == "course":
        return _course(args)
    if args.command == "report":
        return _report(parser, args)
    elif args.command == "env":
        from workbench.dist.environment import describe_environment, format_environment

        info = describe_environment()
        print(json.dumps(info, indent=2) if args.json else format_environment(info))
    elif args.command == "calc":
        try:
            _calc(args)
        except ValueError as exc:
            parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
