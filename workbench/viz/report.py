"""The run report: one self-contained HTML page with the run's loss curve first (checkpoint saves, restarts and
fp16's skipped steps marked, and for a run trained in several attempts each attempt shaded and labelled: started,
resumed, restarted, preempted, its world size; for fp16 runs the loss scale per step on a log axis beside it), the
attempts, the per-rank timeline, memory by category per rank beside theory's prediction (on CUDA with the
allocator's figures and the GPU's utilisation), communication per traced step by mesh axis and collective beside
theory's bytes, for pipeline runs the bubble (plan beside measurement), and the configuration: the settings that
apply to the run's layout, the others folded (``applicable_settings``).

Theory comes from ``workbench.theory`` (pure Python) for the run's own layout, so every measured number sits
next to what the ZeRO paper (Rajbhandari et al. 2020), Megatron-LM (Shoeybi et al. 2019), Korthikanti et al.
2022 and the pipeline schedules predict; where they differ the report prints both and the difference. The
numbers behind the tables are also embedded as JSON (``<script id="workbench-report-data">``) for tests and
tools. Presentation only: reads summary.json and the traces' plain records, never torch.distributed.

Size and offline use: plotly.js (4.8 MB) is carried once, gzip-compressed and base64-encoded (2 MB), and the
browser decompresses it (``DecompressionStream``) before drawing; each figure is its JSON (floats rounded to
``FIGURE_DIGITS`` significant digits) in a non-executed script element. A 50-step 4-rank report is about 2 MB;
nothing is fetched from the network.
"""

from __future__ import annotations

import base64
import functools
import gzip
import html
import itertools
import json
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from workbench.theory.comm import sp_grad_collectives, sp_vocab_collectives, tp_vocab_collectives
from workbench.theory.memory import gpt_activation_bytes, gpt_block_activation_bytes
from workbench.theory.models import gpt_param_count
from workbench.theory.parallelism import Layout, layout_comm, layout_memory
from workbench.trace import Trace
from workbench.viz.timeline import comm_table, steps_only, timeline


def loss_curve(history: Sequence[dict[str, Any]], title: str = "global-batch loss per step",
               checkpoint_steps: Sequence[int] = (), restarts: Sequence[dict[str, Any]] = (),
               skipped_steps: Sequence[int] = (), attempts: Sequence[dict[str, Any]] = ()) -> go.Figure:
    """The loss per step; ``checkpoint_steps`` (the run record's, else summary["checkpoint"]["written_steps"])
    marked as saves, each restart (summary["restarts"]: attempt, reason, and ``at_step`` or else
    ``last_step_done``) as a dashed line, fp16's ``skipped_steps`` (inf/NaN gradients: the weights did not move)
    as crossed circles, and with more than one attempt (summary["attempts"]) each attempt's steps shaded and
    labelled (how it began, its world size, a preemption that ended it)."""
    steps = [m["step"] for m in history]
    loss_at = {m["step"]: m["loss"] for m in history}
    fig = go.Figure(go.Scatter(x=steps, y=[m["loss"] for m in history], mode="lines+markers", name="loss"))
    skipped = [s for s in skipped_steps if s in loss_at]
    if skipped:
        fig.add_trace(go.Scatter(x=skipped, y=[_finite_or(loss_at[s], loss_at) for s in skipped], mode="markers",
                                 name=SKIPPED_NAME, marker=_SKIPPED_MARKER,
                                 hovertemplate="step %{x} skipped: inf/NaN gradients, weights unchanged"
                                               "<extra></extra>"))
    saved = [s for s in checkpoint_steps if s in loss_at]
    if saved:
        fig.add_trace(go.Scatter(x=saved, y=[loss_at[s] for s in saved], mode="markers", name="checkpoint saved",
                                 marker={"symbol": "diamond", "size": 11, "color": "#54A24B"},
                                 hovertemplate="checkpoint saved after step %{x}<extra></extra>"))
    for r in restarts:
        at = _restart_step(r)
        if at is None:
            continue
        fig.add_vline(x=at, line_dash="dash", line_color="#E45756")
        fig.add_trace(go.Scatter(x=[at], y=[loss_at.get(at, min(loss_at.values(), default=0.0))], mode="markers",
                                 name=f"restart {r.get('attempt', '?')} at step {at}",
                                 marker={"symbol": "x", "size": 12, "color": "#E45756"},
                                 hovertext=[str(r.get("reason", ""))], hoverinfo="text+name"))
    if len(attempts) > 1:
        _mark_attempts(fig, attempts)
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="loss", height=380 if len(attempts) > 1 else 350,
                      margin={"t": 90 if len(attempts) > 1 else 60})
    return fig


#: How an attempt began, as the loss curve and the attempts table say it.
ATTEMPT_WORDS = {"start": "started", "resume": "resumed", "restart": "restarted", "shrink": "shrunk", "grow": "grown"}
_SHADES = ("rgba(99,110,250,0.07)", "rgba(0,204,150,0.09)")


def attempt_label(attempt: dict[str, Any]) -> str:
    """One attempt in a few words: "attempt 2: resumed, world size 2" (what the curve and the table show)."""
    cause = ATTEMPT_WORDS.get(attempt.get("cause", ""), str(attempt.get("cause")))
    size = attempt.get("world_size")
    return f"attempt {attempt['index'] + 1}: {cause}" + (f", world size {size}" if size is not None else "")


def _mark_attempts(fig: go.Figure, attempts: Sequence[dict[str, Any]]) -> None:
    """Each attempt's steps shaded (alternating), a dotted line where one begins, labels above the plot, and a
    solid line where a preemption ended one. Attempts that trained no step (failed at once) are not drawn."""
    drawn = [a for a in attempts if a.get("first_step") is not None]
    for i, a in enumerate(drawn):
        x0, x1 = a["first_step"] - 0.5, a["last_step"] + 0.5
        fig.add_vrect(x0=x0, x1=x1, fillcolor=_SHADES[i % 2], line_width=0, layer="below")
        fig.add_annotation(x=x0, y=1.0, xref="x", yref="paper", yanchor="bottom", xanchor="left", showarrow=False,
                           text=html.escape(attempt_label(a)), font={"size": 11, "color": "#3d4ab8"},
                           yshift=4 + 14 * (i % 2))  # alternate heights: short attempts' labels do not overlap
        if i:
            fig.add_vline(x=x0, line_dash="dot", line_color="#3d4ab8", line_width=1)
        if a.get("outcome") == "preempted":
            fig.add_vline(x=x1, line_color="#B279A2", line_width=2)
            fig.add_annotation(x=x1, y=0.02, xref="x", yref="paper", xanchor="right", showarrow=False,
                               text=f"preempted ({html.escape(str((a.get('preempted') or {}).get('signal')))})",
                               font={"size": 11, "color": "#B279A2"})


#: The legend name of fp16's skipped steps, on the loss curve and on the loss-scale panel alike.
SKIPPED_NAME = "skipped step (inf or NaN gradients)"  # no "/": plotly writes it as \u002f
_SKIPPED_MARKER = {"symbol": "circle-x-open", "size": 13, "color": "#F58518"}


def _finite_or(value: Any, loss_at: dict[int, Any]) -> float:
    """``value`` where it is a finite number, else the lowest finite loss (a marker needs a height to sit at)."""
    finite = [v for v in loss_at.values() if isinstance(v, int | float) and math.isfinite(v)]
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return min(finite, default=0.0)


def loss_scale_trace(history: Sequence[dict[str, Any]], precision: str | None = None) -> dict[str, Any]:
    """fp16's dynamic loss scaler as the per-step metrics recorded it: the scale each step's backward used and
    the steps skipped on inf/NaN. ``shown`` when the run scaled its loss: ``precision`` is "fp16", or any scale
    is not 1, or any step was skipped (fp32 and bf16 runs record scale 1 and never skip: no panel for them)."""
    scales = [1.0 if m.get("loss_scale") is None else float(m["loss_scale"]) for m in history]
    skipped = [m["step"] for m in history if m.get("skipped")]
    shown = precision == "fp16" or bool(skipped) or any(s != 1.0 for s in scales)
    return {"shown": shown, "steps": [m["step"] for m in history], "loss_scale": scales, "skipped_steps": skipped}


