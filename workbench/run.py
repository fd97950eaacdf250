"""One run, start to end: what ``workbench run``, a notebook's ``run_training``, the live dashboard and torchrun
all call. It prepares a resume (resharding a checkpoint saved on another layout), launches the ranks
(``training.trainer.train_rank`` on each), collects their results and restarts, summarizes them (``summary.json``'s
shape) and writes ``summary.json``, ``traces.json`` and ``report.html``. The summary covers the whole run from
step 0, over every attempt and every ``--resume``: rank 0's metrics are appended to the run's record as they
stream in (``workbench.record``, ``<ckpt_dir>/record.jsonl``; ``open_record``, ``whole_run_summary``).
``live=True`` trains behind a ``widgets.dashboard.Dashboard``, which only draws what the ranks stream: this
module owns the run, its thread and its Stop file (``LiveRun``).

Preemption (docs/preemption.md): while ``run_training`` runs in the main thread, the first SIGTERM or SIGINT (what
Slurm and Kubernetes send before they kill a job, or Ctrl-C) creates the same Stop file the dashboard's button
does: every rank finishes its step, they agree on the step to stop at, a checkpoint is saved there (with
``ckpt_dir``), and summary.json and report.html are written with ``"preempted": {"step": N, "signal": ...}``;
``workbench run`` then exits with ``PREEMPTED_EXIT_CODE``. A second signal tears the ranks down at once
(``KeyboardInterrupt`` for SIGINT, ``SystemExit(128 + signum)`` for SIGTERM).

``workbench.cli`` parses flags into a ``RunConfig`` and calls ``run_training``; it re-exports the names that
lived there before (``workbench.cli.run_training``, ``summarize``, ``write_outputs``, ``comm_group_labels``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from workbench.dist.notices import in_kernel, say

#: ``workbench run``'s exit status after a graceful preemption: sysexits.h's EX_TEMPFAIL ("a temporary failure; the
#: user is invited to retry"): the checkpoint of the stop step is good, rerun with --resume. Not 128 + signum, which a
#: shell also reports for a process the signal killed (nothing saved); a second signal exits with that instead.
PREEMPTED_EXIT_CODE = 75
#: The signals that preempt a run: SIGTERM (Slurm, Kubernetes, docker stop) and SIGINT (Ctrl-C).
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGINT)

if TYPE_CHECKING:  # the dashboard (ipywidgets, plotly) is imported only by a live run: the CLI starts without it
    from workbench.dist.emulation import LinkEmulation
    from workbench.record import RunRecord
    from workbench.training.config import RunConfig  # and torch only once a run starts: `workbench --help` is quick
    from workbench.widgets.dashboard import Dashboard


def run_training(cfg: RunConfig, out: str | Path | None = None, progress: bool = True, live: bool = False,
                 on_metrics: Callable[[int, dict[str, Any]], None] | None = None) -> Any:
    """Launch ``cfg.nproc`` ranks, train, and (with ``out``) write summary.json and report.html.

    ``on_metrics(rank, metrics)`` is called in this process after every step of every rank (the step's metrics,
    that rank's ledger peaks and the bytes each collective moved: ``train._streamed``). ``live=True`` shows a
    dashboard that updates while the ranks train, with a Stop button (``run_live``, which says
    what it returns); headless it draws the same figures once at the end. In the main thread SIGTERM and SIGINT
    preempt the run (``preemptible``): the summary then says ``"preempted"``.
    """
    if live:
        return run_live(cfg, out)
    from workbench.dist.launch import launch, under_torchrun
    from workbench.training.trainer import train_rank

    # Under torchrun every process runs this function; only global rank 0 draws and writes.
    lead = not under_torchrun() or os.environ.get("RANK") == "0"
    cfg, torchrun_resize = torchrun_world(cfg) if under_torchrun() else (cfg, None)
    bar = progress_bar(cfg.steps, f"training on {cfg.nproc} rank(s)", enabled=progress and lead)
    streamed: list[dict[str, Any]] = []  # rank 0's metrics of every attempt: a restart's history starts later
    record = open_record(cfg) if lead else None  # the whole run's record (workbench.record): one writer

    worlds: list[dict[str, Any]] = []  # an elastic run's world changes (``_launch_elastic``)

    def on_report(rank: int, metrics: dict[str, Any]) -> None:
        metrics = {**metrics, "world": len(worlds)} if worlds else metrics  # which world trained it
        if rank == 0:
            streamed.append(metrics)
            if record is not None:
                record.metrics(metrics, world_size=worlds[-1]["nproc"][1] if worlds else cfg.nproc)
            bar.update(metrics["step"] + 1, metrics["loss"], metrics["tokens_per_s"])  # a restart goes back
        if on_metrics is not None:
            on_metrics(rank, metrics)

    if cfg.resume and lead or under_torchrun() and cfg.min_nproc is not None:  # torchrun: each process's own
        prepare_resume(cfg, lead)
    if torchrun_resize is not None and record is not None:
        record.event("world_size", **torchrun_resize)
    links = cfg.link_emulation()
    with preemptible(cfg) as (cfg, preemption), recording(record):
        try:
            if cfg.netns:
                results = _run_on_shaped_link(cfg)
            else:
                def launch_world(cfg: RunConfig) -> Any:
                    return launch(train_rank, cfg.nproc, cfg, timeout=cfg.timeout, on_report=on_report,
                                  device=cfg.device, backend=cfg.backend, port=cfg.port,
                                  max_restarts=cfg.max_restarts, straggler=cfg.straggler, **_link_keywords(links))

                results, cfg = _launch_elastic(cfg, launch_world, worlds)
        finally:
            bar.close()
        summary = _summary(cfg, results, streamed, links, preemption, worlds)
        if record is not None:
            whole_run_summary(cfg, record, summary, results, streamed)
        if out is not None and lead:  # a first signal now changes nothing; a second still stops the writing
            write_outputs(Path(out), summary, results.traces)
    return summary


class LineProgress:
    """Progress for a log (CI, ``workbench run > log 2>&1``, a batch job): a redrawn bar writes a line per redraw
    there, two per step. Instead one line every ``ceil(total / lines)`` steps, the first step's and the last's,
    each step once: a restart that goes back to a checkpoint does not show its redone steps again."""

    def __init__(self, total: int, desc: str, file: TextIO, lines: int = 10) -> None:
        self.total, self.desc, self.file = total, desc, file
        self.every = max(1, math.ceil(total / max(1, lines)))
        self.shown = 0  # the highest step shown, counted from 1
        self.last: tuple[int, float, float] | None = None  # the latest update: close() shows it if it was skipped
        self.start = time.monotonic()

    def update(self, done: int, loss: float, tokens_per_s: float) -> None:
        """Step ``done`` (counted from 1) finished with this loss and throughput."""
        self.last = (done, loss, tokens_per_s)
        if done > self.shown and (done == 1 or done % self.every == 0 or done >= self.total):
            self._show(*self.last)

    def close(self) -> None:
        """Show the last step if its line was skipped (a run stopped or preempted between two lines)."""
        if self.last is not None and self.last[0] > self.shown:
            self._show(*self.last)

    def _show(self, done: int, loss: float, tokens_per_s: float) -> None:
        self.shown = done
        print(f"{self.desc}: step {done}/{self.total}, loss {loss:.3f}, {tokens_per_s:.0f} tok/s, "
              f"{time.monotonic() - self.start:.1f}s", file=self.file, flush=True)


class BarProgress:
    """tqdm's bar, in a terminal or a notebook (``tqdm.auto``: a widget there); redrawn once per step."""

    def __init__(self, total: int, desc: str, file: TextIO, enabled: bool = True) -> None:
        from tqdm.auto import tqdm  # only once a run starts: `workbench --help` is quick

        self.bar = tqdm(total=total, desc=desc, disable=not enabled, file=file)

    def update(self, done: int, loss: float, tokens_per_s: float) -> None:
        """Step ``done`` (counted from 1) finished; a restart moves the bar back to its checkpoint's step."""
        self.bar.n = done
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def progress_bar(total: int, desc: str, enabled: bool = True,
                 file: TextIO | None = None) -> LineProgress | BarProgress:
    """The run's progress on ``file`` (stderr): tqdm's bar in a terminal or a notebook, ``LineProgress``'s few
    lines where nobody watches a redraw (stderr is a file or a pipe: a CI log)."""
    file = sys.stderr if file is None else file
    if enabled and not _is_tty(file) and not in_kernel():
        return LineProgress(total, desc, file)
    return BarProgress(total, desc, file, enabled)


def _is_tty(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # not a real stream, or a closed one: no terminal to redraw
        return False


def _summary(cfg: RunConfig, results: Any, streamed: list[dict[str, Any]], links: LinkEmulation | None,
             preemption: Preemption | None, worlds: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """summary.json's content for the ranks' ``results``, with what this run added on top of ``summarize``."""
    summary = summarize(cfg, results[0], results.traces)
    if worlds:
        summary["elastic"] = _elastic_log(worlds, streamed)
    if cfg.ps_servers is not None:
        from workbench.training.param_server_run import ps_summary

        summary["parameter_server"] = ps_summary(cfg, list(results))
    if links is not None:
        summary["links"] = links_summary(links, results.traces)
    if cfg.netns:
        summary["links"] = _netns_summary(cfg)
    if results.restarts:
        summary["restarts"] = _restart_log(results.restarts, streamed, summary)
    if preemption is not None and (preempted := preemption.outcome(summary["stopped_after_step"])):
        summary["preempted"] = preempted
    return summary


def _launch_elastic(cfg: RunConfig, launch_world: Callable[[RunConfig], Any],
                    worlds: list[dict[str, Any]]) -> tuple[Any, RunConfig]:
    """``launch_world(cfg)``; with ``--min-nproc``, each time a rank is lost for good (``dist.faults``'s ``lose``)
    the survivors go on from the newest checkpoint, resharded to one rank fewer with the same global batch
    (``training.elastic``), while at least ``min_nproc`` are left. Appends each change to ``worlds``; returns the
    last world's results and config."""
    from workbench.dist.faults import LOST_RANK_EXIT_CODE
    from workbench.dist.launch import RankError
    from workbench.training.elastic import micro_batch, striking_lose

    budget = micro_batch(cfg)  # the first world's micro-batch: the memory a rank has, kept through every change
    while True:
        try:
            return launch_world(cfg), cfg
        except RankError as error:
            if cfg.min_nproc is None or error.exit_code != LOST_RANK_EXIT_CODE:
                raise
            spec = striking_lose(cfg, error.rank)
            lost = (error.rank,) if spec is None else spec.ranks
            if cfg.nproc - len(lost) < cfg.min_nproc:
                raise RankError(error.rank, f"{error.message}\nonly {cfg.nproc - len(lost)} rank(s) are left, fewer "
                                f"than min_nproc={cfg.min_nproc}: the run stops (its checkpoints in {cfg.ckpt_dir} "
                                f"resume with --resume on more ranks)", error.remote_traceback,
                                error.exit_code) from error
            cfg = _shrink(cfg, lost, -1 if spec is None else spec.step, budget, worlds)


def _shrink(cfg: RunConfig, lost: tuple[int, ...], struck_step: int, budget: int,
            worlds: list[dict[str, Any]]) -> RunConfig:
    """The next world after the ``lost`` ranks are gone (by the ``lose`` spec of ``struck_step``; -1: none named
    them): ``cfg`` on the survivors, resuming from the newest checkpoint (resharded here, before they start) or from
    step 0 when none was written yet."""
    from workbench.checkpoint.resume import find_resume_point
    from workbench.checkpoint.store import list_steps, read_manifest
    from workbench.dist.faults import after_shrink, parse_faults
    from workbench.record import record_event
    from workbench.training.elastic import resized
    from workbench.training.trainer import prepare_resharded_resume

    smaller = resized(cfg, cfg.nproc - len(lost), budget, resume=bool(list_steps(cfg.ckpt_dir)),
                      faults_left=after_shrink(parse_faults(cfg.inject_fault), struck_step))
    step = None
    if smaller.resume:
        step = read_manifest(find_resume_point(smaller))["step"]
        prepare_resharded_resume(smaller)
    who = f"rank {lost[0]}" if len(lost) == 1 else f"ranks {', '.join(map(str, lost))}"
    worlds.append({"lost_rank": lost[0], "lost_ranks": list(lost), "nproc": [cfg.nproc, smaller.nproc],
                   "grad_accum": [cfg.grad_accum, smaller.grad_accum], "resumed_from_step": step,
                   "time": time.time()})
    record_event(cfg.ckpt_dir, "world_size", world_size=smaller.nproc, step=step, grad_accum=smaller.grad_accum,
                 reason=f"{who} lost for good")
    record_event(cfg.ckpt_dir, "attempt", cause="shrink", world=len(worlds), world_size=smaller.nproc,
                 layout={**_mesh(smaller), "zero": smaller.zero, "grad_accum": smaller.grad_accum})
    say(f"{who} {'is' if len(lost) == 1 else 'are'} lost for good: going on with {smaller.nproc} rank(s) from "
        + (f"the checkpoint of step {step}" if step is not None else "step 0 (no checkpoint yet)")
        + f", the same global batch of {cfg.batch_size} (gradient accumulation {cfg.grad_accum} -> "
        f"{smaller.grad_accum})")
    return smaller


def _elastic_log(worlds: list[dict[str, Any]], streamed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each world change with the last step the world before it finished (the summary's curve over every world
    comes from the run's record: ``whole_run_summary``)."""
    done: dict[int, int] = {}
    for m in streamed:
        done[m.get("world", 0)] = m["step"]
    return [{**w, "last_step_done": done.get(i)} for i, w in enumerate(worlds)]


class Preemption:
    """The signals a run caught (``preemptible``): the first creates ``stop_file`` (every rank then stops after its
    step: ``train.StopSignal``), the second stops the run at once by raising in the main thread, which tears the
    ranks down as any error does (``launch``: SIGTERM, then SIGKILL after a grace period)."""

    def __init__(self, stop_file: Path) -> None:
        self.stop_file = stop_file
        self.signal: str | None = None  # the first signal's name, once one came

    def handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal = name
            self.stop_file.touch()
            say(f"{name}: every rank stops after its current step (saving a checkpoint there with --ckpt-dir); "
                f"send it again to stop at once")
            return
        say(f"{name} again: stopping the ranks now (nothing more is saved)")
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def outcome(self, stopped_after_step: int | None) -> dict[str, Any] | None:
        """summary.json's ``preempted``, or None: no signal came, or it came too late to stop anything (the ranks
        had trained every step, or run a loop that does not look for the stop file: a parameter server's)."""
        if self.signal is None or stopped_after_step is None:
            return None
        return {"step": stopped_after_step, "signal": self.signal, "exit_code": PREEMPTED_EXIT_CODE}


@contextlib.contextmanager
def preemptible(cfg: RunConfig) -> Iterator[tuple[RunConfig, Preemption | None]]:
    """While in the block, SIGTERM and SIGINT preempt the run (``Preemption``). Yields the config the ranks must
    get (with a stop file in ``extra``: the live run's own, or a temporary one) and the ``Preemption``; None, and
    ``cfg`` as it is, outside the main thread, where Python cannot catch a signal (a live run's thread: its Stop
    button is the way there). The previous handlers are put back on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield cfg, None
        return
    own_dir = None
    if cfg.extra.get("stop_file") is None:
        own_dir = Path(tempfile.mkdtemp(prefix="workbench-stop-"))
        cfg = dataclasses.replace(cfg, extra={**cfg.extra, "stop_file": str(own_dir / "stop")})
    preemption = Preemption(Path(cfg.extra["stop_file"]))
    previous = {signum: signal.signal(signum, preemption.handle) for signum in PREEMPT_SIGNALS}
    try:
        yield cfg, preemption
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


def _run_on_shaped_link(cfg: RunConfig) -> Any:
    """``--netns``: the ranks of each node in a network namespace of their own, joined by real links shaped with tc
    tbf to the inter-node bandwidth (``workbench.dist.netns``: a veth pair for 2 nodes, a switch from 3); refused,
    naming what is missing, without root."""
    from workbench.dist import netns
    from workbench.training.trainer import train_rank

    reason = netns.unavailable_reason(cfg.nodes)
    if reason is not None:
        raise ValueError(f"--netns needs network namespaces and tc tbf, which this process cannot use: {reason}")
    rate = _netns_rate(cfg)
    # the whole run's bound: every step may take up to the collective timeout (a hung collective fails sooner)
    return netns.launch_shaped(train_rank, cfg.nproc, rate, cfg, nodes=cfg.nodes,
                               timeout=cfg.timeout * (cfg.steps + 5), group_timeout=cfg.timeout)


def _netns_rate(cfg: RunConfig) -> float:
    from workbench.theory.topology import parse_link

    return parse_link(cfg.inter_link).bandwidth


def _netns_summary(cfg: RunConfig) -> dict[str, Any]:
    rate, nodes = _netns_rate(cfg), cfg.nodes
    joined = "a veth pair" if nodes == 2 else "veth pairs to a switch (a bridge), each"
    return {"netns": True, "emulated": False, "nodes": nodes, "ranks_per_node": cfg.nproc // nodes, "rate_Bps": rate,
            "describe": f"{nodes} nodes x {cfg.nproc // nodes} ranks in network namespaces of their own, joined by "
                        f"{joined} shaped with tc tbf to {rate / 1e6:g} MB/s each way (real time, not emulated; the "
                        f"latency is the real link's, not the spec's)",
            "rank0_by_link": {}}


def _link_keywords(links: LinkEmulation | None) -> dict[str, Any]:
    """``launch``'s topology keywords for ``links`` (none: no emulation)."""
    if links is None:
        return {}
    topo = links.topology
    return {"nodes": topo.nodes, "intra_link": topo.intra, "inter_link": topo.inter, "time_scale": links.time_scale,
            "distribution": topo.distribution}


def links_summary(links: LinkEmulation, traces: list[Any]) -> dict[str, Any]:
    """What summary.json says of emulated links: the topology, the time scale it ran at, and per link class the
    bytes rank 0 sent, with the modelled and the measured seconds of those ops (emulated time, labelled so)."""
    per_class: dict[str, dict[str, float]] = {}
    for event in traces[0].comms if traces else []:
        if not event.link:
            continue
        row = per_class.setdefault(event.link, {"ops": 0, "bus_bytes": 0.0, "modelled_s": 0.0, "measured_s": 0.0})
        row["ops"] += 1
        row["bus_bytes"] += event.bus_bytes
        row["modelled_s"] += event.modelled_s or 0.0
        row["measured_s"] += event.t1 - event.t0
    topo = links.topology
    return {"emulated": True, "describe": links.describe(), "nodes": topo.nodes, "ranks_per_node": topo.ranks_per_node,
            "distribution": topo.distribution,
            "intra": {"alpha_s": topo.intra.alpha, "bandwidth_Bps": topo.intra.bandwidth},
            "inter": {"alpha_s": topo.inter.alpha, "bandwidth_Bps": topo.inter.bandwidth},
            "time_scale": links.time_scale, "rank0_by_link": per_class}


def prepare_resume(cfg: RunConfig, lead: bool = True) -> None:
    """A resume on another layout gathers the checkpoint into full tensors first (``train.prepare_resharded_resume``,
    which launches the saved layout's ranks on the CPU). Under torchrun, whose processes are the ranks, only an
    elastic run (``--min-nproc``: torchrun's ``--nnodes MIN:MAX`` re-formed the world) may change layout: its rank 0
    gathers the checkpoint in a process group of its own, and every other process waits for the file."""
    from workbench.checkpoint.resume import find_resume_point, layout_changes
    from workbench.checkpoint.store import list_steps, read_manifest
    from workbench.dist.faults import restart_count
    from workbench.dist.launch import under_torchrun
    from workbench.training.trainer import prepare_resharded_resume

    if not under_torchrun():
        if note := prepare_resharded_resume(cfg):
            say(note)
        return
    if cfg.min_nproc is None:
        saved = read_manifest(find_resume_point(cfg))["meta"]["run_config"]
        if changes := layout_changes(cfg, saved):
            raise ValueError(f"resuming on another layout ({'; '.join(changes)}) is not supported under torchrun: "
                             f"run `workbench run --resume` with the new layout without torchrun, or let an elastic "
                             f"run (--min-nproc) re-form it")
        return
    if not (cfg.resume or restart_count() > 0) or not list_steps(cfg.ckpt_dir):
        return
    point = find_resume_point(cfg, finished_ok=restart_count() > 0)
    if layout_changes(cfg, read_manifest(point)["meta"]["run_config"]):
        # one launch of the saved layout, each of its collectives bounded by --timeout: 5x that bounds the wait
        _gather_outside_torchrun(point) if lead else _wait_for_gathered(point, 5 * cfg.timeout)


def _gather_outside_torchrun(point: Path) -> None:
    """``consolidate_checkpoint(point)`` in a child process without torchrun's variables, so its ranks form a group
    of their own on this host (the checkpoint store is shared, as a resume on any node needs)."""
    import subprocess

    from workbench.checkpoint.resume import FULL_STATE
    from workbench.dist.launch import TORCHRUN_VARIABLES

    if (point / FULL_STATE).is_file():
        return
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
    code = ("import sys; from workbench.training.trainer import consolidate_checkpoint; "
            "consolidate_checkpoint(sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(point)], env=env, check=True)
    say(f"resharding {point.name} for the world torchrun formed ({os.environ.get('WORLD_SIZE')} ranks)")


def _wait_for_gathered(point: Path, timeout: float) -> None:
    from workbench.checkpoint.resume import FULL_STATE

    deadline = time.time() + timeout
    while not (point / FULL_STATE).is_file():
        if time.time() > deadline:
            raise TimeoutError(f"rank 0 did not gather {point} into {FULL_STATE} within {timeout:g} s (5 x --timeout)")
        time.sleep(0.1)


def torchrun_world(cfg: RunConfig) -> tuple[RunConfig, dict[str, Any] | None]:
    """Under torchrun: ``cfg`` for the world this attempt's rendezvous formed. With ``--min-nproc`` and torchrun's
    ``--nnodes MIN:MAX`` a lost node's agent is gone and the survivors' agent restarts its workers in a smaller world
    (a node that comes back makes it larger again): the run keeps its global batch by gradient accumulation, as
    ``--min-nproc`` does without torchrun (``training.elastic``). Returns the config and, when it changed, the
    record's ``world_size`` event."""
    from workbench.checkpoint.store import list_steps
    from workbench.training.elastic import micro_batch, resized

    world = int(os.environ["WORLD_SIZE"])
    if cfg.min_nproc is None or world == cfg.nproc:
        return cfg, None
    if not cfg.min_nproc <= world <= cfg.nproc:
        raise ValueError(f"torchrun formed a world of {world} ranks; this elastic run goes on with "
                         f"{cfg.min_nproc}..{cfg.nproc} (--min-nproc..--nproc)")
    smaller = resized(cfg, world, micro_batch(cfg), resume=bool(list_steps(cfg.ckpt_dir)))
    if os.environ.get("RANK") == "0":  # every process resizes; one says so
        say(f"torchrun formed a world of {world} rank(s) (of {cfg.nproc}): the same global batch of {cfg.batch_size}, "
            f"gradient accumulation {cfg.grad_accum} -> {smaller.grad_accum}")
    return smaller, {"world_size": world, "grad_accum": smaller.grad_accum,
                     "reason": f"torchrun's rendezvous formed {world} of {cfg.nproc} ranks"}


def _restart_log(restarts: list[dict[str, Any]], streamed: list[dict[str, Any]],
                 summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each restart with the last step its attempt finished; the summary's loss curve gets the steps that the
    failed attempts trained before the step the final attempt resumed from (redone steps count once, as the
    final attempt ran them)."""
    final = summary["history"]
    first_final = final[0]["step"] if final else math.inf
    last_attempt = len(restarts)
    before = {m["step"]: _plain_metrics(m) for m in streamed
              if m.get("attempt", 0) < last_attempt and m["step"] < first_final}
    summary["history"] = [before[s] for s in sorted(before)] + final
    summary["losses"] = [m["loss"] for m in summary["history"]]
    done = {}
    for m in streamed:
        done[m.get("attempt", 0)] = m["step"]
    return [{**r, "last_step_done": done.get(r["attempt"] - 1)} for r in restarts]


def _plain_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if k not in ("rank", "memory_peak", "comm_bytes", "attempt")}


def open_record(cfg: RunConfig) -> RunRecord:
    """The run's record (``workbench.record``) for this invocation, its first attempt begun: in
    ``<ckpt_dir>/record.jsonl`` when checkpoints are kept (a resume, or a restarted torchrun attempt, continues
    it; a new run starts it afresh), in memory otherwise."""
    from workbench.dist.faults import restart_count
    from workbench.record import RunRecord, record_path

    again = restart_count()  # > 0 under torchrun: this process is a restarted attempt of the same run
    record = RunRecord(None if cfg.ckpt_dir is None else record_path(cfg.ckpt_dir), fresh=not cfg.resume and not again)
    cause = "restart" if again else "resume" if cfg.resume else "start"  # a restarted torchrun attempt may resume
    record.start(cause, cfg.nproc, {**_mesh(cfg), "zero": cfg.zero}, number=again)
    return record


@contextlib.contextmanager
def recording(record: RunRecord | None) -> Iterator[None]:
    """While in the block ``record_event(ckpt_dir, ...)`` appends through ``record``; an error that ends the run
    (every restart spent, a second signal) is written as the attempt's end before it propagates."""
    if record is None:
        yield
        return
    with record:
        try:
            yield
        except BaseException as exc:
            record.event("end", outcome="failed", error=type(exc).__name__)
            raise


def whole_run_summary(cfg: RunConfig, record: RunRecord, summary: dict[str, Any], results: Any,
                      streamed: list[dict[str, Any]]) -> None:
    """Write what this invocation's end knows into ``record`` (restarts with their reasons, checkpoint saves,
    a preemption, the outcome), then make ``summary`` the whole run's: ``history`` and ``losses`` from step 0
    over every attempt and invocation, ``attempts``, and ``record`` (its file, events and checkpoint steps)."""
    from workbench.record import checkpoint_steps

    if not streamed:  # a path that streams nothing (netns): the final attempt's history, at its end
        for m in results[0]["history"]:
            record.metrics({**m, "attempt": results[0].get("attempt", 0)}, world_size=cfg.nproc)
    world = len(summary.get("elastic") or [])
    for r in summary.get("restarts") or []:
        record.event("restart", attempt=r.get("attempt"), world=world, rank=r.get("rank"), reason=r.get("reason"))
    for step in _new_checkpoint_steps(cfg, summary, streamed, checkpoint_steps(record.lines)):
        record.event("checkpoint", step=step)
    if preempted := summary.get("preempted"):
        record.event("preempted", step=preempted["step"], signal=preempted["signal"])
    outcome = "preempted" if preempted else "stopped" if summary.get("stopped_after_step") is not None else "finished"
    whole = record.whole_run()
    last = whole["history"][-1]["step"] if whole["history"] else None
    record.event("end", outcome=outcome, last_step=last, world_size=cfg.nproc)
    whole = record.whole_run()
    summary["history"] = whole["history"]
    summary["losses"] = [m["loss"] for m in whole["history"]]
    summary["attempts"] = whole["attempts"]
    summary["health"]["val_losses"] = [[m["step"], m["val_loss"]] for m in whole["history"] if "val_loss" in m]
    summary["record"] = {"path": None if record.path is None else str(record.path), "events": whole["events"],
                         "checkpoint_steps": checkpoint_steps(record.lines)}


def _new_checkpoint_steps(cfg: RunConfig, summary: dict[str, Any], streamed: list[dict[str, Any]],
                          known: list[int]) -> list[int]:
    """Checkpoint saves of this invocation not yet in the record: the final attempt's (``written_steps``) and
    those earlier attempts left on disk (a failed attempt reports nothing; its saves are found by their step)."""
    from workbench.checkpoint.store import list_steps

    written = set((summary.get("checkpoint") or {}).get("written_steps") or [])
    trained = {m["step"] for m in streamed}
    on_disk = set(list_steps(cfg.ckpt_dir)) & trained if cfg.ckpt_dir is not None else set()
    return sorted((written | on_disk) - set(known))


def summarize(cfg: RunConfig, rank0: dict[str, Any], traces: list[Any]) -> dict[str, Any]:
    history = rank0["history"]
    steady = [m["tokens_per_s"] for m in history[1:]] or [history[0]["tokens_per_s"]]
    return {
        "config": _recorded_config(cfg), "strategy": rank0["strategy"], "n_params": rank0["n_params"],
        "model_config": asdict(cfg.gpt_config()),  # the model's sizes: the report prices theory from them
        "losses": [m["loss"] for m in history], "tokens_per_s": statistics.median(steady),
        "step_time_s": statistics.median(m["step_time_s"] for m in history[1:] or history),
        "data_wait_s": statistics.median(m.get("data_wait_s", 0.0) for m in history[1:] or history),
        "final_params_sha256": rank0["final_params_sha256"], "history": history,
        "placement": rank0.get("placement"),
        "checkpoint": rank0.get("checkpoint"),
        "attempt": rank0.get("attempt", 0),  # > 0: this result came from a restarted attempt (ours or torchrun's)
        "stopped_after_step": rank0.get("stopped_after_step"),
        "health": _health_summary(rank0, traces),
        "memory_peak_bytes": [t.memory.peak for t in traces],
        "device_memory": [asdict(t.device_memory) if t.device_memory is not None else None for t in traces],
        "mesh": _mesh(cfg),
        "comm_groups": comm_group_labels(_mesh(cfg), getattr(cfg, "ep", 1)),
        **({"pipeline": _pipeline_summary(cfg, traces)} if cfg.pp > 1 else {}),
        **({"moe": moe_summary(cfg, rank0, traces)} if getattr(cfg, "moe_experts", 0) else {}),
    }


def _recorded_config(cfg: RunConfig) -> dict[str, Any]:
    """The config as summary.json records it: without the live dashboard's temporary stop file."""
    config = cfg.to_dict()
    config["extra"] = {k: v for k, v in config.get("extra", {}).items() if k != "stop_file"}
    return config


def _health_summary(rank0: dict[str, Any], traces: list[Any]) -> dict[str, Any]:
    """Spike/NaN events and their actions, the validation curve, and stragglers from every rank's step times
    (the first step is left out: it pays for warm-up on every rank alike)."""
    from workbench.training.health import stragglers

    health = dict(rank0.get("health") or {})
    health["val_losses"] = [[m["step"], m["val_loss"]] for m in rank0["history"] if "val_loss" in m]
    steps = [t.metrics[1:] or t.metrics for t in traces]
    computed = all("compute_s" in m for ms in steps for m in ms)
    compute = [[m["compute_s"] for m in ms] for ms in steps] if computed else None
    health["stragglers"] = stragglers([[m["step_time_s"] for m in ms] for ms in steps], compute_times=compute)
    return health


def _mesh(cfg: RunConfig) -> dict[str, int]:
    """The run's mesh axes."""
    return {"pp": cfg.pp, "dp": cfg.dp, "cp": cfg.cp, "tp": cfg.tp}


def comm_group_labels(mesh: dict[str, int], ep: int = 1) -> list[dict[str, Any]]:
    """Every process group of the mesh as ``{"ranks": [...], "axis": name}``, so a report can say which axis
    a collective ran on. Axes of size 1 only give one-rank groups; the whole world is labelled by the single
    axis it equals (e.g. ``dp`` for plain data parallelism), else ``world``. With ``ep`` > 1, expert parallelism's
    groups over the dp ranks: ``ep`` (tokens' all-to-all) and ``expert_data`` (an expert shard's gradients)."""
    from workbench.dist.mesh import AXES, MeshShape

    shape = MeshShape(**mesh)
    labels: dict[tuple[int, ...], str] = {}
    for axis in sorted(AXES, key=lambda a: mesh[a] == 1):  # real axes first: they win a shared group
        for group in shape.all_axis_groups(axis):
            labels.setdefault(tuple(sorted(group)), axis)
    if shape.cp > 1:  # context parallel ranks share parameters: gradients are averaged over dp x cp
        for rank in range(shape.world_size):
            labels.setdefault(tuple(shape.fused_ranks(("dp", "cp"), rank)), "dp_cp")
    if ep > 1:
        from workbench.theory.expert import expert_data_groups, expert_parallel_groups

        for name, groups in (("ep", expert_parallel_groups(shape.dp, ep)), ("expert_data",
                                                                            expert_data_groups(shape.dp, ep))):
            for group in groups:
                labels.setdefault(tuple(group), name)
    labels.setdefault(tuple(range(shape.world_size)), "world")
    return [{"ranks": list(ranks), "axis": axis} for ranks, axis in labels.items()]


#: The comm tags of expert parallelism's all-to-alls (``parallel.expert``), forward and backward.
EP_TAGS = ("ep_counts", "ep_dispatch", "ep_combine", "ep_dispatch_grad", "ep_combine_grad")


def moe_summary(cfg: RunConfig, rank0: dict[str, Any], traces: list[Any]) -> dict[str, Any]:
    """What summary.json says of a mixture of experts: per step, the assignments each expert was chosen for and
    the dropped ones summed over every rank (``Trainer``'s ``moe_*`` metrics), the run's load per expert, and, with
    ep > 1, rank 0's all-to-all bytes per traced step measured (comm log) beside ``theory.expert``: exact for the
    routing that happened and for even routing."""
    by_rank = [{m["step"]: m for m in t.metrics if "moe_calls" in m} for t in traces] or \
        [{m["step"]: m for m in rank0["history"]}]
    per_step = []
    for m0 in rank0["history"]:
        ms = [r[m0["step"]] for r in by_rank if m0["step"] in r]
        load = [sum(col) for col in zip(*(m["moe_tokens_per_expert"] for m in ms), strict=True)]
        dropped = sum(m["moe_dropped"] for m in ms)
        per_step.append({"step": m0["step"], "tokens_per_expert": load, "dropped": dropped,
                         "dropped_fraction": dropped / sum(load) if sum(load) else 0.0})
    total = [sum(col) for col in zip(*(s["tokens_per_expert"] for s in per_step), strict=True)]
    out = {"experts": cfg.moe_experts, "top_k": cfg.moe_top_k, "capacity_factor": cfg.moe_capacity_factor,
           "aux_loss_coef": cfg.moe_aux_loss_coef, "ep": cfg.ep, "per_step": per_step, "load_per_expert": total,
           "ranks_counted": len(by_rank)}
    if cfg.ep > 1 and traces and len(by_rank) == cfg.nproc:
        out["all_to_all"] = _all_to_all_bytes(cfg, traces, by_rank)
    return out


def _all_to_all_bytes(cfg: RunConfig, traces: list[Any], by_rank: list[dict[int, Any]]) -> list[dict[str, Any]]:
    """Rank 0's all-to-all bytes sent per traced step (every MoE layer, forward and backward): the comm log's, the
    exact theory for the counts routed (each call's rows to and from the ranks of rank 0's ep group) and the
    theory for even routing (``theory.expert``), rows in the compute dtype: under bf16/fp16 autocast they travel
    in 16 bits (``models.moe``)."""
    from workbench.theory.expert import all_to_all_bytes, measured_all_to_all_bytes, rows_to_ranks

    d, experts, ep = cfg.gpt_config().d_model, cfg.moe_experts, cfg.ep
    value = 4 if cfg.precision == "fp32" else 2
    per_expert = experts // ep
    rows = []
    for step in sorted({c.step for c in traces[0].comms if c.tag in EP_TAGS and c.step is not None}):
        measured = sum(c.bus_bytes for c in traces[0].comms if c.tag in EP_TAGS and c.step == step)
        calls = [by_rank[r][step]["moe_calls"] for r in range(ep)]  # rank 0's ep group: ranks 0 .. ep-1
        exact = even = 0.0
        for i, call in enumerate(calls[0]):
            rows_from = [sum(calls[src][i]["kept"][:per_expert]) for src in range(ep)]
            exact += measured_all_to_all_bytes(rows_to_ranks(call["kept"], ep), rows_from, 0, d, experts,
                                               value)["total"]
            even += all_to_all_bytes(call["tokens"], d, cfg.moe_top_k, experts, ep, value)["total"]
        rows.append({"step": step, "measured_bytes": measured, "theory_exact_bytes": exact,
                     "theory_even_bytes": even})
    return rows


def _pipeline_summary(cfg: RunConfig, traces: list[Any]) -> dict[str, Any]:
    """Schedule, theory's bubble beside the measured one (median over the traced steps) and activation peaks."""
    from workbench.dist.mesh import MeshShape
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
    from workbench.record import json_safe
    from workbench.viz.report import write_report

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(json_safe(summary), indent=2, allow_nan=False))
    (out / "traces.json").write_text(json.dumps(json_safe([t.to_dict() for t in traces]), allow_nan=False))
    write_report(out / "report.html", summary, traces)
    kept = (summary.get("record") or {}).get("path")
    if kept and Path(kept).is_file() and Path(kept).resolve() != (out / Path(kept).name).resolve():
        shutil.copyfile(kept, out / Path(kept).name)  # the run's record beside its summary (workbench.record)


class LiveRun:
    """A training run with a dashboard: ``wait()``, ``stop()``, ``done``, ``summary``, ``error``.

    Owns a temporary stop file (``cfg.extra["stop_file"]``, train.StopSignal): ``stop()`` creates it, and it is
    removed with its folder when the run ends.
    """

    def __init__(self, cfg: RunConfig, out: str | Path | None, dashboard: Dashboard) -> None:
        self._stop_dir = Path(tempfile.mkdtemp(prefix="workbench-stop-"))
        self.stop_file = self._stop_dir / "stop"
        self.cfg = dataclasses.replace(cfg, extra={**cfg.extra, "stop_file": str(self.stop_file)})
        self.out, self.dashboard = out, dashboard
        self.summary: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        dashboard.on_stop = self._touch_stop_file  # the Stop button

    @property
    def done(self) -> bool:
        """The run has ended (trained, stopped or failed) and its ranks are gone."""
        return self._finished.is_set()

    @property
    def stopped_after_step(self) -> int | None:
        """The last step trained when Stop ended the run early; None while training, or when it ran all steps."""
        history = (self.summary or {}).get("history") or []
        if not self.done or not history or history[-1]["step"] >= self.cfg.steps - 1:
            return None
        return history[-1]["step"]

    def stop(self) -> None:
        """End the run after the step the ranks are in; what was trained is written as usual. No-op once done."""
        if not self.done:
            self.dashboard.request_stop()  # greys the button, says "stopping", calls _touch_stop_file

    def _touch_stop_file(self) -> None:
        try:
            self.stop_file.touch()
        except FileNotFoundError:  # the run ended meanwhile and took its folder with it: nothing to stop
            pass

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Block until the run ends; return its summary, or raise the error that ended it (a ``RankError``
        naming the rank). ``TimeoutError`` if it is still running after ``timeout`` seconds."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout < 0):
            raise ValueError(f"timeout must be None (wait for the end) or seconds >= 0, got {timeout!r}")
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the run is still training after {timeout} s (step {self.dashboard.last_step + 1} "
                               f"of {self.cfg.steps}); call stop() to end it")
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.summary is not None
        return self.summary

    def start(self) -> None:
        """Train in a background thread (the kernel stays free to hear the Stop button)."""
        self._thread = threading.Thread(target=self.run, name="workbench-live-run", daemon=True)
        atexit.register(self._stop_at_exit)
        self._thread.start()

    def run(self) -> None:
        """Train in this thread; the outcome goes to ``summary`` or ``error`` and the dashboard's status line."""
        try:
            self.summary = run_training(self.cfg, self.out, progress=False, on_metrics=self.dashboard.update)
        except BaseException as exc:  # surfaced by wait() and in the status line
            self.error = exc
        finally:
            atexit.unregister(self._stop_at_exit)
            shutil.rmtree(self._stop_dir, ignore_errors=True)
            self.dashboard.finish(self.summary, self.error)
            self._finished.set()

    def _stop_at_exit(self) -> None:
        """The interpreter is leaving with the run still training: end it, so its ranks are reaped, not orphaned."""
        if not self.done:
            self.stop()
            self._finished.wait(self.cfg.timeout)

    def __repr__(self) -> str:
        state = ("failed" if self.error else "done") if self.done else "training"
        return f"LiveRun({state}, step {self.dashboard.last_step + 1} of {self.cfg.steps})"


def run_live(cfg: RunConfig, out: str | Path | None = None, front_end: bool | None = None,
             min_interval_s: float = 0.25) -> LiveRun:
    """Train ``cfg`` with a live dashboard; returns a ``LiveRun`` (see the module docstring).

    ``front_end`` (None: ``has_widget_front_end()``): True shows the dashboard and trains in a background thread
    (the call returns at once); False trains here, shows the panels once at the end and returns a finished run.
    Headless, a rank's error is raised here, as ``run_training`` without ``live`` would.
    """
    from workbench.widgets.dashboard import Dashboard, display_figure, display_widget, has_widget_front_end

    if not all(hasattr(cfg, name) for name in ("nproc", "steps", "extra", "timeout")):
        raise ValueError(f"cfg must be a workbench.train.RunConfig, got {type(cfg).__name__}")
    front_end = has_widget_front_end() if front_end is None else front_end
    servers = list(range(cfg.nproc - cfg.ps_servers, cfg.nproc)) if cfg.ps_servers else []  # the last S ranks
    dashboard = Dashboard(cfg.nproc, cfg.steps, live=front_end, min_interval_s=min_interval_s,
                          experts=cfg.moe_experts, compression=cfg.grad_compression != "none", ps_servers=servers)
    handle = LiveRun(cfg, out, dashboard)
    if front_end:
        display_widget(dashboard, f"live dashboard: {cfg.nproc} rank(s), {cfg.steps} step(s)")
        handle.start()
        return handle
    handle.run()
    if handle.error is not None:
        raise handle.error
    display_figure(dashboard.static_figure(), dashboard.status.value)
    return handle
