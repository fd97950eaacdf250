"""docs/pytorch_api.md, the table from each workbench piece to the PyTorch API a learner uses next, checked against
this checkout and the installed torch: every workbench module imports, every ``torch.…`` name resolves (and every
argument it names is in its signature), every environment variable appears in torch's installed source, every CLI
is one of torch's console scripts and its flags appear in that script's source, every external name belongs to a
project listed as external, every test or notebook named exists. A misspelt name fails (the last tests plant some).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "pytorch_api.md"
TORCH_DIR = Path(torch.__file__).parent
#: Projects outside torch's core the table may name; their names are not resolved (they are not installed).
EXTERNAL = ("torchtitan", "torchft")
#: The pieces issue 24 asked the table to cover.
REQUIRED = ("collectives", "launch", "DDP", "ZeRO-1/2", "ZeRO-3 / FSDP", "TP", "SP", "PP", "CP", "EP",
            "mixed precision", "recomputation", "checkpoints", "compression", "local SGD / DiLoCo", "elastic",
            "hang detection")
COLUMNS = ("piece", "workbench module", "PyTorch API", "compared in", "what differs")

TICKED = re.compile(r"`([^`]+)`")
API_ITEM = re.compile(r"(?:\b(env|CLI|external)\s+)?`([^`]+)`")
CALL = re.compile(r"^(?P<name>[\w.]+)(?:\((?P<args>[\w, ]*)\))?$")
ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]+")
REPO_REF = re.compile(r"^(tests|notebooks)/[\w./-]+(?:::\w+)?$")


def rows(text: str) -> list[dict[str, str]]:
    """The table's rows as {column: cell}; the header must name ``COLUMNS`` in order."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert tuple(header) == COLUMNS, f"{TABLE.name}: header {header}, expected {list(COLUMNS)}"
    out = []
    for line in lines[2:]:  # after the header and its |---| rule
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(COLUMNS), f"{TABLE.name}: a row with {len(cells)} cells: {line[:80]}"
        out.append(dict(zip(COLUMNS, cells, strict=True)))
    return out


def resolve(dotted: str) -> Any:
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError names what is missing
        return obj
    raise ImportError(f"no module in {dotted!r}")


def torch_api_errors(item: str) -> list[str]:
    """``torch.a.b`` or ``torch.a.f(x, y)``: resolves, and each argument is a parameter of its signature."""
    match = CALL.match(item)
    if match is None or not match["name"].startswith("torch."):
        return [f"{item!r} is not a torch.… name (mark it env, CLI or external if it is one of those)"]
    try:
        obj = resolve(match["name"])
    except (ImportError, AttributeError) as e:
        return [f"{match['name']!r} does not resolve in torch {torch.__version__}: {e}"]
    args = [a.strip() for a in (match["args"] or "").split(",") if a.strip()]
    if not args:
        return []
    params = inspect.signature(obj).parameters
    return [f"{match['name']} has no argument {a!r} (it has {', '.join(params)})" for a in args if a not in params]


@functools.lru_cache(maxsize=1)
def torch_distributed_source() -> str:
    """torch's distributed Python sources and C++ headers as installed: where the env variables it reads are named."""
    files = [*(TORCH_DIR / "distributed").rglob("*.py"), *(TORCH_DIR / "include/torch/csrc/distributed").rglob("*.h*")]
    return "\n".join(f.read_text(errors="replace") for f in files)


def env_errors(name: str) -> list[str]:
    if not ENV_NAME.fullmatch(name):
        return [f"env {name!r} is not an environment variable's name"]
    return [] if name in torch_distributed_source() else [f"env {name!r} appears nowhere in torch's installed source"]


def cli_errors(command: str) -> list[str]:
    """``tool --flag ...``: tool is one of torch's console scripts, and each flag is in its module's source."""
    tool, *flags = command.split()
    scripts = {ep.name: ep for ep in importlib.metadata.distribution("torch").entry_points
               if ep.group == "console_scripts"}
    if tool not in scripts:
        return [f"CLI {tool!r} is not one of torch's commands ({', '.join(sorted(scripts))})"]
    source = inspect.getsource(importlib.import_module(scripts[tool].module))
    return [f"CLI {tool} has no flag {f!r} in its source" for f in flags if f'"{f}"' not in source]


