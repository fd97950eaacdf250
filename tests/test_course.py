"""``workbench course DIR`` (issue 25, item 2) from this checkout: every notebook and lab copied, no solution; a
folder with something in it refused unless --force, which keeps the learner's other files. The same from an
installed wheel: tests/test_wheel.py (extended lane)."""

from __future__ import annotations

from pathlib import Path

from workbench.cli import main
from workbench.course import benchmarks_dir, course_files, course_root

REPO = Path(__file__).resolve().parents[1]


def test_the_course_is_the_checkouts_notebooks_and_labs_without_solutions() -> None:
    assert course_root() == REPO  # an editable install reads the checkout
    files = [str(p) for p in course_files()]
    assert files == sorted(str(p.relative_to(REPO)) for part in ("notebooks", "labs")
                           for p in (REPO / part).glob("*.ipynb"))
    assert not [f for f in files if "solution" in f] and (benchmarks_dir() / "run.py").is_file()


def test_course_copies_refuses_a_folder_in_use_and_force_keeps_other_files(tmp_path: Path, capsys) -> None:
    target = tmp_path / "course"
    assert main(["course", str(target)]) == 0
    copied = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert copied == [str(p) for p in course_files()]
    mine = target / "labs" / "notes.txt"
    mine.write_text("my notes")
    (target / "labs" / "02_ring_allreduce.ipynb").write_text("{}")  # the learner's edits of a lab copy
    assert main(["course", str(target)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (target / "labs" / "02_ring_allreduce.ipynb").read_text() == "{}"  # untouched without --force
    assert main(["course", str(target), "--force"]) == 0
    assert mine.read_text() == "my notes"
    lab = Path("labs") / "02_ring_allreduce.ipynb"
    assert (target / lab).read_bytes() == (REPO / lab).read_bytes()
    (tmp_path / "file").write_text("x")
    assert main(["course", str(tmp_path / "file")]) == 2
