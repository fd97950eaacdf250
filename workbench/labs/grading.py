"""Graded labs from the command line: ``workbench labs list | start NAME DIR | check PATH.ipynb``.

``check`` runs a learner's lab notebook headless, top to bottom, in its own folder, and keeps going past a
failed cell, so every exercise gets a verdict: an *exercise* is a code cell that calls a checker
(``check(...)``, ``check_on_ranks(...)``, possibly assigned). It passes when the cell runs without error; it
fails with the checker's pointed message (``LabCheckFailed``) or with the error the learner's code raised.
An error in any other cell is reported too, since later exercises may depend on it. The exit status is 0 only
when every exercise passed and no cell failed, so a CI job or an autograder can use it.

The lab notebooks ship in the wheel (``workbench/course/labs``, without their reference solutions) and sit in the
repository's ``labs/`` in a source checkout; ``labs_dir`` finds either (``workbench.course``), or the folder
``$WORKBENCH_LABS`` points to.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXERCISE = re.compile(r"^(?:\w+\s*=\s*)?check\w*\(", re.MULTILINE)
CELL_TIMEOUT_S = 600


def labs_dir() -> Path:
    """The folder holding the lab notebooks: ``$WORKBENCH_LABS``, else the installed course's ``labs/`` (in the
    wheel, or beside the package in a source checkout: ``workbench.course``)."""
    from workbench.course import course_root

    env = os.environ.get("WORKBENCH_LABS")
    if env:
        candidates = [Path(env)]
    else:
        try:
            candidates = [course_root() / "labs"]
        except FileNotFoundError as error:
            raise FileNotFoundError(f"no lab notebooks: {error}; or set WORKBENCH_LABS to a folder of them") from None
    for folder in candidates:
        if folder.is_dir() and any(folder.glob("*.ipynb")):
            return folder
    raise FileNotFoundError(f"no lab notebooks in {', '.join(map(str, candidates))}: set WORKBENCH_LABS to a "
                            "folder of them, or reinstall the package")


def available() -> dict[str, Path]:
    """{lab name (file stem): notebook path}, in course order."""
    return {p.stem: p for p in sorted(labs_dir().glob("*.ipynb"))}


def title(path: Path) -> str:
    """The lab's first markdown heading, without the '#'."""
    import nbformat

    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type == "markdown" and cell.source.lstrip().startswith("#"):
            return cell.source.lstrip().splitlines()[0].lstrip("#").strip()
    return path.stem


def find(name: str) -> Path:
    """A lab by its number ("02"), its name ("ring_allreduce") or its file stem; ValueError naming the valid ones."""
    labs = available()
    matches = [p for stem, p in labs.items() if name in (stem, stem[:2], stem[3:]) or stem == Path(name).stem]
    if len(matches) != 1:
        raise ValueError(f"no lab {name!r}; valid: {', '.join(labs)} (or their numbers: "
                         f"{', '.join(s[:2] for s in labs)})")
    return matches[0]


def start(name: str, folder: str | Path) -> Path:
    """Copy lab ``name`` into ``folder`` for the learner to work in; the original stays untouched. Refuses to
    overwrite a copy that is already there (the learner's work)."""
    source = find(name)
    target = Path(folder) / source.name
    if target.exists():
        raise FileExistsError(f"{target} exists (your work?): choose another folder or remove it first")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


@dataclass
class Verdict:
    """One exercise's (or a failed cell's) result."""

    cell: int
    what: str  # the cell's first line
    passed: bool
    message: str = ""
    exercise: bool = True


def _first_error(cell: Any) -> tuple[str, str] | None:
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return out.get("ename", "Error"), out.get("evalue", "")
    return None


def grade(path: str | Path, timeout: float = CELL_TIMEOUT_S) -> list[Verdict]:
    """Run the notebook at ``path`` headless (cwd: its folder), every cell even after a failure; one verdict
    per exercise cell, plus one per other cell that raised."""
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    if not path.is_file() or path.suffix != ".ipynb":
        raise ValueError(f"{str(path)!r} is not a notebook file (.ipynb); pass the path of your lab copy")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(path.parent.resolve())}}).execute()
    verdicts = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        error, exercise = _first_error(cell), bool(EXERCISE.search(cell.source))
        if exercise or error:
            first = next((line for line in cell.source.splitlines() if line.strip()), "")
            message = "" if error is None else (error[1] if error[0] == "LabCheckFailed"  # the pointed message
                                                else f"{error[0]}: {error[1].strip().splitlines()[0]}")
            verdicts.append(Verdict(i, first.strip(), error is None, message, exercise))
    return verdicts


def report(verdicts: list[Verdict]) -> str:
    """One line per exercise (PASS / FAIL with its message), then the count."""
    lines = []
    for v in verdicts:
        kind = "exercise" if v.exercise else "cell"
        lines.append(f"{'PASS' if v.passed else 'FAIL'}  {kind} (cell {v.cell}: {v.what})")
        if v.message:
            lines += [f"      {line}" for line in v.message.splitlines()]
    exercises = [v for v in verdicts if v.exercise]
    passed = sum(v.passed for v in exercises)
    lines.append(f"{passed} of {len(exercises)} exercise(s) passed"
                 + ("" if all(v.passed for v in verdicts if not v.exercise) else "; other cells failed too"))
    return "\n".join(lines)