def loss_scale_curve(scaler: dict[str, Any]) -> go.Figure:
    """The loss scale per step on a log axis (the scaler moves it by factors of 2), skipped steps marked: each
    skip is where the scale backs off (Micikevicius et al. 2018, §3.2); a long clean stretch is where it grows."""
    steps, scales = scaler["steps"], scaler["loss_scale"]
    scale_at = dict(zip(steps, scales, strict=True))
    fig = go.Figure(go.Scatter(x=steps, y=scales, mode="lines+markers", name="loss scale", line_shape="hv"))
    skipped = [s for s in scaler["skipped_steps"] if s in scale_at]
    if skipped:
        fig.add_trace(go.Scatter(x=skipped, y=[scale_at[s] for s in skipped], mode="markers", name=SKIPPED_NAME,
                                 marker=_SKIPPED_MARKER,
                                 hovertemplate="step %{x} skipped at scale %{y}: the scale backs off"
                                               "<extra></extra>"))
    fig.update_layout(title="fp16 loss scale per step (log axis), skipped steps marked", xaxis_title="step",
                      yaxis_title="loss scale", yaxis_type="log", yaxis_exponentformat="power", height=300)
    return fig


def loss_scale_sentence(scaler: dict[str, Any]) -> str:
    """One sentence: how many steps fp16 skipped, which, and where the scale started and ended."""
    skipped, scales = scaler["skipped_steps"], scaler["loss_scale"]
    which = f" (step{'s' if len(skipped) > 1 else ''} {', '.join(str(s) for s in skipped)})" if skipped else ""
    span = f"from {scales[0]:g} to {scales[-1]:g}" if scales else "not recorded"
    return (f"fp16 dynamic loss scaling: {len(skipped)} of {len(scaler['steps'])} steps skipped{which}; a skipped "
            f"step found an inf or NaN gradient on some rank, so no rank updated its weights and the scale backed "
            f"off. Scale used by backward {span}. Skipped steps are marked on the loss curve and on the loss-scale "
            f"panel.")


def _restart_step(restart: dict[str, Any]) -> int | None:
    """The step a restart is drawn at: ``at_step`` where the log has it, else the last step its attempt finished."""
    at = restart.get("at_step")
    return restart.get("last_step_done") if at is None else at


def metric_curves(history: Sequence[dict[str, Any]]) -> go.Figure:
    from plotly.subplots import make_subplots

    keys = {"grad_norm": "grad norm (before clipping)", "lr": "learning rate", "tokens_per_s": "tokens/s",
            "data_wait_s": "data wait (s): fetching the batch"}
    keys = {k: title for k, title in keys.items() if all(k in m for m in history)}  # older runs lack data_wait_s
    fig = make_subplots(rows=1, cols=len(keys), subplot_titles=list(keys.values()))
    steps = [m["step"] for m in history]
    for col, key in enumerate(keys, start=1):
        fig.add_trace(go.Scatter(x=steps, y=[m[key] for m in history], mode="lines", name=key), row=1, col=col)
    fig.update_layout(height=300, showlegend=False)
    return fig


def _table(rows: list[dict[str, Any]], empty: str = "(no communication recorded)") -> str:
    if not rows:
        return f"<p>{html.escape(empty)}</p>"
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in row.values()) + "</tr>" for row in rows)
    return f"<table class='wb'><tr>{head}</tr>{body}</table>"


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else html.escape(str(v))


def write_report(path: str | Path, summary: dict[str, Any], traces: Sequence[Trace | dict]) -> Path:
    """Write ``report.html``: summary and configuration, loss (checkpoints, restarts) and metric curves, the
    measured per-rank timeline, the pipeline bubble, communication and memory each beside theory."""
    path = Path(path)
    traces = [_trace(t) for t in traces]
    history = summary["history"]
    last_traced = max((c.step for t in traces for c in t.comms if c.step is not None), default=None)
    scaler = loss_scale_trace(history, (summary.get("config") or {}).get("precision"))
    figures = [loss_curve(history, checkpoint_steps=saved_steps(summary), restarts=summary.get("restarts") or (),
                          skipped_steps=scaler["skipped_steps"], attempts=summary.get("attempts") or ()),
               *([loss_scale_curve(scaler)] if scaler["shown"] else []),
               metric_curves(history),
               timeline([steps_only(t) for t in traces],
                        title=f"per-rank timeline of the last traced steps ({summary['strategy']})")]
    parts = [f"<h1>workbench run: {html.escape(summary['strategy'])}</h1>",
             f"<p class='lead'>{summary['config']['nproc']} rank(s), model {html.escape(summary['config']['model'])} "
             f"({summary['n_params']:,} parameters), {len(history)} steps, final loss "
             f"{summary['losses'][-1]:.4f}, median {summary['tokens_per_s']:.0f} tokens/s"
             f"{_attempts_phrase(summary)}.</p>",
             figure_html(figures[0], with_plotlyjs=True),  # the loss curve first: what a person looks for
             f"<p>final_params_sha256: <code>{summary['final_params_sha256']}</code></p>"]
    if summary.get("placement"):
        where = summary["placement"]
        parts.append(f"<p>ranks ran on {html.escape(where['device_name'])} ({html.escape(where['device'])} on rank 0, "
                     f"backend {html.escape(where['backend'])}).</p>")
    parts += attempts_section(summary)
    parts += checkpoint_sentences(summary)
    if scaler["shown"]:
        parts.append(f"<p>{html.escape(loss_scale_sentence(scaler))}</p>")
    parts += [figure_html(fig) for fig in figures[1:]]
    if summary.get("mesh"):
        parts.append("<p>mesh: " + " x ".join(f"{html.escape(str(k))}={v}" for k, v in summary["mesh"].items())
                     + "</p>")
    if summary.get("pipeline"):
        parts += pipeline_section(summary, traces)
    if summary.get("moe"):
        parts += moe_section(summary["moe"])
    parts.append(f"<h2>communication in step {last_traced} (from the log)</h2>")
    parts.append(_table(comm_table(traces, step=last_traced, group_labels=summary.get("comm_groups"))))
    comm = comm_vs_theory(summary, traces)
    parts += comm_section(comm)
    parts += links_section(summary)
    parts += gradient_sync_section(summary)
    parts += rank_time_section(summary)
    parts += memory_section(traces)
    memory = memory_vs_theory(summary, traces)
    parts += memory_theory_section(memory)
    parts += config_section(summary)
    data = {"memory_vs_theory": memory, "comm_vs_theory": comm, "config": summary.get("config", {}),
            "loss_scale": scaler, "attempts": summary.get("attempts") or []}
    parts.append(embedded_json("workbench-report-data", data))
    path.write_text("<!DOCTYPE html><html><head><meta charset='utf-8'><title>workbench report: "
                    f"{html.escape(summary['strategy'])}</title><style>{REPORT_CSS}</style></head><body>"
                    + "\n".join(parts) + "</body></html>")
    return path


#: The report's look: readable type, a bounded width, tables with a header band, zebra rows and aligned digits.
REPORT_CSS = (
    "body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;color:#1f2430;line-height:1.45;"
    "max-width:1240px;margin:0 auto;padding:20px 28px;background:#fff}"
    "h1{font-size:1.7em;margin:.2em 0 .4em;padding-bottom:.25em;border-bottom:3px solid #636EFA}"
    "h2{font-size:1.25em;margin-top:1.9em;padding-bottom:.2em;border-bottom:1px solid #d9dce5}"
    "h3{font-size:1.05em;margin-top:1.4em}p.lead{font-size:1.1em}"
    "code{background:#f1f3f8;padding:1px 4px;border-radius:3px;font-size:.92em;word-break:break-all}"
    "table.wb{border-collapse:collapse;margin:.6em 0 1.2em;font-size:13px;font-variant-numeric:tabular-nums}"
    "table.wb th{background:#e9ecf6;text-align:left;font-weight:600}"
    "table.wb th,table.wb td{border:1px solid #d4d8e3;padding:4px 9px;vertical-align:top}"
    "table.wb tr:nth-child(even) td{background:#f7f8fc}table.wb tr:hover td{background:#eef3ff}"
    "details{margin:.4em 0 1.2em}summary{cursor:pointer;color:#3d4ab8}"
    ".wb-figure{min-height:120px;margin:.6em 0}"
)


