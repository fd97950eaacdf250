"""`workbench labs list | start | check`: a learner copies a lab, and a headless run grades each exercise with
the checker's pointed message; exit status 0 only when all pass (usable by CI or an autograder)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.labs import LabCheckFailed, grading

pytestmark = pytest.mark.timeout(600)
LABS = Path(__file__).resolve().parent.parent / "labs"


def test_list_names_every_lab(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["labs", "list"]) == 0
    out = capsys.readouterr().out
    for lab in LABS.glob("*.ipynb"):
        assert lab.stem in out
    assert "Lab 02 — ring all-reduce" in out


def test_start_copies_and_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["labs", "start", "02", str(tmp_path)]) == 0
    copy = tmp_path / "02_ring_allreduce.ipynb"
    assert copy.read_bytes() == (LABS / copy.name).read_bytes()
    assert "workbench labs check" in capsys.readouterr().out
    for argv, message in ((["labs", "start", "ring_allreduce", str(tmp_path)], "exists (your work?)"),
                          (["labs", "start", "99", str(tmp_path)], "no lab '99'; valid: 02_ring_allreduce")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err


def _with_solution(tmp_path: Path) -> Path:
    """The learner's copy with the reference solution switched on (and the solutions beside it)."""
    copy = grading.start("02", tmp_path)
    shutil.copytree(LABS / "solutions", tmp_path / "solutions")
    nb = json.loads(copy.read_text())
    params = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    params["source"] = "".join(params["source"]).replace("USE_SOLUTION = False", "USE_SOLUTION = True")
    copy.write_text(json.dumps(nb))
    return copy


@pytest.mark.extended  # runs lab 02's cells: the extended lane (each tests/test_lab_*.py grades its stub)
def test_check_grades_the_stub_as_failed_with_the_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = grading.start("02", tmp_path)
    assert main(["labs", "check", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  exercise (cell" in out and "check(ring_all_reduce)" in out
    assert "your function is still the stub" in out and "hint(1)" in out
    assert "0 of 1 exercise(s) passed" in out
    assert "Traceback" not in out.split("FAIL  cell")[0], "an exercise's verdict is the pointed message alone"


@pytest.mark.extended  # lab 02 with its solution: the extended lane (tests/test_lab_ring_allreduce.py: its checker)
def test_check_passes_the_reference_solution(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["labs", "check", str(_with_solution(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "PASS  exercise" in out and "1 of 1 exercise(s) passed" in out and "FAIL" not in out


def test_check_refuses_what_is_not_a_notebook(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["labs", "check", str(tmp_path / "missing.ipynb")])
    assert info.value.code == 2 and "is not a notebook file" in capsys.readouterr().err


def test_a_failed_check_renders_as_its_message_in_the_notebook() -> None:
    [shown] = LabCheckFailed("off by one chunk")._render_traceback_()
    assert shown.endswith("LabCheckFailed\x1b[0m: off by one chunk")
