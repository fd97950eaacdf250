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
    if summary.get("placement"):
        where = summary["placement"]
        parts.append(f"<p>ranks ran on {html.escape(where['device_name'])} ({html.escape(where['device'])} on rank 0, "
                     f"backend {html.escape(where['backend'])}).</p>")
    for i, fig in enumerate(figures):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    if summary.get("mesh"):
        parts.append("<p>mesh: " + " x ".join(f"{html.escape(str(k))}={v}" for k, v in summary["mesh"].items())
                     + "</p>")
    if summary.get("pipeline"):
        parts += pipeline_section(summary, traces)
    parts.append(f"<h2>communication in step {last_traced} (from the log)</h2>")
    parts.append(_table(comm_table(traces, step=last_traced, group_labels=summary.get("comm_groups"))))
    parts += memory_section([_trace(t) for t in traces])
    path.write_text("<html><head><meta charset='utf-8'><title>workbench report</title></head><body>"
                    + "\n".join(parts) + "</body></html>")
    return path


_MIB = 2**20

_ALLOCATOR_GAP = (
    "The ledger counts the categories theory predicts (parameters, gradients, optimizer state, saved "
    "activations, communication buffers, gathered shards), attributed by the code that owns them. The CUDA "
    "allocator counts every live tensor: also temporaries (matmul outputs, autograd intermediates, the "
    "optimizer's scratch tensors) and each block's rounding to 512 bytes, so its figures are the larger; at "
    "its peak, forward's temporaries and the optimizer's scratch add to what the ledger's peak holds. Neither "
    "counts the CUDA context or the allocator's cached free blocks, which nvidia-smi shows.")


def memory_rows(traces: Sequence[Trace]) -> list[dict[str, Any]]:
    """Per rank: the ledger's bytes by category (MiB) at the last record, its peak, and the allocator's."""
    rows = []
    for t in traces:
        row: dict[str, Any] = {"rank": t.rank}
        row.update({f"{k} (MiB)": v / _MIB for k, v in t.memory.current.items()})
        row["ledger peak (MiB)"] = t.memory.peak_total / _MIB
        if t.device_memory is not None:
            dm = t.device_memory
            row["allocator now (MiB)"] = dm.allocated / _MIB
            row["allocator - ledger now (MiB)"] = (dm.allocated - dm.ledger_total) / _MIB
            row["allocator peak (MiB)"] = dm.peak_allocated / _MIB
        rows.append(row)
    return rows


def memory_section(traces: Sequence[Trace]) -> list[str]:
    """HTML: the ledger's theory-shaped breakdown per rank and, on CUDA, the allocator's figures and the gap."""
    on_cuda = any(t.device_memory is not None for t in traces)
    where = "measured on CUDA: ledger beside the allocator" if on_cuda else "the ledger (CPU: no allocator to ask)"
    parts = [f"<h2>memory per rank ({where})</h2>", _table(memory_rows(traces))]
    if on_cuda:
        parts.append(f"<p>{html.escape(_ALLOCATOR_GAP)}</p>")
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
        parts.append(fig.to_html(full_html=False, include_plotlyjs=False))
    per_stage = pipe.get("peak_activation_bytes_per_stage") or []
    parts.append("<h3>peak activation memory per stage (ledger)</h3>")
    parts.append(_table([{"stage": i, "peak activations (MiB)": b / _MIB} for i, b in enumerate(per_stage)]))
    return parts


def _trace(t: Trace | dict) -> Trace:
    return t if isinstance(t, Trace) else Trace.from_dict(t)
