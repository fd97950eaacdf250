"""Every lab's checker module offers tiered hints, and no reference solution ships in the workbench package.

A lab's checker module is the ``workbench.labs.<name>`` its notebook imports from. ``hint(1)``, ``hint(2)``,
``hint(3)`` must each print a different hint, each more specific than the one before: longer, or more code-like
(tier 3 is close to the recipe, often code). The solutions live in ``labs/solutions/``, beside the notebooks.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
LABS = sorted((ROOT / "labs").glob("*.ipynb"))
# What makes a hint more specific when it is not longer: calls, indexing, assignments, numbers.
CODE_TOKEN = re.compile(r"\w+\(|[\[\]=%]|\b\d+\b")


def _checker_modules(lab: Path) -> list[str]:
    """The ``workbench.labs.<name>`` modules a lab notebook imports (its checker)."""
    source = "\n".join(c.source for c in nbformat.read(lab, as_version=4).cells if c.cell_type == "code")
    return sorted(set(re.findall(r"from (workbench\.labs\.\w+) import", source)))


def _tiers(module_name: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    module = importlib.import_module(module_name)
    shown = []
    for level in (1, 2, 3):
        module.hint(level)
        shown.append(capsys.readouterr().out.strip())
    return shown


def _specificity(text: str) -> tuple[int, int]:
    return len(text), len(CODE_TOKEN.findall(text))


def test_every_lab_has_a_checker_module() -> None:
    assert LABS, "no lab notebooks found in labs/"
    for lab in LABS:
        assert _checker_modules(lab), f"{lab.name} imports no workbench.labs.<name> checker module"


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_hints_are_tiered(lab: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for module_name in _checker_modules(lab):
        tiers = _tiers(module_name, capsys)
        assert all(len(t) > 40 for t in tiers), f"{module_name}: a hint printed (almost) nothing: {tiers}"
        assert len(set(tiers)) == 3, f"{module_name}: two hint tiers print the same text"
        for level in (1, 2):
            (len_a, code_a), (len_b, code_b) = _specificity(tiers[level - 1]), _specificity(tiers[level])
            assert len_b > len_a or code_b > code_a, (
                f"{module_name}: hint({level + 1}) is neither longer nor more code-like than hint({level}) "
                f"({len_b} vs {len_a} characters, {code_b} vs {code_a} code tokens)")


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_hint_rejects_other_tiers(lab: Path) -> None:
    for module_name in _checker_modules(lab):
        module = importlib.import_module(module_name)
        for level in (0, 4):
            with pytest.raises(ValueError, match=str(level)):
                module.hint(level)


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_notebook_points_at_hints_and_imports_its_solution_from_labs(lab: Path) -> None:
    source = "\n".join(c.source for c in nbformat.read(lab, as_version=4).cells)
    assert "hint(1)" in source, f"{lab.name} never tells the learner about hint(1)"
    assert re.search(r"from solutions\.\w+ import", source), f"{lab.name} does not import labs/solutions/"
    assert "workbench.labs.solutions" not in source, f"{lab.name} imports a solution from the package"


def test_no_reference_solution_in_the_package() -> None:
    assert not (ROOT / "workbench" / "labs" / "solutions").exists(), (
        "workbench/labs/solutions/ is back: reference solutions belong in labs/solutions/, outside the package "
        "a learner imports")
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "workbench").rglob("*.py")
                 if re.search(r"(?m)^\s*(from|import)\s+(workbench\.labs\.)?solutions\b", p.read_text())]
    assert not offenders, f"package modules import a lab solution: {offenders}"


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_every_lab_has_its_solution_file(lab: Path) -> None:
    source = "\n".join(c.source for c in nbformat.read(lab, as_version=4).cells if c.cell_type == "code")
    for name in re.findall(r"from solutions\.(\w+) import", source):
        assert (ROOT / "labs" / "solutions" / f"{name}.py").is_file(), f"{lab.name}: labs/solutions/{name}.py missing"
