"""Live dashboard: watch the ranks train step by step, and stop the run with a button.

``run_training(cfg, live=True)`` (``workbench.run``, also importable from ``workbench.cli``) trains behind a
``Dashboard``, this module's one job: draw what the ranks stream. In JupyterLab (or any front end that
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
every step of every rank: rank 0's loss, grad-norm, lr and tokens/s; every rank's step time (one line per rank) and,
dotted, its compute time (synchronous steps all last as long as the slowest rank's: the straggler is the rank whose
compute fills its step, the gap above the others' dotted lines is their waiting); every rank's ledger peaks by memory
category (stacked bars); the bytes each rank's collectives moved, per collective type, summed over the steps so far.
Where the run has them, more rows: a compressed run (``compression``) rank 0's compression ratio and the bytes its
gradients took each step (``compression_ratio``, ``grad_bytes_sent``); a parameter server (``ps_servers``, the
server ranks) the staleness of every gradient the servers applied (a histogram, one count per gradient and server)
and each server's load, the bytes through its link each way with its updates, from what every server streams
after each update (``training.param_server_run``). A fast run reports many steps a second, so the figure is
redrawn at most every ``min_interval_s`` (0.25 s: a few redraws a second), in one ``batch_update`` message each.

Stop writes a file that rank 0 checks after each step (``train.StopSignal``); all ranks then leave the loop at the
same step, the launcher reaps them, and ``run_training`` writes what was trained (summary, report, a checkpoint if
``ckpt_dir`` is set). This module never starts ranks nor imports ``torch.distributed`` (DESIGN.md: presentation
draws records): ``workbench.run`` owns the run, its thread and its stop file (``run.LiveRun``, ``run.run_live``)
and calls ``Dashboard.update`` with what each rank streams.
"""

from __future__ import annotations

