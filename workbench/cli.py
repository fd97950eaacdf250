"""``workbench`` command line: ``run`` trains on N ranks (gloo on the CPU, or NCCL with one GPU per rank) and
writes a summary and a report; ``env`` says what this machine offers a run; ``calc`` prints the per-rank
memory of a training configuration; ``bench`` runs the benchmarks."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from workbench.launch import VALID_BACKENDS, VALID_DEVICES
from workbench.parallel import DDP_KINDS, ZERO_STAGES
from workbench.theory.pipeline import SCHEDULES

PIPELINE_SCHEDULES = tuple(SCHEDULES)


def _run_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="train the tiny GPT on N ranks; write summary.json and report.html")
    p.add_argument("--nproc", type=int, default=None,
                   help="number of ranks (1 = the single-process baseline; under torchrun: its WORLD_SIZE)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: nproc / tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (heads, MLP and vocabulary split)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism over the tp ranks (needs --tp > 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages of layers)")
    p.add_argument("--schedule", choices=PIPELINE_SCHEDULES, default="1f1b", help="pipeline schedule")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches per step (default 2 x pp)")
    p.add_argument("--virtual-stages", type=int, default=1, help="stages per rank (--schedule interleaved)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch, split across data-parallel ranks")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per rank per step")
    p.add_argument("--model", default="tiny", help="GPT preset: tiny, small, bench")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--clip", type=float, default=1.0, help="max global grad norm (0 disables)")
    p.add_argument("--seed", type=int, default=0, help="fixes model init and data order")
    p.add_argument("--ddp", choices=DDP_KINDS, default="bucketed", help="gradient synchronisation")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--zero", type=int, choices=ZERO_STAGES, default=0, help="ZeRO stage")
    p.add_argument("--offload", action="store_true", help="offload optimizer state (and stage-3 params) to CPU")
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


def _config_from_args(args: argparse.Namespace) -> Any:
    from workbench.launch import under_torchrun
    from workbench.train import RunConfig

    if args.nproc is not None:
        nproc = args.nproc
    else:
        nproc = int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1
    if args.clip is not None and args.clip < 0:
        raise ValueError(f"clip must be >= 0 (0 disables clipping), got {args.clip}")
    return RunConfig(model=args.model, seq_len=args.seq_len, nproc=nproc, dp=args.dp, tp=args.tp, pp=args.pp,
                     sp=args.sp, schedule=args.schedule, microbatches=args.microbatches,
                     virtual_stages=args.virtual_stages, steps=args.steps,
                     batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr, warmup=args.warmup,
                     clip=args.clip or None, seed=args.seed, ddp=args.ddp, bucket_mb=args.bucket_mb,
                     zero=args.zero, offload=args.offload, data=args.data, timeout=args.timeout,
                     device=args.device, backend=None if args.backend == "auto" else args.backend, port=args.port)


def run_training(cfg: Any, out: str | Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Launch ``cfg.nproc`` ranks, train, and (with ``out``) write summary.json and report.html."""
    from tqdm.auto import tqdm

    from workbench.launch import launch, under_torchrun
    from workbench.train import train_rank

    # Under torchrun every process runs this function; only global rank 0 draws and writes.
    lead = not under_torchrun() or os.environ.get("RANK") == "0"
    bar = tqdm(total=cfg.steps, desc=f"training on {cfg.nproc} rank(s)", disable=not (progress and lead),
               file=sys.stderr)

    def on_report(rank: int, metrics: dict[str, Any]) -> None:
        if rank == 0:
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")

    try:
        results = launch(train_rank, cfg.nproc, cfg, timeout=cfg.timeout, on_report=on_report, device=cfg.device,
                         backend=cfg.backend, port=cfg.port)
    finally:
        bar.close()
    summary = summarize(cfg, results[0], results.traces)
    if out is not None and lead:
        write_outputs(Path(out), summary, results.traces)
    return summary


def summarize(cfg: Any, rank0: dict[str, Any], traces: list[Any]) -> dict[str, Any]:
    history = rank0["history"]
    steady = [m["tokens_per_s"] for m in history[1:]] or [history[0]["tokens_per_s"]]
    return {
        "config": cfg.to_dict(), "strategy": rank0["strategy"], "n_params": rank0["n_params"],
        "losses": [m["loss"] for m in history], "tokens_per_s": statistics.median(steady),
        "step_time_s": statistics.median(m["step_time_s"] for m in history[1:] or history),
        "final_params_sha256": rank0["final_params_sha256"], "history": history,
        "placement": rank0.get("placement"),
        "memory_peak_bytes": [t.memory.peak for t in traces],
        "device_memory": [asdict(t.device_memory) if t.device_memory is not None else None for t in traces],
        "mesh": _mesh(cfg),
        "comm_groups": comm_group_labels(_mesh(cfg)),
        **({"pipeline": _pipeline_summary(cfg, traces)} if cfg.pp > 1 else {}),
    }


