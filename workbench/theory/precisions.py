"""The precision names `workbench run`, `workbench calc`, the trainer and the theory all accept: one table.

The canonical names are the compute dtypes `workbench run --precision` has always taken ("fp32", "bf16",
"fp16"); the theory used to call the mixed ones "bf16-mixed" and "fp16-mixed" (issue 19: the two commands had
drifted), so those stay accepted as aliases and mean the same. `tests/test_cli_config.py` fails if a parser, the
trainer's ``workbench.parallel.precision.PRECISIONS`` or this table drift apart.

Which *memory layout* a mixed precision keeps (fp32 parameters under autocast, as the trainer does, or 16-bit
parameters beside an fp32 master copy) is a separate choice: ``theory.memory.MEMORY_LAYOUTS``.
"""

from __future__ import annotations

PRECISION_NAMES: tuple[str, ...] = ("fp32", "bf16", "fp16")  # canonical: the compute dtype
PRECISION_ALIASES: dict[str, str] = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}  # older theory/calc spellings
ACCEPTED_PRECISIONS: tuple[str, ...] = (*PRECISION_NAMES, *PRECISION_ALIASES)


def canonical_precision(name: str) -> str:
    """The canonical name of ``name`` ("bf16-mixed" -> "bf16"); ValueError naming the accepted ones."""
    if name in PRECISION_NAMES:
        return name
    if isinstance(name, str) and name in PRECISION_ALIASES:
        return PRECISION_ALIASES[name]
    aliases = ", ".join(f"{a!r} (= {c!r})" for a, c in PRECISION_ALIASES.items())
    raise ValueError(f"unknown precision {name!r}; valid: {', '.join(map(repr, PRECISION_NAMES))}, or the aliases "
                     f"{aliases}")


def parse_precision(text: str) -> str:
    """An argparse ``type``: an alias becomes its canonical name, anything else passes through unchanged so that
    ``choices=PRECISION_NAMES`` rejects it with argparse's own message listing the valid names."""
    return PRECISION_ALIASES.get(text, text)


def is_mixed(precision: str) -> bool:
    """True for a 16-bit compute dtype (bf16, fp16 and their aliases)."""
    return canonical_precision(precision) != "fp32"


__all__ = ["ACCEPTED_PRECISIONS", "PRECISION_ALIASES", "PRECISION_NAMES", "canonical_precision", "is_mixed",
           "parse_precision"]
