"""The course a learner installs: the notebooks, the labs (without their solutions) and the benchmarks.

A wheel carries them inside the package, in ``workbench/course/`` (``hatch_build.py`` puts them there when the
wheel is built); a source checkout (``pip install -e .``) has them beside the package, in the repository's
``notebooks/``, ``labs/`` and ``benchmarks/``. ``course_root`` finds whichever is there, and ``copy_course`` gives
a learner a copy to work in (``workbench course DIR``), so the installed originals stay pristine for the next
``workbench labs start`` or a fresh copy. The labs' reference solutions never ship: they stay with the tests and
the instructors (``labs/solutions/`` in the repository).
"""

from __future__ import annotations

import shutil
from pathlib import Path

PACKAGED = "course"  # workbench/course/: the course inside an installed wheel
PARTS = ("notebooks", "labs")  # what a learner gets a copy of
BENCHMARKS = "benchmarks"


def course_root() -> Path:
    """The folder holding ``notebooks/`` and ``labs/``: the wheel's ``workbench/course/``, else the checkout the
    package was installed from; FileNotFoundError saying where it looked."""
    package = Path(__file__).resolve().parent
    candidates = [package / PACKAGED, package.parent]
    for root in candidates:
        if all(any((root / part).glob("*.ipynb")) for part in PARTS):
            return root
    raise FileNotFoundError(f"no course found (notebooks/ and labs/) in {', '.join(map(str, candidates))}: "
                            "reinstall the package from its wheel, or work in a source checkout")


def benchmarks_dir() -> Path:
    """``benchmarks/`` (``run.py`` and the bench modules) of the installed course or the checkout."""
    folder = course_root() / BENCHMARKS
    if not (folder / "run.py").is_file():
        raise FileNotFoundError(f"no benchmarks in {folder}: reinstall the package from its wheel, or work in a "
                                "source checkout")
    return folder


def course_files(root: Path | None = None) -> list[Path]:
    """The notebooks and labs a learner gets, relative to the course root (no solutions: they are not notebooks,
    and ``labs/solutions/`` is left out wherever it is)."""
    root = course_root() if root is None else root
    return sorted(p.relative_to(root) for part in PARTS for p in (root / part).glob("*.ipynb"))


def copy_course(folder: str | Path, force: bool = False) -> list[Path]:
    """Copy the notebooks and labs into ``folder`` (``folder/notebooks``, ``folder/labs``) for a learner; returns
    the copies. A folder that exists and is not empty is refused (it may hold the learner's work) unless ``force``,
    which overwrites the course's files there and leaves every other file alone."""
    target, root = Path(folder), course_root()
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target} is a file: pass a folder for the course")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise FileExistsError(f"{target} exists and is not empty (your work?): choose another folder, or pass "
                              "--force to overwrite the course's notebooks and labs there")
    copies = []
    for relative in course_files(root):
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        copies.append(Path(shutil.copyfile(root / relative, target / relative)))
    return copies


__all__ = ["benchmarks_dir", "copy_course", "course_files", "course_root"]
