"""Committed predictions (issue 24, item 1): one shared ``check_prediction``; a prediction left ``None`` stops a
notebook that a person runs, before the answer, and never a headless run.

* every notebook and lab uses ``workbench.predictions``'s ``check_prediction`` and ``commit_prediction``,
  none defines its own;
* every prediction cell (``MY_… = None``) ends with ``commit_prediction`` of exactly its names, and a later cell
  checks each of them with ``check_prediction``;
* ``predictions_required()`` follows ``$WORKBENCH_PREDICTIONS`` and otherwise the front end (``cellId``);
* in a real kernel, a cell sent with a ``cellId`` (as JupyterLab sends it) fails with a one-line
  ``PredictionMissing``, and the same cell sent as nbclient / papermill / nbval send it runs.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

from workbench import predictions
from workbench.predictions import (
    PREDICTIONS_ENV,
    PredictionMissing,
    check_prediction,
    commit_prediction,
    predictions_required,
)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "labs").glob("*.ipynb"))
SHARED = ("check_prediction", "commit_prediction")
PREDICTION = re.compile(r"^(?:MY|PREDICTED)_\w+$")


def _code(path: Path) -> list[tuple[int, ast.Module]]:
    """(cell index, parsed source) of every code cell, IPython magics and shell lines blanked."""
    cells = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type == "code":
            source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                               for line in cell.source.splitlines())
            cells.append((i, ast.parse(source)))
    return cells


def _predictions(tree: ast.Module) -> list[str]:
    """The names a cell sets to None at top level: its predictions (``MY_X = None``)."""
    return [t.id for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            and node.value.value is None for t in node.targets if isinstance(t, ast.Name) and PREDICTION.match(t.id)]


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_no_notebook_defines_its_own_prediction_check(path: Path) -> None:
    for i, tree in _code(path):
        for node in ast.walk(tree):
            defined = ([node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else
                       [t.id for t in getattr(node, "targets", [getattr(node, "target", None)])
                        if isinstance(t, ast.Name)] if isinstance(node, (ast.Assign, ast.AnnAssign)) else [])
            own = sorted(set(defined) & set(SHARED))
            assert not own, (f"{path.parent.name}/{path.name}, cell {i} defines {own}: import them from "
                             f"workbench.predictions (one shared check for every notebook)")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and {a.name for a in node.names} & set(SHARED):
                assert node.module == "workbench.predictions", (path.name, i, node.module)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_prediction_is_committed_then_checked(path: Path) -> None:
    cells = _code(path)
    imported = False
    for n, (i, tree) in enumerate(cells):
        imported |= any(isinstance(node, ast.ImportFrom) and node.module == "workbench.predictions"
                        and "commit_prediction" in {a.name for a in node.names} for node in ast.walk(tree))
        names = _predictions(tree)
        if not names:
            continue
        where = f"{path.parent.name}/{path.name}, cell {i} ({', '.join(names)})"
        assert imported, f"{where}: import commit_prediction from workbench.predictions in an earlier cell"
        last = tree.body[-1]
        committed = (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
                     and isinstance(last.value.func, ast.Name) and last.value.func.id == "commit_prediction")
        assert committed, f"{where}: a prediction cell ends with commit_prediction({', '.join(names)})"
        assert [a.id for a in last.value.args if isinstance(a, ast.Name)] == names, (
            f"{where}: commit_prediction must name the cell's predictions, in order: {names}")
        later = [call for _, t in cells[n + 1:] for call in _calls(t, "check_prediction")]
        for name in names:
            assert any(name in _names(call) for call in later), (
                f"{where}: {name} is never passed to check_prediction after the experiment")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch):
    def set_to(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(PREDICTIONS_ENV, raising=False)
        else:
            monkeypatch.setenv(PREDICTIONS_ENV, value)
    return set_to


class _Kernel:
    def __init__(self, metadata: dict) -> None:
        self.metadata = metadata

    def get_parent(self, channel: str = "shell") -> dict:
        return {"header": {"msg_type": "execute_request"}, "metadata": self.metadata}


@pytest.mark.parametrize("shell, person", [
    (None, False),                                                          # plain python, a script
    (SimpleNamespace(user_ns={}), False),                                   # terminal IPython: no kernel
    (SimpleNamespace(user_ns={}, kernel=_Kernel({})), False),               # papermill, nbval, labs check
    (SimpleNamespace(user_ns={}, kernel=_Kernel({"cellId": "c1"})), True),  # JupyterLab / Notebook 7
    (SimpleNamespace(user_ns={"__vsc_ipynb_file__": "x.ipynb"}, kernel=_Kernel({})), True),  # VS Code
])
def test_required_where_a_person_runs_the_cell(monkeypatch: pytest.MonkeyPatch, env, shell, person: bool) -> None:
    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    env(None)
    assert predictions_required() is person
    env("optional")  # the test suite's setting (conftest): never stops, even in the browser test's JupyterLab
    assert predictions_required() is False
    env("required")
    assert predictions_required() is True


def test_unanswered_prediction_raises_only_when_required(env) -> None:
    env("required")
    with pytest.raises(PredictionMissing, match="predict before you measure: your prediction is still None"):
        commit_prediction(None)
    with pytest.raises(PredictionMissing, match="1 of the 2 predictions are still None"):
        commit_prediction(3, None)
    with pytest.raises(PredictionMissing, match="bytes: no prediction given"):
        check_prediction("bytes", None, 100.0, 100.0)
    commit_prediction(3, "ring", 0.0, False)  # every one answered (0 and False are answers)
    assert check_prediction("bytes", 100.0, 100.0).endswith("✓")

    env("optional")  # headless
    commit_prediction(None, None)
    assert "no prediction given" in check_prediction("bytes", None, 100.0, 100.0)

    env("sometimes")
    with pytest.raises(ValueError, match="'required' or 'optional'"):
        commit_prediction(None)


def test_missing_prediction_renders_as_one_line() -> None:
    err = PredictionMissing("predict before you measure: your prediction is still None in this cell")
    assert err._render_traceback_() == ["PredictionMissing: predict before you measure: your prediction is still "
                                        "None in this cell"]


def test_theory_only_and_choice_predictions(env) -> None:
    env("optional")
    line = check_prediction("model states, GiB (calculator)", 100.0, None, 105.0)
    assert "measured" not in line and "theory 105" in line and "-5% from the theory" in line and line.endswith("✓")
    assert check_prediction("fits", False, None, False).endswith("✓")
    assert check_prediction("fits", True, None, False).endswith("✗")
    assert check_prediction("axis", "dp", "tp", "tp").endswith("✗")
    with pytest.raises(ValueError, match="measurement, the theory or both"):
        check_prediction("x", 1.0, None)
    assert predictions.__all__.count("commit_prediction") == 1


def test_a_real_kernel_stops_for_jupyterlab_and_runs_for_nbclient() -> None:
    """The same cell in one ipykernel: sent with a cellId (JupyterLab) it fails with one line; without (nbclient,
    behind papermill, nbval and ``workbench labs check``) it prints the headless line."""
    from jupyter_client.manager import start_new_kernel

    env = {k: v for k, v in os.environ.items() if k != PREDICTIONS_ENV}
    km, kc = start_new_kernel(kernel_name="python3", env=env, startup_timeout=60)
    cell = ("from workbench.predictions import check_prediction, commit_prediction\n"
            "MY_X = None\ncommit_prediction(MY_X)\nprint(check_prediction('x', MY_X, 2.0))")
    try:
        results = {}
        for front_end, metadata in (("jupyterlab", {"cellId": "a1b2"}), ("nbclient", {})):
            msg = kc.session.msg("execute_request", {"code": cell, "silent": False, "store_history": True,
                                                     "user_expressions": {}, "allow_stdin": False,
                                                     "stop_on_error": True}, metadata=metadata)
            kc.shell_channel.send(msg)
            reply = kc.get_shell_msg(timeout=60)
            while reply["parent_header"].get("msg_id") != msg["header"]["msg_id"]:  # start_new_kernel's kernel_info
                reply = kc.get_shell_msg(timeout=60)
            shown = []
            while True:
                out = kc.get_iopub_msg(timeout=60)
                if out["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
                    continue
                if out["msg_type"] in ("stream", "error"):
                    shown.append(out["content"])
                if out["msg_type"] == "status" and out["content"]["execution_state"] == "idle":
                    break
            results[front_end] = (reply["content"], shown)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)

    reply, shown = results["jupyterlab"]
    assert reply["status"] == "error" and reply["ename"] == "PredictionMissing"
    [error] = [c for c in shown if "traceback" in c]
    assert len(error["traceback"]) == 1 and error["traceback"][0].startswith("PredictionMissing: predict before")
    assert not any("x: measured" in c.get("text", "") for c in shown), "stopped before the answer was printed"
    reply, shown = results["nbclient"]
    assert reply["status"] == "ok", reply
    assert any("x: measured 2  (no prediction given" in c.get("text", "") for c in shown), shown
