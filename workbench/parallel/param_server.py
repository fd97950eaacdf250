"""A parameter server: dedicated server ranks hold the parameters and apply the optimizer; workers pull the
parameters, compute gradients on their data and push them back.

The architecture of DistBelief and of Li et al. 2014 ("Scaling Distributed Machine Learning with the Parameter
Server", OSDI), built here from ``comm``'s point-to-point messages (no RPC): the ranks named ``servers`` each own a
shard of the parameters (whole tensors, dealt by size: ``shard_parameters``) and an optimizer over that shard alone;
every other rank is a worker with a full replica that it never steps itself.

One worker step, against each server s (``PSWorker``):

    pull   server → worker   header [version, norm, loss, stop]        then the shard's parameters   ``ps_pull``
    ...    forward and backward on the worker's own batch
    push   worker → server   header [version, clock, |g|², loss, done]  then the shard's gradients    ``ps_push``

``version`` is how many optimizer steps the server's shard had taken when the parameters were sent; ``clock`` how
many gradients this worker had pushed before; the headers are fp64 (8 bytes a field). A worker pulls once before
its first step and once after every push, and stops when a pull says ``stop``: in sync after ``steps`` steps (every
replica then holds the servers' final parameters); in async once server 0 has applied ``steps`` x W gradients, from
whichever workers were ready (a straggler contributes fewer), when each worker also tells the other servers it is
``done`` (a header alone).

Modes (``ParameterServer.serve``):

``sync``   each step the server sends its shard to every worker, receives every worker's gradient (in worker
           order, so the sum is the same every run), averages them and steps once. That is data parallelism with
           the all-reduce replaced by a gather to the server and a broadcast back: the same update as DDP on the
           same global batch (``tests/test_param_server.py``), every gradient of staleness 0.
``async``  the server applies each worker's gradient alone, on arrival (Hogwild-style asynchronous SGD, Dean et al.
           2012, "Large Scale Distributed Deep Networks"), and answers that worker at once with the new parameters,
           so a fast worker never waits for a slow one. The price is *staleness*: the gradient was computed on
           parameters ``version`` while the server is at ``current``; ``current − version`` updates by other
           workers happened in between, and every update's staleness is recorded. With one worker, async is plain
           sequential training, bit for bit.
           ``max_staleness=K`` bounds it the way the Stale Synchronous Parallel server does (Ho et al. 2013, "More
           Effective Distributed ML via a Stale Synchronous Parallel Parameter Server", NeurIPS): a worker may
           start its c-th step only while c − (the slowest unfinished worker's clock) ≤ K, so the server holds its
           reply until the slowest catches up. K = 0 is lock-step rounds (still applied one gradient at a time);
           ``None`` is unbounded.

Checkpoints: a server's ``state_dict`` is its shard by name, its optimizer's state, its version and the last
update's (norm, loss); ``load_state_dict`` puts them back and ``serve`` then takes steps ``version``..``steps-1``,
so a synchronous run resumed from a checkpoint is the unbroken run bit for bit (``training.param_server_run`` saves
and loads them with the workers' data positions). ``serve(steps, on_update)`` calls ``on_update(server)`` after
every update: the run saves and streams its metrics there.

What crosses the links (``theory.param_server.step_bytes`` says the same): per worker and step, every parameter
once each way (4 bytes an element) plus the headers; per server and step, W workers times its shard each way, which
is why the server's link saturates as workers are added while a ring all-reduce's per-rank bytes stay ~2P.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from workbench.dist import comm

MODES = ("sync", "async")
PULL_TAG, PUSH_TAG, NORM_TAG = "ps_pull", "ps_push", "ps_norm"
#: fp64 header fields (integers below 2^53 are exact): a pull's [version, last update's gradient norm, its loss,
#: stop] and a push's [version pulled, clock, squared norm of the worker's whole gradient, its loss, control]
PULL_HEADER, PUSH_HEADER, HEADER_BYTES = 4, 5, 8
#: A push's control field: a gradient follows; the worker is done (async: no gradient follows); a gradient follows
#: and the worker asks the run to stop (a preemption or the dashboard's Stop: ``PSWorker.push(stop=True)``).
PUSH_GRADIENT, PUSH_DONE, PUSH_STOP = 0, 1, 2


def check_layout(nproc: int, servers: int) -> None:
    """At least one server and one worker: ``servers`` in 1..nproc-1."""
    if not isinstance(servers, int) or not 1 <= servers < nproc:
        raise ValueError(f"--ps-servers {servers!r} with --nproc {nproc}: a parameter server needs at least one "
                         f"server and one worker, so servers must be in 1..{nproc - 1}")


def check_staleness(max_staleness: int | None) -> None:
    if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
        raise ValueError(f"--max-staleness {max_staleness!r}: a bound on how many steps a worker may run ahead of "
                         f"the slowest, an integer >= 0 (0: lock-step rounds); leave it out for no bound")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"parameter-server mode {mode!r}: valid modes are {', '.join(MODES)}")


def server_ranks(nproc: int, servers: int) -> list[int]:
    """The last ``servers`` ranks serve: workers keep ranks 0..W-1, so worker w reads data shard w."""
    check_layout(nproc, servers)
    return list(range(nproc - servers, nproc))


def shard_parameters(numels: Sequence[tuple[str, int]], servers: int) -> list[list[str]]:
    """Deal whole tensors to servers, largest first, each to the least-loaded server (the lower index on a tie):
    the greedy rule that keeps the heaviest server within one tensor of the mean. Each server's names come back
    in the model's order, the order its flat buffer is laid out in."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    load, owner = [0] * servers, {}
    for name, n in sorted(numels, key=lambda item: -item[1]):
        s = min(range(servers), key=lambda i: (load[i], i))
        owner[name], load[s] = s, load[s] + n
    return [[name for name, _ in numels if owner[name] == s] for s in range(servers)]


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def model_shards(model: nn.Module, servers: int) -> list[list[str]]:
    return shard_parameters([(n, p.numel()) for n, p in _trainable(model)], servers)


