"""The package's floors, checked from its source (issue 19, "Guard tests first").

Every module under ``workbench/`` is parsed with ``ast`` (nothing is imported) and three rules are checked:

a. no upward import: a module imports its own floor or a lower one (``FLOORS``);
b. no strategy under ``workbench/parallel/`` imports a sibling strategy (``STRATEGIES`` vs ``HELPERS``);
c. no private name (``_x``) is imported, or reached as ``module._x``, from another module;
d. no module imports an old path (an alias module kept for learners' code: ``old_paths``);

and the modules' imports form no circle (``test_no_import_cycle``).

Each rule has an allow-list of today's breaches. The test fails on a breach that is not listed, and on a listed
breach that no longer exists, so the lists only shrink. All four are empty since issue 19: a new breach is
fixed, not listed.

Every import counts, wherever it is written: a function-level (lazy) import or one under ``TYPE_CHECKING`` is
still a dependency of the module, only a deferred one, so it cannot be used to hide an upward import.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]

# Floors, lowest first: DESIGN.md's layer table in the order issue 19 proposes. A key ending in "/" covers a
# folder, any other key one file; the longest matching key wins. Every module must be covered
# (test_every_module_has_a_floor), so a new file is placed on purpose.
FLOOR_NAMES = ["theory", "trace", "dist", "models, data", "parallel", "checkpoint, training", "presentation",
               "entry points"]
FLOORS = {
    "workbench/theory/": 0,        # pure Python: memory, α-β communication, schedules as data, layouts
    "workbench/trace.py": 1,       # plain records
    "workbench/dist/": 2,          # launch, placement, mesh, comm, rank_pool, faults, environment
    "workbench/__init__.py": 2,    # re-exports launch, Mesh and Trace: the dist floor's front door
    "workbench/models/": 3, "workbench/data.py": 3,
    "workbench/parallel/": 4,      # the strategies, their helpers, and parallelize (the composer)
    "workbench/checkpoint/": 5, "workbench/training/": 5,
    "workbench/record.py": 5,      # one run's record across attempts, kept beside its checkpoints (stdlib only)
    "workbench/viz/": 6, "workbench/widgets/": 6,
    "workbench/cli.py": 7, "workbench/magics.py": 7, "workbench/labs/": 7,
    "workbench/run.py": 7,         # one run start to end: cli.py parses flags and calls it
    "workbench/course.py": 7,      # the installed course (notebooks, labs, benchmarks) and workbench course
    "workbench/predictions.py": 6,  # asks the IPython kernel who runs the cell: presentation, not theory
    # Not named in the issue: both launch ranks for a notebook (measure: notebooks 02-04's α-β calibration;
    # pipeline_demo: notebook 08 and the schedule explorer), so they are entry points, not presentation.
    "workbench/measure.py": 7, "workbench/pipeline_demo.py": 7,
}
# Old paths (workbench/launch.py, workbench/train.py...) are alias modules (``old_paths()``): each sits on its
# target's floor, and the package never imports one (rule d).

# What counts as a strategy under workbench/parallel/ (module prefix -> reason). A strategy may import helpers
# and its own package's modules (zero/* is one strategy), never another strategy.
STRATEGIES = {
    "workbench.parallel.local_sgd": "local SGD and DiLoCo: replicas averaged every H steps (Douillard et al. 2023)",
    "workbench.parallel.context": "context parallelism: ring attention over the sequence (Liu et al. 2023)",
    "workbench.parallel.param_server": "a parameter server: server ranks hold the shards and step them, workers "
                                       "pull and push, sync or async (Li et al. 2014)",
    "workbench.parallel.ddp": "data parallelism: replicas, bucketed gradient all-reduce",
    "workbench.parallel.expert": "expert parallelism: a MoE model's experts split over ranks, tokens by all-to-all "
                                 "(GShard, Lepikhin et al. 2020)",
    "workbench.parallel.tensor": "tensor parallelism (Megatron's column/row/vocab-parallel layers) and sequence "
                                 "parallelism (the same plan with sharded norms and reduce-scatter): one plan, "
                                 "two styles",
    "workbench.parallel.pipeline": "pipeline parallelism: the cut and the schedule executor",
    "workbench.parallel.zero": "ZeRO 1/2/3: flat buckets, sharded optimizer, gradients, fully sharded model",
}
HELPERS = {
    "workbench.parallel.compression": "gradient compressors (bf16, PowerSGD, top-k, sign) any data-parallel strategy "
                                      "may reduce through",
    "workbench.parallel.collectives": "algorithms over comm (ring, tree, a module's broadcast) any strategy may call",
    "workbench.parallel.grad_norm": "clipping a split model: shared by every strategy that shards parameters",
    "workbench.parallel.buckets": "size-capped gradient buckets (Li et al. 2020): shared by DDP, ZeRO and lab 03",
    "workbench.parallel.precision": "mixed precision and loss scaling, applied around every strategy",
    "workbench.parallel.recompute": "activation recomputation, applied around every strategy",
}
# The one place that combines strategies (parallelize.py, re-exported by the package __init__). It imports every
# strategy, so a strategy importing either would reach its siblings through it: that counts as a sibling too.
COMPOSERS = ("workbench.parallel", "workbench.parallel.parallelize")


class Import(NamedTuple):
    line: int
    module: str        # the module written in the statement, made absolute (``from .x`` resolved)
    name: str | None   # the imported name (``from m import name``) or attribute reached (``m._name``), or None


class Breach(NamedTuple):
    rule: str
    key: tuple[str, str, str | None]  # (importer, imported, name-or-None): the allow-list's form
    path: str
    line: int
    detail: str = ""


# Rule a: upward imports today. Each is a dependency the refactor removes.
ALLOWED_UPWARD: set[tuple[str, str, str | None]] = set()
# (empty since workbench/run.py: the dashboard used to start a run through the CLI, which imported it back)

# Rule b: strategies importing a sibling strategy today.
ALLOWED_SIBLING: set[tuple[str, str, str | None]] = set()
# (empty since sequence parallelism moved into tensor/: DESIGN.md's "SP is the same plan with reduce-scatter
# outputs", one strategy with two styles)

# Rule c: private names used across modules today.
ALLOWED_PRIVATE: set[tuple[str, str, str | None]] = set()
# (empty since parallel/buckets.py: DDP, ZeRO and lab 03 cut their buckets with one public helper)


# Rule d: the package imports its modules by their new paths; the old ones are kept for learners' code only.
ALLOWED_OLD_PATH: set[tuple[str, str, str | None]] = set()


def module_name(path: str) -> str:
    """``workbench/parallel/zero/__init__.py`` -> ``workbench.parallel.zero``."""
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_sources(root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """Module name -> (path relative to the repo, source) for every module under workbench/."""
    paths = sorted(p.relative_to(root).as_posix() for p in (root / "workbench").rglob("*.py"))
    return {module_name(p): (p, (root / p).read_text(encoding="utf-8")) for p in paths}


@functools.cache  # the package is parsed once, however many tests plant a change in one module
def imports_of(source: str, module: str, path: str) -> tuple[Import, ...]:
    """Every workbench import in ``source`` (lazy ones too), and every ``alias._private`` reached through one."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found, aliases, nodes = [], {}, list(ast.walk(ast.parse(source)))
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                found.append(Import(node.lineno, a.name, None))
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                found.append(Import(node.lineno, target, a.name))
                aliases[a.asname or a.name] = f"{target}.{a.name}"
    for node in nodes:  # second pass: aliases are known wherever they were bound
        chain = _dotted(node.value) if isinstance(node, ast.Attribute) and _private(node.attr) else None
        if chain and chain[0] in aliases:
            found.append(Import(node.lineno, ".".join([aliases[chain[0]], *chain[1:]]), node.attr))
    return tuple(i for i in found if i.module == "workbench" or i.module.startswith("workbench."))


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None for anything but names and attributes."""
    if isinstance(node, ast.Name):
        return [node.id]
    return [*head, node.attr] if isinstance(node, ast.Attribute) and (head := _dotted(node.value)) else None


def _private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not name.startswith("__")


def floor_of(path: str) -> int | None:
    keys = [k for k in FLOORS if path == k or (k.endswith("/") and path.startswith(k))]
    return FLOORS[max(keys, key=len)] if keys else None


def _prefixed(module: str, table: dict[str, str]) -> str | None:
    """The longest key of ``table`` that is ``module`` or a package above it."""
    keys = [k for k in table if module == k or module.startswith(k + ".")]
    return max(keys, key=len) if keys else None


def dependency(imp: Import, modules: dict[str, tuple[str, str]]) -> str | None:
    """The module an import loads: ``from workbench import comm`` loads workbench.comm, not workbench."""
    for candidate in (f"{imp.module}.{imp.name}", imp.module) if imp.name else (imp.module,):
        if candidate in modules:
            return candidate
    return None


# Old paths with no alias file: ``workbench.launch`` is also the package's ``launch()``, so workbench/__init__.py
# registers the module under that name itself (tests/test_public_api.py checks both).
REGISTERED_OLD_PATHS = {"workbench.launch": "workbench.dist.launch"}


def old_paths(sources: dict[str, tuple[str, str]]) -> dict[str, str]:
    """Alias module -> the module it stands for: a module that ends ``sys.modules[__name__] = m`` after
    ``from <package> import <leaf> as m`` (workbench/train.py and the other paths issue 19 moved)."""
    found = {}
    for name, (_, text) in sources.items():
        tree = ast.parse(text)
        last = tree.body[-1] if tree.body else None
        if not (isinstance(last, ast.Assign) and ast.unparse(last.targets[0]) == "sys.modules[__name__]"
                and isinstance(last.value, ast.Name)):
            continue
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and [a.asname for a in node.names] == [last.value.id]:
                found[name] = f"{node.module}.{node.names[0].name}"
    return found


def breaches(sources: dict[str, tuple[str, str]]) -> list[Breach]:
    """The four rules over ``sources`` (module -> (path, text)), as in package_sources()."""
    out, aliases = [], old_paths(sources)
    for module, (path, text) in sources.items():
        if module in aliases:
            continue  # an old path only points at its new home
        for imp in imports_of(text, module, path):
            if _private(imp.name) and imp.module != module:
                out.append(Breach("c", (module, imp.module, imp.name), path, imp.line))
            if imp.module in REGISTERED_OLD_PATHS and imp.module not in sources:  # not `from workbench import launch`
                new = REGISTERED_OLD_PATHS[imp.module]
                out.append(Breach("d", (module, imp.module, None), path, imp.line, f" (import {new} instead)"))
            dep = dependency(imp, sources)
            if dep is None or dep == module:
                continue
            if dep in aliases:
                out.append(Breach("d", (module, dep, None), path, imp.line, f" (import {aliases[dep]} instead)"))
                dep = aliases[dep] if aliases[dep] in sources else dep
            mine, theirs = floor_of(path), floor_of(sources[dep][0])
            if mine is not None and theirs is not None and theirs > mine:
                detail = f" (floor {mine} {FLOOR_NAMES[mine]!r} < floor {theirs} {FLOOR_NAMES[theirs]!r})"
                out.append(Breach("a", (module, dep, None), path, imp.line, detail))
            mine, theirs = _prefixed(module, STRATEGIES), _prefixed(dep, STRATEGIES) or (dep in COMPOSERS and dep)
            if mine and theirs and mine != theirs:
                out.append(Breach("b", (module, dep, None), path, imp.line, f" ({mine} and {theirs} are strategies)"))
    return sorted(set(out), key=lambda b: (b.path, b.line, b.rule, b.key))  # one per statement and key


RULES = {
    "a": ("upward import", ALLOWED_UPWARD),
    "b": ("strategy imports a sibling strategy", ALLOWED_SIBLING),
    "c": ("private name used across modules", ALLOWED_PRIVATE),
    "d": ("the package imports an old path", ALLOWED_OLD_PATH),
}


def problems(found: list[Breach], rule: str, allowed: set) -> list[str]:
    """A line per breach not in ``allowed`` and per allowed breach no longer found."""
    title = RULES[rule][0]
    seen = {b.key for b in found if b.rule == rule}
    new = [f"{b.path}:{b.line}: rule {rule} ({title}): {b.key[0]} imports {b.key[1]}"
           + (f".{b.key[2]}" if b.key[2] else "") + b.detail for b in found if b.rule == rule and b.key not in allowed]
    gone = [f"rule {rule} ({title}): {key} no longer happens: remove it from the allow-list"
            for key in sorted(allowed - seen, key=str)]
    return new + gone


# ---- the package today ----

@functools.cache
def _today() -> list[Breach]:
    return breaches(package_sources())


def _check(rule: str) -> None:
    lines = problems(_today(), rule, RULES[rule][1])
    assert not lines, "\n".join(lines)


def test_no_upward_import() -> None:
    _check("a")


def test_no_strategy_imports_a_sibling_strategy() -> None:
    _check("b")


def test_no_private_name_across_modules() -> None:
    _check("c")


def test_the_package_imports_no_old_path() -> None:
    _check("d")


def test_every_module_has_a_floor() -> None:
    sources = package_sources()
    aliases = old_paths(sources)
    missing = [path for m, (path, _) in sources.items() if floor_of(path) is None and m not in aliases]
    assert not missing, f"no floor for {missing}: add them to FLOORS in {Path(__file__).name}"


def test_every_parallel_module_is_a_strategy_or_a_helper() -> None:
    sources = package_sources()
    aliases = old_paths(sources)  # once: it parses every module (in the comprehension it took 28 s)
    modules = [m for m in sources if (m == "workbench.parallel" or m.startswith("workbench.parallel."))
               and m not in aliases]
    loose = [m for m in modules if not _prefixed(m, STRATEGIES) and m not in HELPERS and m not in COMPOSERS]
    assert not loose, f"{loose}: say whether each is a strategy or a helper (STRATEGIES / HELPERS)"


def import_graph(sources: dict[str, tuple[str, str]]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (lazy imports too; an old path counts as its new home)."""
    aliases = old_paths(sources)
    graph = {}
    for module, (path, text) in sources.items():
        if module not in aliases:
            deps = {aliases.get(d, d) for imp in imports_of(text, module, path) if (d := dependency(imp, sources))}
            graph[module] = deps - {module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan 1972): each is a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                component.append(stack.pop())
                if component[-1] == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle() -> None:
    assert not (found := import_cycles(import_graph(package_sources()))), f"modules importing each other: {found}"