def external_errors(name: str) -> list[str]:
    project = name.split(".")[0]
    return [] if project in EXTERNAL else [f"external {name!r}: {project!r} is not one of {EXTERNAL}"]


def api_errors(cell: str) -> list[str]:
    items = API_ITEM.findall(cell)
    if not items:
        return [f"no API named in {cell[:60]!r}"]
    check = {"env": env_errors, "CLI": cli_errors, "external": external_errors, "": torch_api_errors}
    return [e for kind, item in items for e in check[kind](item)]


def module_errors(cell: str) -> list[str]:
    names = TICKED.findall(cell)
    if not names:
        return [f"no workbench module in {cell[:60]!r}"]
    errors = []
    for name in names:
        if not name.startswith("workbench."):
            errors.append(f"{name!r} is not a workbench module")
            continue
        try:
            importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name!r} does not import: {e}")
    return errors


def repo_ref_errors(row: dict[str, str]) -> list[str]:
    """Every `tests/...` or `notebooks/...` in the row exists, and a ``::test_name`` is defined in that file."""
    errors = []
    refs = [r for cell in row.values() for r in TICKED.findall(cell) if r.startswith(("tests/", "notebooks/"))]
    for ref in refs:
        if not REPO_REF.match(ref):
            errors.append(f"{ref!r} is not a path or path::test")
            continue
        path, _, test = ref.partition("::")
        if not (ROOT / path).is_file():
            errors.append(f"{path} does not exist")
        elif test and not re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.M):
            errors.append(f"{path} defines no {test}")
    compared = row["compared in"]
    if compared != "—" and not TICKED.findall(compared):
        errors.append(f"'compared in' is neither a test nor '—': {compared!r}")
    return errors


TABLE_ROWS = rows(TABLE.read_text())


def test_every_piece_the_issue_names_has_a_row() -> None:
    pieces = [r["piece"] for r in TABLE_ROWS]
    assert len(pieces) == len(set(pieces)), f"a piece listed twice: {pieces}"
    assert not set(REQUIRED) - set(pieces), f"missing rows: {sorted(set(REQUIRED) - set(pieces))}"


def test_every_workbench_module_imports() -> None:
    errors = [f"{r['piece']}: {e}" for r in TABLE_ROWS for e in module_errors(r["workbench module"])]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("row", TABLE_ROWS, ids=[r["piece"] for r in TABLE_ROWS])
def test_every_pytorch_name_resolves(row: dict[str, str]) -> None:
    errors = api_errors(row["PyTorch API"])  # one row a test: importing torch.distributed.optim alone takes ~1 s
    assert not errors, f"{row['piece']}: " + "\n".join(errors)


def test_every_test_and_notebook_named_exists() -> None:
    errors = [f"{r['piece']}: {e}" for r in TABLE_ROWS for e in repo_ref_errors(r)]
    assert not errors, "\n".join(errors)
    assert sum(r["compared in"] != "—" for r in TABLE_ROWS) >= 8  # most pieces are run beside their built-in


@pytest.mark.parametrize("cell", [
    "`torch.distributed.all_reduc`",                            # a misspelt function
    "`torch.distributed.fsdp.fully_shard(reshard_after_forwad)`",  # a misspelt argument
    "`torch.distribute.checkpoint.save`",                       # a misspelt module
    "`ZeroRedundancyOptimizer`",                                # not a dotted torch name
    "env `TORCH_NCCL_DUMP_ON_TIMEOT`",                          # a misspelt environment variable
    "CLI `torchrn`",                                            # a misspelt command
    "CLI `torchrun --nnode`",                                   # a misspelt flag
    "external `torchtitn.distributed.expert_parallel.ExpertParallel`",  # a misspelt project
])
def test_a_misspelt_api_is_caught(cell: str) -> None:
    assert api_errors(cell), cell


def test_a_misspelt_module_or_test_is_caught() -> None:
    assert module_errors("`workbench.parallel.dpp`") and module_errors("`torch.nn`")
    row = dict.fromkeys(COLUMNS, "")
    for ref in ("`tests/test_dd.py`", "`tests/test_ddp.py::test_no_such_test`", "`notebooks/10_checkpoint.ipynb`"):
        assert repo_ref_errors({**row, "compared in": ref}), ref
