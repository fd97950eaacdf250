"""The labs under nbgrader (issue 25, item 7): ``workbench labs export --nbgrader DIR`` writes an nbgrader course
source from the labs and their reference solutions, with no second copy of a lab kept anywhere.

Fast here: every lab exports; nbgrader's own ClearSolutions, run on each source notebook, gives back exactly the
lab's stub (so the release is the lab a learner knows, and no line of a solution is left in it); the checkers are
the graded cells, with their points; the export refuses, naming what is missing, where the solutions are not.
Extended lane: ``nbgrader generate_assignment``, ``autograde`` and ``generate_feedback`` on two labs in a temporary
course, where the reference solution scores full marks and the untouched stub zero (minutes: every submission runs
the whole lab on real ranks).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from workbench.cli import main
from workbench.labs import grading
from workbench.labs.nbgrader_export import BEGIN, CONFIG_NAME, END, export, source_notebook

LABS = Path(__file__).resolve().parent.parent / "labs"
SOLUTIONS = LABS / "solutions"
pytestmark = pytest.mark.timeout(300)


def _nbgrader(cell: nbformat.NotebookNode) -> dict:
    return cell.metadata.get("nbgrader", {})


def _release(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """What ``nbgrader generate_assignment`` makes of the solution cells: nbgrader's own preprocessor, run here
    with the code stub the export's nbgrader_config.py sets."""
    from nbgrader.preprocessors import ClearSolutions
    from traitlets.config import Config

    config = Config()
    config.ClearSolutions.code_stub = {"python": "# (your answer goes in the stub above)"}
    released, _ = ClearSolutions(config=config).preprocess(nbformat.from_dict(nb), {})
    return released


@pytest.mark.parametrize("lab", sorted(LABS.glob("*.ipynb")), ids=lambda p: p.stem[:2])
def test_every_lab_exports_and_its_release_is_the_lab_itself(lab: Path) -> None:
    original = nbformat.read(lab, as_version=4)
    source = source_notebook(lab, SOLUTIONS, points=3)
    answers = [c for c in source.cells if _nbgrader(c).get("solution")]
    tests = [c for c in source.cells if _nbgrader(c).get("grade")]
    assert answers and all(BEGIN in c.source and END in c.source for c in answers)
    for cell in answers:  # each solution region runs as Python (no `from __future__` left in mid-cell)
        ast.parse(cell.source)
    # The graded cells are the checker calls `workbench labs check` grades, each worth the points asked for.
    want = [c.source for c in original.cells if c.cell_type == "code" and grading.EXERCISE.search(c.source)]
    assert [c.source for c in tests] == want and all(_nbgrader(c)["points"] == 3 for c in tests)
    assert "USE_SOLUTION" not in "".join(c.source for c in source.cells), "the release has no solutions to import"
    # The release: every stub cell exactly as in the lab, then the stub comment; every other cell unchanged.
    kept = [c for c in original.cells if "USE_SOLUTION" not in c.source or "parameters" in c.metadata.get("tags", [])]
    released = _release(source).cells
    for before, after in zip(kept, released, strict=True):  # strict: no cell added or lost
        if _nbgrader(after).get("solution"):
            assert after.source.startswith(before.source.rstrip() + "\n")
            assert after.source.endswith("# (your answer goes in the stub above)")
            assert BEGIN not in after.source
        elif "parameters" in before.metadata.get("tags", []):
            assert after.source == "\n".join(line for line in before.source.splitlines()
                                             if not line.startswith("USE_SOLUTION"))
        else:
            assert after.source == before.source


def test_the_solution_regions_hold_the_reference_solution() -> None:
    """Lab 02's region is the solution module's function (docstring and `from __future__` left out), so the
    source notebook passes the checker where the module does."""
    source = source_notebook(LABS / "02_ring_allreduce.ipynb", SOLUTIONS)
    [answer] = [c for c in source.cells if _nbgrader(c).get("solution")]
    region = answer.source.split(BEGIN + "\n")[1].split("\n" + END)[0]
    module = (SOLUTIONS / "ring_allreduce.py").read_text()
    assert module.split("\n\n\ndef ring_all_reduce")[1].strip() in region
    assert "from __future__" not in region and "Reference solution of lab 02" not in region