def test_cycle_finder_finds_a_lazy_circle_and_nothing_else() -> None:
    graph = import_graph(_sources({"workbench/a.py": "from workbench import b\n", "workbench/b.py": "def f():\n"
                                   "    import workbench.c\n", "workbench/c.py": "from workbench.a import x\n",
                                   "workbench/d.py": "from workbench import a\n"}))
    assert import_cycles(graph) == [["workbench.a", "workbench.b", "workbench.c"]]


def test_allow_lists_name_real_modules() -> None:
    modules = package_sources()
    unknown = [key for _, allowed in RULES.values() for key in allowed if not set(key[:2]) <= set(modules)]
    assert not unknown, f"allow-list entries that name no module: {unknown}"


# ---- the checker itself, on synthetic sources: each rule catches what it should ----

def _sources(files: dict[str, str]) -> dict[str, tuple[str, str]]:
    """{path: source} -> package_sources()'s form."""
    return {module_name(path): (path, text) for path, text in files.items()}


def _found(files: dict[str, str]) -> list[tuple]:
    return [(b.rule, b.key, f"{b.path}:{b.line}") for b in breaches(_sources(files))]


def test_checker_catches_an_upward_import_even_a_lazy_one() -> None:
    assert _found({"workbench/theory/memory.py": "def f():\n    from workbench.training.config import RunConfig\n",
                   "workbench/training/config.py": "from workbench.theory.memory import to_unit\n"}) == [
        ("a", ("workbench.theory.memory", "workbench.training.config", None), "workbench/theory/memory.py:2")]


