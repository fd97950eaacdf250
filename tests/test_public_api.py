"""Every ``workbench`` name the learner-facing material uses still resolves (issue 19, "Guard tests first").

Moving files (issue 19) must keep every path a learner touches working, through alias modules. This test
collects those paths from the code a learner reads or runs, and resolves each one:

- notebooks/*.ipynb and labs/*.ipynb code cells (``%``/``!`` lines dropped; a cell that still does not parse is
  skipped), and their ``%load_ext workbench...`` lines (the module must keep ``load_ipython_extension``);
- labs/solutions/*.py and benchmarks/*.py;
- ```python blocks of README.md and docs/*.md;
- pyproject.toml's console scripts (``workbench = "workbench.cli:main"``).

A use is written ``module:attribute.chain``, as Python resolves it: ``from workbench import launch`` is
``workbench:launch`` (the package's ``launch`` attribute: the function, not the module), ``import workbench.mesh``
is ``workbench.mesh``, and an attribute chain on a name an import bound extends it (``comm.all_reduce`` after
``from workbench import comm`` is ``workbench:comm.all_reduce``). Each use is one test, named by it; a failure
says where the material uses it.
"""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import json
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
LOAD_EXT = re.compile(r"^\s*%load_ext\s+(workbench[\w.]*)", re.MULTILINE)
SCRIPT = re.compile(r'^\S+\s*=\s*"(workbench[\w.]*):(\w+)"', re.MULTILINE)


