"""The labs as an nbgrader course: ``workbench labs export --nbgrader DIR``.

nbgrader (JupyterHub's release → collect → autograde → feedback loop) wants a *source* notebook per assignment in
which the solutions are written out between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` and each test cell is
marked with its points. Our labs cannot carry that themselves: they ship to learners (the wheel, the image) and must
not hold the reference solutions, which stay in the repository's ``labs/solutions/``. So the nbgrader source is
*generated* from the one lab notebook and its one solution module, when an instructor asks, and never stored: no
second copy of a lab to keep in step.

For each lab, in ``DIR/source/<lab>/<lab>.ipynb``:

* each cell holding a stub the learner replaces (the names the lab's ``if USE_SOLUTION:`` cell imports from
  ``solutions.<module>``) becomes an autograded-answer cell: the stub stays as the learner knows it, and after it,
  between the markers, the reference solution's definitions of those names (the first such cell also gets the
  module's imports and helpers), which shadow the stub. ``nbgrader generate_assignment`` cuts the region out of
  the release, leaving the stub and ``ClearSolutions.code_stub`` (one comment line, set in the
  ``nbgrader_config.py`` written beside ``source/``);
* each exercise cell (a checker call, as ``workbench labs check`` finds them) becomes a locked autograded-test
  cell worth ``points``: the checker raises ``LabCheckFailed`` on a wrong answer, so the cell scores 0, else full;
* the ``USE_SOLUTION`` switch (parameter and cell) is left out: the release has no ``solutions`` to import.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path
from typing import Any

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
SOLUTIONS = "solutions"  # beside the lab notebooks in a checkout: labs/solutions/<module>.py
CONFIG_NAME = "nbgrader_config.py"
# Written beside source/ (never over an existing one). The stub comment replaces the solution region in the
# release; nbgrader's own default ("raise NotImplementedError()") would make the released cell raise when run.
# The checkers start real ranks, so a cell may take minutes on a small machine; nbgrader's default is 30 s.
CONFIG = '''"""nbgrader settings for the workbench labs (written by `workbench labs export --nbgrader`)."""

c = get_config()  # noqa: F821 (nbgrader provides it)
# The released cell keeps the lab's stub; the reference solution after it is replaced by this line.
c.ClearSolutions.code_stub = {"python": "# (your answer goes in the stub above)"}
# The labs' checkers run real ranks: allow minutes per cell (nbgrader's default is 30 s).
c.Execute.timeout = 600
'''


def solutions_dir(labs: Path, given: str | Path | None = None) -> Path:
    """Where the reference solutions are: ``given``, else ``labs/solutions``. FileNotFoundError, saying what is
    missing and where to find it, when that folder holds none (an installed wheel ships no solutions)."""
    folder = Path(given) if given is not None else labs / SOLUTIONS
    if not any(folder.glob("*.py")):
        raise FileNotFoundError(
            f"the labs' reference solutions are not in {folder}: nbgrader's source notebooks need them, and they "
            "ship only with the source repository (labs/solutions/), never in the wheel or the image. Run this from "
            "a checkout, or pass --solutions PATH/TO/labs/solutions")
    return folder


def _solution_imports(cells: list[Any]) -> list[tuple[int, str, list[str]]]:
    """(index, module, names) of each ``if USE_SOLUTION: from solutions.<module> import <names>`` cell; a lab
    has one per exercise or one for all."""
    found = []
    for i, cell in enumerate(cells):
        if cell.cell_type != "code" or "USE_SOLUTION" not in cell.source:
            continue
        body = ast.parse(cell.source).body
        if len(body) == 1 and isinstance(body[0], ast.If) and isinstance(body[0].body[0], ast.ImportFrom):
            node = body[0].body[0]
            if node.module and node.module.startswith(SOLUTIONS + "."):
                found.append((i, node.module.split(".", 1)[1], [alias.name for alias in node.names]))
    if not found:
        raise ValueError("no `if USE_SOLUTION: from solutions.<module> import ...` cell: every lab has one")
    return found


def _stub_cells(cells: list[Any], switches: list[tuple[int, str, list[str]]]) -> dict[int, list[tuple[str, str]]]:
    """{cell index: [(module, name), ...]}: for each name a switch imports, the last code cell before the switch
    that defines it (the stub its solution replaces)."""
    stubs: dict[int, list[tuple[str, str]]] = {}
    for switch, module, names in switches:
        for name in names:
            where = [i for i in range(switch) if cells[i].cell_type == "code" and name in _defines(cells[i].source)]
            if not where:
                raise ValueError(f"no cell before cell {switch} defines {name}, which it imports from "
                                 f"solutions.{module}: the stub must come first")
            stubs.setdefault(where[-1], []).append((module, name))
    return stubs


def _defines(source: str) -> set[str]:
    """The names a cell binds at its top level (def, class, assignment)."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return set()
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _solution_parts(module: Path, wanted: list[str]) -> tuple[str, dict[str, str]]:
    """The solution module split for the notebook: (preamble, {wanted name: its source}). The preamble is every
    other top-level statement (imports, helpers, constants) with the comments above it; the module docstring,
    ``from __future__`` (legal only at a cell's top) and ``__all__`` are left out."""
    text = module.read_text()
    lines, body = text.splitlines(), ast.parse(text).body
    preamble, parts, start = [], {}, 0
    for i, node in enumerate(body):
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]) - 1
        chunk = "\n".join(lines[start:node.end_lineno])  # with the blank lines and comments above it
        own = "\n".join(lines[first:node.end_lineno])  # without the blank lines and comments above
        start = node.end_lineno
        named = _defines(own) & set(wanted)
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the module docstring
        if isinstance(node, ast.ImportFrom) and node.module == "__future__" or _defines(own) == {"__all__"}:
            continue
        if named:
            parts[named.pop()] = chunk.strip("\n")
        else:
            preamble.append(chunk)
    missing = [name for name in wanted if name not in parts]
    if missing:
        raise ValueError(f"{module} does not define {', '.join(missing)}, which its lab imports from it")
    return "\n".join(preamble).strip("\n"), parts