def test_export_writes_the_course_source_and_keeps_an_instructors_files(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["labs", "export", "--nbgrader", str(tmp_path), "02", "14", "--points", "2"]) == 0
    out = capsys.readouterr().out
    notebooks = sorted(tmp_path.glob("source/*/*.ipynb"))
    assert [p.relative_to(tmp_path / "source").as_posix() for p in notebooks] == [
        "02_ring_allreduce/02_ring_allreduce.ipynb", "14_online_softmax_merge/14_online_softmax_merge.ipynb"]
    assert "nbgrader generate_assignment 02_ring_allreduce" in out
    config = (tmp_path / CONFIG_NAME).read_text()
    assert "c.ClearSolutions.code_stub" in config and "c.Execute.timeout = 600" in config
    # An instructor's config is never replaced; a source notebook only with --force.
    (tmp_path / CONFIG_NAME).write_text("c = get_config()\n")
    with pytest.raises(SystemExit) as info:
        main(["labs", "export", "--nbgrader", str(tmp_path), "02"])
    assert info.value.code == 2 and "pass --force to overwrite" in capsys.readouterr().err
    assert export(tmp_path, ["02"], force=True) == [notebooks[0]]
    assert (tmp_path / CONFIG_NAME).read_text() == "c = get_config()\n"


def test_export_refuses_without_the_solutions(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """As from a wheel install: the labs are there, their solutions are not (they never ship)."""
    labs = tmp_path / "labs"
    labs.mkdir()
    for lab in LABS.glob("*.ipynb"):
        shutil.copy(lab, labs)
    monkeypatch.setenv("WORKBENCH_LABS", str(labs))
    with pytest.raises(SystemExit) as info:
        main(["labs", "export", "--nbgrader", str(tmp_path / "course")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"reference solutions are not in {labs / 'solutions'}" in err
    assert "--solutions" in err and not (tmp_path / "course").exists()
    # --solutions names them; a folder without the lab's module is refused by name.
    assert export(tmp_path / "course", ["14"], solutions=SOLUTIONS)
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(SOLUTIONS / "online_softmax.py", partial)
    with pytest.raises(FileNotFoundError, match=r"ring_allreduce\.py is missing: lab 02_ring_allreduce"):
        export(tmp_path / "other", ["02"], solutions=partial)


def _nbgrader_cli(args: list[str], course: Path, timeout: float) -> None:
    # The venv's nbgrader, run as a module (its console script may not be on PATH).
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "WORKBENCH_PREDICTIONS": "optional"})
    assert done.returncode == 0, f"nbgrader {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}"


@pytest.mark.extended  # two labs, two submissions each, every one run whole on real ranks: minutes on 2 cores
@pytest.mark.timeout(1500)
def test_nbgrader_autogrades_the_solution_full_and_the_stub_zero(tmp_path: Path) -> None:
    from nbgrader.api import Gradebook

    labs = ["02_ring_allreduce", "14_online_softmax_merge"]  # ranks and collectives; a pure-tensor lab
    course = tmp_path / "course"
    export(course, labs, points=2)
    for lab in labs:
        _nbgrader_cli(["generate_assignment", lab], course, timeout=300)
        release = course / "release" / lab / f"{lab}.ipynb"
        assert BEGIN not in release.read_text() and "from typing import Any" not in release.read_text()
        for student, notebook in (("reference", course / "source" / lab / f"{lab}.ipynb"), ("stub", release)):
            (course / "submitted" / student / lab).mkdir(parents=True)
            shutil.copy(notebook, course / "submitted" / student / lab)
        _nbgrader_cli(["autograde", lab], course, timeout=600)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        for lab in labs:
            reference = gradebook.find_submission_notebook(lab, lab, "reference")
            stub = gradebook.find_submission_notebook(lab, lab, "stub")
            assert reference.max_score == 2, "one checker cell, 2 points"
            assert (reference.score, stub.score) == (2, 0), lab
    # Feedback for the learner: the checker's pointed message, not a traceback into the checker.
    _nbgrader_cli(["generate_feedback", labs[0]], course, timeout=300)
    feedback = (course / "feedback" / "stub" / labs[0] / f"{labs[0]}.html").read_text()
    assert "your function is still the stub" in feedback
