"""Every lab notebook's untouched stub fails the checker with a hint (a LabCheckFailed, not a crash or a hang),
and every lab runs top to bottom with its solution filled in.

The stubs run cell by cell in one shared kernel (cwd labs/, as papermill runs them), each lab from the kernel's
fresh namespace: kernel start and imports would otherwise be most of a stub's run. The solutions run in the
extended lane (``python -m pytest -q -m extended``, as ``.ci/run`` runs it), twice: in that shared kernel and
under papermill itself with small overrides, beside the notebooks' (``tests/test_notebook_overrides.py``); in
the test command each lab's own tests/test_lab_<name>.py grades its solution with its checker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

papermill = pytest.importorskip("papermill")

LABS = sorted((Path(__file__).resolve().parent.parent / "labs").glob("*.ipynb"))
pytestmark = pytest.mark.timeout(600)
CELL_TIMEOUT_S = 300

# lab number -> small overrides for the papermill run (each a parameter of that lab's parameters cell)
LAB_OVERRIDES: dict[str, dict] = {"10": {"DEMO_STEPS": 2}}


@pytest.fixture(scope="module")
def kernel() -> Iterator[object]:
    """One kernel for every lab; ``_FRESH_NAMES`` remembers its namespace as it started (``%reset -f`` would
    also drop ``__spec__``, which multiprocessing reads in ``__main__``)."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(LABS[0].parent))
    try:
        kc.execute_interactive("_FRESH_NAMES = set(globals()) | {'_FRESH_NAMES'}", timeout=60)
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _run_cells(kernel: object, lab: Path, use_solution: bool) -> dict | None:
    """Run ``lab``'s code cells in order (``USE_SOLUTION`` set after its parameters cell, as papermill injects
    it); the reply of the first cell that fails, or None when every cell ran."""
    kernel.execute_interactive("for _name in set(globals()) - _FRESH_NAMES: del globals()[_name]", timeout=60)
    for cell in nbformat.read(lab, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        source = cell.source
        if "parameters" in cell.metadata.get("tags", []):
            source += f"\nUSE_SOLUTION = {use_solution}"
        reply = kernel.execute_interactive(source, timeout=CELL_TIMEOUT_S, output_hook=lambda msg: None)["content"]
        if reply["status"] == "error":
            return reply
    return None


@pytest.mark.extended
@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_passes_with_solution(lab: Path, kernel: object) -> None:
    failed = _run_cells(kernel, lab, use_solution=True)
    assert failed is None, f"{lab.name} with its solution: {failed['ename']}: {failed['evalue']}"


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_stub_fails_checker_with_hint(lab: Path, kernel: object) -> None:
    """The untouched stub (USE_SOLUTION = False, the parameters cell's default) stops at its checker."""
    failed = _run_cells(kernel, lab, use_solution=False)
    assert failed is not None, f"{lab.name}: every cell ran with the stub; its checker should have failed"
    assert failed["ename"] == "LabCheckFailed", f"{failed['ename']}: {failed['evalue']}"
    assert len(failed["evalue"]) > 20, "the hint should say what to do"


@pytest.mark.extended
@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_runs_under_papermill_with_its_solution(lab: Path, tmp_path: Path) -> None:
    parameters = {"USE_SOLUTION": True, **LAB_OVERRIDES.get(lab.name[:2], {})}
    papermill.execute_notebook(str(lab), str(tmp_path / lab.name), parameters=parameters,
                               cwd=str(lab.parent), progress_bar=False, kernel_name="python3")