def saved_steps(summary: dict[str, Any]) -> list[int]:
    """Every step a checkpoint was saved after: the whole run's (its record's), else this invocation's."""
    recorded = (summary.get("record") or {}).get("checkpoint_steps")
    return list(recorded) if recorded is not None else list((summary.get("checkpoint") or {}).get("written_steps")
                                                            or ())


#: A small template for every figure of the report: plotly's default template is ~7 KB of JSON per figure.
_COMPACT = go.layout.Template(layout={"colorway": ["#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#FFA15A", "#19D3F3",
                                                   "#FF6692", "#B6E880", "#FF97FF", "#FECB52"],
                                      "plot_bgcolor": "#F4F6FA", "hovermode": "closest",
                                      "xaxis": {"zeroline": False}})
#: Significant digits kept of every float a figure carries: far below what a plot can show, a third of the bytes.
FIGURE_DIGITS = 5
#: The element holding plotly.js, gzip-compressed and base64-encoded (``plotly_js_payload``).
PLOTLY_ELEMENT_ID = "workbench-plotlyjs"


def figure_html(fig: go.Figure, with_plotlyjs: bool = False) -> str:
    """A figure as an HTML fragment: an empty ``div`` and the figure's JSON (compact template, floats rounded to
    ``FIGURE_DIGITS``) in a non-executed script element, drawn once the page has loaded. ``with_plotlyjs`` (once
    per page) adds plotly.js itself and the few lines that draw every figure of the page (``plotly_js_payload``)."""
    fig.update_layout(template=_COMPACT)
    figure = _rounded(json.loads(pio.to_json(fig, validate=False, pretty=False)), FIGURE_DIGITS)
    div_id = f"wb-figure-{next(_FIGURE_IDS)}"
    text = json.dumps(figure, separators=(",", ":")).replace("</", "<\\/")  # cannot close its script element
    block = (f"<div id='{div_id}' class='wb-figure'></div>"
             f"<script type='application/json' data-wb-figure='{div_id}'>{text}</script>")
    return (plotly_js_payload() + block) if with_plotlyjs else block


_FIGURE_IDS = itertools.count()


def _rounded(value: Any, digits: int) -> Any:
    """``value`` with every float rounded to ``digits`` significant digits (ints, strings and base64 arrays kept)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else None  # JSON.parse has no NaN
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    return value


@functools.lru_cache(maxsize=1)
def _plotly_js_gzip_base64() -> str:
    """The installed plotly.min.js, gzip-compressed (mtime 0: the same bytes every time) and base64-encoded:
    1.5 MB of base64 text where the plain script is 4.8 MB."""
    from plotly.offline import get_plotlyjs

    return base64.b64encode(gzip.compress(get_plotlyjs().encode(), compresslevel=9, mtime=0)).decode()


#: Draws every figure of the page: decompresses plotly.js with the browser's own ``DecompressionStream`` (Chromium
#: 80, Firefox 113, Safari 16.4), runs it, then plots each figure's JSON into its div; says so on the page if the
#: browser cannot. Offline: nothing is fetched. ``data-figures`` on <body> reads "drawn" when done (tests wait for it).
_LOADER = """
(function () {
  async function draw() {
    const figures = document.querySelectorAll("script[data-wb-figure]");
    try {
      if (!window.Plotly) {
        const text = document.getElementById("%(id)s").textContent.trim();
        const bytes = Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
        const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
        const script = document.createElement("script");
        script.textContent = await new Response(stream).text();
        document.head.appendChild(script);
      }
      for (const holder of figures) {
        const fig = JSON.parse(holder.textContent);
        Plotly.newPlot(holder.dataset.wbFigure, fig.data, fig.layout || {}, {responsive: true, displaylogo: false});
      }
      document.body.dataset.figures = "drawn";
    } catch (error) {
      document.body.dataset.figures = "failed";
      for (const holder of figures) {
        document.getElementById(holder.dataset.wbFigure).textContent =
          "This browser could not draw the figure (" + error + "); the numbers are in the tables.";
      }
    }
  }
  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", draw); } else { draw(); }
})();
"""


def plotly_js_payload() -> str:
    """plotly.js once (compressed, ``_plotly_js_gzip_base64``) and the script that draws the page's figures."""
    return (f"<script type='application/octet-stream' id='{PLOTLY_ELEMENT_ID}'>{_plotly_js_gzip_base64()}</script>"
            f"<script>{_LOADER % {'id': PLOTLY_ELEMENT_ID}}</script>")


def read_figures(page: str) -> list[dict[str, Any]]:
    """Every figure a page carries (``figure_html``), in page order, as plotly JSON: for tests and tools."""
    found = re.finditer(r"<script type='application/json' data-wb-figure='[^']*'>(.*?)</script>", page, re.S)
    return [json.loads(m.group(1)) for m in found]


def read_plotly_js(page: str) -> str:
    """The plotly.js a page carries (``plotly_js_payload``), decompressed: for tests and tools."""
    start = page.index(f"id='{PLOTLY_ELEMENT_ID}'>") + len(f"id='{PLOTLY_ELEMENT_ID}'>")
    return gzip.decompress(base64.b64decode(page[start:page.index("</script>", start)])).decode()


def embedded_json(element_id: str, data: Any) -> str:
    """The report's numbers as JSON in a non-executed script element (``</`` escaped so it cannot close it)."""
    text = json.dumps(data, default=str).replace("</", "<\\/")
    return f"<script type='application/json' id='{element_id}'>{text}</script>"


def read_embedded_json(page: str, element_id: str = "workbench-report-data") -> Any:
    """The JSON a report embedded with ``embedded_json`` (for tests and tools reading a written report)."""
    start = page.index(f"id='{element_id}'>") + len(f"id='{element_id}'>")
    return json.loads(page[start:page.index("</script>", start)])  # JSON reads the escaped "<\/" as "</"


def attempts_section(summary: dict[str, Any]) -> list[str]:
    """The run's attempts (summary["attempts"], from its record): how each began, on how many ranks, the steps
    it trained (a step redone later counts for the attempt that redid it on the curve) and how it ended."""
    attempts = summary.get("attempts") or []
    if len(attempts) < 2:
        return []
    rows = [{"attempt": a["index"] + 1, "began": ATTEMPT_WORDS.get(a.get("cause", ""), a.get("cause")),
             "world size": "" if a.get("world_size") is None else a["world_size"],
             "layout": " ".join(f"{k}={v}" for k, v in (a.get("layout") or {}).items() if v not in (None, 1, 0)),
             "steps": "none" if a.get("first_step") is None else f"{a['first_step']} - {a['last_step']}",
             "ended": _ending(a)} for a in attempts]
    return [f"<h2>one run in {len(attempts)} attempts (shaded on the loss curve)</h2>",
            "<p>The loss curve and the step metrics cover every attempt, from step 0, as the run's record "
            "(<code>record.jsonl</code> beside the checkpoints) kept them: a step trained again after a restart or "
            "a rollback counts once, as the attempt that trained it last.</p>", _table(rows)]


def _attempts_phrase(summary: dict[str, Any]) -> str:
    """", in 3 attempts (2 resumed)" for the report's first sentence; "" for a run of one attempt."""
    attempts = summary.get("attempts") or []
    if len(attempts) < 2:
        return ""
    causes: dict[str, int] = {}
    for a in attempts[1:]:
        word = ATTEMPT_WORDS.get(a.get("cause", ""), str(a.get("cause")))
        causes[word] = causes.get(word, 0) + 1
    return f", in {len(attempts)} attempts ({', '.join(f'{n} {word}' for word, n in causes.items())})"


