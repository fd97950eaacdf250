"""The Megatron MLP split drawn to scale: which rank holds which slice of which matrix.

Shoeybi et al. 2019 (Megatron-LM) §3, for Z = GeLU(X A) B with X [T, h] (T = b·s tokens), A [h, 4h], B [4h, h]:

    column-parallel fc:  X · A_r = Y_r     A_r: A's r-th block of columns [h, 4h/tp]  (rows of fc.weight)
    row-parallel proj:   Y_r · B_r = Z_r   B_r: B's r-th block of rows [4h/tp, h]     (columns of proj.weight)
    g:                   Z = Σ_r Z_r       one all-reduce of T·h values

``mlp_split_shapes`` says it in numbers (what each rank's parameters are, as slices of nn.Linear's
[out, in] weights); ``mlp_split_figure`` draws the same, every rectangle to scale, coloured by the rank
that holds it (grey: whole on every rank). Both come from the sizes alone, so a notebook can draw the
model it runs and check the drawing against the shapes its ranks report.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

RANK_COLOURS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#9D755D")
REPLICATED = "#BAB0AC"


def _check(d_model: int, hidden: int, tp: int, tokens: int) -> None:
    for name, value in (("d_model", d_model), ("hidden", hidden), ("tp", tp), ("tokens", tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if hidden % tp:
        valid = [t for t in range(1, hidden + 1) if hidden % t == 0]
        raise ValueError(f"the MLP's hidden width {hidden} is not divisible by tp={tp}; valid tp: {valid}")


def mlp_split_shapes(d_model: int, hidden: int, tp: int) -> list[dict[str, dict[str, Any]]]:
    """Per rank, each MLP parameter's local shape and the slice of the full nn.Linear tensor it is.

    ``[{"mlp.fc.weight": {"shape": (hidden/tp, d_model), "rows": (start, stop), "cols": None}, ...}, ...]``:
    fc (column-parallel) keeps a block of rows of its [hidden, d_model] weight and the same block of its bias;
    proj (row-parallel) keeps a block of columns of its [d_model, hidden] weight and its whole bias."""
    _check(d_model, hidden, tp, 1)
    n = hidden // tp
    out = []
    for r in range(tp):
        block = (r * n, (r + 1) * n)
        out.append({
            "mlp.fc.weight": {"shape": (n, d_model), "rows": block, "cols": None},
            "mlp.fc.bias": {"shape": (n,), "rows": block, "cols": None},
            "mlp.proj.weight": {"shape": (d_model, n), "rows": None, "cols": block},
            "mlp.proj.bias": {"shape": (d_model,), "rows": None, "cols": None},
        })
    return out


def _rect(fig: go.Figure, x0: float, y0: float, w: float, h: float, colour: str, hover: str,
          hovers: list[tuple[float, float, str]]) -> None:
    fig.add_shape(type="rect", x0=x0, y0=y0, x1=x0 + w, y1=y0 + h, fillcolor=colour, opacity=0.85,
                  line={"color": "white", "width": 1})
    hovers.append((x0 + w / 2, y0 + h / 2, hover))


def _label(fig: go.Figure, x: float, y: float, text: str, size: int = 11, anchor: str = "bottom") -> None:
    """Text centred at x; above y (``anchor="bottom"``) or centred on it (``"middle"``)."""
    fig.add_annotation(x=x, y=y, text=text, showarrow=False, font={"size": size}, yanchor=anchor)


def _split_columns(fig: go.Figure, x0: float, y0: float, width: int, height: int, tp: int, what: str,
                   hovers: list) -> None:
    """A [height, width] matrix whose columns are split in tp blocks, one colour per rank."""
    n = width // tp
    for r in range(tp):
        _rect(fig, x0 + r * n, y0, n, height, RANK_COLOURS[r % len(RANK_COLOURS)],
              f"rank {r}: {what} columns [{r * n}, {(r + 1) * n}) — [{height}, {n}]", hovers)


def _split_rows(fig: go.Figure, x0: float, y0: float, width: int, height: int, tp: int, what: str,
                hovers: list) -> None:
    n = height // tp
    for r in range(tp):
        _rect(fig, x0, y0 + r * n, width, n, RANK_COLOURS[r % len(RANK_COLOURS)],
              f"rank {r}: {what} rows [{r * n}, {(r + 1) * n}) — [{n}, {width}]", hovers)


def mlp_split_figure(d_model: int, hidden: int, tp: int, tokens: int, title: str | None = None) -> go.Figure:
    """Column-parallel fc then row-parallel proj, drawn to scale (one unit = one element).

    Top row: X [tokens, d_model] (grey: whole on every rank) · A = fc.weightᵀ [d_model, hidden], split in tp
    column blocks = Y [tokens, hidden], each rank holding its block of columns Y_r. Bottom row: Y_r · B_r, with
    B = proj.weightᵀ [hidden, d_model] split in tp row blocks, gives tp partial sums Z_r [tokens, d_model],
    which g all-reduces into Z (grey again). Hover a block for its slice and shape."""
    _check(d_model, hidden, tp, tokens)
    fig, hovers = go.Figure(), []
    gap, n = max(d_model, tokens), hidden // tp
    # Top row: X · A = Y.
    _rect(fig, 0, 0, d_model, tokens, REPLICATED, f"X [{tokens}, {d_model}]: whole on every rank", hovers)
    x_a = d_model + gap
    _split_columns(fig, x_a, 0, hidden, d_model, tp, "A = fc.weightᵀ", hovers)
    x_y = x_a + hidden + gap
    _split_columns(fig, x_y, 0, hidden, tokens, tp, "Y = GeLU(X·A)", hovers)
    top = max(tokens, d_model)
    _label(fig, d_model / 2, -4, f"X [{tokens}, {d_model}]<br>whole on every rank")
    _label(fig, x_a + hidden / 2, -4, f"A = fc.weightᵀ [{d_model}, {hidden}]<br>column-parallel: rank r holds "
                                       f"{n} columns")
    _label(fig, x_y + hidden / 2, -4, f"Y = GeLU(X·A) [{tokens}, {hidden}]<br>rank r holds Y_r [{tokens}, {n}]")
    _label(fig, d_model + gap / 2, top / 2, "·", 28, "middle")
    _label(fig, x_a + hidden + gap / 2, top / 2, "=", 22, "middle")
    # Bottom row: Y_r · B_r = Z_r, then g: Z = Σ_r Z_r.
    y0 = top + 3 * gap // 2 + 40
    _split_columns(fig, 0, y0, hidden, tokens, tp, "Y", hovers)
    x_b = hidden + gap
    _split_rows(fig, x_b, y0, d_model, hidden, tp, "B = proj.weightᵀ", hovers)
    x_z = x_b + d_model + gap
    for r in range(tp):
        _rect(fig, x_z, y0 + r * (tokens + 8), d_model, tokens, RANK_COLOURS[r % len(RANK_COLOURS)],
              f"rank {r}: Z_{r} = Y_{r}·B_{r}, a partial sum [{tokens}, {d_model}]", hovers)
    x_sum = x_z + d_model + gap
    _rect(fig, x_sum, y0, d_model, tokens, REPLICATED, f"Z = Σ_r Z_r [{tokens}, {d_model}]: after g, whole on "
          f"every rank; + proj.bias once", hovers)
    _label(fig, hidden / 2, y0 - 4, f"Y [{tokens}, {hidden}]<br>(fc's output, after GeLU)")
    _label(fig, x_b + d_model / 2, y0 - 4, f"B = proj.weightᵀ<br>[{hidden}, {d_model}]<br>row-parallel")
    _label(fig, x_z + d_model / 2, y0 - 4, f"Z_r = Y_r·B_r<br>[{tokens}, {d_model}]<br>partial sums")
    _label(fig, x_sum + d_model / 2, y0 - 4, f"Z [{tokens}, {d_model}]<br>whole again")
    _label(fig, hidden + gap / 2, y0 + tokens / 2, "·", 28, "middle")
    _label(fig, x_b + d_model + gap / 2, y0 + tokens / 2, "=", 22, "middle")
    _label(fig, x_z + d_model + gap / 2, y0 + tokens / 2, "g: Σ_r<br>(all-reduce)", 11, "middle")
    fig.add_trace(go.Scatter(x=[h[0] for h in hovers], y=[h[1] for h in hovers], mode="markers",
                             marker={"size": 1, "opacity": 0}, hovertext=[h[2] for h in hovers],
                             hoverinfo="text", showlegend=False))
    for r in range(tp):  # a legend entry per rank
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=f"rank {r}",
                                 marker={"size": 12, "symbol": "square", "color": RANK_COLOURS[r % len(RANK_COLOURS)]}))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="whole on every rank",
                             marker={"size": 12, "symbol": "square", "color": REPLICATED}))
    width = max(x_sum + d_model, x_y + hidden)
    height = y0 + max(hidden, tp * (tokens + 8))
    fig.update_xaxes(visible=False, range=[-8, width + 8])
    fig.update_yaxes(visible=False, range=[height + 8, -gap - 40], scaleanchor="x")
    fig.update_layout(title=title or f"MLP {d_model}→{hidden}→{d_model} over tp={tp}: column-parallel fc, "
                                     f"row-parallel proj ({tokens} tokens; to scale)",
                      plot_bgcolor="white", height=560, margin={"l": 10, "r": 10, "t": 50, "b": 10})
    return fig


__all__ = ["RANK_COLOURS", "mlp_split_figure", "mlp_split_shapes"]
