"""Interactive ipywidgets for the notebooks; they compute with `workbench.theory` and draw with `viz`."""

from workbench.widgets.dashboard import Dashboard, LiveRun, run_live
from workbench.widgets.memory_calculator import calculator_table, memory_calculator

__all__ = ["Dashboard", "LiveRun", "calculator_table", "memory_calculator", "run_live"]
