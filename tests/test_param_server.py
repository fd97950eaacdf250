"""The parameter server (``parallel.param_server``): the equivalence ladder's two rungs (synchronous PS = data
parallelism on the global batch; asynchronous PS with one worker = sequential training, bit for bit), the staleness
bound of the asynchronous mode under a straggler, every byte on the links against ``theory.param_server``, the
sharding rule by hand, and bad input.

All the multi-rank work runs in ONE 4-rank launch (module fixture) whose ranks play each scenario in turn, ranks
outside a scenario sitting it out:

* ``sync``: workers 0, 1 and servers 2, 3 (the parameters dealt over two servers), AdamW, 3 steps, each worker on
  its half of the global batch.
* ``async1``: worker 0 and server 3 alone, the whole batch.
* ``straggler`` / ``bounded``: workers 0, 1, 2 and server 3, asynchronous, worker 2 sleeping STRAGGLE_S a step;
  unbounded, then ``max_staleness=1``.

Tolerances. Synchronous PS vs one process: the server sums the workers' mean gradients in worker order and divides
by W where one process takes the mean over the whole batch: another order of the same fp32 sums, so the parameters
after AdamW are compared with ``assert_adam_params_close`` (tests/equivalence.py: Adam's update normalises the
gradient, so rounding noise in a near-zero gradient may flip a step; the helper bounds that by the learning rates).
Asynchronous PS with one worker does the very same operations as one process (the gradient is copied exactly into
fp32, the server's AdamW steps the same tensors in the same order): bit for bit. Bytes are integers: exact.
"""

from __future__ import annotations

import time

import pytest
import torch
from equivalence import (
    assert_adam_params_close,
    assert_params_identical,
    gpt_batch,
    reference_grads,
    reference_train,
    shard,
)

from workbench import launch, trace
from workbench.dist import comm
from workbench.models import GPTConfig, build_gpt
from workbench.parallel.param_server import (
    ParameterServer,
    PSWorker,
    check_layout,
    check_mode,
    check_staleness,
    model_shards,
    server_ranks,
    shard_parameters,
)
from workbench.theory.param_server import server_link_seconds, step_bytes

pytestmark = [pytest.mark.numerics, pytest.mark.timeout(180)]

TINY = GPTConfig.preset("tiny", seq_len=16)
BATCH, STEPS, LR = 8, 3, 1e-3
STRAGGLE_S, ASYNC_STEPS = 0.1, 5
CLIP = 0.1  # below the tiny GPT's gradient norm at these steps, so every update is clipped


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return gpt_batch(step, BATCH, seq_len=TINY.seq_len)


def _adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)


def _log_bytes(start: int, tag: str, op: str) -> int:
    return sum(c.nbytes for c in trace.current().trace.comms[start:] if c.tag == tag and c.op == op)


def _play(servers: list[int], workers: list[int], mode: str, steps: int, max_staleness: int | None = None,
          straggler: int | None = None, clip: float | None = None) -> dict | None:
    rank, start = comm.group_rank(), len(trace.current().trace.comms)
    model = build_gpt(TINY, seed=0)
    if rank in servers:
        ps = ParameterServer(model, servers, workers, _adamw, mode=mode, max_staleness=max_staleness, clip=clip)
        stats = ps.serve(steps)
        return {"params": {n: p.clone() for n, p in ps.named_parameters().items()}, "stats": stats,
                "log_in": _log_bytes(start, "ps_push", "recv"), "log_out": _log_bytes(start, "ps_pull", "send")}
    if rank not in workers:
        return None
    worker, index, t0 = PSWorker(model, servers), workers.index(rank), time.perf_counter()
    worker.pull()
    step = 0
    while not worker.stopped:  # sync: `steps` steps; async: until server 0 has applied steps x W gradients
        model.zero_grad(set_to_none=True)
        model(*shard(_batch(step), index, len(workers))).backward()
        if rank == straggler:
            time.sleep(STRAGGLE_S)
        worker.push()
        worker.pull()
        step += 1
    if mode == "async":
        worker.done()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "sent": worker.bytes_sent,
            "norm": worker.update_norm, "steps": step,
            "received": worker.bytes_received, "log_push": _log_bytes(start, "ps_push", "send"),
            "log_pull": _log_bytes(start, "ps_pull", "recv"), "seconds": time.perf_counter() - t0}