def test_checker_resolves_a_submodule_imported_from_its_package() -> None:
    assert _found({"workbench/trace.py": "from workbench.dist import comm\n", "workbench/dist/comm.py": "",
                   "workbench/dist/__init__.py": "",
                   "workbench/__init__.py": "from workbench.trace import Trace\n"}) == [
        ("a", ("workbench.trace", "workbench.dist.comm", None), "workbench/trace.py:1")]


def test_checker_catches_the_old_launch_path_but_not_the_package_launch_function() -> None:
    assert _found({"workbench/dist/mesh.py": "from workbench.launch import rank_device\n",
                   "workbench/viz/x.py": "from workbench import launch\n", "workbench/__init__.py": ""}) == [
        ("d", ("workbench.dist.mesh", "workbench.launch", None), "workbench/dist/mesh.py:1")]


def test_checker_catches_an_import_of_an_old_path_and_judges_it_by_its_new_home() -> None:
    alias = "import sys\n\nfrom workbench.training import trainer as module\n\nsys.modules[__name__] = module\n"
    assert _found({"workbench/train.py": alias, "workbench/training/trainer.py": "",
                   "workbench/training/__init__.py": "",
                   "workbench/dist/mesh.py": "from workbench.train import Trainer\n"}) == [
        ("a", ("workbench.dist.mesh", "workbench.training.trainer", None), "workbench/dist/mesh.py:1"),
        ("d", ("workbench.dist.mesh", "workbench.train", None), "workbench/dist/mesh.py:1")]


