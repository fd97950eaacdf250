"""Live dashboard: watch the ranks train step by step, and stop the run with a button.

``run_training(cfg, live=True)`` (``workbench.cli``) calls ``run_live``. In JupyterLab (or any front end that
draws widgets) the dashboard appears at once and the ranks train in a background thread, so the cell returns and
the kernel stays free to hear the Stop button (a kernel busy in the cell would never see the click)::

    from workbench.cli import run_training
    from workbench.train import RunConfig

    run = run_training(RunConfig(nproc=2, steps=200, seq_len=32, batch_size=8), out="runs/live", live=True)
    # ... the figure updates every step; click Stop, or:
    run.stop()
    summary = run.wait()              # summary.json and report.html are in runs/live; a rank's error is raised here
    summary["history"][-1]["step"]    # the last step trained

Headless (papermill, nbval, a script) the same call trains in the calling thread, collects the same metrics and
draws the same panels once, as a static figure, at the end; the handle it returns is already done.

What the panels show comes from ``on_metrics(rank, metrics)`` (``train._streamed``), called in this process after
every step of every rank: rank 0's loss, grad-norm, lr and tokens/s; every rank's step time (one line per rank, so a
straggler stands out); every rank's ledger peaks by memory category (stacked bars); the bytes each rank's collectives
moved, per collective type, summed over the steps so far. A fast run reports many steps a second, so the figure is
redrawn at most every ``min_interval_s`` (0.25 s: a few redraws a second), in one ``batch_update`` message each.

Stop writes a file that rank 0 checks after each step (``train.StopSignal``); all ranks then leave the loop at the
same step, the launcher reaps them, and ``run_training`` writes what was trained (summary, report, a checkpoint if
``ckpt_dir`` is set). This module never imports ``torch.distributed`` itself (DESIGN.md: presentation draws
records); it calls ``workbench.cli.run_training``, which does.
"""

from __future__ import annotations

import atexit
import dataclasses
import html
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from workbench.theory.memory import to_unit
from workbench.trace import MEMORY_CATEGORIES
from workbench.viz.memory import category_color

#: rank 0's scalar panels: metric key -> panel title
SCALARS: dict[str, str] = {"loss": "loss", "grad_norm": "grad norm", "lr": "learning rate",
                           "tokens_per_s": "tokens/s (rank 0)"}
UNIT = "MiB"  # memory and bytes moved
_RANK_COLORS = qualitative.Plotly


