"""The numerics lane (.ci/run: ``ATEN_CPU_CAPABILITY=default python -m pytest -q -m numerics``) must really run
its ranks on the instruction set it names: torch reads the variable once, at import, and the ranks are forked
from a forkserver that imports torch itself, so this checks what the ranks report, not what was asked for."""

from __future__ import annotations

import os

import pytest
import torch

from workbench import launch

pytestmark = [pytest.mark.numerics, pytest.mark.timeout(120)]


def _capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def test_rank_processes_run_the_requested_instruction_set() -> None:
    requested = os.environ.get("ATEN_CPU_CAPABILITY")
    want = requested.upper() if requested else _capability()  # unset: the machine's best, as in this process
    assert _capability() == want, f"this process runs {_capability()}, ATEN_CPU_CAPABILITY={requested}"
    assert list(launch(_capability, 2, timeout=60)) == [want, want]