def test_checker_catches_a_strategy_importing_a_sibling_but_not_a_helper() -> None:
    assert _found({"workbench/parallel/ddp.py": "from workbench.parallel import tensor\n"
                                                "from .grad_norm import clip_by_shares_\n",
                   "workbench/parallel/zero/optimizer.py": "from workbench.parallel.zero.flat import Bucket\n"
                                                           "from .. import ZERO_STAGES\n",
                   "workbench/parallel/__init__.py": "from workbench.parallel import ddp, tensor\n",
                   "workbench/parallel/tensor.py": "", "workbench/parallel/grad_norm.py": "",
                   "workbench/parallel/zero/flat.py": ""}) == [
        ("b", ("workbench.parallel.ddp", "workbench.parallel.tensor", None), "workbench/parallel/ddp.py:1"),
        ("b", ("workbench.parallel.zero.optimizer", "workbench.parallel", None),
         "workbench/parallel/zero/optimizer.py:2")]


def test_checker_catches_private_names_imported_or_reached_across_modules() -> None:
    assert _found({"workbench/rank_pool.py": "from workbench.launch import _context, launch\n"
                                             "from .launch import _stop_all, __doc__\n"
                                             "import workbench.launch as L\n"
                                             "L._host_store(self._own)\n",
                   "workbench/launch.py": "from workbench.launch import _own\n"}) == [
        ("c", ("workbench.rank_pool", "workbench.launch", "_context"), "workbench/rank_pool.py:1"),
        ("c", ("workbench.rank_pool", "workbench.launch", "_stop_all"), "workbench/rank_pool.py:2"),
        ("c", ("workbench.rank_pool", "workbench.launch", "_host_store"), "workbench/rank_pool.py:4")]


def test_a_planted_breach_fails_and_a_fixed_one_asks_to_shrink_the_list() -> None:
    sources = package_sources()
    path, text = sources["workbench.theory.pipeline"]
    sources["workbench.theory.pipeline"] = (path, text + "\ndef _x():\n    from workbench.viz import timeline\n")
    lines = problems(breaches(sources), "a", ALLOWED_UPWARD)
    assert len(lines) == 1 and lines[0].startswith(f"{path}:{text.count(chr(10)) + 3}: rule a (upward import)")
    assert "floor 0 'theory' < floor 6 'presentation'" in lines[0]

    fixed = ("workbench.widgets.dashboard", "workbench.cli", None)  # the circle run.py removed
    assert problems(breaches(sources), "a", ALLOWED_UPWARD | {fixed})[-1] == (
        "rule a (upward import): ('workbench.widgets.dashboard', 'workbench.cli', None) no longer happens: "
        "remove it from the allow-list")