def has_widget_front_end() -> bool:
    """True when this code runs in a kernel whose client draws widgets and can send a click back.

    A kernel alone is not enough: papermill and nbval run a real kernel too, but their client never opens a widget
    comm and never clicks. Signs of a drawing client: JupyterLab's widget manager opened ipywidgets' control comm;
    or the cell being run was sent by JupyterLab / Notebook 7, which put the cell's id in the execute request's
    metadata (``cellId``; nbclient, behind papermill, and nbval do not); or Colab or VS Code hosts the kernel.
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    if kernel is None:  # plain python, or terminal IPython
        return False
    if widgets.Widget._control_comm is not None or "google.colab" in sys.modules:
        return True
    if "__vsc_ipynb_file__" in getattr(shell, "user_ns", {}):
        return True
    try:
        request = kernel.get_parent("shell") or {}
    except TypeError:  # ipykernel < 6.22 takes no channel
        request = kernel.get_parent() or {}
    return bool((request.get("metadata") or {}).get("cellId"))


def _anywidget_available() -> bool:
    """plotly >= 6 builds FigureWidget on anywidget; without it, the dashboard redraws a static figure instead."""
    try:
        import anywidget  # noqa: F401
    except ImportError:
        return False
    return True


class Dashboard(widgets.VBox):
    """Panels of a run that fill while it trains, a status line and a Stop button.

    ``update(rank, metrics)`` is ``run_training``'s ``on_metrics`` callback. ``live=True`` draws into a plotly
    ``FigureWidget`` (when anywidget is installed; else into an Output that gets the redrawn figure);
    ``live=False`` keeps a plain ``go.Figure`` to be shown once (``static_figure``). ``on_stop`` is called once when
    Stop is clicked (``LiveRun`` creates its stop file there).
    """

    def __init__(self, nproc: int, steps: int, live: bool = True, min_interval_s: float = 0.25,
                 on_stop: Callable[[], None] | None = None) -> None:
        _check_positive_int("nproc", nproc)
        _check_positive_int("steps", steps)
        if isinstance(min_interval_s, bool) or not isinstance(min_interval_s, (int, float)) or min_interval_s < 0:
            raise ValueError(f"min_interval_s must be a number of seconds >= 0 (0: redraw every step), "
                             f"got {min_interval_s!r}")
        self.nproc, self.steps, self.min_interval_s, self.on_stop = nproc, steps, float(min_interval_s), on_stop
        self._lock = threading.RLock()  # update() runs in the training thread, the click in the kernel's
        self.scalars: dict[str, dict[int, float]] = {key: {} for key in SCALARS}  # step -> value, rank 0
        self.step_time: list[dict[int, float]] = [{} for _ in range(nproc)]
        self.memory: list[dict[str, int]] = [{} for _ in range(nproc)]  # ledger peaks so far, per rank
        self.comm_bytes: list[dict[str, int]] = [{} for _ in range(nproc)]  # bytes per op, summed over steps
        self.last_step, self.attempt, self.stop_requested = -1, 0, False
        self.outcome: str | None = None  # set by finish(): what the status line ends with
        self._started, self._ended = time.monotonic(), None
        self._last_draw, self._dirty = -float("inf"), False
        self.figure = _panels(nproc, widget=live and _anywidget_available())
        drawn = isinstance(self.figure, widgets.DOMWidget)
        self._output = widgets.Output() if live and not drawn else None  # the redrawn figure, without anywidget
        self.status = widgets.HTML(self._status_text())
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop",
                                          tooltip="end the run after the current step; what was trained is kept")
        self.stop_button.on_click(lambda _button: self.request_stop())
        view = self.figure if drawn else self._output or widgets.Output()
        super().__init__([widgets.HBox([self.stop_button, self.status]), view])
        if self._output is not None:
            self._show_in_output()

    # -- the callback ---------------------------------------------------------------------------------------

    def update(self, rank: int, metrics: dict[str, Any]) -> None:
        """Record one step of one rank (``on_metrics``); redraw if the last redraw is ``min_interval_s`` old."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.nproc:
            raise ValueError(f"rank must be an int in 0..{self.nproc - 1} (this dashboard has {self.nproc} "
                             f"rank(s)), got {rank!r}")
        if "step" not in metrics:
            raise ValueError(f"metrics need a 'step' (train._streamed's dict), got keys {sorted(metrics)}")
        with self._lock:
            self._record(rank, metrics)
            if time.monotonic() - self._last_draw >= self.min_interval_s:
                self.flush()

    def _record(self, rank: int, m: dict[str, Any]) -> None:
        step = int(m["step"])
        self.step_time[rank][step] = float(m.get("step_time_s", float("nan")))
        self.memory[rank] = dict(m.get("memory_peak") or self.memory[rank])
        for op, nbytes in (m.get("comm_bytes") or {}).items():
            self.comm_bytes[rank][op] = self.comm_bytes[rank].get(op, 0) + int(nbytes)
        if rank == 0:
            # a restart resumes from its checkpoint and redoes steps: keyed by step, the redone value replaces
            for key in SCALARS:
                if m.get(key) is not None:
                    self.scalars[key][step] = float(m[key])
            self.last_step, self.attempt = step, max(self.attempt, int(m.get("attempt", 0)))
        self._dirty = True

    # -- drawing --------------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Redraw now (the end of a run calls it, so the last steps are never left out by the throttle)."""
        with self._lock:
            self._last_draw = time.monotonic()
            if self._dirty:
                self._dirty = False
                with self.figure.batch_update():  # one message to the front end, not one per trace
                    self._fill(self.figure)
                if self._output is not None:
                    self._show_in_output()
            self.status.value = self._status_text()

    def _fill(self, fig: go.Figure) -> None:
        for i, key in enumerate(SCALARS):
            steps = sorted(self.scalars[key])
            fig.data[i].x, fig.data[i].y = steps, [self.scalars[key][s] for s in steps]
        base = len(SCALARS)
        for rank in range(self.nproc):
            steps = sorted(self.step_time[rank])
            fig.data[base + rank].x = steps
            fig.data[base + rank].y = [self.step_time[rank][s] for s in steps]
        base += self.nproc
        for i, category in enumerate(MEMORY_CATEGORIES):
            fig.data[base + i].y = [to_unit(self.memory[r].get(category, 0), UNIT) for r in range(self.nproc)]
        base += len(MEMORY_CATEGORIES)
        ops = sorted({op for per_rank in self.comm_bytes for op in per_rank})
        for rank in range(self.nproc):
            fig.data[base + rank].x = ops
            fig.data[base + rank].y = [to_unit(self.comm_bytes[rank].get(op, 0), UNIT) for op in ops]

    def _show_in_output(self) -> None:
        """Without anywidget: replace the Output's figure (set directly: capturing ``display`` from another thread
        would land in whichever cell runs now)."""
        bundle = {"application/vnd.plotly.v1+json": json.loads(self.figure.to_json()), "text/plain": "dashboard"}
        self._output.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)

    def static_figure(self) -> go.Figure:
        """The panels as they stand, as a plain figure (headless runs show this once, at the end)."""
        with self._lock:
            if self._dirty:
                self.flush()
            return go.Figure(self.figure)

    # -- status and stop ------------------------------------------------------------------------------------

    def _status_text(self) -> str:
        done = self.last_step + 1
        parts = [f"step {done} of {self.steps}", f"elapsed {(self._ended or time.monotonic()) - self._started:.1f} s"]
        if self.attempt > 0:
            parts.append(f"restarts: {self.attempt}")
        if self.stop_requested and self.outcome is None:
            parts.append("stopping after this step…")
        if self.outcome is not None:
            parts.append(self.outcome)
        return " · ".join(html.escape(p) for p in parts)

    def request_stop(self) -> None:
        """What the Stop button does: ask the run to end after the current step (once)."""
        with self._lock:
            if self.stop_requested or self.outcome is not None:
                return
            self.stop_requested = True
            self.stop_button.disabled = True
            self.status.value = self._status_text()
        if self.on_stop is not None:
            self.on_stop()

    def finish(self, summary: dict[str, Any] | None = None, error: BaseException | None = None) -> None:
        """The run ended: draw the last steps and say how it ended (trained, stopped early, or failed)."""
        with self._lock:
            if error is not None:
                first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                self.outcome = f"failed: {type(error).__name__}: {first}"[:300]
            else:
                history = (summary or {}).get("history") or []
                last = history[-1]["step"] if history else -1  # a resumed run's history starts later: go by step
                self.outcome = (f"stopped after step {last}" if 0 <= last < self.steps - 1
                                else f"done: {len(history)} step(s) trained")
            self.stop_button.disabled = True
            self._ended, self._dirty = time.monotonic(), True
            self.flush()


