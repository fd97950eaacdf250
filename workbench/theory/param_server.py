"""What a parameter server moves, and when its link becomes the bottleneck (``parallel.param_server``).

Per step, each worker pulls every parameter and pushes every gradient (fp32: 4 bytes an element) plus a header per
server and direction (fp64 fields: 32 bytes for the pull's [version, norm, loss, stop], 40 for the push's
[version, clock, |g|², loss, done]). Server s holds n_s of the P parameters and so receives W (4 n_s + 40) bytes
and sends W (4 n_s + 32) each step: its link carries W
times its shard, while a ring all-reduce (Patarasuk & Yuan 2009) sends each rank 2 (N−1)/N · 4P, about 8P bytes
whatever N is. With the α-β model (Hockney 1994) and messages on one link in series, the busiest server's link
needs about W (α + 4 n_max / β) each way (``server_link_seconds``); the ring 2 (N−1) (α + 4P / (N β))
(``theory.comm.ring_allreduce_time``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workbench.theory.comm import p2p_time

PULL_HEADER_BYTES, PUSH_HEADER_BYTES = 32, 40
FP32 = 4


def step_bytes(shard_numels: Sequence[int], workers: int) -> dict[str, Any]:
    """Bytes of one step: per worker (each way) and per server (each way), for shards of ``shard_numels``."""
    if workers < 1 or not shard_numels:
        raise ValueError(f"need at least one worker and one server, got workers={workers}, "
                         f"shards={list(shard_numels)}")
    push = [FP32 * n + PUSH_HEADER_BYTES for n in shard_numels]
    pull = [FP32 * n + PULL_HEADER_BYTES for n in shard_numels]
    return {"worker_push": sum(push), "worker_pull": sum(pull),
            "server_in": [workers * b for b in push], "server_out": [workers * b for b in pull]}


def server_link_seconds(shard_numels: Sequence[int], workers: int, alpha: float, bandwidth: float, *,
                        pushes_queue: bool = True) -> float:
    """α-β time (``theory.comm.p2p_time``, α seconds, bandwidth bytes/s) of one step on the busiest server's link,
    each push and pull a header then a payload. ``pushes_queue``: the W pushes arrive one after another (one NIC
    receives them) as the W pulls leave: W (push + pull). False: only what a rank *sends* queues on its link, the
    model of ``workbench.dist.emulation``: the W pushes leave their workers side by side, so push + W pull."""
    n = max(shard_numels)
    push = p2p_time(PUSH_HEADER_BYTES, alpha, bandwidth) + p2p_time(FP32 * n, alpha, bandwidth)
    pull = p2p_time(PULL_HEADER_BYTES, alpha, bandwidth) + p2p_time(FP32 * n, alpha, bandwidth)
    return workers * (push + pull) if pushes_queue else push + workers * pull
