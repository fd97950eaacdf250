"""A static check of the one-device-per-rank rule: every tensor the package creates names its device.

Factory calls such as ``torch.zeros(n)`` silently create a CPU tensor; on an NCCL rank that tensor then
meets a CUDA one and the run fails far from the cause (or, in a collective, NCCL refuses it). The rule is
that each factory call says where the tensor is born (``device=``), or copies the device of an existing
tensor (``torch.zeros_like(t)``, ``t.new_zeros(n)``), which this scan allows.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

#: torch functions that create a tensor (or a generator) from nothing, on the default device unless told.
FACTORIES = frozenset({
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "range", "linspace", "logspace", "eye",
    "rand", "randn", "randint", "randperm", "normal", "empty_strided", "scalar_tensor",
    "sparse_coo_tensor", "Generator",
})


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    call: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: torch.{self.call}(...) without device="


def _torch_call_name(node: ast.Call, torch_names: set[str]) -> str | None:
    """``zeros`` for ``torch.zeros(...)`` (or an alias of torch); None for anything else."""
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in torch_names:
        return func.attr
    return None


def _torch_aliases(tree: ast.AST) -> set[str]:
    names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == "torch" and a.asname}
    return names


def scan_source(source: str, path: str = "<string>") -> list[Finding]:
    """Every torch factory call in ``source`` with no ``device=`` keyword."""
    tree = ast.parse(source)
    torch_names = _torch_aliases(tree)
    findings = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _torch_call_name(node, torch_names)
        if name in FACTORIES and not any(k.arg == "device" for k in node.keywords):
            findings.append(Finding(path, node.lineno, name))
    return findings


def scan_tree(root: Path) -> list[Finding]:
    """Scan every ``.py`` file under ``root``."""
    findings = []
    for file in sorted(root.rglob("*.py")):
        findings += scan_source(file.read_text(encoding="utf-8"), str(file.relative_to(root.parent)))
    return findings
