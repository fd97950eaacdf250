"""Hygiene of every notebook and lab, checked without running them (issue 12, item 5).

* every reference to a repo file or folder, to a ``notebook NN`` / ``lab NN`` or to an ``NN_name.ipynb`` points
  at something that exists; ``../shared/...`` (and anything else outside the repo) is not there for a learner;
* every variable of the ``parameters`` cell is used by the rest of the notebook, so a papermill override is
  never silently ignored;
* exactly one ``parameters`` cell, no stored outputs, no absolute paths.

Each message names the notebook, the cell (index and id) and the offending text.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
LABS = sorted((ROOT / "labs").glob("*.ipynb"))
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", "runs",
             "build", "dist", "node_modules"}
# A path whose first part is one of these is a repo path: checked. Other slashed words (torch/distributed,
# and/or, dp/tp) are prose.
TOP_DIRS = {p.name for p in ROOT.iterdir() if p.is_dir() and p.name not in SKIP_DIRS and not p.name.startswith(".")}
# A bare file name with one of these endings names a repo file (a .json or .html one is usually what the
# notebook itself writes at run time, so those are checked only when written as a repo path).
EXTENSIONS = "py|md|ipynb|toml|yaml|yml|sh|cfg|ini"

URL = re.compile(r"\b(?:https?|ftp|file)://\S+|\bwww\.\S+")
PATH = re.compile(r"(?<![\w/.:-])((?:\.\.?/)+[\w.-]+(?:/[\w.-]*)*|[A-Za-z_][\w.-]*/(?:[\w.-]+/?)*)")
BARE_FILE = re.compile(rf"(?<![\w/.:-])([A-Za-z_][\w-]*(?:\.[\w-]+)*\.(?:{EXTENSIONS}))(?![\w/])")
NB_FILE = re.compile(r"(?<![\w/])(\d{2}_[\w-]+\.ipynb)")
NB_NUMBER = re.compile(r"\b([Nn]otebooks?|[Ll]abs?)\s+((?:\d{2}(?:\s*(?:/|,|&|and|or|–|-)\s*(?=\d{2}))?)+)\b")
ABSOLUTE = re.compile(r"(?<![\w.~/-])(?:/work|/tmp|/home|/Users|/root)(?![\w-])|(?<!\w)[A-Za-z]:\\[\w .-]{2,}")


def _repo_files() -> set[str]:
    names: set[str] = set()
    for _dir, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        names.update(files)
    return names


REPO_NAMES = _repo_files()


def _cells(path: Path) -> list[nbformat.NotebookNode]:
    return nbformat.read(path, as_version=4).cells


def _where(path: Path, index: int, cell: nbformat.NotebookNode) -> str:
    return f"{path.parent.name}/{path.name}, cell {index} (id {cell.get('id', '?')}, {cell.cell_type})"


def _exists(ref: str, folder: Path) -> bool:
    """A path as a learner would follow it: from the repo root, the notebook's folder, or the package."""
    for base in (ROOT, folder, ROOT / "workbench"):
        target = (base / ref).resolve()
        if target.is_relative_to(ROOT) and target.exists():
            return True
    return False


def bad_references(text: str, folder: Path) -> list[str]:
    """The references in ``text`` (one cell's source) that point at nothing, each with the reason."""
    text = URL.sub(" ", text)
    bad = []
    for ref in PATH.findall(text):
        ref = ref.rstrip(".")
        if any(c in ref for c in "{}<>*"):
            continue  # a template or a glob, not one path
        first = ref.split("/")[0]
        if re.match(r"(\.\./)+shared(/|$)|shared/", ref):
            bad.append(f"{ref!r} is the authors' folder beside the repo: a learner's checkout does not have it")
        elif first in ("..", "."):
            if not ((folder / ref).resolve().is_relative_to(ROOT)):
                bad.append(f"{ref!r} is outside the repo: a learner's checkout does not have it")
            elif not _exists(ref, folder):
                bad.append(f"{ref!r} does not exist")
        elif first in TOP_DIRS and not _exists(ref, folder):
            bad.append(f"{ref!r} does not exist (looked from the repo root, {folder.name}/ and workbench/)")
    for name in BARE_FILE.findall(text):
        if name not in REPO_NAMES and not NB_FILE.fullmatch(name):
            bad.append(f"{name!r}: no file of that name in the repo")
    for name in NB_FILE.findall(text):
        if not any((ROOT / d / name).exists() for d in ("notebooks", "labs")):
            bad.append(f"{name!r} is neither in notebooks/ nor in labs/")
    for word, numbers in NB_NUMBER.findall(text):
        kind = "labs" if word.lower().startswith("lab") else "notebooks"
        for nn in re.findall(r"\d{2}", numbers):
            if not list((ROOT / kind).glob(f"{nn}_*.ipynb")):
                bad.append(f"'{word} {nn}': there is no {kind}/{nn}_*.ipynb (say 'a later notebook', or drop it)")
    return bad


def absolute_paths(text: str) -> list[str]:
    return [m.group(0) for m in ABSOLUTE.finditer(URL.sub(" ", text))]


