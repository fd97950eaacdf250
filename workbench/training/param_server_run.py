"""``workbench run --ps-servers S``: training with a parameter server (``parallel.param_server``).

Not the ``Trainer``'s loop: its ranks all run the same step, and here they do not. The last S ranks are servers
(``server_ranks``): each builds the seeded model, keeps its shard of the parameters with an AdamW over it (the
run's lr schedule, weight decay and betas, and ``--clip`` on the global norm) and serves. Every other rank is a
worker: it pulls the parameters, takes its equal share of the global batch (``ShardedSampler`` over the W workers),
runs forward and backward in traced spans (so ``--straggler`` slows it as it would a trainer's rank), pushes the
gradients and pulls again, until a pull says stop: after ``--steps`` steps in sync; in async once server 0 has
applied ``--steps`` x W gradients, so the run sees as much data either way while a fast worker takes more of the
steps than a straggler. A synchronous run's step is then the same update as data parallelism on the same global
batch (``tests/test_param_server_run.py`` compares the losses with ``--nproc W``); an asynchronous one lets each
worker run at its own pace, each update's staleness recorded.

Checkpoints (``--ckpt-dir``, ``--ckpt-every``, ``--keep``, ``--resume``, and a restart under ``--max-restarts``), in
sync: after every ``ckpt_every``-th step and after the last, every rank saves its part with the package's store
(``checkpoint.store.save``: one file per rank, rank 0's manifest last, so a save cut short is never resumed from):
a server its shard's parameters, its optimizer's state, its version and last update; a worker its data position
(the sampler's) and its RNG states. Both save at the same step: the server right after it sent that step's
parameters, the worker right after it pulled them. A resume loads each rank's own file (the same layout: same
``--nproc`` and ``--ps-servers``), the servers send the saved parameters in the first pull, and the run goes on
bit for bit as the unbroken one (``tests/test_param_server_ckpt.py``). An asynchronous server applies gradients in
arrival order, which no checkpoint can replay: ``RunConfig`` refuses checkpoints with ``--ps-async``.

Live: every server streams each update's staleness and its bytes so far (``launch.report``), every worker its step's
metrics with its traffic (``_streamed``), so the dashboard draws the staleness histogram and the servers'
load while the run trains.

What comes back has the keys ``train_rank``'s result has (history, n_params, strategy, hash, placement...), so
``run_training``'s summary, report and dashboard take it as they are; ``ps_summary`` adds the servers' view:
updates, the staleness histogram, the widest clock gap, how long replies were held, the bytes through each server's
link beside ``theory.param_server.step_bytes``, and the throughput of all workers together.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import torch

from workbench import trace
from workbench.checkpoint.reshard import MOMENTS
from workbench.checkpoint.resume import FULL_STATE, checkpoint_config, find_resume_point
from workbench.checkpoint.store import (
    discard_newer,
    list_steps,
    load,
    read_manifest,
    rng_state,
    save,
    set_rng_state,
    step_dir,
    write_atomic,
)
from workbench.data import ShardedSampler, make_lm_data
from workbench.dist import comm
from workbench.dist.faults import restart_count
from workbench.dist.launch import rank_device, report
from workbench.models import build_gpt
from workbench.parallel.param_server import ParameterServer, PSWorker, model_shards, server_ranks
from workbench.theory.param_server import step_bytes
from workbench.training.config import RunConfig
from workbench.training.schedule import lr_at, params_sha256


def _roles(cfg: RunConfig) -> tuple[list[int], list[int]]:
    servers = server_ranks(cfg.nproc, cfg.ps_servers)
    return servers, [r for r in range(cfg.nproc) if r not in servers]


def _mode(cfg: RunConfig) -> str:
    return "async" if cfg.ps_async else "sync"


def describe(cfg: RunConfig) -> str:
    workers = cfg.nproc - cfg.ps_servers
    bound = "" if not cfg.ps_async else (f", max staleness {cfg.max_staleness}" if cfg.max_staleness is not None
                                         else ", staleness unbounded")
    return f"parameter server ({_mode(cfg)}: {cfg.ps_servers} server(s), {workers} worker(s){bound})"


def train_ps_rank(cfg: RunConfig) -> dict[str, Any]:
    """This rank's part of a parameter-server run: serve or work, then the result ``train_rank`` would give."""
    torch.manual_seed(cfg.seed)
    servers, workers = _roles(cfg)
    device = rank_device()
    model = build_gpt(cfg.gpt_config(), seed=cfg.seed, device=device)
    n_params = sum(p.numel() for p in model.parameters())
    ckpt = PSCheckpoints(cfg, device)
    if comm.group_rank() in servers:
        ps = _server(cfg, model, servers, workers, lambda step: lr_at(step, cfg), ckpt)
        result: dict[str, Any] = {"history": [], "ps_server": ps.stats.as_dict()}
    else:
        history = _work(cfg, model, servers, workers, device, ckpt)
        result = {"history": history, "stopped_after_step": _stopped_after(cfg, history)}
    backend = torch.distributed.get_backend() if comm.is_distributed() else "none"
    full = {n: p.detach() for n, p in model.named_parameters()}
    return {"n_params": n_params, "strategy": describe(cfg),
            "final_params_sha256": params_sha256(full) if comm.group_rank() == 0 else None,
            "placement": {"backend": backend, "device": str(device), "device_name": str(device)},
            "final_params": None, "checkpoint": ckpt.summary(), "stopped_after_step": None,
            **result, "attempt": restart_count(), "health": {"events": [], "data_skip": 0, "val_split": None}}