def _panels(nproc: int, widget: bool) -> go.Figure:
    """The empty dashboard: every trace exists from the start (traces cannot be added in a batch update); updates
    only replace their x and y."""
    fig = make_subplots(rows=4, cols=2, vertical_spacing=0.09, horizontal_spacing=0.1,
                        specs=[[{}, {}], [{}, {}], [{"colspan": 2}, None], [{}, {}]],
                        subplot_titles=[*SCALARS.values(), "step time per rank (s)",
                                        f"memory peak ({UNIT})", f"bytes per collective ({UNIT})"])
    for i, (key, title) in enumerate(SCALARS.items()):
        fig.add_scatter(x=[], y=[], mode="lines", name=title, showlegend=False, line_color="#444",
                        hovertemplate=f"step %{{x}}<br>{key} %{{y:.4g}}<extra></extra>", row=1 + i // 2, col=1 + i % 2)
    for rank in range(nproc):
        fig.add_scatter(x=[], y=[], mode="lines+markers", marker_size=3, name=f"rank {rank}",
                        legendgroup=f"rank {rank}", line_color=_rank_color(rank), row=3, col=1)
    ranks = [f"rank {r}" for r in range(nproc)]
    for category in MEMORY_CATEGORIES:
        fig.add_bar(x=ranks, y=[0.0] * nproc, name=category, marker_color=category_color(category), row=4, col=1,
                    hovertemplate=f"%{{x}}<br>{category}: %{{y:.3g}} {UNIT}<extra></extra>")
    for rank in range(nproc):
        fig.add_bar(x=[], y=[], name=f"rank {rank}", legendgroup=f"rank {rank}", showlegend=False,
                    marker_color=_rank_color(rank), row=4, col=2,
                    hovertemplate=f"%{{x}}<br>rank {rank}: %{{y:.3g}} {UNIT}<extra></extra>")
    fig.update_layout(barmode="stack", height=900, margin={"t": 40, "b": 30}, legend_tracegroupgap=4)
    fig.update_xaxes(title_text="step", row=3, col=1)
    return go.FigureWidget(fig) if widget else fig


def _rank_color(rank: int) -> str:
    return _RANK_COLORS[rank % len(_RANK_COLORS)]


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


# ----------------------------------------------------------------------------------------------------------
# The run behind the dashboard.


class LiveRun:
    """A training run with a dashboard: ``wait()``, ``stop()``, ``done``, ``summary``, ``error``.

    Owns a temporary stop file (``cfg.extra["stop_file"]``, train.StopSignal): ``stop()`` creates it, and it is
    removed with its folder when the run ends.
    """

    def __init__(self, cfg: Any, out: str | Path | None, dashboard: Dashboard) -> None:
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
        from workbench.cli import run_training  # entry point: launches ranks (imports torch.distributed)

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


def run_live(cfg: Any, out: str | Path | None = None, front_end: bool | None = None,
             min_interval_s: float = 0.25) -> LiveRun:
    """Train ``cfg`` with a live dashboard; returns a ``LiveRun`` (see the module docstring).

    ``front_end`` (None: ``has_widget_front_end()``): True shows the dashboard and trains in a background thread
    (the call returns at once); False trains here, shows the panels once at the end and returns a finished run.
    Headless, a rank's error is raised here, as ``run_training`` without ``live`` would.
    """
    if not all(hasattr(cfg, name) for name in ("nproc", "steps", "extra", "timeout")):
        raise ValueError(f"cfg must be a workbench.train.RunConfig, got {type(cfg).__name__}")
    front_end = has_widget_front_end() if front_end is None else front_end
    dashboard = Dashboard(cfg.nproc, cfg.steps, live=front_end, min_interval_s=min_interval_s)
    handle = LiveRun(cfg, out, dashboard)
    if front_end:
        _display(dashboard, f"live dashboard: {cfg.nproc} rank(s), {cfg.steps} step(s)")
        handle.start()
        return handle
    handle.run()
    if handle.error is not None:
        raise handle.error
    _display_figure(dashboard.static_figure(), dashboard.status.value)
    return handle


def _display(widget: widgets.Widget, text: str) -> None:
    from IPython import get_ipython
    from IPython.display import display

    if get_ipython() is None:
        print(text)
        return
    display(widget)


def _display_figure(fig: go.Figure, text: str) -> None:
    """The static panels where a notebook can draw them (papermill, nbval); one line of text elsewhere."""
    from IPython import get_ipython
    from IPython.display import display

    text = html.unescape(text)
    if get_ipython() is None:
        print(f"dashboard: {text}")
        return
    display({"application/vnd.plotly.v1+json": json.loads(fig.to_json()), "text/plain": f"dashboard: {text}"},
            raw=True)