def uses_in(source: str, aliases: dict[str, str] | None = None) -> dict[str, list[int]]:
    """The workbench uses in ``source`` -> the lines using them.

    ``aliases`` (a name an import bound -> the use it stands for) is updated in place: a notebook's cells share
    one, as they share a kernel.
    """
    uses: dict[str, list[int]] = {}
    aliases = {} if aliases is None else aliases
    nodes = list(ast.walk(ast.parse(source)))
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                uses.setdefault(a.name, []).append(node.lineno)
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                use = node.module if a.name == "*" else f"{node.module}:{a.name}"
                uses.setdefault(use, []).append(node.lineno)
                aliases[a.asname or a.name] = use
    inner = {id(node.value) for node in nodes if isinstance(node, ast.Attribute)}
    for node in nodes:  # the whole chain only (workbench.a.b.c), not also its head (workbench.a.b)
        if isinstance(node, ast.Attribute) and id(node) not in inner and (chain := _dotted(node)):
            if chain[0] in aliases:
                head = aliases[chain[0]]
                use = f"{head}{'.' if ':' in head else ':'}{'.'.join(chain[1:])}"
                uses.setdefault(use, []).append(node.lineno)
    return {use: lines for use, lines in uses.items() if use.split(":")[0].split(".")[0] == "workbench"}


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None for anything but names and attributes."""
    if isinstance(node, ast.Name):
        return [node.id]
    return [*head, node.attr] if isinstance(node, ast.Attribute) and (head := _dotted(node.value)) else None


def cell_source(lines: list[str]) -> str:
    """A code cell as Python: magic and shell lines blanked (line numbers kept), %load_ext turned into a use."""
    body = "".join("\n" if line.lstrip().startswith(("%", "!")) else line for line in lines)
    return body + "".join(f"\nfrom {m} import load_ipython_extension" for m in LOAD_EXT.findall("".join(lines)))


def sources() -> list[tuple[str, str, str]]:
    """(scope, where, python source) of every piece of learner-facing code; one scope shares its imports."""
    out = []
    for nb in sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("labs/*.ipynb")]):
        name = nb.relative_to(ROOT).as_posix()
        for n, cell in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"]):
            if cell["cell_type"] == "code":
                lines = cell["source"] if isinstance(cell["source"], list) else cell["source"].splitlines(True)
                out.append((name, f"{name} cell {n}", cell_source(lines)))
    for py in sorted([*ROOT.glob("labs/solutions/*.py"), *ROOT.glob("benchmarks/*.py")]):
        name = py.relative_to(ROOT).as_posix()
        out.append((name, name, py.read_text(encoding="utf-8")))
    for md in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]:
        name, text = md.relative_to(ROOT).as_posix(), md.read_text(encoding="utf-8")
        for block in PYTHON_BLOCK.finditer(text):
            out.append((name, f"{name} block at line {text.count(chr(10), 0, block.start()) + 1}", block[1]))
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    out += [("pyproject.toml", "pyproject.toml [project.scripts]", f"from {module} import {attr}")
            for module, attr in SCRIPT.findall(pyproject)]
    return out


def collect() -> dict[str, list[str]]:
    """Every use -> where the material has it ("file[ cell N]:line")."""
    found: dict[str, list[str]] = {}
    scopes: dict[str, dict[str, str]] = {}
    for scope, where, src in sources():
        try:
            uses = uses_in(src, scopes.setdefault(scope, {}))
        except SyntaxError:  # not Python once magics are dropped (a template, a %%bash body)
            continue
        for use, lines in uses.items():
            found.setdefault(use, []).extend(f"{where}:{line}" for line in sorted(set(lines)))
    return dict(sorted(found.items()))


@functools.cache
def _import(module: str) -> types.ModuleType:
    return importlib.import_module(module)  # cached: one import per module for the whole run


def resolve(use: str) -> object:
    """``module:a.b`` -> getattr(getattr(module, a), b), importing a submodule where an attribute is missing
    (as ``from module import a`` and ``import module.a`` do)."""
    module, _, chain = use.partition(":")
    obj = _import(module)
    for attr in chain.split(".") if chain else []:
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            name = f"{getattr(obj, '__name__', '')}.{attr}"
            if not hasattr(obj, "__path__") or importlib.util.find_spec(name) is None:  # no such submodule
                raise
            obj = _import(name)
    return obj


USES = collect()


@pytest.mark.parametrize("use", list(USES))
def test_public_name_resolves(use: str) -> None:
    try:
        resolve(use)
    except Exception as exc:
        where = "\n  ".join(USES[use])
        pytest.fail(f"{use} no longer resolves ({type(exc).__name__}: {exc}); used in:\n  {where}")


def test_the_material_is_found() -> None:
    """A broken glob or parser must not quietly turn this file into zero tests."""
    assert len(USES) > 100, sorted(USES)
    files = {where.split(" ")[0].split(":")[0] for wheres in USES.values() for where in wheres}
    for expected in ("notebooks/00_launching_ranks.ipynb", "labs/02_ring_allreduce.ipynb", "README.md",
                     "labs/solutions/ring_allreduce.py", "benchmarks/bench_ddp.py", "pyproject.toml"):
        assert expected in files, f"no workbench use found in {expected}"
    assert "workbench.magics:load_ipython_extension" in USES and "workbench.cli:main" in USES


# ---- the collector and the resolver themselves, on synthetic sources ----

def test_uses_cover_imports_chains_and_aliases() -> None:
    src = ("import workbench.theory.memory\nimport workbench.launch as L\nfrom workbench import comm, trace as T\n"
           "from workbench.mesh import *\nimport torch\n"
           "workbench.theory.memory.to_unit(1)\nL.rank_device()\ncomm.all_reduce(torch.ones(1))\n"
           "T.current().spans\n")
    assert uses_in(src) == {
        "workbench.theory.memory": [1], "workbench.launch": [2], "workbench:comm": [3], "workbench:trace": [3],
        "workbench.mesh": [4], "workbench:theory.memory.to_unit": [6], "workbench.launch:rank_device": [7],
        "workbench:comm.all_reduce": [8], "workbench:trace.current": [9]}


def test_a_notebook_shares_imports_across_cells_and_drops_magics() -> None:
    aliases: dict[str, str] = {}
    uses_in(cell_source(["%load_ext workbench.magics\n", "from workbench.theory import pipeline\n"]), aliases)
    later = uses_in(cell_source(["%%ranks\n", "pipeline.bubble_fraction(4, 8)\n"]), aliases)
    assert later == {"workbench.theory:pipeline.bubble_fraction": [2]}
    assert "load_ipython_extension" in cell_source(["%load_ext workbench.magics\n"])


def test_resolve_follows_python_and_fails_on_a_missing_name() -> None:
    assert resolve("workbench:launch") is _import("workbench.launch").launch  # the function the package exports
    assert resolve("workbench:theory.memory.to_unit") is _import("workbench.theory.memory").to_unit
    with pytest.raises(AttributeError):
        resolve("workbench.theory.memory:no_such_name")
    with pytest.raises(ModuleNotFoundError):
        resolve("workbench.no_such_module:anything")


def test_a_name_that_moved_fails_saying_where_it_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(USES, "workbench.train:Gone", ["notebooks/x.ipynb cell 1:2"])
    with pytest.raises(pytest.fail.Exception, match=r"workbench.train:Gone no longer resolves \(AttributeError: .*"
                                                    r"\); used in:\n  notebooks/x.ipynb cell 1:2"):
        test_public_name_resolves("workbench.train:Gone")


# ---- the old module paths (issue 19 moved the modules into floors): each is the new module, not a copy ----

OLD_PATHS = {
    "workbench.launch": "workbench.dist.launch", "workbench.mesh": "workbench.dist.mesh",
    "workbench.comm": "workbench.dist.comm", "workbench.rank_pool": "workbench.dist.rank_pool",
    "workbench.faults": "workbench.dist.faults", "workbench.environment": "workbench.dist.environment",
    "workbench.reshard": "workbench.checkpoint.reshard", "workbench.health": "workbench.training.health",
    "workbench.train": "workbench.training.trainer", "workbench.precision": "workbench.parallel.precision",
    "workbench.recompute": "workbench.parallel.recompute",
    "workbench.parallel.sequence": "workbench.parallel.tensor.sequence",
}


@pytest.mark.parametrize(("old", "new"), sorted(OLD_PATHS.items()))
def test_an_old_module_path_is_the_new_module(old: str, new: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(new)


def test_every_alias_module_is_listed() -> None:
    aliases = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "workbench").rglob("*.py")
               if "sys.modules[__name__] = " in p.read_text(encoding="utf-8")}
    # workbench.launch has no alias file: the package registers it (its name is also the package's launch())
    assert aliases | {"workbench.launch"} == set(OLD_PATHS)


def test_the_package_launch_stays_the_function_after_the_old_module_path_is_imported() -> None:
    import workbench
    import workbench.launch  # noqa: F401  (the old module path, as a notebook written before issue 19 imports it)

    assert callable(workbench.launch) and not isinstance(workbench.launch, types.ModuleType)
    assert importlib.import_module("workbench.launch") is importlib.import_module("workbench.dist.launch")


def test_old_names_reach_the_same_objects() -> None:
    """What notebooks, labs and scripts import by the old paths is the very object the package uses now."""
    from workbench.checkpoint import store
    from workbench.training import config, trainer

    assert _import("workbench.train").RunConfig is config.RunConfig
    assert _import("workbench.train").train_rank is trainer.train_rank
    assert _import("workbench.checkpoint").save is store.save and _import("workbench.checkpoint").load is store.load
    assert _import("workbench.cli").run_training is _import("workbench.run").run_training
    assert _import("workbench.launch").rank_device is _import("workbench.dist.launch").rank_device