def _mark(cell: Any, grade_id: str, *, solution: bool, points: int = 0) -> None:
    """nbgrader's cell metadata (schema 3): an autograded answer (``solution``) or a locked autograded test."""
    meta = {"schema_version": 3, "grade_id": grade_id, "solution": solution, "grade": not solution,
            "locked": not solution, "task": False}
    if not solution:
        meta["points"] = points
    cell.metadata["nbgrader"] = meta


def _answer_source(stub: str, wanted: list[tuple[str, str]], parsed: dict[str, tuple[str, dict[str, str]]],
                   placed: set[str]) -> str:
    """The stub, then the solution region: each module's preamble the first time it is used (``placed``), then
    the definitions of the names this cell's stub defines."""
    region = []
    for module, name in wanted:
        preamble, parts = parsed[module]
        if module not in placed and preamble:
            region.append(preamble)
        placed.add(module)
        region.append(parts[name])
    return f"{stub.rstrip()}\n\n\n{BEGIN}\n" + "\n\n\n".join(region) + f"\n{END}"


def source_notebook(lab: Path, solutions: Path, points: int = 1) -> Any:
    """Lab notebook ``lab`` as an nbgrader source notebook, its solutions taken from the folder ``solutions``."""
    import nbformat

    from workbench.labs.grading import EXERCISE

    if points < 1:
        raise ValueError(f"points {points!r}: each exercise is worth a whole number of points, at least 1")
    nb = nbformat.read(lab, as_version=4)
    switches = _solution_imports(nb.cells)
    imported: dict[str, list[str]] = {}
    for _, module, names in switches:
        imported.setdefault(module, []).extend(names)
    for module in imported:
        if not (solutions / f"{module}.py").is_file():
            raise FileNotFoundError(f"{solutions / f'{module}.py'} is missing: lab {lab.stem} takes its reference "
                                    "solution from it")
    parsed = {module: _solution_parts(solutions / f"{module}.py", names) for module, names in imported.items()}
    stubs, skip, placed = _stub_cells(nb.cells, switches), {i for i, _, _ in switches}, set()
    cells, answers, tests = [], 0, 0
    for i, cell in enumerate(nb.cells):
        cell = copy.deepcopy(cell)
        if i in skip:
            continue
        if cell.cell_type == "code" and "parameters" in cell.metadata.get("tags", []):
            cell.source = "\n".join(line for line in cell.source.splitlines() if not line.startswith("USE_SOLUTION"))
        elif i in stubs:
            cell.source = _answer_source(cell.source, stubs[i], parsed, placed)
            answers += 1
            _mark(cell, f"{lab.stem}-answer-{answers}", solution=True)
        elif cell.cell_type == "code" and EXERCISE.search(cell.source):
            tests += 1
            _mark(cell, f"{lab.stem}-check-{tests}", solution=False, points=points)
        cells.append(cell)
    if not tests:
        raise ValueError(f"lab {lab.stem}: no checker cell (a call of check...(...)) to grade")
    nb.cells = cells
    return nb


def export(folder: str | Path, names: list[str] | None = None, solutions: str | Path | None = None,
           points: int = 1, force: bool = False) -> list[Path]:
    """Write the nbgrader source of labs ``names`` (numbers or names; default: all) into course folder
    ``folder``: ``source/<lab>/<lab>.ipynb`` each, and ``nbgrader_config.py`` if the folder has none. Refuses to
    overwrite a source notebook already there (an instructor's edits?) unless ``force``. Returns the notebooks."""
    import nbformat

    from workbench.labs.grading import available, find, labs_dir

    labs = [find(name) for name in names] if names else list(available().values())
    where = solutions_dir(labs_dir(), solutions)
    notebooks = {lab: source_notebook(lab, where, points) for lab in labs}  # all or nothing: build before writing
    root = Path(folder)
    targets = {lab: root / "source" / lab.stem / lab.name for lab in labs}
    existing = [str(t) for t in targets.values() if t.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} exist(s) (your edits?): pass --force to overwrite")
    for lab, target in targets.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebooks[lab], target)
    config = root / CONFIG_NAME
    if not config.exists():
        config.write_text(CONFIG)
    return list(targets.values())
