"""Every notebook runs headless under papermill with small parameter overrides, as an instructor would run it
(issue 11, item 6): the parameters cell really steers the notebook, and the claims each notebook asserts (measured
equals theory, a run matches one process, ...) hold at other sizes than the defaults nbval runs.

The overrides are smaller than the defaults where the notebook allows it (fewer ranks, steps, sizes or repeats).
This second run of every notebook (about 3 minutes on 2 quiet cores) is the *extended lane*: it runs with
``python -m pytest -q -m extended`` (``.ci/run`` runs it after the README's test command, which it would push past
20 minutes). Labs run under papermill with their parameters in ``tests/test_lab_notebooks.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_notebook_hygiene import assigned_names, parameters_cells  # the hygiene test's reading of the cell

papermill = pytest.importorskip("papermill")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
pytestmark = pytest.mark.timeout(300)

# notebook number -> overrides (each must be a parameter of that notebook's parameters cell: papermill only warns
# about an unknown name, and the run would silently keep the default).
OVERRIDES: dict[str, dict] = {
    "00": {"WORLD_SIZE": 2, "CHUNK": 3},
    "01": {"BATCH_SIZES": [2, 4], "SEQ_LEN": 32},
    "02": {"WORLD_SIZE": 2, "NODE_SIZE": 1, "SIZES": [2 ** 10, 2 ** 14], "REPS": 2, "STEP_NUMEL": 4},
    "03": {"STEPS": 3, "BUCKET_SWEEP_MB": [0.1, 1.0], "SCALING_WORLDS": [1, 2]},
    "04": {"WORLD_SIZE": 2},
    "05": {"STEPS": 5, "USE_SOLUTION": True},  # the checked exercise with its reference solution
    "06": {"SEQ_LEN": 64, "STEPS": 3, "USE_SOLUTION": True},
    "07": {"TRAIN_STEPS": 2, "USE_SOLUTION": True},
    "08": {"STEPS": 3, "SWEEP_M": [2], "USE_SOLUTION": True},
    "09": {"STEPS": 2, "USE_SOLUTION": True},
    "10": {"STEPS": 6, "FAULT_STEP": 3, "SAVE_REPEATS": 1, "USE_SOLUTION": True},
    "11": {"STEPS": 28, "SDC_EVERY": 3, "NAN_STEP": 2},
    "12": {"SIZES": [2 ** 14, 2 ** 22], "REPS": 2, "STEPS": 3, "SCALING_WORLDS": [1, 4]},
    "13": {"STEPS": 4, "PS_WORKERS": [1, 2], "PS_STEPS": 3, "STRAGGLER_STEPS": 4, "LOCAL_STEPS": [1, 2]},
    "14": {"WORLD": 2, "SEQ_LEN": 64, "BALANCE_SEQ_LEN": 256, "REPS": 2, "STEPS": 3},
    "15": {"WORLD": 2, "ROUTE_CALLS": 20, "STEPS": 3, "TRAIN_BATCH": 4},
    "16": {"STEPS": 10, "LOSE_STEP": 2},
}


def _notebook(number: str) -> Path:
    (path,) = NOTEBOOKS.glob(f"{number}_*.ipynb")
    return path


def _parameter_names(path: Path) -> set[str]:
    """The names the ``parameters`` cell assigns (``DP, TP, PP = 2, 2, 2`` included)."""
    [(_, cell)] = parameters_cells(path)
    return set(assigned_names(cell.source))


def test_every_notebook_has_overrides_of_its_own_parameters() -> None:
    assert sorted(OVERRIDES) == sorted(p.name[:2] for p in NOTEBOOKS.glob("*.ipynb"))
    for number, overrides in OVERRIDES.items():
        known = _parameter_names(_notebook(number))
        unknown = sorted(set(overrides) - known)
        assert not unknown, f"{_notebook(number).name}: {unknown} are not in its parameters cell ({sorted(known)})"


@pytest.mark.extended
@pytest.mark.parametrize("number", sorted(OVERRIDES))
def test_notebook_runs_under_papermill_with_small_overrides(number: str, tmp_path: Path) -> None:
    source = _notebook(number)
    known = _parameter_names(source)
    unknown = sorted(set(OVERRIDES[number]) - known)
    assert not unknown, f"{source.name}: {unknown} are not in its parameters cell (it has {sorted(known)})"
    executed = papermill.execute_notebook(str(source), str(tmp_path / source.name), parameters=OVERRIDES[number],
                                          cwd=str(source.parent), progress_bar=False, kernel_name="python3")
    # A checked exercise's cell is tagged raises-exception (a learner's stub prints its hint and the run goes on), so
    # papermill would not fail on it: with the reference solution, no cell may have raised.
    errors = [i for i, cell in enumerate(executed.cells) if cell.cell_type == "code"
              and any(out.get("output_type") == "error" for out in cell.get("outputs", []))]
    assert not errors, f"{source.name}: cells {errors} raised with the overrides {OVERRIDES[number]}"


@pytest.mark.extended
def test_notebook_12_on_the_issue_cluster_2_nodes_x_4(tmp_path: Path) -> None:
    """Issue 20's 'done when' shape, 8 ranks as 2 nodes x 4 (nbval runs 2 x 2): about 2 minutes on 2 loaded cores.
    Every claim the notebook asserts holds at this shape too."""
    source = _notebook("12")
    papermill.execute_notebook(str(source), str(tmp_path / source.name), parameters={"RANKS_PER_NODE": 4},
                               cwd=str(source.parent), progress_bar=False, kernel_name="python3")
