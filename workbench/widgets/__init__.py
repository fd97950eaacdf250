"""Interactive ipywidgets for the notebooks; they compute with `workbench.theory` and draw with `viz`."""

from workbench.widgets.memory_calculator import calculator_table, memory_calculator

__all__ = ["calculator_table", "memory_calculator"]