@dataclass
class ServerStats:
    """What one server saw: each applied update's staleness (in updates of this shard), the clock gap at every
    reply it released, how long each reply was held back by the staleness bound, and the bytes it moved."""

    mode: str
    workers: int
    updates: int = 0
    staleness: list[int] = field(default_factory=list)
    gaps: list[int] = field(default_factory=list)
    held_s: float = 0.0
    wall_s: float = 0.0
    by_worker: dict[int, int] = field(default_factory=dict)  # gradients applied, per worker rank
    bytes_in: int = 0
    bytes_out: int = 0

    def histogram(self) -> dict[int, int]:
        """{staleness: number of updates}, the view a learner compares across modes."""
        out: dict[int, int] = {}
        for s in self.staleness:
            out[s] = out.get(s, 0) + 1
        return dict(sorted(out.items()))

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "workers": self.workers, "updates": self.updates,
                "staleness_histogram": self.histogram(), "max_gap": max(self.gaps, default=0),
                "held_s": self.held_s, "wall_s": self.wall_s, "by_worker": dict(self.by_worker),
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out}


class _Shard:
    """One server's parameters (fp32 copies of its tensors) laid out as one flat buffer, with views per name."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.names = [n for n, _ in named]
        self.shapes = [t.shape for _, t in named]
        self.numels = [t.numel() for _, t in named]
        device = named[0][1].device if named else torch.device("cpu")
        self.flat = torch.cat([t.detach().reshape(-1).float() for _, t in named]) if named else \
            torch.zeros(0, device=device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [v.view(shape) for v, shape in zip(flat.split(self.numels), self.shapes, strict=True)]


class ParameterServer:
    """The server side: ``serve(steps)`` answers every worker's pulls and applies its pushes, for ``steps`` steps
    of every worker in sync and ``steps`` x W gradients from whichever workers are ready in async.

    ``optimizer`` builds the optimizer over the shard's parameters (one fp32 tensor per name); ``lr(step)``, if
    given, sets its learning rate before each update (the step: the update's index in sync, update // workers in
    async, so a schedule spans the run either way); ``clip`` clips the update's gradient to that global L2 norm,
    as ``clip_grad_norm_`` would on one process: the norm of the averaged gradient over every server's shard in
    sync (the servers exchange their partial sums of squares, tag ``ps_norm``), the pushing worker's whole
    gradient in async (its push header carries it)."""

    def __init__(self, model: nn.Module, servers: Sequence[int], workers: Sequence[int],
                 optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer], *, mode: str = "sync",
                 max_staleness: int | None = None, lr: Callable[[int], float] | None = None,
                 clip: float | None = None) -> None:
        check_mode(mode)
        check_staleness(max_staleness)
        me = comm.group_rank()  # ranks are global: point-to-point messages name global ranks
        if me not in servers:
            raise ValueError(f"rank {me} is not a server (servers: {list(servers)})")
        self.servers, self.index, self.workers = list(servers), list(servers).index(me), list(workers)
        self.mode, self.max_staleness, self.lr, self.clip = mode, max_staleness, lr, clip
        params = dict(_trainable(model))
        names = model_shards(model, len(servers))[self.index]
        self.shard = _Shard([(n, params[n]) for n in names])
        self.params = [nn.Parameter(v) for v in self.shard.views(self.shard.flat)]  # views of the flat buffer
        self.optimizer = optimizer(self.params)
        self.version = 0
        self.last = (0.0, 0.0)  # the last update's (gradient norm, loss): the pull header tells the workers
        self.stop_requested = False  # a worker asked the run to stop (PUSH_STOP)
        self.stopping = False  # sync: the update just applied is the run's last (its end, or a stop request)
        self.stats = ServerStats(mode, len(self.workers))
        self._on_update: Callable[[ParameterServer], None] | None = None

    def named_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in zip(self.shard.names, self.params, strict=True)}

    def state_dict(self) -> dict[str, Any]:
        """What a synchronous resume needs to take the next update as an unbroken run would: the shard's
        parameters by name, its optimizer's state, the version (the lr schedule's step) and the last update's
        (norm, loss), which the first pull after a resume reports. Tensors are copies: saving never aliases the
        buffer the next update changes."""
        return {"params": {n: t.clone() for n, t in self.named_parameters().items()},
                "optim": self.optimizer.state_dict(), "version": self.version, "last": list(self.last)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what ``state_dict`` returned; ``ValueError`` if it holds another shard (other names)."""
        names = list(state["params"])
        if names != self.shard.names:
            raise ValueError(f"server {self.index}'s checkpoint holds parameters {names[:4]}... but this server's "
                             f"shard is {self.shard.names[:4]}...: it was saved with another model or number of "
                             f"servers; resume with the saved --ps-servers and model")
        with torch.no_grad():
            for p, name in zip(self.params, self.shard.names, strict=True):
                p.copy_(state["params"][name])  # into the flat buffer's views: the optimizer's tensors stay
        self.optimizer.load_state_dict(state["optim"])
        self.version, self.last = int(state["version"]), (float(state["last"][0]), float(state["last"][1]))

    # -- messages -------------------------------------------------------------------------------------------------

    def _send_params(self, worker: int, stop: bool = False) -> list[comm.Work]:
        header = torch.tensor([self.version, *self.last, float(stop)], dtype=torch.float64,
                              device=self.shard.flat.device)
        payload = self.shard.flat.clone()  # the worker gets this version even if an update lands before it leaves
        self.stats.bytes_out += HEADER_BYTES * PULL_HEADER + payload.numel() * 4
        return [comm.isend(header, worker, tag=PULL_TAG), comm.isend(payload, worker, tag=PULL_TAG)]

    def _recv_push(self, worker: int | None) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """(sender, header, gradient) of the next push: from ``worker``, or from whichever worker is first. A
        worker's ``done`` is a header alone: the gradient is None."""
        header = torch.zeros(PUSH_HEADER, dtype=torch.float64, device=self.shard.flat.device)
        if worker is None:
            worker = comm.recv_any(header, tag=PUSH_TAG)
        else:
            comm.recv(header, worker, tag=PUSH_TAG)
        if header[4] == PUSH_DONE:
            self.stats.bytes_in += HEADER_BYTES * PUSH_HEADER
            return worker, header, None
        self.stop_requested |= bool(header[4] == PUSH_STOP)
        grad = torch.empty_like(self.shard.flat)
        comm.recv(grad, worker, tag=PUSH_TAG)
        self.stats.by_worker[worker] = self.stats.by_worker.get(worker, 0) + 1
        self.stats.bytes_in += HEADER_BYTES * PUSH_HEADER + grad.numel() * 4
        return worker, header, grad

    def _global_norm(self, grad: torch.Tensor) -> float:
        """The L2 norm of the update's whole gradient, from every server's share of the sum of squares (summed in
        server order, so every server clips by the same factor)."""
        mine = grad.double().square().sum().reshape(1)
        if len(self.servers) == 1:
            return float(mine.sqrt())
        others = [s for s in self.servers if s != self.servers[self.index]]
        parts = {s: torch.zeros(1, dtype=torch.float64, device=grad.device) for s in others}
        works = [comm.isend(mine, s, tag=NORM_TAG) for s in others] + \
                [comm.irecv(parts[s], s, tag=NORM_TAG) for s in others]
        for work in works:
            work.wait()
        parts[self.servers[self.index]] = mine
        return float(sum(parts[s] for s in self.servers).sqrt())

    def _apply(self, grad: torch.Tensor, staleness: list[int], norm: float, loss: float) -> None:
        if self.clip is not None and norm > self.clip:  # clip_grad_norm_'s factor: max_norm / (norm + 1e-6)
            grad.mul_(self.clip / (norm + 1e-6))
        if self.lr is not None:
            step = self.version if self.mode == "sync" else self.version // len(self.workers)
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr(step)
        for p, g in zip(self.params, self.shard.views(grad), strict=True):
            p.grad = g
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.last = (norm, loss)
        self.stats.updates += 1
        self.stats.staleness.extend(staleness)

    # -- serving --------------------------------------------------------------------------------------------------

    def serve(self, steps: int, on_update: Callable[[ParameterServer], None] | None = None) -> ServerStats:
        """Serve until the run's end; ``on_update(self)`` after every update (in sync after its parameters went
        out: a checkpoint saved there holds what every worker has pulled). In sync a server resumed from a
        checkpoint (``load_state_dict``) takes steps ``version``..``steps - 1``."""
        t0 = time.perf_counter()
        self._on_update = on_update
        sends = (self._serve_sync if self.mode == "sync" else self._serve_async)(steps)
        for work in sends:
            work.wait()
        self.stats.wall_s = time.perf_counter() - t0
        return self.stats

    def _serve_sync(self, steps: int) -> list[comm.Work]:
        sends: list[comm.Work] = []
        for w in self.workers:
            sends += self._send_params(w)
        for _ in range(self.version, steps):  # a resumed server starts at its checkpoint's version
            total, staleness, losses = None, [], []
            for w in self.workers:  # worker order: the same sum on every run
                _, header, grad = self._recv_push(w)
                staleness.append(self.version - int(header[0]))
                losses.append(float(header[3]))
                total = grad if total is None else total.add_(grad)
            total.div_(len(self.workers))
            norm = self._global_norm(total)  # clips, and is the step's grad_norm the workers report
            self._apply(total, staleness, norm, sum(losses) / len(losses))
            self.stats.gaps.append(0)
            sends = _settled(sends)  # every worker took its last pull before it pushed: these are done
            # Every server hears every worker each step, so all of them see a stop request at the same version.
            self.stopping = self.version == steps or self.stop_requested
            for w in self.workers:
                sends += self._send_params(w, stop=self.stopping)
            self._updated()
            if self.stopping:
                break
        return sends

    def _updated(self) -> None:
        if self._on_update is not None:
            self._on_update(self)

    def _serve_async(self, steps: int) -> list[comm.Work]:
        """Apply pushes in arrival order (``comm.recv_any`` on the header: whichever worker is first), then answer
        each pusher once the staleness bound lets it run on. A worker is computing (released, a push to come), held
        (pushed, its reply waiting for the slowest) or finished. Server 0 stops each worker it answers once it has
        applied ``steps`` x W gradients; the others learn it from the worker's ``done``. The slowest active worker is
        never held, so this ends."""
        sends: list[comm.Work] = []
        clock, budget = dict.fromkeys(self.workers, 0), steps * len(self.workers)
        for w in self.workers:
            sends += self._send_params(w)
        active, computing, held = set(self.workers), set(self.workers), {}  # held: worker -> when it was held
        while computing or held:
            if computing:
                w, header, grad = self._recv_push(None)
                if w not in computing:
                    raise RuntimeError(f"server {self.index}: a push from rank {w}, which is not a computing worker "
                                       f"(computing: {sorted(computing)})")
                computing.discard(w)
                if grad is None:  # done: server 0 stopped it
                    active.discard(w)
                else:
                    norm = math.sqrt(float(header[2]))  # the worker's whole gradient, what every server applies
                    self._apply(grad, [self.version - int(header[0])], norm, float(header[3]))
                    self._updated()
                    clock[w] += 1
                    held[w] = time.perf_counter()
            stop = self.index == 0 and (self.stats.updates >= budget or self.stop_requested)
            for w in self._release_ready(held, clock, active, stop):
                sends += self._send_params(w, stop=stop)
                if stop:
                    active.discard(w)
                else:
                    computing.add(w)
            sends = _settled(sends)
        return sends

    def _release_ready(self, held: dict[int, float], clock: dict[int, int], active: set[int], stop: bool) -> list[int]:
        """The held workers that may run on, in worker order: every one when stopping or unbounded, else those at
        most ``max_staleness`` steps ahead of the slowest active worker; their waits and gaps recorded."""
        k, ready = self.max_staleness, []
        for w in sorted(held, key=self.workers.index):
            gap = clock[w] - min(clock[u] for u in active) if w in active else 0
            if stop or k is None or gap <= k:
                self.stats.held_s += time.perf_counter() - held.pop(w)
                if not stop:  # the gap a worker runs on at (one stopped runs no more)
                    self.stats.gaps.append(gap)
                ready.append(w)
        return ready

    def send_final(self, worker: int) -> None:
        """The final shard to ``worker`` (async: the last pull of a worker that finished early predates the other
        workers' last updates)."""
        for work in self._send_params(worker):
            work.wait()