import html
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from workbench.theory.checks import positive_int
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
    from workbench.predictions import person_at_front_end

    if widgets.Widget._control_comm is not None:  # only a kernel's widget manager opens it
        return True
    return person_at_front_end()


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
    Stop is clicked (``workbench.run.LiveRun`` creates its stop file there).
    """

    def __init__(self, nproc: int, steps: int, live: bool = True, min_interval_s: float = 0.25,
                 on_stop: Callable[[], None] | None = None, experts: int = 0, compression: bool = False,
                 ps_servers: Sequence[int] = ()) -> None:
        positive_int("nproc", nproc)
        positive_int("steps", steps)
        if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
            raise ValueError(f"experts must be an int >= 0 (0: a dense model, no expert panels), got {experts!r}")
        servers = _check_servers(ps_servers, nproc)
        if isinstance(min_interval_s, bool) or not isinstance(min_interval_s, (int, float)) or min_interval_s < 0:
            raise ValueError(f"min_interval_s must be a number of seconds >= 0 (0: redraw every step), "
                             f"got {min_interval_s!r}")
        self.nproc, self.steps, self.min_interval_s, self.on_stop = nproc, steps, float(min_interval_s), on_stop
        self._lock = threading.RLock()  # update() runs in the training thread, the click in the kernel's
        self.scalars: dict[str, dict[int, float]] = {key: {} for key in SCALARS}  # step -> value, rank 0
        self.step_time: list[dict[int, float]] = [{} for _ in range(nproc)]
        self.compute_time: list[dict[int, float]] = [{} for _ in range(nproc)]  # forward + backward + optimizer
        self.memory: list[dict[str, int]] = [{} for _ in range(nproc)]  # ledger peaks so far, per rank
        self.comm_bytes: list[dict[str, int]] = [{} for _ in range(nproc)]  # bytes per op, summed over steps
        self.experts = experts
        # a MoE run: per step, per rank, the assignments each expert was chosen for and the dropped ones
        self.expert_load: dict[int, dict[int, list[int]]] = {}
        self.dropped: dict[int, dict[int, int]] = {}
        self.compression = bool(compression)
        self.grad_bytes: dict[int, tuple[float, int]] = {}  # step -> rank 0's (compression ratio, bytes sent)
        self.servers = servers  # the server ranks, server index order
        # a parameter server: each update's staleness list, by (server, update number): a redone update replaces
        self.staleness: dict[tuple[int, int], list[int]] = {}
        self.server_load: dict[int, dict[str, int]] = {}  # server index -> its latest totals (bytes in/out, updates)
        self.last_step, self.attempt, self.stop_requested = -1, 0, False
        self.outcome: str | None = None  # set by finish(): what the status line ends with
        self._started, self._ended = time.monotonic(), None
        self._last_draw, self._dirty = -float("inf"), False
        self.figure = _panels(nproc, widget=live and _anywidget_available(), experts=experts,
                              compression=self.compression, servers=servers)
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
        if m.get("ps_server") is not None:  # a server's update: no step of its own to draw
            self._record_server(m)
            return
        step = int(m["step"])
        self.step_time[rank][step] = float(m.get("step_time_s", float("nan")))
        if m.get("compute_s") is not None:
            self.compute_time[rank][step] = float(m["compute_s"])
        self.memory[rank] = dict(m.get("memory_peak") or self.memory[rank])
        for op, nbytes in (m.get("comm_bytes") or {}).items():
            self.comm_bytes[rank][op] = self.comm_bytes[rank].get(op, 0) + int(nbytes)
        if self.experts and m.get("moe_tokens_per_expert") is not None:
            self.expert_load.setdefault(step, {})[rank] = [int(n) for n in m["moe_tokens_per_expert"]]
            self.dropped.setdefault(step, {})[rank] = int(m.get("moe_dropped", 0))
        if rank == 0 and m.get("compression_ratio") is not None:
            self.grad_bytes[step] = (float(m["compression_ratio"]), int(m.get("grad_bytes_sent", 0)))
        if rank == 0:
            # a restart resumes from its checkpoint and redoes steps: keyed by step, the redone value replaces
            for key in SCALARS:
                if m.get(key) is not None:
                    self.scalars[key][step] = float(m[key])
            self.last_step, self.attempt = step, max(self.attempt, int(m.get("attempt", 0)))
        self._dirty = True

    def _record_server(self, m: dict[str, Any]) -> None:
        server = int(m["ps_server"])
        if self.servers and not 0 <= server < len(self.servers):
            raise ValueError(f"ps_server must be a server index in 0..{len(self.servers) - 1} (this dashboard has "
                             f"{len(self.servers)} server(s)), got {server!r}")
        if m.get("ps_staleness"):  # every update applies a gradient; none: the server's final totals alone
            self.staleness[(server, int(m.get("ps_updates", 0)))] = [int(s) for s in m["ps_staleness"]]
        self.server_load[server] = {key: int(m.get(key, 0)) for key in ("ps_bytes_in", "ps_bytes_out", "ps_updates")}
        self._dirty = True

    def staleness_histogram(self) -> dict[int, int]:
        """{staleness: gradients applied at it}, over every server (summary.json's ``staleness_histogram``)."""
        out: dict[int, int] = {}
        for values in self.staleness.values():
            for v in values:
                out[v] = out.get(v, 0) + 1
        return dict(sorted(out.items()))

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
        for rank in range(self.nproc):
            steps = sorted(self.compute_time[rank])
            fig.data[base + rank].x = steps
            fig.data[base + rank].y = [self.compute_time[rank][s] for s in steps]
        base += self.nproc
        for i, category in enumerate(MEMORY_CATEGORIES):
            fig.data[base + i].y = [to_unit(self.memory[r].get(category, 0), UNIT) for r in range(self.nproc)]
        base += len(MEMORY_CATEGORIES)
        ops = sorted({op for per_rank in self.comm_bytes for op in per_rank})
        for rank in range(self.nproc):
            fig.data[base + rank].x = ops
            fig.data[base + rank].y = [to_unit(self.comm_bytes[rank].get(op, 0), UNIT) for op in ops]
        base += self.nproc
        if self.experts:
            self._fill_experts(fig, base)
            base += 2
        if self.compression:
            steps = sorted(self.grad_bytes)
            fig.data[base].x = fig.data[base + 1].x = steps
            fig.data[base].y = [self.grad_bytes[s][0] for s in steps]
            fig.data[base + 1].y = [to_unit(self.grad_bytes[s][1], UNIT) for s in steps]
            base += 2
        if self.servers:
            self._fill_servers(fig, base)

    def _fill_servers(self, fig: go.Figure, base: int) -> None:
        """The staleness histogram, and each server's bytes in and out (stacked) with its updates on hover."""
        histogram = self.staleness_histogram()
        fig.data[base].x, fig.data[base].y = list(histogram), list(histogram.values())
        load = [self.server_load.get(i, {}) for i in range(len(self.servers))]
        fig.data[base + 1].y = [to_unit(entry.get("ps_bytes_in", 0), UNIT) for entry in load]
        fig.data[base + 2].y = [to_unit(entry.get("ps_bytes_out", 0), UNIT) for entry in load]
        fig.data[base + 1].customdata = fig.data[base + 2].customdata = [entry.get("ps_updates", 0) for entry in load]

    def _fill_experts(self, fig: go.Figure, base: int) -> None:
        """The newest step every reporting rank has sent: its load per expert summed over the ranks, as a multiple of
        the mean (1: even); and each step's dropped share of the assignments (capacity), over the ranks."""
        reporting = {rank for per_step in self.expert_load.values() for rank in per_step}
        complete = [s for s, per_rank in self.expert_load.items() if len(per_rank) == len(reporting)]
        if not complete:
            return
        load = [sum(col) for col in zip(*self.expert_load[max(complete)].values(), strict=True)]
        mean = sum(load) / len(load)
        fig.data[base].y = [n / mean if mean else 0.0 for n in load]
        steps = sorted(complete)
        chosen = {s: sum(map(sum, self.expert_load[s].values())) for s in steps}
        fig.data[base + 1].x = steps
        fig.data[base + 1].y = [100.0 * sum(self.dropped[s].values()) / max(1, chosen[s]) for s in steps]

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


def _panels(nproc: int, widget: bool, experts: int = 0, compression: bool = False,
            servers: Sequence[int] = ()) -> go.Figure:
    """The empty dashboard: every trace exists from the start (traces cannot be added in a batch update); updates
    only replace their x and y. A MoE run (``experts``) gets a row more: expert load and dropped assignments; a
    compressed run one: compression ratio and gradient bytes per step; a parameter server one: the staleness
    histogram and the servers' load."""
    extra = [(experts > 0, ["expert load, newest step (assignments / mean; 1 = even)",
                            "dropped assignments per step (%)"]),
             (compression, ["compression ratio per step (rank 0; uncompressed / sent)",
                            f"gradient bytes sent per step ({UNIT}, rank 0)"]),
             (bool(servers), ["staleness of each applied gradient (updates behind; count)",
                              f"server load: bytes through each server's link ({UNIT})"])]
    titles = [t for wanted, pair in extra if wanted for t in pair]
    rows = 4 + len(titles) // 2
    fig = make_subplots(rows=rows, cols=2, vertical_spacing={4: 0.09, 5: 0.07}.get(rows, 0.055),
                        horizontal_spacing=0.1,
                        specs=[[{}, {}], [{}, {}], [{"colspan": 2}, None], [{}, {}]] + [[{}, {}]] * (rows - 4),
                        subplot_titles=[*SCALARS.values(),
                                        "step time per rank (s); dotted: computing, the gap above it waiting",
                                        f"memory peak ({UNIT})", f"bytes per collective ({UNIT})", *titles])
    for i, (key, title) in enumerate(SCALARS.items()):
        fig.add_scatter(x=[], y=[], mode="lines", name=title, showlegend=False, line_color="#444",
                        hovertemplate=f"step %{{x}}<br>{key} %{{y:.4g}}<extra></extra>", row=1 + i // 2, col=1 + i % 2)
    for rank in range(nproc):
        fig.add_scatter(x=[], y=[], mode="lines+markers", marker_size=3, name=f"rank {rank}",
                        legendgroup=f"rank {rank}", line_color=_rank_color(rank), row=3, col=1)
    for rank in range(nproc):  # synchronous steps all last as long; compute says who the others waited for
        fig.add_scatter(x=[], y=[], mode="lines", name=f"rank {rank} computing", legendgroup=f"rank {rank}",
                        showlegend=False, line={"color": _rank_color(rank), "dash": "dot"}, row=3, col=1,
                        hovertemplate=f"step %{{x}}<br>rank {rank} computing %{{y:.3g}} s<extra></extra>")
    ranks = [f"rank {r}" for r in range(nproc)]
    for category in MEMORY_CATEGORIES:
        fig.add_bar(x=ranks, y=[0.0] * nproc, name=category, marker_color=category_color(category), row=4, col=1,
                    hovertemplate=f"%{{x}}<br>{category}: %{{y:.3g}} {UNIT}<extra></extra>")
    for rank in range(nproc):
        fig.add_bar(x=[], y=[], name=f"rank {rank}", legendgroup=f"rank {rank}", showlegend=False,
                    marker_color=_rank_color(rank), row=4, col=2,
                    hovertemplate=f"%{{x}}<br>rank {rank}: %{{y:.3g}} {UNIT}<extra></extra>")
    row = 5
    if experts:
        _expert_panels(fig, experts)
        row += 1
    if compression:
        _compression_panels(fig, row)
        row += 1
    if servers:
        _server_panels(fig, row, servers)
    fig.update_layout(barmode="stack", height=900 + 220 * (rows - 4), margin={"t": 40, "b": 30},
                      legend_tracegroupgap=4)
    fig.update_xaxes(title_text="step", row=3, col=1)
    return go.FigureWidget(fig) if widget else fig


def _expert_panels(fig: go.Figure, experts: int) -> None:
    fig.add_bar(x=[f"expert {e}" for e in range(experts)], y=[0.0] * experts, name="expert load", showlegend=False,
                marker_color="#7f7f7f", row=5, col=1, hovertemplate="%{x}: %{y:.2f} x the mean<extra></extra>")
    fig.add_hline(y=1.0, line_dash="dot", row=5, col=1)
    fig.add_scatter(x=[], y=[], mode="lines+markers", name="dropped", showlegend=False, line_color="#d62728",
                    row=5, col=2, hovertemplate="step %{x}<br>dropped %{y:.2f} %<extra></extra>")
    fig.update_xaxes(title_text="step", row=5, col=2)


def _compression_panels(fig: go.Figure, row: int) -> None:
    fig.add_scatter(x=[], y=[], mode="lines+markers", marker_size=3, name="compression ratio", showlegend=False,
                    line_color="#2ca02c", row=row, col=1, hovertemplate="step %{x}<br>ratio %{y:.3g}x<extra></extra>")
    fig.add_scatter(x=[], y=[], mode="lines+markers", marker_size=3, name="gradient bytes sent", showlegend=False,
                    line_color="#444", row=row, col=2,
                    hovertemplate=f"step %{{x}}<br>%{{y:.3g}} {UNIT} sent<extra></extra>")
    fig.update_xaxes(title_text="step", row=row, col=1)
    fig.update_xaxes(title_text="step", row=row, col=2)


def _server_panels(fig: go.Figure, row: int, servers: Sequence[int]) -> None:
    fig.add_bar(x=[], y=[], name="staleness", showlegend=False, marker_color="#9467bd", row=row, col=1,
                hovertemplate="staleness %{x}: %{y} gradient(s)<extra></extra>")
    fig.update_xaxes(title_text="staleness (updates between pull and apply)", dtick=1, row=row, col=1)
    names = [f"server {i} (rank {r})" for i, r in enumerate(servers)]
    for direction, color in (("in", "#1f77b4"), ("out", "#ff7f0e")):
        what = "gradients pushed in" if direction == "in" else "parameters pulled out"
        fig.add_bar(x=names, y=[0.0] * len(names), name=f"server {direction}", showlegend=False,
                    marker_color=color, row=row, col=2, customdata=[0] * len(names),
                    hovertemplate=f"%{{x}}<br>{what}: %{{y:.3g}} {UNIT}<br>%{{customdata}} update(s)<extra></extra>")


def _check_servers(servers: Sequence[int], nproc: int) -> list[int]:
    """The server ranks, each in 0..nproc-1, fewer than nproc (a parameter server needs a worker)."""
    out = list(servers)
    if len(out) >= nproc or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < nproc for r in out):
        raise ValueError(f"ps_servers must be the server ranks, each an int in 0..{nproc - 1} and fewer than "
                         f"nproc={nproc} (a parameter server needs a worker), got {servers!r}")
    return out


def _rank_color(rank: int) -> str:
    return _RANK_COLORS[rank % len(_RANK_COLORS)]


def display_widget(widget: widgets.Widget, text: str) -> None:
    from IPython import get_ipython
    from IPython.display import display

    if get_ipython() is None:
        print(text)
        return
    display(widget)


def display_figure(fig: go.Figure, text: str) -> None:
    """The static panels where a notebook can draw them (papermill, nbval); one line of text elsewhere."""
    from IPython import get_ipython
    from IPython.display import display

    text = html.unescape(text)
    if get_ipython() is None:
        print(f"dashboard: {text}")
        return
    display({"application/vnd.plotly.v1+json": json.loads(fig.to_json()), "text/plain": f"dashboard: {text}"},
            raw=True)
