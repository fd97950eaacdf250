"""RankPool (persistent ranks running code strings) and the %ranks / %%ranks IPython magics."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading

import pytest

from workbench.rank_pool import PoolBrokenError, RankPool

pytestmark = pytest.mark.timeout(120)

# Short enough that the hang tests stay quick, long enough for gloo on 2 busy shared cores.
TIMEOUT = 4.0


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, timeout=TIMEOUT)
    try:
        yield p
    finally:
        p.stop()


def test_state_persists_across_runs(pool):
    pool.run("x = rank * 10")
    results = pool.run("x += 1\nprint('x is', x)")
    assert [r.stdout for r in results] == ["x is 1\n", "x is 11\n"]
    assert all(r.ok and r.value is None for r in results)


def test_last_expression_is_returned_per_rank(pool):
    results = pool.run("y = rank + 100\ny")
    assert [(r.rank, r.value) for r in results] == [(0, "100"), (1, "101")]
    assert pool.run("world_size, str(device)")[0].value == "(2, 'cpu')"


def test_all_reduce_sums_on_every_rank(pool):
    results = pool.run("t = torch.tensor([rank + 1.0], device=device)\ncomm.all_reduce(t)\nt.item()")
    assert [r.value for r in results] == ["3.0", "3.0"]
    assert all(r.trace is not None and [c.op for c in r.trace.comms] == ["all_reduce"] for r in results)


def test_exception_on_one_rank_comes_back_and_pool_survives(pool):
    results = pool.run("if rank == 1:\n    raise KeyError('only on one')\n'fine'")
    assert results[0].ok and results[0].value == "'fine'"
    assert "KeyError: 'only on one'" in results[1].error and "<rank 1, cell" in results[1].error
    assert "rank_pool.py" not in results[1].error  # the learner's frames only
    assert pool.broken is None
    assert [r.value for r in pool.run("rank")] == ["0", "1"]


def test_subset_run_and_stderr(pool):
    results = pool.run("import sys\nprint('err', rank, file=sys.stderr)\nrank", ranks=[1])
    assert [(r.rank, r.value, r.stderr) for r in results] == [(1, "1", "err 1\n")]


def test_syntax_error_is_a_rank_error(pool):
    results = pool.run("def (:")
    assert all("SyntaxError" in r.error for r in results) and pool.broken is None


@pytest.mark.parametrize("ranks", [[2], [-1], [], [0, "1"]])
def test_bad_rank_list_is_a_value_error(pool, ranks):
    with pytest.raises(ValueError, match=r"ranks must be distinct ints in 0\.\.1"):
        pool.run("rank", ranks=ranks)


@pytest.mark.parametrize("kwargs", [{"world_size": 0}, {"world_size": 2, "timeout": 0},
                                    {"world_size": 2, "device": "tpu"}])
def test_bad_pool_arguments_are_value_errors(kwargs):
    with pytest.raises(ValueError, match="world_size|timeout|device"):
        RankPool(**kwargs)


def test_hung_collective_is_reported_and_restart_recovers():
    pool = RankPool(2, timeout=TIMEOUT)
    try:
        results = pool.run("if rank == 0:\n    comm.all_reduce(torch.ones(1, device=device))\n'done'")
        assert results[1].value == "'done'"
        assert "timed out" in results[0].error.lower() and "restart" in results[0].error
        assert pool.broken and "[0]" in pool.broken
        with pytest.raises(PoolBrokenError, match="restart"):
            pool.run("rank")
        pool.restart()
        assert pool.broken is None
        assert [r.value for r in pool.run("t = torch.ones(1)\ncomm.all_reduce(t)\nt.item()")] == ["2.0", "2.0"]
    finally:
        pool.stop()


def test_unanswered_and_dead_ranks_are_named():
    pool = RankPool(2, timeout=TIMEOUT)
    try:
        results = pool.run("import time\nif rank == 0:\n    time.sleep(60)", timeout=1.0)
        assert results[0].lost and "rank 0 did not answer" in results[0].error and results[1].ok
        pool.restart()
        # Ctrl-C in the caller while the ranks run (SIGINT from a thread: pytest-timeout owns SIGALRM).
        ctrl_c = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        ctrl_c.start()
        with pytest.raises(KeyboardInterrupt):
            pool.run("import time\ntime.sleep(60)")
        ctrl_c.join()
        assert "interrupted" in pool.broken
        pool.restart()
        pids = [s.pid for s in pool.status()]
        results = pool.run("import os\nif rank == 1:\n    os._exit(3)")
        assert results[1].lost and "rank 1 died" in results[1].error and "code 3" in results[1].error
        assert pool.broken and "[1]" in pool.broken
        assert [s.alive for s in pool.status()] == [True, False]
    finally:
        pool.stop()
    assert all(_gone(pid) for pid in pids)


def test_stop_leaves_no_children_and_is_idempotent():
    pool = RankPool(2, timeout=TIMEOUT)
    status = pool.status()
    assert [s.rank for s in status] == [0, 1] and all(s.alive and s.device == "cpu" for s in status)
    assert all(s.rss_bytes is None or s.rss_bytes > 0 for s in status)
    pool.stop()
    pool.stop()
    assert all(_gone(s.pid) for s in status)
    pids = {s.pid for s in status}
    assert not [p for p in mp.active_children() if p.pid in pids]  # reaped, not zombies
    with pytest.raises(PoolBrokenError, match="stopped"):
        pool.run("rank")


# ----------------------------------------------------------------------------------------------------
# The magics, through a real IPython shell.


@pytest.fixture()
def shell():
    interactive = pytest.importorskip("IPython.core.interactiveshell")
    ip = interactive.InteractiveShell.instance()
    ip.run_line_magic("load_ext", "workbench.magics")
    try:
        yield ip
    finally:
        ip.run_line_magic("unload_ext", "workbench.magics")


def _magics(ip):
    return ip.magics_manager.registry["RankMagics"]


def test_magics_start_cell_status_stop(shell):
    from IPython.utils.capture import capture_output

    with capture_output() as started:
        shell.run_line_magic("ranks", f"start 2 --timeout {TIMEOUT}")
    assert "started 2 rank(s), gloo on the CPU" in started.stdout
    pids = [s.pid for s in _magics(shell).pool.status()]
    with capture_output() as out:
        shell.run_cell_magic("ranks", "", "z = rank * 7\nprint('hello from', rank)\nz")
    html = out.outputs[0].data["text/html"]
    assert "rank 0" in html and "rank 1" in html and "hello from 1" in html and ">7</pre>" in html
    assert "--- rank 1" in out.outputs[0].data["text/plain"]
    with capture_output() as out:
        shell.run_cell_magic("ranks", "1", "1 / 0")
    html = out.outputs[0].data["text/html"]
    assert "rank 0" not in html and "ZeroDivisionError" in html and "color:#c62828" in html
    with capture_output() as out:
        shell.run_line_magic("ranks", "status")
    assert "rank 1: pid" in out.stdout and "alive" in out.stdout
    with capture_output() as out:
        shell.run_line_magic("ranks", "stop")
    assert "stopped" in out.stdout and _magics(shell).pool is None
    assert all(_gone(pid) for pid in pids)


@pytest.mark.parametrize(("line", "cell", "message"), [
    ("start 0", None, "at least 1"),
    ("start two", None, "must be an integer"),
    ("start 2 --colour red", None, "unknown option"),
    ("launch", None, "unknown command"),
    ("", "rank", "no rank pool is running"),
    ("status", None, "no rank pool is running"),
    ("start 4 --nodes 3", None, "nodes=3 must divide the 4 ranks"),
    ("start 2 --nodes 2 --inter-link fast", None, "inter_link: unknown link 'fast'"),
    ("start 2 --straggler rank=2:factor=2", None, "straggler rank 2 does not exist"),
    ("start 2 --nodes 2 --distribution scatter", None, "distribution='scatter'; valid: block, cyclic"),
])
def test_magics_bad_arguments_without_pool(shell, line, cell, message):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match=message):
        if cell is None:
            shell.run_line_magic("ranks", line)
        else:
            shell.run_cell_magic("ranks", line, cell)


def test_magics_rank_out_of_range(shell):
    from IPython.core.error import UsageError

    shell.run_line_magic("ranks", f"start 2 --timeout {TIMEOUT}")
    try:
        with pytest.raises(UsageError, match=r"out of range.*valid ranks are 0\.\.1"):
            shell.run_cell_magic("ranks", "0,5", "rank")
    finally:
        shell.run_line_magic("ranks", "stop")


def test_magics_start_on_emulated_nodes_with_a_straggler(shell):
    from IPython.utils.capture import capture_output

    with capture_output() as started:
        shell.run_line_magic("ranks", f"start 2 --timeout {TIMEOUT} --nodes 2 --inter-link 0.02,1000 "
                                      "--straggler rank=1:factor=3")
    try:
        assert "emulated: 2 nodes x 1 rank, intra nvlink" in started.stdout
        assert "inter 0.02 GB/s, 1000 µs" in started.stdout
        assert "emulated straggler: rank 1 computes 3x slower" in started.stdout
        with capture_output() as out:
            shell.run_cell_magic("ranks", "", "x = torch.ones(1024)\ncomm.all_reduce(x)\nx[0].item()")
        assert ">2.0</pre>" in out.outputs[0].data["text/html"]  # both ranks' sum
        events = [r.trace.comms[-1] for r in _magics(shell).pool.last_results]
        assert all(e.link == "inter" and e.modelled_s > 0 for e in events)
    finally:
        shell.run_line_magic("ranks", "stop")
