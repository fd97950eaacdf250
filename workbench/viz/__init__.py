"""Plotly figures drawn from trace records and theory (never from torch.distributed)."""

from workbench.viz.timeline import comm_table, timeline

__all__ = ["timeline", "comm_table"]
