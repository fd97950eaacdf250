"""The course in the wheel (issue 25, items 1-2): the package built as a learner installs it (``pip wheel``, then a
fresh venv with the pinned CPU torch first), used from outside any checkout. ``workbench course`` copies the
notebooks and labs, never a solution; ``labs list|start|check`` and ``bench`` work from the installed copy; a copied
notebook runs under nbval. Editable installs (the rest of the suite) keep reading the checkout.

Extended lane: building, a fresh venv and its installs take a minute or two.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.course import course_files, course_root

pytestmark = [pytest.mark.extended, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[1]
DIST = "distributed-training-workbench"  # the distribution's name ("workbench" on PyPI is another project)


def _run(args: list[str], cwd: Path, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORKBENCH_LABS", "VIRTUAL_ENV")}
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-3000:]}")
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """A fresh venv holding the built wheel, and a folder outside the checkout to work in."""
    tmp = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"), str(REPO)], tmp)
    wheel = next((tmp / "dist").glob("distributed_training_workbench-*.whl"))
    _run([sys.executable, "-m", "venv", str(tmp / "venv")], tmp)
    pip = [str(tmp / "venv" / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run([*pip, "torch==2.13.0"], tmp)  # the pinned CPU build first, as README's set-up does
    _run([*pip, str(wheel), "nbclient", "nbformat", "ipykernel", "pytest", "nbval"], tmp)
    work = tmp / "work"
    work.mkdir()
    return {"bin": tmp / "venv" / "bin", "work": work, "wheel": wheel}


def test_the_wheel_carries_the_course_and_no_solution(installed) -> None:
    import zipfile

    names = zipfile.ZipFile(installed["wheel"]).namelist()
    shipped = sorted(n.removeprefix("workbench/course/") for n in names if n.startswith("workbench/course/"))
    want = [str(p) for p in course_files(course_root())]
    assert [n for n in shipped if n.endswith(".ipynb")] == want
    assert "benchmarks/run.py" in shipped
    assert not [n for n in names if "solutions" in n], "a lab solution shipped in the wheel"


def test_course_labs_and_a_notebook_from_the_installed_package(installed) -> None:
    bin_, work = installed["bin"], installed["work"]
    where = _run([str(bin_ / "python"), "-c", "import workbench; print(workbench.__file__)"], work).stdout
    assert str(bin_.parent) in where, where  # the installed copy, not the checkout
    _run([str(bin_ / "workbench"), "course", "course"], work)
    copied = sorted(str(p.relative_to(work / "course")) for p in (work / "course").rglob("*.ipynb"))
    assert copied == [str(p) for p in course_files(course_root())]
    again = _run([str(bin_ / "workbench"), "course", "course"], work, check=False)
    assert again.returncode != 0 and "--force" in again.stderr, again.stderr
    _run([str(bin_ / "workbench"), "course", "course", "--force"], work)

    listed = _run([str(bin_ / "workbench"), "labs", "list"], work).stdout
    assert "02_ring_allreduce" in listed and "15_token_dispatch_and_combine" in listed
    _run([str(bin_ / "workbench"), "labs", "start", "02", "mine"], work)
    graded = _run([str(bin_ / "workbench"), "labs", "check", "mine/02_ring_allreduce.ipynb"], work, check=False)
    assert graded.returncode == 1 and "FAIL" in graded.stdout and "hint" in graded.stdout, graded.stdout[-2000:]

    nbval = _run([str(bin_ / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                  "course/notebooks/00_launching_ranks.ipynb"], work)
    assert " passed" in nbval.stdout and "failed" not in nbval.stdout, nbval.stdout[-2000:]


def test_bench_runs_from_the_installed_package(installed) -> None:
    done = _run([str(installed["bin"] / "workbench"), "bench", "--help"], installed["work"])
    assert "--quick" in done.stdout
