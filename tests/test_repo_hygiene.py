"""Nothing the project needs is hidden from git: a source file that .gitignore swallows works here and is missing from
every clone. (It happened: a bare ``dist/`` pattern, meant for build output, ignored ``workbench/dist/`` and its new
modules, which a fresh clone then lacked.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("workbench", "tests", "notebooks", "labs", "benchmarks", "docs", "docker", "cluster", "scripts", ".ci")
GENERATED = ("__pycache__", ".pyc", ".egg-info", ".ipynb_checkpoints")


def test_no_source_file_is_ignored_by_git() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing can be ignored")
    listed = subprocess.run(["git", "ls-files", "--others", "--ignored", "--exclude-standard", "--", *SOURCES],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    hidden = [path for path in listed if not any(part in path for part in GENERATED)]
    assert not hidden, f"these files exist but .gitignore hides them from every clone: {hidden}"
