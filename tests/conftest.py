import os
import sys

import pytest

# Tests import the shared helpers in this folder (tests/equivalence.py) by module name.
sys.path.insert(0, os.path.dirname(__file__))

# The CPU suite runs its ranks on the CPU on every machine (a GPU machine too), so its results do not
# depend on what hardware is there; tests marked `gpu` ask for CUDA explicitly.
os.environ.setdefault("WORKBENCH_DEVICE", "cpu")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped with the reason where no GPU is visible")
