"""Every lab notebook runs top to bottom with its solution filled in, and its untouched stub fails the
checker with a hint (a LabCheckFailed, not a crash or a hang)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

papermill = pytest.importorskip("papermill")

LABS = sorted((Path(__file__).resolve().parent.parent / "labs").glob("*.ipynb"))
pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_passes_with_solution(lab: Path, tmp_path: Path) -> None:
    papermill.execute_notebook(str(lab), str(tmp_path / lab.name), parameters={"USE_SOLUTION": True},
                               cwd=str(lab.parent), progress_bar=False, kernel_name="python3")


@pytest.fixture(scope="module")
def kernel() -> Iterator[object]:
    """One kernel for every stub (cwd labs/, as papermill runs them): a stub stops at its first check, so the run
    is mostly kernel start and imports; each lab starts from the kernel's fresh namespace (not ``%reset -f``: it
    also drops ``__spec__``, which multiprocessing reads in ``__main__``)."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(LABS[0].parent))
    try:
        kc.execute_interactive("_FRESH_NAMES = set(globals()) | {'_FRESH_NAMES'}", timeout=60)
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_stub_fails_checker_with_hint(lab: Path, kernel: object) -> None:
    """The untouched stub (USE_SOLUTION = False, the parameters cell's default), cell by cell until one fails."""
    import nbformat

    kernel.execute_interactive("for _name in set(globals()) - _FRESH_NAMES: del globals()[_name]", timeout=60)
    for cell in nbformat.read(lab, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        reply = kernel.execute_interactive(cell.source, timeout=300, output_hook=lambda msg: None)["content"]
        if reply["status"] == "error":
            assert reply["ename"] == "LabCheckFailed", f"{reply['ename']}: {reply['evalue']}"
            assert len(reply["evalue"]) > 20, "the hint should say what to do"
            return
    pytest.fail(f"{lab.name}: every cell ran with the stub; its checker should have failed")
