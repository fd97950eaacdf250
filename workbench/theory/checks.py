"""Argument checks shared by every floor: one rule and one message per kind of value, so a bad value reads the
same wherever it is caught (a RunConfig, a theory function, a widget). In ``theory/`` because that is the lowest
floor, pure Python, which every other floor may import (DESIGN.md), not because checking is theory."""

from __future__ import annotations

import math
from typing import Any


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is an int >= 1 (a bool is not), else ``ValueError`` naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def positive_number(name: str, value: Any, unit: str = "") -> float:
    """``float(value)`` if it is a finite number > 0 (a bool is not), else ``ValueError`` naming ``name``, the value
    and, when given, the ``unit`` it is counted in (``"seconds"``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        what = f"a positive number of {unit}" if unit else "a positive finite number"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


__all__ = ["positive_int", "positive_number"]