class PSCheckpoints:
    """A synchronous parameter-server run's checkpoints, on every rank (servers and workers alike): which step to
    resume from (rank 0 picks it, every rank loads its own file), when a save is due, and the save itself."""

    def __init__(self, cfg: RunConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.written: list[int] = []
        self.stalls: list[dict[str, float]] = []
        self.resumed_from: int | None = None
        self.skipped: list[str] = []

    def due(self, done: int) -> bool:
        """After every ``ckpt_every``-th step and after the last, as the trainer saves; ``done``: steps taken."""
        every = self.cfg.ckpt_every or self.cfg.steps
        return self.cfg.ckpt_dir is not None and (done % every == 0 or done == self.cfg.steps)

    def keeps_stop(self, done: int) -> bool:
        """Whether a run stopped early after ``done`` steps saves there too (what was trained is kept: a later
        ``--resume`` goes on from it), as the trainer does after a stop."""
        return self.cfg.ckpt_dir is not None and done < self.cfg.steps

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Every rank calls this at the same step (the store's barriers pair them up)."""
        t0 = time.perf_counter()
        meta = {"run_config": checkpoint_config(self.cfg), "strategy": describe(self.cfg)}
        with trace.span(f"checkpoint step {step}", "other"):
            save(self.cfg.ckpt_dir, step, {**state, "step": step, "rng": rng_state()}, meta=meta, keep=self.cfg.keep)
        self.written.append(step)
        self.stalls.append({"step": step, "stall_s": time.perf_counter() - t0})

    def resume(self) -> dict[str, Any] | None:
        """This rank's saved state to go on from, or None: no ``--resume`` and no restart, or a restart before the
        first save (then the run starts over from its seed, as the attempt it replaces did)."""
        cfg = self.cfg
        restarted = restart_count() > 0 and cfg.ckpt_dir is not None
        if not (cfg.resume or restarted):
            return None
        step = self._pick_step(restarted)
        if step is None:
            return None
        state = load(step_dir(cfg.ckpt_dir, step), map_location=self.device)
        if state.get("step") != step:
            raise ValueError(f"{step_dir(cfg.ckpt_dir, step)} holds step {state.get('step')}, not {step}")
        set_rng_state(state["rng"])
        self.resumed_from = step
        return state

    def _pick_step(self, after_restart: bool) -> int | None:
        """Rank 0's choice (``find_resume_point``, which hashes every file: ranks choosing alone could disagree),
        broadcast to every rank; None: a restart found nothing saved yet."""
        step, problem = -1, ""
        if comm.group_rank() == 0:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    if after_restart and not list_steps(self.cfg.ckpt_dir):
                        step = -2
                    else:
                        step = read_manifest(find_resume_point(self.cfg, finished_ok=after_restart))["step"]
                        discard_newer(self.cfg.ckpt_dir, step)
                except ValueError as e:
                    problem = str(e)
            self.skipped = [str(w.message) for w in caught]
        if comm.is_distributed():
            t = torch.tensor([step], dtype=torch.int64, device=self.device)
            comm.broadcast(t, src=0, tag="checkpoint")
            step = int(t.item())
        if step == -2:
            return None
        if step < 0:
            raise ValueError(problem or "rank 0 found no checkpoint to resume from (its error says why)")
        return step

    def summary(self) -> dict[str, Any] | None:
        """The result's ``checkpoint``, the trainer's keys."""
        cfg = self.cfg
        return None if cfg.ckpt_dir is None else {
            "dir": cfg.ckpt_dir, "every": cfg.ckpt_every, "keep": cfg.keep, "written_steps": self.written,
            "resumed_from_step": self.resumed_from, "skipped_on_resume": self.skipped, "async": cfg.async_ckpt,
            "stalls": self.stalls}


def _server(cfg: RunConfig, model: torch.nn.Module, servers: list[int], workers: list[int],
            lr: Any, ckpt: PSCheckpoints) -> ParameterServer:
    settings = cfg.parallel_config()  # the trainer's AdamW settings (lr, weight decay, betas), not a copy of them

    def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay, betas=settings.betas)

    ps = ParameterServer(model, servers, workers, adamw, mode=_mode(cfg), max_staleness=cfg.max_staleness, lr=lr,
                         clip=cfg.clip)
    if (state := ckpt.resume()) is not None:
        ps.load_state_dict(state["server"])
    streamed = {"staleness": len(ps.stats.staleness)}

    def updated(ps: ParameterServer) -> None:
        report(_server_metrics(cfg, ps, streamed))
        done = ps.version
        if not cfg.ps_async and (ckpt.due(done) or ps.stopping and ckpt.keeps_stop(done)):
            ckpt.save(done - 1, {"server": ps.state_dict()})

    ps.serve(cfg.steps, on_update=updated)
    if cfg.ps_async:  # worker 0's last pull may predate the others' last updates: it gets the final shard
        ps.send_final(workers[0])
    report(_server_metrics(cfg, ps, streamed))  # the totals with the sends after the last update (async)
    return ps


def _server_metrics(cfg: RunConfig, ps: ParameterServer, streamed: dict[str, int]) -> dict[str, Any]:
    """What a server streams after an update (the dashboard's staleness histogram and server load): the staleness
    of the gradients this update applied (none: the final totals after the last update), and the server's totals
    so far. ``step`` is the run's step the update
    belongs to (async: one step is W updates)."""
    new = ps.stats.staleness[streamed["staleness"]:]
    streamed["staleness"] = len(ps.stats.staleness)
    step = ps.version - 1 if not cfg.ps_async else (ps.version - 1) // len(ps.workers)
    return {"step": step, "rank": comm.group_rank(), "attempt": restart_count(), "ps_server": ps.index,
            "ps_staleness": new, "ps_updates": ps.stats.updates, "ps_bytes_in": ps.stats.bytes_in,
            "ps_bytes_out": ps.stats.bytes_out}


def _work(cfg: RunConfig, model: torch.nn.Module, servers: list[int], workers: list[int],
          device: torch.device, ckpt: PSCheckpoints) -> list[dict[str, Any]]:
    """The worker's loop; rank 0's history is the run's. In sync each step's loss and grad norm are the global
    batch's (the server averaged the losses and clipped by the averaged gradient's norm, and says so in the next
    pull); in async they are this worker's own."""
    model_cfg = cfg.gpt_config()
    dataset = make_lm_data(model_cfg.seq_len, cfg.data)
    index = workers.index(comm.group_rank())
    sampler = ShardedSampler(len(dataset), cfg.batch_size, index, len(workers), seed=cfg.seed)
    worker = PSWorker(model, servers)
    tracer = trace.current()
    tokens = cfg.batch_size * model_cfg.seq_len // (len(workers) if cfg.ps_async else 1)
    history, step = [], 0
    if (state := ckpt.resume()) is not None:  # the data position; the parameters come in the first pull
        sampler.load_state_dict(state["sampler"])  # refuses another seed or global batch
        step = worker.clock = sampler.step
    with trace.span("pull", "wait"):
        worker.pull()
    while not worker.stopped:  # sync: cfg.steps steps; async: until server 0 has applied steps x W gradients
        trace.set_step(step)
        if tracer is not None:  # async: a fast worker may take more than cfg.steps steps, a slow one fewer
            tracer.enabled = step >= cfg.steps - cfg.trace_steps
            tracer.take_compute_s()
        t0 = time.time()
        with trace.span("data", "data"):
            x, y = dataset.get(sampler.indices(step), device=device)
        data_wait = time.time() - t0
        model.zero_grad(set_to_none=True)
        with trace.span("forward", "forward"):
            loss = model(x, y)
        with trace.span("backward", "backward"):
            loss.backward()
        with trace.span("push and pull", "wait"):  # the gradients out, the next parameters in
            norm = worker.push(loss.detach(), stop=stop_requested(cfg))
            worker.pull()
        elapsed = time.time() - t0
        metrics = {"step": step, "loss": worker.update_loss if not cfg.ps_async else float(loss.detach()),
                   "grad_norm": worker.update_norm if not cfg.ps_async else norm, "lr": lr_at(step, cfg),
                   "step_time_s": elapsed, "data_wait_s": data_wait, "tokens_per_s": tokens / elapsed,
                   "loss_scale": None, "skipped": False}
        if tracer is not None:
            metrics["compute_s"] = tracer.take_compute_s()
            tracer.record_metrics(metrics)
        history.append(metrics)
        report(_streamed(metrics))  # the dashboard's view of this worker's step
        step += 1
        # the servers save this step too, after the parameters went out (keeps_stop: a run stopped early)
        if not cfg.ps_async and (ckpt.due(step) or worker.stopped and ckpt.keeps_stop(step)):
            ckpt.save(step - 1, {"sampler": {**sampler.state_dict(), "step": step, "data_skip": 0}})
    if cfg.ps_async:
        worker.done()  # the other servers learn from this that no push follows
        if index == 0:
            worker.finish()  # the servers' final parameters (send_final)
    return history


def _stopped_after(cfg: RunConfig, history: list[dict[str, Any]]) -> int | None:
    """The last step of a worker the run stopped early (a preemption, the Stop button), else None. In sync every
    worker trains steps 0..steps-1 unless stopped; in async the count varies by worker, so the stop file says it."""
    if not history:
        return None
    early = stop_requested(cfg) if cfg.ps_async else history[-1]["step"] < cfg.steps - 1
    return history[-1]["step"] if early else None


def stop_requested(cfg: RunConfig) -> bool:
    """Whether this worker was asked to stop: the stop file a preemption signal or the dashboard's Stop button
    creates (``run.preemptible``, ``run.LiveRun``). No collective, unlike the trainer's ``StopSignal``: servers are
    busy serving, so the request rides in the next push (``PSWorker.push(stop=True)``) and every server sees it."""
    stop_file = cfg.extra.get("stop_file")
    return stop_file is not None and Path(stop_file).exists()


def consolidate_ps_checkpoint(path: str | Path) -> Path:
    """A parameter server's checkpoint at ``path`` (a ``step-*`` folder) as the trainer's full state
    (``checkpoint.reshard.full_training_state``'s keys: the parameters and AdamW moments by name, the optimizer's
    step), written beside its files (``FULL_STATE``, atomically); returns that file. No ranks needed: the servers'
    files hold every parameter whole, each in exactly one server's shard; the data position is worker 0's."""
    folder = Path(path)
    saved = read_manifest(folder)["meta"]["run_config"]
    servers = server_ranks(saved["nproc"], saved["ps_servers"])
    full: dict[str, Any] = {"params": {}, **{key: {} for key in MOMENTS}}
    steps = set()
    for rank in servers:
        server = load(folder, rank)["server"]
        moments = server["optim"]["state"]  # keyed by the index of the shard's tensor, in the shard's name order
        for i, (name, value) in enumerate(server["params"].items()):
            full["params"][name] = value
            for key in MOMENTS:
                full[key][name] = moments[i][key] if i in moments else torch.zeros_like(value)
            steps |= {float(moments[i]["step"])} if i in moments else set()
    full["optimizer_step"] = steps.pop() if len(steps) == 1 else 0.0
    worker = load(folder, 0)
    full.update({k: worker[k] for k in ("step", "sampler", "rng")})
    return write_atomic(folder / FULL_STATE, full)


def _streamed(metrics: dict[str, Any]) -> dict[str, Any]:
    """A worker's step as the trainer's ranks stream theirs (``trainer._streamed``, which this module cannot import:
    the trainer imports it): the metrics, this rank's ledger peaks and the bytes it moved since the last step."""
    tracer = trace.current()
    if tracer is None:
        return metrics
    return {**metrics, "rank": tracer.trace.rank, "attempt": restart_count(), "memory_peak": dict(tracer.memory.peak),
            "comm_bytes": tracer.take_comm_totals()}


def ps_summary(cfg: RunConfig, results: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's ``parameter_server``: each server's view, merged staleness (one entry per gradient and
    server), bytes beside theory, and the throughput of all workers together (the tokens behind every gradient
    server 0 applied, over the slowest server's wall time)."""
    servers, workers = _roles(cfg)
    per_server = [results[s]["ps_server"] for s in servers]
    histogram: dict[int, int] = {}
    for stats in per_server:
        for staleness, count in stats["staleness_histogram"].items():
            histogram[int(staleness)] = histogram.get(int(staleness), 0) + count
    model = build_gpt(cfg.gpt_config(), seed=cfg.seed)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    shards = model_shards(model, cfg.ps_servers)
    theory = step_bytes([sum(sizes[n] for n in names) for names in shards], len(workers))
    wall = max(s["wall_s"] for s in per_server)
    pushes = sum(per_server[0]["staleness_histogram"].values())  # one per worker gradient server 0 applied
    tokens = pushes * cfg.batch_size // len(workers) * cfg.gpt_config().seq_len
    return {"mode": _mode(cfg), "servers": servers, "workers": workers, "max_staleness": cfg.max_staleness,
            "per_server": per_server, "staleness_histogram": dict(sorted(histogram.items())),
            "max_gap": max(s["max_gap"] for s in per_server), "held_s": max(s["held_s"] for s in per_server),
            "theory_step_bytes": theory, "wall_s": wall, "tokens_per_s": tokens / wall if wall else None}
