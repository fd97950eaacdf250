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

What comes back has the keys ``train_rank``'s result has (history, n_params, strategy, hash, placement...), so
``run_training``'s summary, report and dashboard take it as they are; ``ps_summary`` adds the servers' view:
updates, the staleness histogram, the widest clock gap, how long replies were held, the bytes through each server's
link beside ``theory.param_server.step_bytes``, and the throughput of all workers together.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from workbench import trace
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
    if comm.group_rank() in servers:
        ps = _server(cfg, model, servers, workers, lambda step: lr_at(step, cfg))
        result: dict[str, Any] = {"history": [], "ps_server": ps.stats.as_dict()}
    else:
        result = {"history": _work(cfg, model, servers, workers, device)}
    backend = torch.distributed.get_backend() if comm.is_distributed() else "none"
    full = {n: p.detach() for n, p in model.named_parameters()}
    return {**result, "n_params": n_params, "strategy": describe(cfg),
            "final_params_sha256": params_sha256(full) if comm.group_rank() == 0 else None,
            "placement": {"backend": backend, "device": str(device), "device_name": str(device)},
            "final_params": None, "checkpoint": None, "stopped_after_step": None, "attempt": restart_count(),
            "health": {"events": [], "data_skip": 0, "val_split": None}}


def _server(cfg: RunConfig, model: torch.nn.Module, servers: list[int], workers: list[int],
            lr: Any) -> ParameterServer:
    settings = cfg.parallel_config()  # the trainer's AdamW settings (lr, weight decay, betas), not a copy of them

    def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay, betas=settings.betas)

    ps = ParameterServer(model, servers, workers, adamw, mode=_mode(cfg), max_staleness=cfg.max_staleness, lr=lr,
                         clip=cfg.clip)
    ps.serve(cfg.steps)
    if cfg.ps_async:  # worker 0's last pull may predate the others' last updates: it gets the final shard
        ps.send_final(workers[0])
    return ps


def _work(cfg: RunConfig, model: torch.nn.Module, servers: list[int], workers: list[int],
          device: torch.device) -> list[dict[str, Any]]:
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
    with trace.span("pull", "wait"):
        worker.pull()
    history, step = [], 0
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
            norm = worker.push(loss.detach())
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
        report(metrics)
        step += 1
    if cfg.ps_async:
        worker.done()  # the other servers learn from this that no push follows
        if index == 0:
            worker.finish()  # the servers' final parameters (send_final)
    return history


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
