import os
import sys
from pathlib import Path

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
    config.addinivalue_line("markers", "docker: builds docker/Dockerfile and runs the image (starts dockerd where "
                                       "none runs); runs with `-m docker`, as .ci/run does last")


#: Notebooks the test command's nbval run leaves to the extended lane, where tests/test_notebook_overrides.py runs
#: them top to bottom under papermill with their asserts: notebook 16 launches ranks five times over three
#: invocations with resharded resumes (about 65 s on 2 cores) and notebook 11 runs four faulted runs (about 25 s),
#: which the 20-minute test command has no room for (20m57 with them at 44b91e5 on a quiet 2-core machine).
NOTEBOOKS_IN_EXTENDED_LANE = {"11_training_health.ipynb", "16_elastic_training.ipynb"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The extended and docker lanes run only when asked for: they would push the README's test command past 20
    minutes."""
    markexpr = config.getoption("markexpr") or ""
    for item in items:  # notebooks whose nbval run belongs to the extended lane (papermill runs them there)
        if Path(str(item.fspath)).name in NOTEBOOKS_IN_EXTENDED_LANE:
            item.add_marker(pytest.mark.extended)
    # The docker lane builds an image (minutes): only when asked for, like the extended lane.
    for lane in ("extended", "docker"):
        if lane in markexpr:
            continue
        skip = pytest.mark.skip(reason=f"{lane} lane: run it with `python -m pytest -q -m {lane}` (.ci/run does)")
        for item in items:
            if item.get_closest_marker(lane) is not None:
                item.add_marker(skip)