def _mesh(cfg: Any) -> dict[str, int]:
    """The run's mesh axes (context parallelism is not a run flag yet: cp is always 1)."""
    return {"pp": cfg.pp, "dp": cfg.dp, "cp": getattr(cfg, "cp", 1), "tp": cfg.tp}


def comm_group_labels(mesh: dict[str, int]) -> list[dict[str, Any]]:
    """Every process group of the mesh as ``{"ranks": [...], "axis": name}``, so a report can say which axis
    a collective ran on. Axes of size 1 only give one-rank groups; the whole world is labelled by the single
    axis it equals (e.g. ``dp`` for plain data parallelism), else ``world``."""
    from workbench.mesh import AXES, MeshShape

    shape = MeshShape(**mesh)
    labels: dict[tuple[int, ...], str] = {}
    for axis in sorted(AXES, key=lambda a: mesh[a] == 1):  # real axes first: they win a shared group
        for group in shape.all_axis_groups(axis):
            labels.setdefault(tuple(sorted(group)), axis)
    labels.setdefault(tuple(range(shape.world_size)), "world")
    return [{"ranks": list(ranks), "axis": axis} for ranks, axis in labels.items()]


def _pipeline_summary(cfg: Any, traces: list[Any]) -> dict[str, Any]:
    """Schedule, theory's bubble beside the measured one (median over the traced steps) and activation peaks."""
    from workbench.mesh import MeshShape
    from workbench.parallel.pipeline import busy_intervals, measured_bubble
    from workbench.theory.pipeline import bubble_fraction

    traced = sorted({s.step for t in traces for s in t.spans if s.step is not None})
    steps = [step for step in traced if all(busy_intervals(traces, step).values())]
    measured = [measured_bubble(traces, step) for step in steps]
    per_rank = [int(t.memory.peak.get("activations", 0)) for t in traces]
    shape = MeshShape(**_mesh(cfg))
    per_stage = [max((b for t, b in zip(traces, per_rank, strict=True) if shape.coords(t.rank)["pp"] == stage),
                     default=0) for stage in range(cfg.pp)]
    return {"schedule": cfg.schedule, "microbatches": cfg.microbatches, "virtual_stages": cfg.virtual_stages,
            "bubble_theory": bubble_fraction(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages),
            "bubble_measured": statistics.median(measured) if measured else None,
            "traced_steps": steps,
            "peak_activation_bytes_per_rank": per_rank,
            "peak_activation_bytes_per_stage": per_stage}


def write_outputs(out: Path, summary: dict[str, Any], traces: list[Any]) -> None:
    from workbench.viz.report import write_report

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "traces.json").write_text(json.dumps([t.to_dict() for t in traces]))
    write_report(out / "report.html", summary, traces)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Validate everything before a rank starts (a bad flag is one line, exit 2); a rank's failure is one
    paragraph naming the rank and where it failed (exit 1), not a traceback of the launcher."""
    from workbench.launch import RankError, resolve_placement, under_torchrun

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


def _calc_parser(sub: Any) -> None:
    p = sub.add_parser("calc", help="per-rank memory of a training configuration (theory)")
    p.add_argument("--model", default="llama-7B", help="a preset of workbench.theory.models.MODEL_PRESETS")
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--zero", type=int, choices=ZERO_STAGES, default=0)
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--offload", action="store_true")


def _calc(args: argparse.Namespace) -> None:
    from workbench.widgets.memory_calculator import calculator_table

    table = calculator_table(model=args.model, dp=args.dp, zero_stage=args.zero, precision=args.precision,
                             optimizer=args.optimizer, offload=args.offload)
    print(f"{table['model']}: {table['n_params']:,} parameters, dp={args.dp}, ZeRO-{args.zero}, "
          f"{args.precision}, {args.optimizer}  [{table['formula']}]")
    for category, nbytes in table["per_rank"].items():
        print(f"  {category:<16} {nbytes / 2**30:10.2f} GiB")
    print(f"  {'total per rank':<16} {table['total_gib']:10.2f} GiB")


def _bench(rest: list[str]) -> int:
    """Benchmarks live beside the package in a source checkout (they are not installed with it)."""
    import subprocess

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
    if not script.exists():
        print(f"workbench bench needs a source checkout: {script} not found", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *rest])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # every later flag belongs to benchmarks/run.py
        return _bench(argv[1:])
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _run_parser(sub)
    _calc_parser(sub)
    sub.add_parser("bench", help="run benchmarks/run.py (ours beside PyTorch's built-ins); flags pass through")
    env = sub.add_parser("env", help="what this machine offers a run: torch, backends, GPUs, cores, sensible --nproc")
    env.add_argument("--json", action="store_true", help="print the facts as JSON")
    args = parser.parse_args(argv)
    if args.command == "run":
        return _run(parser, args)
    elif args.command == "env":
        from workbench.environment import describe_environment, format_environment

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
