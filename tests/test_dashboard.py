"""The live dashboard (issue 11, item 1): panels filled from streamed metrics, a real headless run, a threaded run
stopped early with its ranks gone and its outputs written, and a rank's error surfacing from ``wait()``."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from workbench.run import LiveRun, run_live
from workbench.trace import MEMORY_CATEGORIES
from workbench.widgets import dashboard as dash
from workbench.widgets.dashboard import SCALARS, Dashboard, has_widget_front_end

MIB = 2**20
N_SCALARS = len(SCALARS)


def _metrics(rank: int, step: int, attempt: int = 0) -> dict:
    """What train._streamed sends: rank 1 is the straggler and reports other scalars than rank 0."""
    return {"step": step, "loss": 5.0 - step + 10 * rank, "grad_norm": 1.0 + step, "lr": 1e-3 * (step + 1),
            "step_time_s": 0.1 * (rank + 1), "compute_s": 0.05 * (rank + 1), "tokens_per_s": 1000.0 + step,
            "rank": rank, "attempt": attempt,
            "memory_peak": {"parameters": 2 * MIB, "activations": (step + 1) * MIB * (rank + 1)},
            "comm_bytes": {"all_reduce": MIB, **({"broadcast": 3 * MIB} if step == 0 else {})}}


def _fill(board: Dashboard, steps: int) -> None:
    for step in range(steps):
        for rank in range(board.nproc):
            board.update(rank, _metrics(rank, step))


def _trace(board: Dashboard, name: str, nth: int = 0):
    return [t for t in board.figure.data if t.name == name][nth]


def test_update_fills_every_panel() -> None:
    board = Dashboard(nproc=2, steps=10, live=False, min_interval_s=0)
    _fill(board, 3)
    data = board.figure.data
    # rank 0's scalars, by step (rank 1's loss is 10 higher: it must not leak into rank 0's curve)
    assert list(data[0].x) == [0, 1, 2] and list(data[0].y) == [5.0, 4.0, 3.0]
    assert list(data[1].y) == [1.0, 2.0, 3.0]
    assert list(data[2].y) == pytest.approx([1e-3, 2e-3, 3e-3])
    assert list(data[3].y) == [1000.0, 1001.0, 1002.0]
    # one step-time line per rank: the straggler stands out
    assert list(data[N_SCALARS].y) == pytest.approx([0.1] * 3)
    assert list(data[N_SCALARS + 1].y) == pytest.approx([0.2] * 3)
    # dotted beside them, each rank's compute time: the rest of its step it waited
    assert data[N_SCALARS + 2].name == "rank 0 computing" and data[N_SCALARS + 2].line.dash == "dot"
    assert list(data[N_SCALARS + 2].y) == pytest.approx([0.05] * 3)
    assert list(data[N_SCALARS + 3].y) == pytest.approx([0.1] * 3)
    # memory: the latest ledger peaks, stacked by category, one bar per rank, in MiB
    memory = {data[N_SCALARS + 4 + i].name: list(data[N_SCALARS + 4 + i].y) for i in range(len(MEMORY_CATEGORIES))}
    assert set(memory) == set(MEMORY_CATEGORIES)
    assert memory["parameters"] == [2.0, 2.0] and memory["activations"] == [3.0, 6.0]
    assert memory["gradients"] == [0.0, 0.0]
    # bytes per collective, summed over steps, one stacked bar per rank
    comm = data[N_SCALARS + 4 + len(MEMORY_CATEGORIES):]
    assert [t.name for t in comm] == ["rank 0", "rank 1"]
    assert list(comm[0].x) == ["all_reduce", "broadcast"] and list(comm[0].y) == [3.0, 3.0]
    assert board.figure.layout.barmode == "stack"
    assert "step 3 of 10" in board.status.value


def test_redraws_are_throttled_and_flush_draws_the_rest() -> None:
    board = Dashboard(nproc=1, steps=10, live=False, min_interval_s=3600)
    board.update(0, _metrics(0, 0))  # the first update draws
    board.update(0, _metrics(0, 1))  # within the interval: recorded, not drawn
    assert list(board.figure.data[0].y) == [5.0]
    assert board.scalars["loss"] == {0: 5.0, 1: 4.0}
    board.flush()
    assert list(board.figure.data[0].y) == [5.0, 4.0]


def test_a_restart_redoes_steps_and_the_status_counts_it() -> None:
    board = Dashboard(nproc=1, steps=10, live=False, min_interval_s=0)
    _fill(board, 3)
    board.update(0, {**_metrics(0, 1, attempt=1), "loss": 9.0})  # resumed from step 0's checkpoint
    assert list(board.figure.data[0].y) == [5.0, 9.0, 3.0]
    assert "restarts: 1" in board.status.value and "step 2 of 10" in board.status.value


def test_stop_button_calls_on_stop_once_and_says_so() -> None:
    calls = []
    board = Dashboard(nproc=1, steps=5, live=False, on_stop=lambda: calls.append(1))
    board.stop_button.click()
    board.stop_button.click()
    assert calls == [1] and board.stop_button.disabled and "stopping" in board.status.value
    board.finish({"history": [{"step": 0}, {"step": 1}]})
    assert "stopped after step 1" in board.status.value and "stopping" not in board.status.value


def test_live_without_anywidget_redraws_a_figure_into_an_output(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dash, "_anywidget_available", lambda: False)
    board = Dashboard(nproc=2, steps=4, live=True, min_interval_s=0)
    _fill(board, 2)
    (shown,) = board._output.outputs
    figure = shown["data"]["application/vnd.plotly.v1+json"]
    assert figure["data"][0]["y"] == [5.0, 4.0]


def test_live_with_anywidget_is_a_figure_widget() -> None:
    pytest.importorskip("anywidget", reason="plotly's FigureWidget needs anywidget (not installed here)")
    import plotly.graph_objects as go

    board = Dashboard(nproc=2, steps=4, live=True, min_interval_s=0)
    _fill(board, 2)
    assert isinstance(board.figure, go.FigureWidget) and board.figure in board.children
    assert list(board.figure.data[0].y) == [5.0, 4.0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(nproc=0, steps=4), "nproc must be a positive int, got 0"),
    (dict(nproc=2, steps=True), "steps must be a positive int, got True"),
    (dict(nproc=2, steps=4, min_interval_s=-1), "min_interval_s must be a number of seconds >= 0"),
])
def test_bad_dashboard_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Dashboard(**kwargs)


def test_bad_update_names_the_value() -> None:
    board = Dashboard(nproc=2, steps=4, live=False)
    with pytest.raises(ValueError, match=r"rank must be an int in 0\.\.1 .* got 2"):
        board.update(2, _metrics(0, 0))
    with pytest.raises(ValueError, match="metrics need a 'step'"):
        board.update(0, {"loss": 1.0})


class _Kernel:
    def __init__(self, metadata: dict) -> None:
        self.metadata = metadata

    def get_parent(self, channel: str = "shell") -> dict:
        return {"header": {"msg_type": "execute_request"}, "metadata": self.metadata}


@pytest.mark.parametrize("shell, expected", [
    (None, False),                                                       # plain python
    (SimpleNamespace(user_ns={}), False),                                # terminal IPython: no kernel
    (SimpleNamespace(user_ns={}, kernel=_Kernel({})), False),            # papermill / nbval: a kernel, no cellId
    (SimpleNamespace(user_ns={}, kernel=_Kernel({"cellId": "c1"})), True),  # JupyterLab / Notebook 7
    (SimpleNamespace(user_ns={"__vsc_ipynb_file__": "x.ipynb"}, kernel=_Kernel({})), True),  # VS Code
])
def test_front_end_detection(monkeypatch: pytest.MonkeyPatch, shell: object, expected: bool) -> None:
    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    assert has_widget_front_end() is expected


# -- real ranks ---------------------------------------------------------------------------------------------


def _cfg(steps: int, **kw):
    from workbench.train import RunConfig

    return RunConfig(nproc=2, steps=steps, seq_len=32, batch_size=8, timeout=60, **kw)


def _rank_processes() -> list[int]:
    """Live processes below our children: the ranks (forked by the forkserver, which is our child)."""
    parents, states = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        parents[int(entry.name)], states[int(entry.name)] = int(fields[1]), fields[0]
    children = {pid for pid, ppid in parents.items() if ppid == os.getpid()}
    return [pid for pid, ppid in parents.items() if ppid in children and states[pid] != "Z"]


def _assert_nothing_left(run) -> None:
    # active_children() also reaps: a rank still listed here is alive or was never waited for
    assert not multiprocessing.active_children(), "the run left rank processes behind"
    assert _rank_processes() == []
    assert run._thread is None or not run._thread.is_alive()
    assert not run.stop_file.parent.exists(), "the stop file's folder was not cleaned up"


def test_headless_run_trains_and_draws(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from workbench.cli import run_training

    run = run_training(_cfg(4), out=tmp_path, live=True)  # no front end here: trains now, draws at the end
    assert run.done and run.error is None and run.stopped_after_step is None
    summary = run.wait()
    assert len(summary["losses"]) == 4
    assert json.loads((tmp_path / "summary.json").read_text())["losses"] == summary["losses"]
    fig = run.dashboard.static_figure()
    assert list(fig.data[0].y) == pytest.approx(summary["losses"])
    assert [len(fig.data[N_SCALARS + r].y) for r in range(2)] == [4, 4]  # every rank's step times
    params = _trace(run.dashboard, "parameters")
    assert all(y > 0 for y in params.y)
    comm = [t for t in fig.data if t.type == "bar" and t.name == "rank 0"][0]
    assert "all_reduce" in comm.x and all(y > 0 for y in comm.y)
    assert "done: 4 step(s) trained" in capsys.readouterr().out
    _assert_nothing_left(run)


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_threaded_run_stops_early_and_keeps_what_it_trained(tmp_path: Path) -> None:
    run = run_live(_cfg(200), out=tmp_path, front_end=True)
    assert not run.done  # the call returned while the ranks train
    _wait_for(lambda: run.dashboard.last_step >= 2, 120, "three steps")
    assert len(_rank_processes()) == 2  # the ranks are there: the check below is not vacuous
    run.stop()
    summary = run.wait(timeout=120)
    stopped = run.stopped_after_step
    assert stopped is not None and 2 <= stopped < 199
    assert [m["step"] for m in summary["history"]] == list(range(stopped + 1))
    written = json.loads((tmp_path / "summary.json").read_text())
    assert len(written["losses"]) == stopped + 1 and (tmp_path / "report.html").exists()
    assert run.dashboard.stop_button.disabled and f"stopped after step {stopped}" in run.dashboard.status.value
    _assert_nothing_left(run)
    run.stop()  # once done, a no-op


def test_an_error_in_a_rank_surfaces_from_wait(tmp_path: Path) -> None:
    from workbench.launch import RankError

    run = run_live(_cfg(6, inject_fault="raise:rank=1:step=2"), out=tmp_path, front_end=True)
    with pytest.raises(RankError, match="rank 1") as caught:
        run.wait(timeout=120)
    assert run.done and run.error is caught.value and run.summary is None
    assert "failed: RankError" in run.dashboard.status.value
    assert not (tmp_path / "summary.json").exists()
    _assert_nothing_left(run)


def test_run_live_refuses_what_is_not_a_run_config() -> None:
    with pytest.raises(ValueError, match="cfg must be a workbench.train.RunConfig, got dict"):
        run_live({"nproc": 2, "steps": 4})


def test_wait_with_a_bad_timeout() -> None:
    board = Dashboard(nproc=2, steps=4, live=False)
    run = LiveRun(_cfg(4), None, board)
    with pytest.raises(ValueError, match="timeout must be None .* got -1"):
        run.wait(timeout=-1)
    with pytest.raises(TimeoutError, match="still training"):
        run.wait(timeout=0)
    shutil.rmtree(run.stop_file.parent)  # never started, so never cleaned up by its run


@pytest.mark.extended  # a real kernel end to end (about 40 s); LiveRun's stop file is tested above without one
def test_a_kernel_hears_the_stop_click_while_the_ranks_train(tmp_path: Path) -> None:
    """A real kernel driven as JupyterLab drives it: the execute request carries a cellId (so the dashboard goes
    live), the cell returns while the ranks train, and a click sent through the Stop button's comm ends the run."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        out = _execute(kc, "from workbench.cli import run_training\nfrom workbench.train import RunConfig\n"
                           "run = run_training(RunConfig(nproc=2, steps=300, seq_len=32, batch_size=8, timeout=60), "
                           "out='live', live=True)\nprint(run.done)")
        assert "application/vnd.jupyter.widget-view+json" in out and "False" in out  # drawn, and still training
        button = _execute(kc, "import time\nwhile run.dashboard.last_step < 2: time.sleep(0.05)\n"
                              "print(run.dashboard.stop_button.model_id)").split()[-1]
        kc.shell_channel.send(kc.session.msg("comm_msg", {
            "comm_id": button, "data": {"method": "custom", "content": {"event": "click"}}}))
        out = _execute(kc, "s = run.wait(120)\nimport multiprocessing\n"
                           "print(run.stopped_after_step, len(s['history']), multiprocessing.active_children())")
        stopped, trained, children = out.split(maxsplit=2)
        assert 2 <= int(stopped) < 299 and int(trained) == int(stopped) + 1 and children.strip() == "[]"
        assert len(json.loads((tmp_path / "live" / "summary.json").read_text())["losses"]) == int(trained)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _execute(kc, code: str, timeout: float = 180) -> str:
    """Run ``code`` as JupyterLab sends a cell (metadata with the cell's id); its stdout, display types, errors."""
    msg = kc.session.msg("execute_request", {"code": code, "silent": False, "store_history": True,
                                             "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
                         metadata={"cellId": "cell-1"})
    kc.shell_channel.send(msg)
    out = []
    while True:
        reply = kc.get_iopub_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
            continue
        kind, content = reply["msg_type"], reply["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "display_data":
            out.append(" ".join(content["data"]) + "\n")
        elif kind == "error":
            raise AssertionError(f"the kernel raised {content['ename']}: {content['evalue']}")
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out)


def test_a_moe_run_gets_expert_load_and_dropped_panels() -> None:
    """Issue 21: the newest step's load per expert (summed over ranks, as a multiple of the mean) and each step's
    dropped share; a step only one rank has sent yet is not drawn as if it were the whole."""
    board = Dashboard(nproc=2, steps=4, live=False, min_interval_s=0, experts=4)
    loads = {0: [[4, 2, 1, 1], [2, 2, 2, 2]], 1: [[8, 0, 0, 0], [0, 0, 4, 4]]}  # step -> per rank, chosen per expert
    for step, per_rank in loads.items():
        for rank, load in enumerate(per_rank):
            board.update(rank, {**_metrics(rank, step), "moe_tokens_per_expert": load, "moe_dropped": step + rank})
    board.update(0, {**_metrics(0, 2), "moe_tokens_per_expert": [16, 0, 0, 0], "moe_dropped": 9})  # rank 1 not yet
    fig = board.static_figure()
    load, dropped = _trace(board, "expert load"), _trace(board, "dropped")
    assert list(load.x) == ["expert 0", "expert 1", "expert 2", "expert 3"]
    assert list(load.y) == pytest.approx([8 / 4, 0 / 4, 4 / 4, 4 / 4])  # step 1: [8, 0, 4, 4], mean 4
    assert list(dropped.x) == [0, 1] and list(dropped.y) == pytest.approx([100 * 1 / 16, 100 * 3 / 16])
    titles = [a.text for a in fig.layout.annotations]
    assert any(t.startswith("expert load, newest step") for t in titles)
    assert "dropped assignments per step (%)" in titles
    dense = Dashboard(nproc=1, steps=2, live=False)
    assert not any("expert" in (t.name or "") for t in dense.figure.data)
    with pytest.raises(ValueError, match="experts must be an int >= 0"):
        Dashboard(nproc=1, steps=2, experts=-1)


# -- beyond all-reduce (issue 22 item 5): compression ratio, staleness histogram, server load ---------------------


def test_a_compressed_run_gets_its_ratio_and_bytes_per_step() -> None:
    """Rank 0's compression ratio and gradient bytes per step; rank 1's (other values) stay out of the curves."""
    board = Dashboard(nproc=2, steps=4, live=False, min_interval_s=0, compression=True)
    for step in range(3):
        for rank in range(2):
            board.update(rank, {**_metrics(rank, step), "compression_ratio": 8.0 + step + 100 * rank,
                                "grad_bytes_sent": (step + 1) * MIB * (rank + 1)})
    board.update(0, {**_metrics(0, 1, attempt=1), "compression_ratio": 20.0, "grad_bytes_sent": MIB})  # redone
    board.flush()
    ratio, sent = _trace(board, "compression ratio"), _trace(board, "gradient bytes sent")
    assert list(ratio.x) == [0, 1, 2] and list(ratio.y) == [8.0, 20.0, 10.0]
    assert list(sent.y) == pytest.approx([1.0, 1.0, 3.0])  # MiB
    titles = [a.text for a in board.figure.layout.annotations]
    assert any(t.startswith("compression ratio per step") for t in titles)
    plain = Dashboard(nproc=1, steps=2, live=False)
    assert not any(t.name in ("compression ratio", "staleness") for t in plain.figure.data)


def _server_update(server: int, updates: int, staleness: list[int], bytes_in: int, bytes_out: int) -> dict:
    """What param_server_run._server_metrics streams after an update."""
    return {"step": updates - 1, "rank": 2 + server, "attempt": 0, "ps_server": server, "ps_staleness": staleness,
            "ps_updates": updates, "ps_bytes_in": bytes_in, "ps_bytes_out": bytes_out}


def test_a_parameter_server_gets_a_staleness_histogram_and_each_servers_load() -> None:
    board = Dashboard(nproc=4, steps=4, live=False, min_interval_s=0, ps_servers=[2, 3], experts=2,
                      compression=True)  # every optional row at once: the indices of each must hold
    board.update(0, _metrics(0, 0))
    board.update(2, _server_update(0, 1, [0], MIB, 2 * MIB))
    board.update(2, _server_update(0, 2, [1], 2 * MIB, 4 * MIB))
    board.update(2, _server_update(0, 2, [2], 2 * MIB, 4 * MIB))  # a restart redid update 2: it replaces
    board.update(3, _server_update(1, 1, [0], MIB // 2, MIB))
    board.flush()
    histogram = _trace(board, "staleness")
    assert board.staleness_histogram() == {0: 2, 2: 1}
    assert list(histogram.x) == [0, 2] and list(histogram.y) == [2, 1]
    bytes_in, bytes_out = _trace(board, "server in"), _trace(board, "server out")
    assert list(bytes_in.x) == ["server 0 (rank 2)", "server 1 (rank 3)"]
    assert list(bytes_in.y) == pytest.approx([2.0, 0.5]) and list(bytes_out.y) == pytest.approx([4.0, 1.0])
    assert list(bytes_in.customdata) == [2, 1]  # updates, on hover
    assert list(board.figure.data[0].y) == [5.0]  # a server's update is no step of rank 0's
    assert all(len(board.step_time[r]) == 0 for r in (2, 3))
    assert board.figure.layout.height == 900 + 3 * 220


@pytest.mark.parametrize("servers", [[0, 1], [2], [True], "01"])
def test_bad_server_ranks_are_refused(servers) -> None:
    with pytest.raises(ValueError, match=r"ps_servers must be the server ranks, each an int in 0\.\.1"):
        Dashboard(nproc=2, steps=2, ps_servers=servers)


@pytest.mark.extended  # real ranks (~20 s on 2 cores); the views themselves are tested above without ranks
def test_a_real_async_parameter_server_streams_what_its_summary_holds() -> None:
    """Every server's streamed updates add up to summary.json's staleness histogram and bytes; the workers'
    steps fill the step-time panel (async: staleness > 0 is possible, the counts must agree whatever it is)."""
    from workbench.cli import run_training
    from workbench.train import RunConfig

    cfg = RunConfig(nproc=3, ps_servers=1, ps_async=True, steps=3, seq_len=32, batch_size=8, timeout=60)
    board = Dashboard(nproc=3, steps=3, live=False, min_interval_s=0, ps_servers=[2])
    summary = run_training(cfg, progress=False, on_metrics=board.update)
    ps = summary["parameter_server"]
    assert board.staleness_histogram() == {int(k): v for k, v in ps["staleness_histogram"].items()}
    assert sum(board.staleness_histogram().values()) >= 3 * 2  # steps x workers gradients, at least
    load, server = board.server_load[0], ps["per_server"][0]
    assert (load["ps_bytes_in"], load["ps_bytes_out"], load["ps_updates"]) == (
        server["bytes_in"], server["bytes_out"], server["updates"])  # the final report has the last sends too
    assert [len(board.step_time[r]) > 0 for r in range(3)] == [True, True, False]