def _ending(attempt: dict[str, Any]) -> str:
    outcome = attempt.get("outcome") or "unknown"
    if outcome == "preempted":
        pre = attempt.get("preempted") or {}
        return f"preempted by {pre.get('signal')} after step {pre.get('step')}"
    if outcome == "failed" and attempt.get("failure"):
        failure = attempt["failure"]
        return f"failed: {failure.get('reason')}" + (f" (rank {failure['rank']})" if failure.get("rank") is not None
                                                     else "")
    if outcome == "interrupted":
        return "interrupted (the process ended without a word: killed, or lost with its machine)"
    return outcome


def checkpoint_sentences(summary: dict[str, Any]) -> list[str]:
    """Where checkpoints were saved and when the run restarted (both also marked on the loss curve)."""
    parts = []
    ckpt = summary.get("checkpoint") or {}
    if saved := saved_steps(summary):
        steps = ", ".join(str(s) for s in saved)
        parts.append(f"<p>checkpoints saved after step(s) {steps} in <code>{html.escape(str(ckpt.get('dir')))}"
                     f"</code> (diamonds on the loss curve)"
                     + (f"; the run resumed from the checkpoint of step {ckpt['resumed_from_step']}"
                        if ckpt.get("resumed_from_step") is not None else "") + ".</p>")
    if preempted := summary.get("preempted"):
        parts.append(f"<p><b>preempted</b> by {html.escape(str(preempted.get('signal')))} after step "
                     f"{preempted.get('step')}: every rank stopped there"
                     + (" and saved a checkpoint; rerun with --resume to go on" if ckpt.get("dir") else "")
                     + ".</p>")
    restarts = summary.get("restarts") or []
    if restarts:
        rows = [{"attempt": r.get("attempt"), "at step": _restart_step(r), "rank": r.get("rank", ""),
                 "reason": r.get("reason", "")} for r in restarts]
        parts += ["<h3>restarts (dashed lines on the loss curve)</h3>", _table(rows)]
    return parts


def rank_time_section(summary: dict[str, Any]) -> list[str]:
    """Per rank: median step, compute (forward, backward, optimizer) and waiting, so a straggler and the ranks that
    waited for it are named (in synchronous training every rank's step lasts as long as the slowest one's)."""
    found = (summary.get("health") or {}).get("stragglers") or {}
    if "median_compute_s" not in found:
        return []
    config = summary.get("config") or {}
    rows = [{"rank": r, "step (s)": step, "computing (s)": compute, "waiting (s)": wait}
            for r, (step, compute, wait) in enumerate(zip(found["median_step_time_s"], found["median_compute_s"],
                                                         found["median_wait_s"], strict=True))]
    slow = found.get("stragglers") or []
    verdict = (f"rank(s) {', '.join(map(str, slow))} computed more than {found['factor']:g}x the typical "
               f"{found['typical_s']:.3f} s per step; the others waited for them"
               if slow else "no rank computed much longer than the others")
    planted = f" (emulated: {html.escape(config['straggler'])})" if config.get("straggler") else ""
    return ["<h2>per-rank step time: computing vs waiting</h2>", f"<p>{html.escape(verdict)}{planted}.</p>",
            _table(rows)]


def links_section(summary: dict[str, Any]) -> list[str]:
    """Emulated links (``--nodes``): the topology and, per link class, rank 0's bytes with modelled and measured
    seconds, all of it emulated time."""
    links = summary.get("links")
    if not links:
        return []
    if links.get("netns"):  # a real shaped link: nothing was emulated, nothing modelled per op
        return ["<h2>network: a real shaped link</h2>", f"<p>{html.escape(links['describe'])}.</p>"]
    rows = [{"link": name, "ops": row["ops"], "bus MB": row["bus_bytes"] / 1e6, "modelled (s)": row["modelled_s"],
             "measured (s)": row["measured_s"]} for name, row in sorted(links["rank0_by_link"].items())]
    return ["<h2>emulated links (rank 0's collectives and messages; times are emulated)</h2>",
            f"<p>{html.escape(links['describe'])}.</p>", _table(rows)]


def gradient_sync_section(summary: dict[str, Any]) -> list[str]:
    """Gradient compression (rank 0's bytes per step and the compression ratio, from each step's metrics) or local
    SGD (which steps ended an outer step: the only ones that communicated parameters)."""
    history = summary.get("history") or []
    config = summary.get("config") or {}
    rows = [{"step": m["step"], "gradient bytes sent": m["grad_bytes_sent"],
             "compression ratio": m["compression_ratio"]} for m in history if "compression_ratio" in m]
    if rows:
        return [f"<h2>gradient compression: {html.escape(str(config.get('grad_compression')))} (rank 0, per step; "
                f"the ratio is uncompressed fp32 all-reduce bytes / bytes sent)</h2>", _table(rows)]
    if summary.get("parameter_server"):
        return parameter_server_section(summary["parameter_server"])
    outer = [m["step"] for m in history if m.get("outer_step")]
    if config.get("local_steps") is not None:
        return [f"<h2>local SGD: H={config['local_steps']}, outer {html.escape(str(config.get('outer_optimizer')))}"
                f"</h2>", f"<p>parameters averaged (one all-reduce, tag <code>outer</code>) after steps "
                f"{', '.join(map(str, outer)) or 'none'}; no gradient was communicated.</p>"]
    return []


def moe_section(moe: dict[str, Any]) -> list[str]:
    """A mixture of experts (summary.json's ``moe``): the load per expert over the run (assignments chosen, before
    capacity, summed over ranks and layers), the dropped share per step, and with ep > 1 rank 0's all-to-all bytes
    per traced step measured beside ``theory.expert`` (exact for the routing that happened; even routing)."""
    cap = "none (no token dropped)" if moe["capacity_factor"] is None else f"{moe['capacity_factor']:g}"
    parts = [f"<h2>mixture of experts: {moe['experts']} experts, top-{moe['top_k']}, capacity factor "
             f"{html.escape(cap)}, ep={moe['ep']}</h2>"]
    load = moe["load_per_expert"]
    steps = [s["step"] for s in moe["per_step"]]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("load per expert (assignments, whole run)",
                                                        "dropped fraction per step"))
    fig.add_trace(go.Bar(x=[str(i) for i in range(len(load))], y=load, name="assignments"), row=1, col=1)
    fig.add_trace(go.Scatter(x=steps, y=[s["dropped_fraction"] for s in moe["per_step"]], mode="lines+markers",
                             name="dropped fraction"), row=1, col=2)
    fig.update_layout(template=_COMPACT, height=320, showlegend=False)
    parts.append(figure_html(fig))
    mean = sum(load) / len(load) if load else 0
    parts.append(f"<p>busiest expert {max(load, default=0):,} assignments, {max(load, default=0) / mean:.2f} x the "
                 f"mean; dropped in all {sum(s['dropped'] for s in moe['per_step']):,}.</p>" if mean else "")
    if moe.get("all_to_all"):
        parts.append("<h3>all-to-all bytes rank 0 sent per traced step (dispatch, combine, counts; forward and "
                     "backward): comm log beside theory.expert</h3>")
        parts.append(_table([{"step": r["step"], "measured": r["measured_bytes"],
                              "theory (routing as counted)": r["theory_exact_bytes"],
                              "theory (even routing)": r["theory_even_bytes"]} for r in moe["all_to_all"]]))
    return parts


def parameter_server_section(ps: dict[str, Any]) -> list[str]:
    """Each server's link (bytes in and out beside theory's per step), the staleness of the updates it applied, and
    how far the workers ran apart (the clock gap; replies held back by ``--max-staleness``)."""
    theory = ps["theory_step_bytes"]
    links = [{"server rank": rank, "updates": s["updates"], "bytes in": s["bytes_in"],
              "theory in / step": theory["server_in"][i], "bytes out": s["bytes_out"],
              "theory out / step": theory["server_out"][i], "wall (s)": s["wall_s"]}
             for i, (rank, s) in enumerate(zip(ps["servers"], ps["per_server"], strict=True))]
    stale = [{"staleness (updates)": k, "updates": v} for k, v in ps["staleness_histogram"].items()]
    bound = "no bound" if ps.get("max_staleness") is None else f"--max-staleness {ps['max_staleness']}"
    return [f"<h2>parameter server: {html.escape(ps['mode'])}, workers {ps['workers']}, servers {ps['servers']}</h2>",
            f"<p>All workers together: {ps['tokens_per_s'] or 0:.0f} tokens/s. Widest clock gap between workers: "
            f"{ps['max_gap']} steps ({bound}); replies held back {ps['held_s']:.3f} s in all. Each server's link "
            f"carries every worker's share each way, per step (theory: <code>theory.param_server.step_bytes</code>; "
            f"the run's bytes also count the first pull).</p>", _table(links),
            "<h3>staleness of each applied update (updates by others between its pull and its push)</h3>",
            _table(stale)]


