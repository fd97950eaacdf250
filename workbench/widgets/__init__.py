"""Interactive ipywidgets for the notebooks; they compute with `workbench.theory` and draw with `viz`."""

from workbench.widgets.dashboard import Dashboard
from workbench.widgets.memory_calculator import calculator_table, memory_calculator

# The live run behind a Dashboard (LiveRun, run_live) moved to workbench.run: widgets draw, they start no ranks.
__all__ = ["Dashboard", "calculator_table", "memory_calculator"]