def parameters_cells(path: Path) -> list[tuple[int, nbformat.NotebookNode]]:
    return [(i, c) for i, c in enumerate(_cells(path)) if "parameters" in c.get("metadata", {}).get("tags", [])]


def assigned_names(source: str) -> list[str]:
    names = []
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign | ast.AugAssign) else []
        for t in targets:
            names += [n.id for n in ast.walk(t) if isinstance(n, ast.Name)]
    return names


def _used_names(source: str) -> set[str]:
    """Names a code cell reads; IPython magic and shell lines (and an unparsable cell) are read as words."""
    lines = source.splitlines()
    magic = [line for line in lines if line.lstrip().startswith(("%", "!"))]
    words = set(re.findall(r"[A-Za-z_]\w*", "\n".join(magic)))
    try:
        tree = ast.parse("\n".join(line for line in lines if line not in magic))
    except SyntaxError:
        return words | set(re.findall(r"[A-Za-z_]\w*", source))
    return words | {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def unused_parameters(path: Path) -> list[str]:
    cells = _cells(path)
    [(index, params)] = parameters_cells(path)
    used: set[str] = set()
    for i, c in enumerate(cells):
        if c.cell_type == "code" and i != index:
            used |= _used_names(c.source)
    return [name for name in dict.fromkeys(assigned_names(params.source)) if name not in used]


ALL = NOTEBOOKS + LABS
IDS = [f"{p.parent.name}/{p.stem}" for p in ALL]


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_every_reference_points_at_something_that_exists(path: Path):
    problems = [f"{_where(path, i, c)}: {why}" for i, c in enumerate(_cells(path))
                for why in bad_references(c.source, path.parent)]
    assert not problems, "references to nothing:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_exactly_one_parameters_cell_and_every_parameter_is_used(path: Path):
    params = parameters_cells(path)
    assert len(params) == 1, (f"{path.parent.name}/{path.name}: {len(params)} cells tagged 'parameters' "
                              f"(cells {[i for i, _ in params]}); papermill needs exactly one")
    [(index, cell)] = params
    assert cell.cell_type == "code", f"{_where(path, index, cell)}: the parameters cell must be code"
    unused = unused_parameters(path)
    assert not unused, (f"{_where(path, index, cell)}: parameters {unused} are never used by the rest of the "
                        f"notebook, so overriding them (papermill -p) would be silently ignored")


@pytest.mark.parametrize("path", ALL, ids=IDS)
def test_no_stored_outputs_and_no_absolute_paths(path: Path):
    problems = []
    for i, c in enumerate(_cells(path)):
        if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None):
            problems.append(f"{_where(path, i, c)}: stored outputs / execution count (store notebooks clean)")
        problems += [f"{_where(path, i, c)}: absolute path {p!r}" for p in absolute_paths(c.source)]
    assert not problems, "\n  ".join(["not clean:", *problems])


# ---- the checks themselves catch what they claim to ------------------------------------------------------------


@pytest.mark.parametrize(("text", "expect"), [
    ("see `BENCHMARKS.md` for numbers", "'BENCHMARKS.md'"),
    ("as notebook 99 shows", "'notebook 99'"),
    ("notebooks 04/98 measure it", "'notebooks 98'"),  # 11 exists now (training health)
    ("open 13_no_such_notebook.ipynb", "'13_no_such_notebook.ipynb'"),
    ("read ../shared/CURRICULUM.md", "learner's checkout does not have it"),
    ("read ../../outside.md", "outside the repo"),
    ("`workbench/parallel/nope.py` holds it", "'workbench/parallel/nope.py' does not exist"),
    ("the solutions in labs/nowhere/", "'labs/nowhere/' does not exist"),
])
def test_bad_references_are_caught(text: str, expect: str):
    found = bad_references(text, ROOT / "notebooks")
    assert any(expect in why for why in found), found


@pytest.mark.parametrize("text", [
    "notebook 04 and 04_zero_and_fsdp.ipynb", "see workbench/parallel/ and parallel/collectives.py",
    "https://github.com/x/BENCHMARKS.md and www.example.com/notebook.md", "../labs/solutions/zero1.py",
    "torch/distributed, dp/tp and and/or", "README.md", "labs 02 and 04",
])
def test_good_references_pass(text: str):
    assert bad_references(text, ROOT / "notebooks") == []


def test_absolute_paths_and_unused_parameters_are_caught(tmp_path: Path):
    assert absolute_paths('open("/work/main/x") or "/tmp/a" or r"C:\\Users\\me" or "/home/me"') == [
        "/work", "/tmp", "C:\\Users", "/home"]
    assert absolute_paths("relative runs/tmp/x, https://host/home/x, and/or ~/work") == []
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("A = 1\nB: int = 2\nC, D = 3, 4", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("%time print(A)\nD = 5\nprint(f'{B}')"),
                nbformat.v4.new_markdown_cell("C is mentioned only in prose")]
    nbformat.write(nb, tmp_path / "x.ipynb")
    assert unused_parameters(tmp_path / "x.ipynb") == ["C", "D"]
