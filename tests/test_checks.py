"""workbench.theory.checks: the one rule for a positive int and a positive finite number, with the words every caller
uses (a RunConfig, the theory, the dashboard, the rank pool)."""

from __future__ import annotations

import math

import pytest

from workbench.theory.checks import positive_int, positive_number


@pytest.mark.parametrize("value", [0, -3, 1.0, 2.5, True, "4", None])
def test_positive_int_refuses_by_name(value: object) -> None:
    with pytest.raises(ValueError, match=rf"^steps must be a positive int, got {value!r}$".replace("(", r"\(")):
        positive_int("steps", value)


@pytest.mark.parametrize("value, unit, words", [
    (0, "", "a positive finite number"), (-1.0, "", "a positive finite number"), (math.inf, "", "a positive finite"),
    (math.nan, "", "a positive finite number"), (True, "", "a positive finite number"),
    (0, "seconds", "a positive number of seconds"),
])
def test_positive_number_refuses_by_name(value: object, unit: str, words: str) -> None:
    with pytest.raises(ValueError, match=f"^timeout must be {words}"):
        positive_number("timeout", value, unit)


def test_good_values_pass_through() -> None:
    assert positive_int("n", 3) == 3
    assert positive_number("t", 2) == 2.0 and isinstance(positive_number("t", 2), float)
