"""The run report: one self-contained HTML page (works offline) with the loss curve and the timeline."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from workbench.trace import Trace
from workbench.viz.timeline import comm_table, steps_only, timeline


def loss_curve(history: Sequence[dict[str, Any]], title: str = "global-batch loss per step") -> go.Figure:
    steps = [m["step"] for m in history]
    fig = go.Figure(go.Scatter(x=steps, y=[m["loss"] for m in history], mode="lines+markers", name="loss"))
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="loss", height=350)
    return fig


def metric_curves(history: Sequence[dict[str, Any]]) -> go.Figure:
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=3, subplot_titles=("grad norm (before clipping)", "learning rate",
                                                        "tokens/s"))
    steps = [m["step"] for m in history]
    for col, key in enumerate(("grad_norm", "lr", "tokens_per_s"), start=1):
        fig.add_trace(go.Scatter(x=steps, y=[m[key] for m in history], mode="lines", name=key), row=1, col=col)
    fig.update_layout(height=300, showlegend=False)
    return fig


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>(no communication recorded)</p>"
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in row.values()) + "</tr>" for row in rows)
    return f"<table border=1 cellpadding=4 style='border-collapse:collapse'><tr>{head}</tr>{body}</table>"


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else html.escape(str(v))


def write_report(path: str | Path, summary: dict[str, Any], traces: Sequence[Trace | dict]) -> Path:
    """Write ``report.html``: summary, loss and metric curves, measured per-rank timeline, comm table."""
    path = Path(path)
    history = summary["history"]
    last_traced = max((c.step for t in traces for c in _trace(t).comms if c.step is not None), default=None)
    figures = [loss_curve(history), metric_curves(history),
               timeline([steps_only(t) for t in traces],
                        title=f"per-rank timeline of the last traced steps ({summary['strategy']})")]
    parts = [f"<h1>workbench run: {html.escape(summary['strategy'])}</h1>",
             f"<p>{summary['config']['nproc']} rank(s), model {html.escape(summary['config']['model'])} "
             f"({summary['n_params']:,} parameters), {len(history)} steps, final loss "
             f"{summary['losses'][-1]:.4f}, median {summary['tokens_per_s']:.0f} tokens/s.</p>",
             f"<p>final_params_sha256: <code>{summary['final_params_sha256']}</code></p>"]
    for i, fig in enumerate(figures):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    parts.append(f"<h2>communication in step {last_traced} (from the log)</h2>")
    parts.append(_table(comm_table(traces, step=last_traced)))
    path.write_text("<html><head><meta charset='utf-8'><title>workbench report</title></head><body>"
                    + "\n".join(parts) + "</body></html>")
    return path


def _trace(t: Trace | dict) -> Trace:
    return t if isinstance(t, Trace) else Trace.from_dict(t)