def _scenarios() -> dict:
    out = {"sync": _play([2, 3], [0, 1], "sync", STEPS), "async1": _play([3], [0], "async", STEPS),
           "straggler": _play([3], [0, 1, 2], "async", ASYNC_STEPS, straggler=2),
           "bounded": _play([3], [0, 1, 2], "async", ASYNC_STEPS, max_staleness=1, straggler=2),
           "clipped": _play([2, 3], [0, 1], "sync", STEPS, clip=CLIP)}
    if comm.group_rank() == 0:  # the reference in a rank: same threads, so the same kernels as the workers'
        build = lambda: build_gpt(TINY, seed=0)  # noqa: E731
        out["reference"] = reference_train(build, _batch, STEPS, lr=LR)
        out["grads0"] = reference_grads(build, _batch)
        out["reference_clipped"] = reference_train(build, _batch, STEPS, lr=LR, max_norm=CLIP)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launch(_scenarios, 4, timeout=150)


# -- the equivalence ladder ----------------------------------------------------------------------------------------

def test_synchronous_ps_is_data_parallel_training_on_the_global_batch(ranks):
    want, grads0 = ranks[0]["reference"], ranks[0]["grads0"]
    for worker in (0, 1):
        assert_adam_params_close(ranks[worker]["sync"]["params"], want, grads0, lr_sum=STEPS * LR,
                                 msg=f"worker {worker}: ")
    served = {**ranks[2]["sync"]["params"], **ranks[3]["sync"]["params"]}
    assert sorted(served) == sorted(want)
    for name, p in ranks[0]["sync"]["params"].items():  # the final pull: each replica is the servers' parameters
        assert torch.equal(p, served[name]), name
    for server in (2, 3):
        stats = ranks[server]["sync"]["stats"]
        assert stats.updates == STEPS and stats.histogram() == {0: 2 * STEPS}  # one update a step, never stale


def test_synchronous_ps_clips_by_the_global_norm_across_servers(ranks):
    """Two servers each hold part of the gradient: the clip factor needs the norm of the whole, so they exchange
    their sums of squares. Against ``clip_grad_norm_`` on one process (which rounds the norm differently: the
    factor differs by rounding, inside the Adam bound)."""
    assert_adam_params_close(ranks[0]["clipped"]["params"], ranks[0]["reference_clipped"], ranks[0]["grads0"],
                             lr_sum=STEPS * LR)
    assert ranks[0]["clipped"]["norm"] > CLIP  # the clip was in force
    clipped, plain = ranks[0]["clipped"]["params"], ranks[0]["sync"]["params"]
    assert any(not torch.equal(p, plain[n]) for n, p in clipped.items())  # and it changed the updates


def test_asynchronous_ps_with_one_worker_is_sequential_training_bit_for_bit(ranks):
    assert_params_identical(ranks[0]["async1"]["params"], ranks[0]["reference"])
    assert_params_identical(ranks[3]["async1"]["params"], ranks[0]["reference"])
    assert ranks[3]["async1"]["stats"].histogram() == {0: STEPS}


# -- asynchrony and its bound --------------------------------------------------------------------------------------

def _budget_kept(stats, workers: int) -> bool:
    """Server 0 stops the run once it has applied ASYNC_STEPS x W gradients; pushes already under way when it
    does are applied too (at most one per other worker)."""
    budget = workers * ASYNC_STEPS
    return budget <= stats.updates <= budget + workers - 1 and sum(stats.histogram().values()) == stats.updates