def _emulated(c: dict[str, Any]) -> bool:
    return any(c.get(k) is not None for k in ("nodes", "intra_link", "inter_link", "distribution"))


#: Settings that only mean something in some runs, with the rule (``training.config.RunConfig``'s validation says
#: the same: e.g. "schedule, microbatches and virtual_stages are pipeline settings: they need pp > 1") and its
#: words. The configuration table shows a setting whose rule holds; the rest are folded under it.
CONDITIONAL_SETTINGS: tuple[tuple[tuple[str, ...], Callable[[dict[str, Any]], bool], str], ...] = (
    (("schedule", "microbatches", "virtual_stages"), lambda c: c.get("pp", 1) > 1, "a pipeline (pp > 1)"),
    (("sp",), lambda c: c.get("tp", 1) > 1, "tensor parallelism (tp > 1)"),
    (("cp_layout",), lambda c: c.get("cp", 1) > 1, "context parallelism (cp > 1)"),
    (("moe_top_k", "moe_capacity_factor", "moe_aux_loss_coef", "ep"), lambda c: bool(c.get("moe_experts")),
     "a mixture of experts (moe_experts > 0)"),
    (("init_loss_scale", "loss_scale_growth_interval"), lambda c: c.get("precision") == "fp16",
     "fp16's loss scaling (precision fp16)"),
    (("reduce_dtype",), lambda c: c.get("precision", "fp32") != "fp32" or c.get("reduce_dtype", "fp32") != "fp32",
     "mixed precision"),
    (("zero3_replicate",), lambda c: c.get("zero") == 3, "ZeRO-3"),
    (("ddp", "bucket_mb"), lambda c: c.get("dp", 1) > 1 and c.get("zero", 0) == 0 and c.get("local_steps") is None
     and c.get("ps_servers") is None, "DDP's gradient all-reduce (dp > 1, no ZeRO)"),
    (("powersgd_rank",), lambda c: c.get("grad_compression") == "powersgd", "PowerSGD compression"),
    (("topk_ratio",), lambda c: c.get("grad_compression") == "topk", "top-k compression"),
    (("compression_warmup",), lambda c: c.get("grad_compression", "none") != "none", "gradient compression"),
    (("outer_optimizer", "outer_lr"), lambda c: c.get("local_steps") is not None, "local SGD (local_steps)"),
    (("outer_momentum",), lambda c: c.get("local_steps") is not None and c.get("outer_optimizer") == "nesterov",
     "local SGD's Nesterov outer step"),
    (("ps_async",), lambda c: c.get("ps_servers") is not None, "a parameter server (ps_servers)"),
    (("max_staleness",), lambda c: bool(c.get("ps_async")), "an asynchronous parameter server"),
    (("ckpt_every", "keep", "resume", "async_ckpt"), lambda c: c.get("ckpt_dir") is not None,
     "checkpoints (ckpt_dir)"),
    (("val_fraction",), lambda c: c.get("val_every") is not None, "validation (val_every)"),
    (("intra_link", "inter_link", "time_scale", "distribution"), _emulated, "emulated links (nodes or links)"),
    (("netns",), lambda c: c.get("nodes") is not None, "emulated nodes"),
)
#: Optional features: shown while on, folded while off (None, False or empty).
OPTIONAL_SETTINGS = ("ckpt_dir", "local_steps", "ps_servers", "val_every", "sdc_check_every", "inject_fault",
                     "export", "data", "straggler", "nodes", "device", "backend", "offload", "extra", "min_nproc",
                     "moe_experts", "max_restarts")


