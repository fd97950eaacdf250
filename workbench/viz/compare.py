"""Runs side by side: one offline page (plotly.js inlined once) comparing what ``workbench run --out DIR`` wrote
for several runs: loss curves overlaid, step time and tokens/s, peak memory per ledger category, bytes moved per
collective, and the settings in which the runs differ. ``workbench report RUN_DIR [RUN_DIR ...]`` builds it.

Each run is read from its directory: ``summary.json`` (required) and ``traces.json`` (optional: without it the
bytes per collective are left out for that run, and the page says so). ``load_run`` checks a directory before
anything is drawn, so a wrong path is one sentence naming it, never a traceback. Presentation only: plain
JSON records, never torch.distributed.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.trace import MEMORY_CATEGORIES

#: What a summary.json must hold for the page to be drawn (written by ``workbench run``).
REQUIRED_KEYS = ("config", "strategy", "history", "losses", "tokens_per_s", "step_time_s", "memory_peak_bytes")
#: Settings that never change what a run computes: left out of the "differences" table.
_NOT_A_DIFFERENCE = ("port", "timeout", "device", "backend", "extra", "ckpt_dir")


class RunDirError(ValueError):
    """A path that is not a readable run directory; the message is one line naming the path and what was expected."""


@dataclass
class Run:
    """One run as the page needs it: where it came from, its label, summary.json and (if present) traces.json."""

    path: Path
    summary: dict[str, Any]
    traces: list[dict[str, Any]] | None = None
    label: str = ""
    notes: list[str] = field(default_factory=list)


def load_run(path: str | Path) -> Run:
    """Read a run directory written by ``workbench run --out``; ``RunDirError`` (one line) if it is not one."""
    path = Path(path)
    expected = "a run directory written by `workbench run --out DIR` (with summary.json)"
    if not path.exists():
        raise RunDirError(f"{path}: no such directory; expected {expected}")
    if not path.is_dir():
        raise RunDirError(f"{path} is not a directory; expected {expected}")
    summary_path = path / "summary.json"
    if not summary_path.is_file():
        raise RunDirError(f"{path} has no summary.json; expected {expected}")
    try:
        summary = json.loads(summary_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunDirError(f"{summary_path} is not valid JSON ({exc}); expected the summary `workbench run` "
                          f"writes") from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(summary, dict) or k not in summary]
    if missing:
        raise RunDirError(f"{summary_path} lacks {', '.join(missing)}; expected the summary `workbench run` writes")
    if not summary["history"]:
        raise RunDirError(f"{summary_path} records no step (empty history); expected a run of at least one step")
    run = Run(path=path, summary=summary)
    run.traces = _load_traces(path / "traces.json", run.notes)
    return run


def _load_traces(path: Path, notes: list[str]) -> list[dict[str, Any]] | None:
    """traces.json if present and readable, else None with a note (the page then leaves that run's bytes out)."""
    if not path.is_file():
        notes.append(f"{path.parent}: no traces.json, so no bytes per collective for this run")
        return None
    try:
        traces = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        notes.append(f"{path} is not valid JSON ({exc}): bytes per collective left out")
        return None
    if not isinstance(traces, list) or not all(isinstance(t, dict) and "comms" in t for t in traces):
        notes.append(f"{path} is not a list of per-rank traces: bytes per collective left out")
        return None
    return traces


def load_runs(paths: Sequence[str | Path]) -> list[Run]:
    """Every run, checked before anything is drawn, each labelled ``N. folder: strategy`` (unique by N)."""
    if not paths:
        raise RunDirError("no run directory given; expected at least one directory written by `workbench run --out`")
    runs = [load_run(p) for p in paths]
    for i, run in enumerate(runs, start=1):
        run.label = f"{i}. {run.path.resolve().name}: {run.summary['strategy']}"
    return runs


# ---------------------------------------------------------------------------------------------------------
# What is compared.


def peak_memory(summary: dict[str, Any]) -> dict[str, int]:
    """Per ledger category, the largest peak over the run's ranks (bytes)."""
    out: dict[str, int] = {}
    for per_rank in summary.get("memory_peak_bytes") or ():
        for category, nbytes in (per_rank or {}).items():
            out[category] = max(out.get(category, 0), int(nbytes))
    return out


def bytes_per_collective(traces: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per collective (op), the bytes (summed tensor sizes) the busiest rank moved per traced step, averaged over
    the traced steps. Set-up traffic (no step) is left out."""
    steps = {c["step"] for t in traces for c in t["comms"] if c.get("step") is not None}
    if not steps:
        return {}
    per_rank: dict[str, dict[int, float]] = {}
    for t in traces:
        for c in t["comms"]:
            if c.get("step") is not None:
                by_rank = per_rank.setdefault(c["op"], {})
                by_rank[t["rank"]] = by_rank.get(t["rank"], 0.0) + c["nbytes"]
    return {op: max(by_rank.values()) / len(steps) for op, by_rank in sorted(per_rank.items())}


def run_row(run: Run) -> dict[str, Any]:
    """The headline numbers of one run (one row of the page's first table)."""
    s, config = run.summary, run.summary["config"]
    memory = peak_memory(s)
    return {"run": run.label, "directory": str(run.path), "ranks": config.get("nproc"),
            "mesh": " x ".join(f"{k}={v}" for k, v in (s.get("mesh") or {}).items() if v > 1) or "1 rank",
            "steps": len(s["history"]), "final loss": float(s["losses"][-1]),
            "median step time (ms)": float(s["step_time_s"]) * 1e3, "median tokens/s": float(s["tokens_per_s"]),
            "peak memory, sum of category peaks, fullest rank (MiB)": _fullest_rank(s) / 2**20,
            "categories": ", ".join(c for c in MEMORY_CATEGORIES if memory.get(c))}


def _fullest_rank(summary: dict[str, Any]) -> int:
    return max((sum(per_rank.values()) for per_rank in summary.get("memory_peak_bytes") or () if per_rank), default=0)


def config_differences(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """The settings whose values differ between the runs, one row per setting, one column per run."""
    keys: list[str] = []
    for run in runs:
        keys += [k for k in run.summary["config"] if k not in keys and k not in _NOT_A_DIFFERENCE]
    rows = []
    for key in keys:
        values = [run.summary["config"].get(key, "(absent)") for run in runs]
        if len(runs) == 1 or any(v != values[0] for v in values):
            rows.append({"setting": key, **{run.label: v for run, v in zip(runs, values, strict=True)}})
    return rows


def compare_data(runs: Sequence[Run]) -> dict[str, Any]:
    """Everything the page shows, as plain data (embedded in the page as JSON for tests and tools)."""
    return {"runs": [{**run_row(run), "strategy": run.summary["strategy"], "config": run.summary["config"],
                      "losses": run.summary["losses"], "peak_memory_bytes": peak_memory(run.summary),
                      "bytes_per_collective": bytes_per_collective(run.traces) if run.traces is not None else None}
                     for run in runs],
            "differences": config_differences(runs)}


# ---------------------------------------------------------------------------------------------------------
# Figures.


def loss_overlay(runs: Sequence[Run]) -> go.Figure:
    """Every run's global-batch loss per step on one pair of axes."""
    fig = go.Figure()
    for run in runs:
        history = run.summary["history"]
        fig.add_trace(go.Scatter(x=[m["step"] for m in history], y=[m["loss"] for m in history],
                                 mode="lines", name=run.label))
    fig.update_layout(title="global-batch loss per step", xaxis_title="step", yaxis_title="loss", height=380,
                      legend={"orientation": "h", "y": -0.25})
    return fig


def speed_bars(runs: Sequence[Run]) -> go.Figure:
    """Median step time and median tokens/s per run (medians leave out the first, warm-up step)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("median step time (ms)", "median tokens/s"))
    labels = [run.label for run in runs]
    fig.add_trace(go.Bar(x=labels, y=[run.summary["step_time_s"] * 1e3 for run in runs], name="step time",
                         marker_color="#4C78A8"), row=1, col=1)
    fig.add_trace(go.Bar(x=labels, y=[run.summary["tokens_per_s"] for run in runs], name="tokens/s",
                         marker_color="#F58518"), row=1, col=2)
    fig.update_layout(height=380, showlegend=False)
    return fig


def memory_bars(runs: Sequence[Run]) -> go.Figure:
    """Peak bytes per ledger category (the fullest rank's peak of each), one bar per run."""
    peaks = [peak_memory(run.summary) for run in runs]
    categories = [c for c in MEMORY_CATEGORIES if any(p.get(c) for p in peaks)]
    fig = go.Figure([go.Bar(name=run.label, x=categories, y=[p.get(c, 0) / 2**20 for c in categories])
                     for run, p in zip(runs, peaks, strict=True)])
    fig.update_layout(barmode="group", title="peak memory per category (ledger; the fullest rank's peak of each)",
                      yaxis_title="MiB", height=380, legend={"orientation": "h", "y": -0.25})
    return fig


def comm_bars(runs: Sequence[Run]) -> go.Figure:
    """Bytes per collective per traced step on the busiest rank, one bar per run that has traces."""
    measured = [(run, bytes_per_collective(run.traces)) for run in runs if run.traces is not None]
    ops = sorted({op for _, per_op in measured for op in per_op})
    fig = go.Figure([go.Bar(name=run.label, x=ops, y=[per_op.get(op, 0.0) / 2**10 for op in ops])
                     for run, per_op in measured])
    fig.update_layout(barmode="group", title="bytes moved per collective per traced step (busiest rank)",
                      yaxis_title="KiB (summed tensor sizes)", height=380, legend={"orientation": "h", "y": -0.25})
    return fig


# ---------------------------------------------------------------------------------------------------------
# The page.


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return html.escape(json.dumps(v) if isinstance(v, dict | list | bool) or v is None else str(v))


def _table(rows: Sequence[dict[str, Any]], empty: str) -> str:
    if not rows:
        return f"<p>{html.escape(empty)}</p>"
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row.values()) + "</tr>" for row in rows)
    return f"<table border=1 cellpadding=4 style='border-collapse:collapse'><tr>{head}</tr>{body}</table>"


def _comm_rows(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run with traces, one column per collective any of them used (KiB per traced step)."""
    measured = [r for r in runs if r["bytes_per_collective"] is not None]
    ops = sorted({op for r in measured for op in r["bytes_per_collective"]})
    return [{"run": r["run"], **{op: r["bytes_per_collective"].get(op, 0.0) / 2**10 for op in ops}} for r in measured]


def compare_html(runs: Sequence[Run]) -> str:
    """The whole page: headline table, differences, and the four figures (plotly.js inlined once)."""
    from workbench.viz.report import embedded_json, figure_html

    data = compare_data(runs)
    notes = [note for run in runs for note in run.notes]
    parts = [f"<h1>workbench: {len(runs)} run(s) side by side</h1>",
             _table([run_row(run) for run in runs], "(no run)"),
             "<h2>settings that differ</h2>",
             _table(data["differences"], "(the runs share every setting)")]
    figures = [loss_overlay(runs), speed_bars(runs), memory_bars(runs), comm_bars(runs)]
    parts += [figure_html(fig, with_plotlyjs=(i == 0)) for i, fig in enumerate(figures)]
    parts += ["<h2>bytes moved per collective per traced step (busiest rank, KiB)</h2>",
              _table(_comm_rows(data["runs"]), "(no run has traces.json)")]
    if notes:
        parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
    parts.append("<p>Step time and tokens/s are medians over each run's steps after the first (warm-up), "
                 "wall-clock on the machine the run used: compare runs from one machine.</p>")
    parts.append(embedded_json("workbench-compare-data", data))
    return ("<html><head><meta charset='utf-8'><title>workbench: runs compared</title></head><body>"
            + "\n".join(parts) + "</body></html>")


def write_compare(out: str | Path, paths: Sequence[str | Path]) -> Path:
    """Check every run directory, then write the comparison page to ``out`` (its folder is created)."""
    runs = load_runs(paths)
    out = Path(out)
    if out.is_dir():
        raise RunDirError(f"--out {out} is a directory; expected a file path such as {out / 'report-compare.html'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(compare_html(runs))
    return out


__all__ = ["REQUIRED_KEYS", "Run", "RunDirError", "bytes_per_collective", "compare_data", "compare_html",
           "config_differences", "load_run", "load_runs", "peak_memory", "write_compare"]
