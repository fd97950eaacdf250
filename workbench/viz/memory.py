"""Plotly figures of per-rank memory by category: predicted, measured, and the two side by side.

Inputs are plain dicts {config: {category: bytes}}, as returned by `workbench.theory.memory` and by the
tracer's memory ledger, so these figures never touch torch. Each category keeps one colour in every
figure of the course, so "optimizer_state" is the same orange in notebook 01 and notebook 04.
"""

from __future__ import annotations

import plotly.graph_objects as go

from workbench.theory.memory import BYTE_UNITS, to_unit

# Fixed colours for the categories of theory and of the trace ledger (Plotly's qualitative palette).
CATEGORY_COLORS: dict[str, str] = {
    "parameters": "#636EFA",
    "gradients": "#EF553B",
    "master_weights": "#AB63FA",
    "optimizer_state": "#FFA15A",
    "activations": "#00CC96",
    "comm_buffers": "#19D3F3",
    "gathered_params": "#FF6692",
    "other": "#B6E880",
}
_SPARE_COLORS = ("#FF97FF", "#FECB52", "#8C564B", "#7F7F7F", "#17BECF", "#BCBD22")


def category_color(category: str, seen: list[str] | None = None) -> str:
    """Colour of a category: fixed for known names, else a spare colour by order of first appearance."""
    if category in CATEGORY_COLORS:
        return CATEGORY_COLORS[category]
    unknown = [c for c in (seen or [category]) if c not in CATEGORY_COLORS]
    index = unknown.index(category) if category in unknown else 0
    return _SPARE_COLORS[index % len(_SPARE_COLORS)]


def _categories(*tables: dict[str, dict[str, float]]) -> list[str]:
    """All categories in the tables: known ones in canonical order first, then others as met."""
    found: list[str] = []
    for table in tables:
        for row in table.values():
            found.extend(c for c in row if c not in found)
    known = [c for c in CATEGORY_COLORS if c in found]
    return known + [c for c in found if c not in CATEGORY_COLORS]


def _check_unit(unit: str) -> None:
    if unit not in BYTE_UNITS:
        raise ValueError(f"unknown unit {unit!r}; valid choices: {', '.join(BYTE_UNITS)}")


def memory_bars(
    per_config: dict[str, dict[str, float]],
    title: str = "Memory per rank",
    unit: str = "MiB",
) -> go.Figure:
    """Stacked bars, one per config (e.g. "ZeRO-0".."ZeRO-3"), one colour per category; values in bytes."""
    _check_unit(unit)
    configs = list(per_config)
    categories = _categories(per_config)
    fig = go.Figure()
    for cat in categories:
        values = [to_unit(per_config[c].get(cat, 0.0), unit) for c in configs]
        fig.add_bar(name=cat, x=configs, y=values, marker_color=category_color(cat, categories),
                    hovertemplate=f"%{{x}}<br>{cat}: %{{y:.3g}} {unit}<extra></extra>")
    totals = [to_unit(sum(per_config[c].values()), unit) for c in configs]
    fig.add_scatter(x=configs, y=totals, mode="text", text=[f"{t:.3g}" for t in totals],
                    textposition="top center", showlegend=False, hoverinfo="skip")
    fig.update_layout(barmode="stack", title=title, yaxis_title=f"{unit} per rank",
                      legend_title_text="category", legend_traceorder="normal")
    return fig


def measured_vs_theory(
    measured: dict[str, dict[str, float]],
    theory: dict[str, dict[str, float]],
    title: str = "Memory per rank: measured vs theory",
    unit: str = "MiB",
) -> go.Figure:
    """For each config a stacked "measured" bar beside a stacked, hatched "theory" bar.

    A two-level x axis (config, kind) keeps each pair together while plain stacking works, which
    plotly's offsetgroup does not combine with. Configs are those of `theory`, then any only measured.
    """
    _check_unit(unit)
    configs = list(theory) + [c for c in measured if c not in theory]
    categories = _categories(measured, theory)
    x_outer = [c for c in configs for _ in (0, 1)]
    x_inner = ["measured", "theory"] * len(configs)
    fig = go.Figure()
    for cat in categories:
        values = []
        for config in configs:
            values.append(to_unit(measured.get(config, {}).get(cat, 0.0), unit))
            values.append(to_unit(theory.get(config, {}).get(cat, 0.0), unit))
        fig.add_bar(name=cat, x=[x_outer, x_inner], y=values, marker_color=category_color(cat, categories),
                    marker_pattern_shape=["", "/"] * len(configs),
                    hovertemplate=f"%{{x}}<br>{cat}: %{{y:.3g}} {unit}<extra></extra>")
    fig.update_layout(barmode="stack", title=title, yaxis_title=f"{unit} per rank",
                      legend_title_text="category (theory hatched)", legend_traceorder="normal")
    return fig


__all__ = ["CATEGORY_COLORS", "category_color", "measured_vs_theory", "memory_bars"]