def test_async_applies_every_gradient_on_arrival_and_records_its_staleness(ranks):
    stats = ranks[3]["straggler"]["stats"]
    assert _budget_kept(stats, 3)
    assert max(stats.staleness) > 0  # three workers: at least one gradient arrives after another's update
    # Unbounded, the fast workers never wait for the straggler: they take the steps it cannot.
    steps = [ranks[w]["straggler"]["steps"] for w in (0, 1, 2)]
    assert min(steps[:2]) > steps[2] and sum(steps) == stats.updates, steps


def test_max_staleness_holds_fast_workers_within_k_steps_of_the_slowest(ranks):
    bounded, free = ranks[3]["bounded"]["stats"], ranks[3]["straggler"]["stats"]
    assert _budget_kept(bounded, 3)
    assert max(bounded.gaps) <= 1, bounded.gaps  # the SSP rule, at every reply the server released
    assert bounded.held_s > 0  # replies were held back for the straggler
    assert max(free.gaps) > 1, free.gaps  # without the bound the fast workers ran further ahead
    steps = [ranks[w]["bounded"]["steps"] for w in (0, 1, 2)]
    assert max(steps) - steps[2] <= 2, steps  # at most K + 1 ahead when the run stops


# -- bytes ---------------------------------------------------------------------------------------------------------

def test_every_byte_is_theory(ranks):
    model = build_gpt(TINY, seed=0)
    sizes = dict((n, p.numel()) for n, p in model.named_parameters())
    numels = [sum(sizes[n] for n in names) for names in model_shards(model, 2)]
    want = step_bytes(numels, workers=2)
    for worker in (0, 1):
        got = ranks[worker]["sync"]
        assert got["sent"] == got["log_push"] == STEPS * want["worker_push"]
        assert got["received"] == got["log_pull"] == (STEPS + 1) * want["worker_pull"]  # and the final pull
    for i, server in enumerate((2, 3)):
        got = ranks[server]["sync"]
        assert got["stats"].bytes_in == got["log_in"] == STEPS * want["server_in"][i]
        assert got["stats"].bytes_out == got["log_out"] == (STEPS + 1) * want["server_out"][i]


def test_theory_hand_checked():
    assert step_bytes([10, 6], workers=3) == {"worker_push": 4 * 16 + 2 * 40, "worker_pull": 4 * 16 + 2 * 32,
                                              "server_in": [3 * 80, 3 * 64], "server_out": [3 * 72, 3 * 56]}
    # 1e6 parameters on one server, 4 workers, 1 GB/s, 0 latency: 4 x (8 MB + 72 B) = 0.032000288 s
    assert server_link_seconds([10**6], 4, 0.0, 1e9) == pytest.approx(4 * (8e6 + 72) / 1e9)
    # the emulator's model: one push (4 MB + 40 B), then 4 pulls (4 MB + 32 B each) queued at the server
    emulated = server_link_seconds([10**6], 4, 0.0, 1e9, pushes_queue=False)
    assert emulated == pytest.approx((4e6 + 40 + 4 * (4e6 + 32)) / 1e9)
    # every message pays alpha: two per push and two per pull (a header, then the payload)
    assert server_link_seconds([0], 3, 1e-3, 1e9) == pytest.approx(3 * 4e-3 + 3 * 72 / 1e9)


# -- layout and bad input ------------------------------------------------------------------------------------------

def test_sharding_deals_the_largest_tensor_first_to_the_least_loaded_server():
    assert shard_parameters([("a", 10), ("b", 6), ("c", 5), ("d", 1)], 2) == [["a", "d"], ["b", "c"]]
    assert shard_parameters([("x", 3), ("y", 3)], 1) == [["x", "y"]]
    assert server_ranks(5, 2) == [3, 4]


@pytest.mark.parametrize("call, message", [
    (lambda: check_layout(4, 4), "servers must be in 1..3"),
    (lambda: check_layout(4, 0), "at least one server and one worker"),
    (lambda: check_staleness(-1), "integer >= 0"),
    (lambda: check_mode("hogwild"), "valid modes are sync, async"),
    (lambda: shard_parameters([("a", 1)], 0), "servers must be >= 1"),
])
def test_bad_input_is_refused_with_what_is_valid(call, message):
    with pytest.raises(ValueError, match=message):
        call()