def applicable_settings(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings that apply to this run, and the others with the condition they wait for (``CONDITIONAL_SETTINGS``,
    ``OPTIONAL_SETTINGS``); every setting lands in exactly one of the two."""
    folded: dict[str, str] = {}
    for names, applies, needs in CONDITIONAL_SETTINGS:
        try:
            holds = applies(config)
        except TypeError:  # a hand-written summary's odd value: show the setting rather than guess
            holds = True
        if not holds:
            folded.update({n: f"applies with {needs}" for n in names if n in config})
    for name in OPTIONAL_SETTINGS:
        if name in config and name not in folded and config[name] in (None, False, {}, []):
            folded[name] = "off (not set)"
    shown = {k: v for k, v in config.items() if k not in folded}
    return shown, folded


def config_section(summary: dict[str, Any]) -> list[str]:
    """The run's configuration (summary.json's ``config``): the settings that apply to its layout as a table, the
    others (another layout's, features left off) folded in a ``<details>`` with the condition each waits for."""
    config = summary.get("config") or {}
    shown, folded = applicable_settings(config)

    def value(v: Any) -> Any:
        return json.dumps(v) if isinstance(v, dict | list) else v

    rows = [{"setting": k, "value": value(v)} for k, v in shown.items()]
    parts = ["<h2>configuration</h2>", _table(rows, empty="(no configuration recorded)")]
    if folded:
        rest = [{"setting": k, "value": value(config[k]), "why not shown": why} for k, why in folded.items()]
        parts += [f"<details><summary>{len(rest)} more settings that do not apply to this run's layout or are "
                  f"off</summary>", _table(rest), "</details>"]
    return parts


# ---------------------------------------------------------------------------------------------------------
# Theory for the run's own layout.

#: Ledger categories theory has no formula for: communication staging buffers (bucket sizes are an
#: implementation choice) and ZeRO-3's transiently gathered units (how many are alive depends on prefetching).
UNMODELLED_MEMORY = ("comm_buffers", "gathered_params")


def model_shape(config: dict[str, Any], n_params: int | None = None,
                model_config: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The run's GPT as a theory model dict (``theory.models``' "gpt" arch), or None where it cannot be known.

    ``model_config`` is the model's sizes as summary.json records them (``model_config``: the run writes its
    ``GPTConfig`` there), so the report never imports the model. A summary written before that key existed gives
    None. The count must reproduce the run's ``n_params`` exactly, else theory would describe another model and
    None is returned."""
    g = model_config or {}
    try:
        shape = {"n_layer": g["n_layer"], "d_model": g["d_model"], "n_head": g["n_head"],
                 "vocab_size": g["vocab_size"], "seq_len": g["seq_len"], "dropout": False, "exact": True,
                 "arch": "gpt", "n_params": gpt_param_count(g["n_layer"], g["d_model"], g["vocab_size"],
                                                            g["seq_len"], g["mlp_ratio"], g["tie_embeddings"])}
    except (KeyError, ValueError, TypeError):
        return None
    if g["mlp_ratio"] != 4 or (n_params is not None and shape["n_params"] != n_params):
        return None
    return shape


def run_layout(config: dict[str, Any]) -> tuple[Layout, int]:
    """The run's flags as a ``theory.parallelism.Layout`` and the micro-batch each rank runs (sequences).

    With pp = 1 the layout's micro-batches are the gradient-accumulation steps (theory's convention)."""
    pp = config.get("pp", 1)
    m = (config.get("microbatches") or 1) if pp > 1 else config.get("grad_accum", 1)
    layout = Layout(dp=config["dp"], tp=config.get("tp", 1), pp=pp, sp=bool(config.get("sp")),
                    zero_stage=config.get("zero", 0), schedule=config.get("schedule", "1f1b"), microbatches=m,
                    virtual_stages=config.get("virtual_stages", 1), offload=bool(config.get("offload")),
                    cp=config.get("cp", 1), cp_layout=config.get("cp_layout", "zigzag"))
    return layout, max(1, config["batch_size"] // (layout.dp * m))


def axis_coordinate(groups: Sequence[dict[str, Any]] | None, rank: int, axis: str) -> int:
    """A rank's index along ``axis``, from summary.json's ``comm_groups`` (0 where the axis has one rank)."""
    for g in groups or ():
        if g["axis"] == axis and rank in g["ranks"] and len(g["ranks"]) > 1:
            return sorted(g["ranks"]).index(rank)
    return 0


def _theory_setup(summary: dict[str, Any]) -> tuple[dict[str, Any], Layout, int, int] | str:
    """(shape, layout, micro-batch, seq_len) for the run, or a sentence saying why theory cannot be applied."""
    config = summary.get("config") or {}
    shape = model_shape(config, summary.get("n_params"), summary.get("model_config"))
    if shape is None:
        return (f"model {config.get('model')!r} has no exact theory shape here (its parameter count is not ours, "
                "or summary.json does not record the model's sizes)")
    try:
        layout, micro = run_layout(config)
        layout.validate(shape, shape["seq_len"])
    except (KeyError, ValueError, TypeError) as exc:
        return f"theory does not take this layout: {exc}"
    return shape, layout, micro, shape["seq_len"]
def _precision_notes(summary: dict[str, Any], what: str) -> list[str]:
    """Why theory's fp32 figures may differ from a mixed-precision run (autocast: fp32 parameters, gradients and
    AdamW state, so the model states stay theory's fp32 row; the activations autocast saves or sends are 16-bit
    where the op ran in 16 bits)."""
    config = summary.get("config") or {}
    precision, reduce = config.get("precision", "fp32"), config.get("reduce_dtype", "fp32")
    if precision == "fp32" and reduce == "fp32":
        return []
    if what == "memory":
        return [f"This run computed in {precision} under autocast: parameters, gradients and optimizer state stay "
                f"fp32 (theory's fp32 row applies), but saved activations are 16-bit where the op ran in "
                f"{precision}; theory's activation figure assumes 4-byte values, so the ledger holds less."]
    return [f"This run computed in {precision} (gradients reduced in {reduce}); theory counts 4-byte tensors, so "
            f"the activations tp and pp move (and gradients reduced in 16 bits) weigh less than theory shows."]


def _activation_theory(shape: dict[str, Any], layout: Layout, micro: int, seq: int, recompute: str,
                       held_layers: int, korthikanti: float) -> tuple[float, str]:
    """Theory's saved activations on one rank, and where the figure comes from.

    Without recomputation the GPT-exact count (``gpt_activation_bytes``: Korthikanti et al. 2022 adapted to this
    model's fused attention) is what the ledger's saved-tensor hooks measure; with pp > 1 its blocks times the
    layer-micro-batches the schedule keeps alive (embedding, head and loss left out). With recomputation,
    Korthikanti et al.'s per-layer estimate (blocks only) as ``layout_memory`` computes it."""
    d, h = shape["d_model"], shape["n_head"]
    if recompute != "none":
        return korthikanti, f"Korthikanti et al. 2022 with recompute={recompute}, blocks only"
    if layout.pp == 1:
        total = gpt_activation_bytes(micro, seq, d, shape["n_layer"], h, shape["vocab_size"], layout.tp, layout.sp)
        return total["total"], "gpt_activation_bytes: blocks, final norm and head, embedding and loss"
    block = gpt_block_activation_bytes(micro, seq, d, h, layout.tp, layout.sp)
    return held_layers * block, ("gpt_block_activation_bytes x the layer-micro-batches the schedule keeps alive on "
                                 "the rank's stage (blocks only: embedding, head and loss not counted)")


def _memory_theory_per_stage(setup: tuple[dict[str, Any], Layout, int, int],
                             config: dict[str, Any]) -> tuple[list[dict[str, float]], str]:
    """Theory's bytes per category for each pipeline rank (fp32 AdamW model states, activations as
    ``_activation_theory``), and where the activation figure comes from."""
    shape, layout, micro, seq = setup
    recompute = config.get("recompute", "none")
    mem = layout_memory(shape, layout, "fp32", "adamw", micro_batch=micro, seq_len=seq, recompute=recompute)
    per_pp, source = [], ""
    for info in mem["ranks"]:
        states = dict(info["per_rank"])
        states["activations"], source = _activation_theory(shape, layout, micro, seq // layout.cp, recompute,
                                                           info["peak_held_layers"], states.get("activations", 0.0))
        per_pp.append(states)
    return per_pp, source


def memory_vs_theory(summary: dict[str, Any], traces: Sequence[Trace]) -> dict[str, Any]:
    """Per rank and ledger category: the measured peak (bytes) beside theory's prediction for the run's layout
    (``theory.parallelism.layout_memory``: ZeRO paper §5.1 model states, fp32 AdamW; activations as
    ``_activation_theory`` says). ``theory_bytes`` is None for the categories theory does not model."""
    setup = _theory_setup(summary)
    out: dict[str, Any] = {"available": not isinstance(setup, str), "why": setup if isinstance(setup, str) else "",
                           "unmodelled": list(UNMODELLED_MEMORY), "activations_source": "", "rows": [],
                           "notes": _precision_notes(summary, "memory")}
    per_pp: list[dict[str, float]] = []
    if not isinstance(setup, str):
        try:
            per_pp, out["activations_source"] = _memory_theory_per_stage(setup, summary["config"])
        except ValueError as exc:  # a layout theory refuses: the measurement is still worth showing
            out.update(available=False, why=f"theory does not take this layout: {exc}")
    for t in sorted(traces, key=lambda t: t.rank):
        theory = per_pp[axis_coordinate(summary.get("comm_groups"), t.rank, "pp")] if per_pp else {}
        for category in _memory_categories(t.memory.peak, theory):
            measured = int(t.memory.peak.get(category, 0))
            predicted = None if category in UNMODELLED_MEMORY or not per_pp else float(theory.get(category, 0.0))
            out["rows"].append({"rank": t.rank, "category": category, "measured_bytes": measured,
                                "theory_bytes": predicted,
                                "difference_bytes": None if predicted is None else measured - predicted})
    return out


def _memory_categories(*tables: dict[str, Any]) -> list[str]:
    from workbench.trace import MEMORY_CATEGORIES

    found = {c for table in tables for c in table}
    return [c for c in MEMORY_CATEGORIES if c in found] + sorted(found - set(MEMORY_CATEGORIES))


def memory_theory_section(memory: dict[str, Any]) -> list[str]:
    """HTML: the per-rank, per-category table and a measured-beside-theory bar figure."""
    from workbench.viz.memory import measured_vs_theory

    parts = ["<h2>memory per rank by category: measured (ledger peaks) beside theory</h2>"]
    if not memory["available"]:
        parts.append(f"<p>Theory not shown: {html.escape(memory['why'])}.</p>")
    else:
        parts.append("<p>Theory: <code>workbench.theory.parallelism.layout_memory</code> for this run's layout "
                     "(ZeRO paper §5.1, fp32 AdamW: 4Ψ parameters + 4Ψ gradients + 8Ψ optimizer state, sharded by "
                     "the ZeRO stage, per pipeline stage and tp shard); activations: "
                     f"{html.escape(memory['activations_source'])}. Not modelled by theory: "
                     f"{', '.join(memory['unmodelled'])}. Each category's peak is its own maximum over the run, so "
                     "the peaks need not occur at the same moment.</p>")
    parts += [f"<p>{html.escape(note)}</p>" for note in memory.get("notes", [])]
    rows = [{"rank": r["rank"], "category": r["category"], "measured (MiB)": r["measured_bytes"] / _MIB,
             "theory (MiB)": "not modelled" if r["theory_bytes"] is None else r["theory_bytes"] / _MIB,
             "measured - theory (KiB)": "" if r["difference_bytes"] is None else r["difference_bytes"] / 1024}
            for r in memory["rows"]]
    parts.append(_table(rows, empty="(no memory recorded)"))
    if memory["available"] and memory["rows"]:
        measured: dict[str, dict[str, float]] = {}
        theory: dict[str, dict[str, float]] = {}
        for r in memory["rows"]:
            measured.setdefault(f"rank {r['rank']}", {})[r["category"]] = r["measured_bytes"]
            if r["theory_bytes"] is not None:
                theory.setdefault(f"rank {r['rank']}", {})[r["category"]] = r["theory_bytes"]
        fig = measured_vs_theory(measured, theory, title="peak memory per rank: measured (ledger) vs theory")
        fig.update_layout(height=420)
        parts.append(figure_html(fig))
    return parts


#: The data-parallel traffic (gradients, ZeRO-3's parameters): theory's dp row, over dp x cp under context parallelism.
GRADIENT_TAGS = ("grad", "param")


def modelled_tags(layout: Layout) -> dict[str, set[str]]:
    """The comm-log tags whose bytes theory predicts, per mesh axis; scalars (clip, metrics, the pipeline's loss
    broadcast, AMP's agreement) and set-up traffic are not modelled."""
    tp = {"tp", "sp"}
    if layout.pp == 1:  # with pp > 1 the embedding/head/loss collectives sit on the first/last stage only
        tp |= {"tp_vocab", "tp_loss", "sp_vocab", "sp_grads"}
    return {"dp": {"grad", "param"}, "cp": {"cp_kv", "cp_grad_kv"}, "tp": tp, "pp": {"pp_act", "pp_grad", "pp_tied"}}


def comm_theory(shape: dict[str, Any], layout: Layout, micro: int, seq: int, recompute: str) -> dict[str, float]:
    """Bytes (summed tensor sizes S, what the log's ``nbytes`` adds up to) per ``"axis/op"`` for one step on the
    busiest rank of each axis: ``layout_comm`` (dp: ZeRO paper §7.2; tp: Megatron's f/g per block, or SP's
    gathers and reduce-scatters; pp: one activation and one gradient per micro-batch and boundary, the tied
    embedding's gradient), plus with pp = 1 the vocab-parallel embedding, head and loss collectives and SP's
    gradient all-reduce. A recv is theory's send seen from the receiving side."""
    comm = layout_comm(shape, layout, "fp32", micro_batch=micro, seq_len=seq, recompute=recompute)
    out: dict[str, float] = {}
    for axis in ("dp", "cp", "tp", "pp"):
        for op, size, count in comm[axis]["ops"]:
            out[f"{axis}/{op}"] = out.get(f"{axis}/{op}", 0.0) + size * count
    if layout.tp > 1 and layout.pp == 1:
        vocab = (sp_vocab_collectives if layout.sp else tp_vocab_collectives)(micro, seq, shape["d_model"], 4)
        extra = [c for phase in vocab.values() for c in phase] * layout.microbatches
        if layout.sp:
            extra += sp_grad_collectives(shape["d_model"], shape["n_layer"], seq, 4)
        for op, size in extra:
            out[f"tp/{op}"] = out.get(f"tp/{op}", 0.0) + size
    for axis in ("pp", "cp"):  # point to point: each rank receives what its neighbour sends
        if f"{axis}/send" in out:
            out[f"{axis}/recv"] = out[f"{axis}/send"]
    return out


def _measured_comm(traces: Sequence[Trace], groups: Sequence[dict[str, Any]] | None,
                   step: int) -> dict[int, dict[tuple[str, str, str], int]]:
    """Per rank: bytes of ``step`` per (axis, op, tag), the axis named from summary.json's ``comm_groups``."""
    names = {tuple(sorted(g["ranks"])): g["axis"] for g in groups or ()}
    out: dict[int, dict[tuple[str, str, str], int]] = {}
    for t in traces:
        per = out.setdefault(t.rank, {})
        for c in t.comms:
            if c.step == step:
                axis = names.get(tuple(sorted(c.group)), str(list(c.group)))
                if axis in ("cp", "dp_cp") and c.tag in GRADIENT_TAGS:  # cp ranks average gradients over dp x cp
                    axis = "dp"
                key = (axis, c.op, c.tag)
                per[key] = per.get(key, 0) + c.nbytes
    return out


def comm_vs_theory(summary: dict[str, Any], traces: Sequence[Trace]) -> dict[str, Any]:
    """Per traced step and (mesh axis, collective): the busiest rank's measured bytes beside theory's
    (``comm_theory``), and, apart, the measured traffic theory does not model (by tag)."""
    setup = _theory_setup(summary)
    out: dict[str, Any] = {"available": not isinstance(setup, str), "why": setup if isinstance(setup, str) else "",
                           "rows": [], "unmodelled": [], "notes": _precision_notes(summary, "comm")}
    theory: dict[str, float] = {}
    tags: dict[str, set[str]] = {}
    if not isinstance(setup, str):
        shape, layout, micro, seq = setup
        try:
            theory = comm_theory(shape, layout, micro, seq, summary["config"].get("recompute", "none"))
            tags = modelled_tags(layout)
        except ValueError as exc:  # a layout theory refuses: the measurement is still worth showing
            out.update(available=False, why=f"theory does not take this layout: {exc}")
    steps = sorted({c.step for t in traces for c in t.comms if c.step is not None})
    for step in steps:
        per_rank = _measured_comm(traces, summary.get("comm_groups"), step)
        modelled: dict[str, dict[int, int]] = {}
        other: dict[tuple[str, str, str], dict[int, int]] = {}
        for rank, table in per_rank.items():
            for (axis, op, tag), nbytes in table.items():
                if tag in tags.get(axis, ()):
                    by_rank = modelled.setdefault(f"{axis}/{op}", {})
                    by_rank[rank] = by_rank.get(rank, 0) + nbytes
                else:
                    other.setdefault((axis, op, tag), {})[rank] = nbytes
        for key in sorted(set(modelled) | set(theory)):
            by_rank = modelled.get(key, {})
            busiest = max(by_rank, key=lambda r: (by_rank[r], -r)) if by_rank else None
            axis, op = key.split("/")
            out["rows"].append({"step": step, "axis": axis, "op": op,
                                "measured_bytes": by_rank.get(busiest, 0) if busiest is not None else 0,
                                "busiest_rank": busiest, "theory_bytes": theory.get(key, 0.0) if tags else None})
        for (axis, op, tag), by_rank in sorted(other.items()):
            out["unmodelled"].append({"step": step, "axis": axis, "op": op, "tag": tag,
                                      "measured_bytes": max(by_rank.values())})
    return out


def comm_section(comm: dict[str, Any]) -> list[str]:
    """HTML: per traced step, bytes by mesh axis and collective, measured (busiest rank) beside theory; the
    traffic theory leaves out; a bar figure of the last traced step."""
    parts = ["<h2>communication per traced step by mesh axis and collective: measured beside theory</h2>"]
    if not comm["available"]:
        parts.append(f"<p>Theory not shown: {html.escape(comm['why'])}.</p>")
    else:
        parts.append("<p>Bytes are the summed tensor sizes S of each collective (a reduce-scatter's full input, an "
                     "all-gather's full output, a message's size), on the rank that moved the most. Theory: "
                     "<code>workbench.theory.parallelism.layout_comm</code> for this layout, fp32, plus the "
                     "vocab-parallel embedding, head and loss (<code>theory.comm</code>) when pp = 1. Where a "
                     "collective appears on one side only, the implementation uses another collective than "
                     "theory's textbook one for that axis (the last column says which side moves more).</p>")
    parts += [f"<p>{html.escape(note)}</p>" for note in comm.get("notes", [])]
    rows = []
    for r in comm["rows"]:
        theory = r["theory_bytes"]
        rows.append({"step": r["step"], "axis": r["axis"], "collective": r["op"],
                     "measured (KiB)": r["measured_bytes"] / 1024,
                     "on rank": "" if r["busiest_rank"] is None else r["busiest_rank"],
                     "theory (KiB)": "n/a" if theory is None else theory / 1024,
                     "measured - theory (KiB)": "" if theory is None else (r["measured_bytes"] - theory) / 1024})
    parts.append(_table(rows, empty="(no traced step with communication)"))
    if comm["unmodelled"]:
        parts.append("<h3>measured, not modelled by theory (scalars and bookkeeping)</h3>")
        parts.append(_table([{"step": u["step"], "axis": u["axis"], "collective": u["op"], "tag": u["tag"],
                              "bytes (busiest rank)": u["measured_bytes"]} for u in comm["unmodelled"]]))
    if comm["rows"]:
        last = max(r["step"] for r in comm["rows"])
        shown = [r for r in comm["rows"] if r["step"] == last]
        x = [f"{r['axis']} {r['op']}" for r in shown]
        fig = go.Figure([go.Bar(name="measured", x=x, y=[r["measured_bytes"] / 1024 for r in shown]),
                         go.Bar(name="theory", x=x, y=[(r["theory_bytes"] or 0) / 1024 for r in shown],
                                marker_pattern_shape="/")])
        fig.update_layout(barmode="group", title=f"bytes per collective and axis in step {last}",
                          yaxis_title="KiB", height=320)
        parts.append(figure_html(fig))
    return parts


_MIB = 2**20

_ALLOCATOR_GAP = (
    "The ledger counts the categories theory predicts (parameters, gradients, optimizer state, saved "
    "activations, communication buffers, gathered shards), attributed by the code that owns them. The CUDA "
    "allocator counts every live tensor, so its figures are the larger. 'allocator - ledger now' is split "
    "into what was measured at that moment: cuBLAS's workspaces (scratch memory for matmuls, one per handle "
    "and stream, kept for the process's life: the forward's thread and autograd's backward thread hold one "
    "each, tens of MiB on a recent GPU, more than a small model's states), the step's batch, and what is "
    "left unexplained (scalars such as the loss, each block's rounding to 512 bytes; a large figure there is "
    "a leak). At its peak, forward's temporaries (matmul outputs, autograd intermediates) and the optimizer's "
    "scratch add to what the ledger's peak holds. Neither counts the CUDA context or the allocator's cached "
    "free blocks, which nvidia-smi shows.")


def memory_rows(traces: Sequence[Trace]) -> list[dict[str, Any]]:
    """Per rank: the ledger's bytes by category (MiB) at the last record, its peak, and the allocator's."""
    rows = []
    for t in traces:
        row: dict[str, Any] = {"rank": t.rank}
        row.update({f"{k} (MiB)": v / _MIB for k, v in t.memory.current.items()})
        row["ledger peak (MiB)"] = t.memory.peak_total / _MIB
        if t.device_memory is not None:
            dm = t.device_memory
            row["device"] = dm.device
            row["allocator now (MiB)"] = dm.allocated / _MIB
            row["allocator - ledger now (MiB)"] = (dm.allocated - dm.ledger_total) / _MIB
            row["of which cuBLAS workspaces (MiB)"] = ("unknown" if dm.cublas_workspaces is None
                                                       else dm.cublas_workspaces / _MIB)
            row["of which the batch (MiB)"] = dm.batch / _MIB
            row["unexplained (MiB)"] = dm.unexplained / _MIB
            row["allocator peak (MiB)"] = dm.peak_allocated / _MIB
            row["allocator reserved (MiB)"] = dm.reserved / _MIB
            row["GPU utilisation (%)"] = "unknown" if dm.utilization is None else dm.utilization
        rows.append(row)
    return rows


_UTILIZATION = (
    "GPU utilisation is torch.cuda.utilization at the same moment: the percent of time one or more kernels ran "
    "over the driver's last sample period (1/6 s to 1 s, as nvidia-smi shows it). It says how busy the GPU was, "
    "not how efficiently: one small kernel running all the time reads 100 %.")
_NO_UTILIZATION = ("GPU utilisation unknown: torch.cuda.utilization needs the pynvml (nvidia-ml-py) package, or "
                   "amdsmi on ROCm, and a driver it can ask.")


def memory_section(traces: Sequence[Trace]) -> list[str]:
    """HTML: the ledger's theory-shaped breakdown per rank and, on CUDA, the allocator's figures, the gap and the
    GPU's utilisation (where pynvml/amdsmi could be asked)."""
    devices = [t.device_memory for t in traces if t.device_memory is not None]
    where = "measured on CUDA: ledger beside the allocator" if devices else "the ledger (CPU: no allocator to ask)"
    parts = [f"<h2>memory per rank ({where})</h2>", _table(memory_rows(traces))]
    if devices:
        parts.append(f"<p>{html.escape(_ALLOCATOR_GAP)}</p>")
        known = any(d.utilization is not None for d in devices)
        parts.append(f"<p>{html.escape(_UTILIZATION if known else _NO_UTILIZATION)}</p>")
    return parts


def bubble_sentence(pipe: dict[str, Any], p: int) -> str:
    """One sentence: the measured bubble (median over the traced steps) beside the schedule's theory."""
    measured = pipe.get("bubble_measured")
    said = "not measured (no traced pipeline step)" if measured is None else f"{measured:.1%}"
    v = pipe.get("virtual_stages", 1)
    return (f"Pipeline bubble ({pipe['schedule']}, p={p}, m={pipe['microbatches']}" + (f", v={v}" if v > 1 else "")
            + f"): measured {said} of the ranks' time idle (median over the traced steps), theory "
              f"{pipe['bubble_theory']:.1%}.")


def pipeline_section(summary: dict[str, Any], traces: Sequence[Trace | dict]) -> list[str]:
    """HTML for a pipeline run: bubble measured beside theory, the last traced step's timeline with each
    action's micro-batch on its bar and the idle gaps drawn, and the peak activation memory per stage."""
    pipe, mesh = summary["pipeline"], summary.get("mesh", {})
    p = mesh.get("pp", len(pipe.get("peak_activation_bytes_per_stage", [])))
    steps = pipe.get("traced_steps") or []
    parts = ["<h2>pipeline</h2>", f"<p>{html.escape(bubble_sentence(pipe, p))}</p>",
             _table([{"": "bubble fraction", "measured": pipe.get("bubble_measured"),
                      "theory": pipe["bubble_theory"]}])]
    if steps:
        last = steps[-1]
        fig = timeline([steps_only(t, [last]) for t in traces], labels=True, idle=True,
                       title=f"pipeline step {last}: F/B/I/W per micro-batch (mb), send/recv, idle")
        parts.append(figure_html(fig))
        parts += _plan_beside_measured(summary, [_trace(t) for t in traces], last)
    per_stage = pipe.get("peak_activation_bytes_per_stage") or []
    parts.append("<h3>peak activation memory per stage (ledger)</h3>")
    parts.append(_table([{"stage": i, "peak activations (MiB)": b / _MIB} for i, b in enumerate(per_stage)]))
    return parts


def _plan_beside_measured(summary: dict[str, Any], traces: Sequence[Trace], step: int) -> list[str]:
    """The schedule's plan (theory, ``viz.pipeline``) above what rank 0's pipeline (its pp group) did in ``step``."""
    from workbench.theory.pipeline import make_plan
    from workbench.viz.pipeline import plan_vs_measured

    pipe, config = summary["pipeline"], summary.get("config", {})
    p = summary.get("mesh", {}).get("pp", 1)
    group = next((g["ranks"] for g in summary.get("comm_groups") or () if g["axis"] == "pp" and 0 in g["ranks"]),
                 [t.rank for t in traces])
    stages = [t for t in traces if t.rank in group]
    try:
        shape = model_shape(config, summary.get("n_params"), summary.get("model_config"))
        plan = make_plan(pipe["schedule"], p, pipe["microbatches"], pipe.get("virtual_stages", 1),
                         shape["n_layer"] if shape else None)
        fig = plan_vs_measured(plan, stages, step, measured_bubble=pipe.get("bubble_measured"),
                               title=f"the bubble: {pipe['schedule']} as planned (theory) and as run (step {step})")
        fig.update_layout(height=max(600, 150 * len(stages) + 320))  # room between the two panels' titles
    except ValueError as exc:  # a trace without action spans for that step
        return [f"<p>plan beside measurement not drawn: {html.escape(str(exc))}</p>"]
    return [figure_html(fig)]


def _trace(t: Trace | dict) -> Trace:
    return t if isinstance(t, Trace) else Trace.from_dict(t)