def _settled(sends: list[comm.Work]) -> list[comm.Work]:
    """Waits (and so logs) the sends that have completed; returns the rest. Keeps the payloads held in flight
    to what the workers have not yet taken, not one copy per step of the run."""
    out = []
    for work in sends:
        if work.is_completed():
            work.wait()
        else:
            out.append(work)
    return out


class PSWorker:
    """The worker side, wrapping its replica: ``pull()`` loads every server's shard into the model (call it once
    before the first step and after every ``push``), ``push(loss)`` sends the gradients the last backward left,
    their squared norm and the loss. The replica's own parameters are never stepped here. After a pull,
    ``update_norm`` and ``update_loss`` are server 0's last update's (in sync: the global batch's), and ``stopped``
    says the run is over for this worker (in async, then call ``done()``)."""

    def __init__(self, model: nn.Module, servers: Sequence[int]) -> None:
        self.model, self.servers = model, list(servers)
        params = dict(_trainable(model))
        self.shards = [[params[n] for n in names] for names in model_shards(model, len(self.servers))]
        self.device = next(iter(self.model.parameters())).device
        self.versions = [0] * len(self.servers)
        self.clock = 0
        self.update_norm = self.update_loss = 0.0
        self.stopped = False
        self.bytes_sent = self.bytes_received = 0

    def pull(self) -> None:
        for i, (server, params) in enumerate(zip(self.servers, self.shards, strict=True)):
            header = torch.zeros(PULL_HEADER, dtype=torch.float64, device=self.device)
            flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32, device=self.device)
            comm.recv(header, server, tag=PULL_TAG)
            comm.recv(flat, server, tag=PULL_TAG)
            version, norm, loss, stop = header.tolist()
            self.versions[i] = int(version)
            if i == 0:  # server 0 speaks for the run: its last update and, in async, when to stop
                self.update_norm, self.update_loss, self.stopped = norm, loss, stop > 0
            with torch.no_grad():
                for p, v in zip(params, flat.split([p.numel() for p in params]), strict=True):
                    p.copy_(v.view(p.shape))
            self.bytes_received += HEADER_BYTES * PULL_HEADER + flat.numel() * 4

    def done(self) -> None:
        """Async, after the pull that said stop: tell the other servers this worker pushes no more."""
        header = torch.tensor([0, self.clock, 0, 0, PUSH_DONE], dtype=torch.float64, device=self.device)
        for server in self.servers[1:]:
            comm.send(header, server, tag=PUSH_TAG)
            self.bytes_sent += HEADER_BYTES * PUSH_HEADER

    def _flat_grads(self) -> list[torch.Tensor]:
        return [torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                           for p in params]) if params else torch.zeros(0, device=self.device)
                for params in self.shards]

    def push(self, loss: float | torch.Tensor = 0.0, stop: bool = False) -> float:
        """Sends this step's gradients; returns their global L2 norm (what async clips by). ``stop``: ask the run to
        end after this update (the servers' next pull says stop; in sync every worker then stops at this step)."""
        flats = self._flat_grads()
        sq = float(sum(f.double().square().sum() for f in flats))
        works = []
        for i, (server, flat) in enumerate(zip(self.servers, flats, strict=True)):
            header = torch.tensor([self.versions[i], self.clock, sq, float(loss), PUSH_STOP if stop else PUSH_GRADIENT],
                                  dtype=torch.float64, device=self.device)
            works += [comm.isend(header, server, tag=PUSH_TAG), comm.isend(flat, server, tag=PUSH_TAG)]
            self.bytes_sent += HEADER_BYTES * PUSH_HEADER + flat.numel() * 4
        for work in works:
            work.wait()
        self.clock += 1
        return math.sqrt(sq)

    def finish(self) -> None:
        """Async: the final parameters, which the servers send worker 0 once every worker has stopped
        (``ParameterServer.send_final``)."""
        self.pull()
