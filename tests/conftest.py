import os
import sys

import pytest

# Tests import the shared helpers in this folder (tests/equivalence.py) by module name.
sys.path.insert(0, os.path.dirname(__file__))

# The CPU suite runs its ranks on the CPU on every machine (a GPU machine too), so its results do not
# depend on what hardware is there; tests marked `gpu` ask for CUDA explicitly.
os.environ.setdefault("WORKBENCH_DEVICE", "cpu")
# Notebooks run with their predictions left None, headless (nbval, papermill) and in the browser test's JupyterLab
# too, which would otherwise stop at the first one (workbench.predictions.predictions_required).
os.environ.setdefault("WORKBENCH_PREDICTIONS", "optional")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped with the reason where no GPU is visible")
    config.addinivalue_line("markers", "extended: the extended lane (every notebook again, with small overrides, "
                                       "the browser and the longest end-to-end runs); runs with `-m extended`, as "
                                       ".ci/run does after the README's test command")
    config.addinivalue_line("markers", "numerics: compares computations that sum in another order (ranks vs one "
                                       "process, shards, collectives); .ci/run runs them again under "
                                       "ATEN_CPU_CAPABILITY=default, the portable instruction set")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The extended lane runs only when asked for: it would push the README's test command past 20 minutes."""
    if "extended" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="extended lane: run it with `python -m pytest -q -m extended` (.ci/run does)")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)
