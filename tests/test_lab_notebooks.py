"""Every lab notebook runs top to bottom with its solution filled in, and its untouched stub fails the
checker with a hint (a LabCheckFailed, not a crash or a hang)."""

from __future__ import annotations

from pathlib import Path

import pytest

papermill = pytest.importorskip("papermill")

LABS = sorted((Path(__file__).resolve().parent.parent / "labs").glob("*.ipynb"))
pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_passes_with_solution(lab: Path, tmp_path: Path) -> None:
    papermill.execute_notebook(str(lab), str(tmp_path / lab.name), parameters={"USE_SOLUTION": True},
                               cwd=str(lab.parent), progress_bar=False, kernel_name="python3")


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_lab_stub_fails_checker_with_hint(lab: Path, tmp_path: Path) -> None:
    with pytest.raises(papermill.PapermillExecutionError) as info:
        papermill.execute_notebook(str(lab), str(tmp_path / lab.name), parameters={"USE_SOLUTION": False},
                                   cwd=str(lab.parent), progress_bar=False, kernel_name="python3")
    assert info.value.ename == "LabCheckFailed", f"{info.value.ename}: {info.value.evalue}"
    assert len(info.value.evalue) > 20, "the hint should say what to do"
