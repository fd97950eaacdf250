"""launch: results in rank order, output relay, and every failure mode ending in RankError, never a hang."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import workbench
from workbench import RankError, comm, launch

pytestmark = pytest.mark.timeout(120)


def _sum_of_ranks(offset: float) -> float:
    t = torch.tensor([float(dist.get_rank())])
    comm.all_reduce(t)
    return t.item() + offset


def test_results_in_rank_order_and_traced() -> None:
    results = launch(lambda: (dist.get_rank(), dist.get_world_size(), dist.get_backend()), 4)
    assert list(results) == [(r, 4, "gloo") for r in range(4)]
    results = launch(_sum_of_ranks, 3, 0.5)
    assert list(results) == [3.5, 3.5, 3.5]
    assert [t.rank for t in results.traces] == [0, 1, 2]
    (event,) = results.traces[1].comms
    assert event.op == "all_reduce" and event.nbytes == 4 and event.group == (0, 1, 2)


def test_two_launches_in_a_row_and_kwargs() -> None:
    def fn(a: int, *, b: int) -> int:
        return a * b + dist.get_rank()

    assert list(launch(fn, 2, 3, b=4)) == [12, 13]
    assert list(launch(fn, 2, 5, b=1)) == [5, 6]


def test_output_is_relayed_with_rank_prefix(capfd: pytest.CaptureFixture[str]) -> None:
    def noisy() -> None:
        print(f"hello from {dist.get_rank()}")
        os.write(2, b"raw fd write\n")

    launch(noisy, 2)
    out, err = capfd.readouterr()
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert "[rank 1] raw fd write" in err


def _assert_no_rank_processes_left() -> None:
    import multiprocessing

    # active_children() also reaps: a rank still listed here is alive or was never waited for.
    assert not multiprocessing.active_children(), "launch left rank processes behind"


def _raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("bad thing on purpose")
    comm.all_reduce(torch.ones(1))
    time.sleep(30)


def test_exception_names_rank_and_stops_others() -> None:
    t0 = time.time()
    with pytest.raises(RankError) as info:
        launch(_raise_on_rank_1, 4, timeout=30)
    assert time.time() - t0 < 15
    err = info.value
    assert isinstance(err, RuntimeError) and err.rank == 1
    assert "ValueError: bad thing on purpose" in str(err)
    assert "_raise_on_rank_1" in err.remote_traceback
    _assert_no_rank_processes_left()


def _sigkill_rank_2() -> None:
    if dist.get_rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(torch.ones(1))
    time.sleep(30)


def test_sigkill_is_reported_as_the_cause() -> None:
    t0 = time.time()
    with pytest.raises(RankError) as info:
        launch(_sigkill_rank_2, 4, timeout=30)
    assert time.time() - t0 < 15
    assert info.value.rank == 2 and "SIGKILL" in str(info.value)
    _assert_no_rank_processes_left()


def _rank_1_never_joins() -> None:
    if dist.get_rank() == 1:
        time.sleep(600)
    comm.all_reduce(torch.ones(1))


def test_collective_one_rank_never_joins_times_out() -> None:
    t0 = time.time()
    with pytest.raises(RankError) as info:
        launch(_rank_1_never_joins, 3, timeout=3)
    elapsed = time.time() - t0
    assert elapsed < 3 + 12, elapsed
    assert "timed out" in str(info.value).lower()
    assert "[1]" in str(info.value), "the rank that never joined should be named"
    _assert_no_rank_processes_left()


def test_rank_exiting_without_result() -> None:
    with pytest.raises(RankError, match="exited with code 3"):
        launch(lambda: os._exit(3) if dist.get_rank() == 0 else time.sleep(30), 2, timeout=30)
    _assert_no_rank_processes_left()


def test_subgroup_collectives_also_time_out() -> None:
    def fn() -> None:
        mesh = workbench.Mesh(dp=2)
        if dist.get_rank() == 0:
            time.sleep(600)
        comm.all_reduce(torch.ones(1), group=mesh.dp_group)

    t0 = time.time()
    with pytest.raises(RankError, match="(?i)timed out"):
        launch(fn, 2, timeout=3)
    assert time.time() - t0 < 15


@pytest.mark.parametrize("bad, message", [
    (dict(world_size=0), "world_size must be a positive int"),
    (dict(world_size=2.0), "world_size must be a positive int"),
    (dict(world_size=2, backend="mpi"), "backend must be one of"),
    (dict(world_size=2, timeout=0), "timeout must be a positive"),
])
def test_bad_arguments_raise_before_spawning(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        launch(print, **bad)


def test_nccl_without_enough_gpus_is_a_clear_error() -> None:
    if torch.cuda.device_count() >= 2:
        pytest.skip("machine has 2 GPUs: NCCL on 2 ranks is valid here")
    with pytest.raises(ValueError, match="no CUDA device is available|one GPU per rank"):
        launch(print, 2, backend="nccl")


def test_unpicklable_result_is_reported() -> None:
    def returns_lock():  # noqa: ANN202
        import threading

        return threading.Lock()

    with pytest.raises(RankError, match="(?i)pickle"):
        launch(returns_lock, 2)


@pytest.mark.extended  # a fresh interpreter importing torch: the extended lane
def test_a_script_read_from_stdin_can_launch() -> None:
    """``python - <<EOF`` gives ``__main__`` the path ``<stdin>``, which multiprocessing cannot re-import."""
    import subprocess
    import sys

    script = ("import torch.distributed as dist\nfrom workbench import launch\n"
              "print(list(launch(lambda: dist.get_rank(), 2, device='cpu', timeout=30)))\n")
    proc = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("[0, 1]")
