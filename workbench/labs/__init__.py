"""Lab checkers (one module per lab notebook in the repository's ``labs/``) and ``LabCheckFailed``.

Each checker module offers ``check(...)``, which runs the learner's code on real ranks and raises
``LabCheckFailed`` with a message pointed at the mistake, and ``hint(level)``, tiered hints. The reference
solutions are not here: they live beside the notebooks, in ``labs/solutions/``. ``grading`` runs a learner's
notebook headless and reports each exercise (``workbench labs check``).
"""


class LabCheckFailed(AssertionError):
    """A lab answer is wrong; the message is a hint pointing at the mistake."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of a traceback: the learner sees the pointed message, not the
        # checker's internals (the raise happens deep inside it, often in a rank's result).
        return [f"\x1b[31mLabCheckFailed\x1b[0m: {self}"]


def show_hint(hints: dict[int, str], level: int) -> str:
    """Print (and return) tier ``level`` of a lab's ``hints`` (1 the idea ... 3 nearly the code): every
    checker's ``hint(level)`` is this, with its own hints."""
    if level not in hints:
        raise ValueError(f"hint level {level!r}: choose one of {sorted(hints)} (each says more than the one before)")
    print(f"hint {level}/{len(hints)}:\n{hints[level]}")
    return hints[level]
