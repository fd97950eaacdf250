"""Plotly figures drawn from trace records and theory (never from torch.distributed)."""

from workbench.viz.timeline import comm_table, steps_only, timeline

__all__ = ["timeline", "comm_table", "steps_only"]
