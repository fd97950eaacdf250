"""Predictions a learner commits to before each experiment (CURRICULUM.md: "predict, then measure").

Each prediction cell of a notebook ends with ``commit_prediction(MY_A, MY_B)``: a person running the notebook who
left one ``None`` is stopped there, with one line, before the experiment shows the answer; a headless run
(papermill, nbval, ``workbench labs check``, a script) has no one to ask and goes on. After the experiment,
``check_prediction`` prints the prediction beside the measurement and the theory (``theory.calibration``'s line),
and stops a person who skipped the cell too. Who counts as a person: ``predictions_required``.

Not in ``theory``: telling a person from a headless run means asking the IPython kernel what sent the cell, and
``theory`` is pure Python with no dependency (DESIGN.md). The dashboard asks the same question
(``person_at_front_end``) to decide whether a widget can be drawn and clicked.
"""

from __future__ import annotations

import os
import sys

from workbench.theory.calibration import check_prediction as prediction_line

# Predictions are committed (CURRICULUM.md): before each experiment the learner writes a number or a choice into a
# `MY_... = None` cell. A person running the notebook who leaves one None is stopped there, before the answer is
# printed; a headless run (papermill, nbval, `workbench labs check`, a script) has no one to ask and goes on.
PREDICTIONS_ENV = "WORKBENCH_PREDICTIONS"  # "required" or "optional" overrides the detection below
_REQUIRED, _OPTIONAL = "required", "optional"


class PredictionMissing(Exception):
    """A prediction left ``None`` where a person runs the notebook. IPython shows it as one line, no traceback."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


def predictions_required() -> bool:
    """True when an unanswered prediction should stop the notebook: a person is running this cell.

    ``$WORKBENCH_PREDICTIONS`` decides when set (``required`` or ``optional``; the test suite sets ``optional``).
    Otherwise a person is detected as the dashboard does (``widgets.dashboard.has_widget_front_end``): the cell
    came from JupyterLab or Notebook 7, which put the cell's id in the execute request (``cellId``; nbclient,
    behind papermill and ``workbench labs check``, and nbval send none), or from VS Code or Colab. Plain Python
    and terminal IPython have no kernel: not required.
    """
    setting = os.environ.get(PREDICTIONS_ENV, "").strip().lower()
    if setting:
        if setting not in (_REQUIRED, _OPTIONAL):
            raise ValueError(f"${PREDICTIONS_ENV} must be {_REQUIRED!r} or {_OPTIONAL!r}, got {setting!r}")
        return setting == _REQUIRED
    return person_at_front_end()


def person_at_front_end() -> bool:
    """True when the cell running now was sent by a person's editor: JupyterLab or Notebook 7 (which put the cell's
    id in the execute request, ``cellId``; nbclient, behind papermill and ``workbench labs check``, and nbval send
    none), or a kernel hosted by VS Code or Colab. Plain Python and terminal IPython have no kernel: False. The
    dashboard asks it too (``widgets.dashboard.has_widget_front_end``)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return False
    if "google.colab" in sys.modules or "__vsc_ipynb_file__" in getattr(shell, "user_ns", {}):
        return True
    try:
        request = kernel.get_parent("shell") or {}
    except TypeError:  # ipykernel < 6.22 takes no channel
        request = kernel.get_parent() or {}
    return bool((request.get("metadata") or {}).get("cellId"))


def commit_prediction(*predicted: object) -> None:
    """The last line of a prediction cell: stops the notebook here while one of ``predicted`` is still ``None``.

    Only where ``predictions_required()`` (a person at JupyterLab); headless runs pass. The exception is one
    line, and Run All stops on it, before the experiment that shows the answer.
    """
    missing = sum(p is None for p in predicted)
    if missing and predictions_required():
        which = "your prediction is" if len(predicted) == 1 else f"{missing} of the {len(predicted)} predictions are"
        raise PredictionMissing(f"predict before you measure: {which} still None in this cell; write your guess "
                                "in place of None, run this cell, then run on")


def check_prediction(what: str, predicted: float | str | bool | None, measured: float | str | bool | None,
                     theory: float | str | bool | None = None, tol: float = 0.05) -> str:
    """One line: a learner's prediction beside the measurement and the theory (``theory.calibration``'s; nothing
    is graded). ``predicted=None``: a headless run says so in the line; where a person runs the notebook
    (``predictions_required()``) it raises ``PredictionMissing``, as ``commit_prediction`` did before the
    experiment. The one check every notebook and lab uses: none defines its own."""
    if predicted is None and predictions_required():
        raise PredictionMissing(f"{what}: no prediction given; fill in the MY_... cell before this experiment, "
                                "run it, then this cell")
    return prediction_line(what, predicted, measured, theory, tol)


__all__ = ["PREDICTIONS_ENV", "PredictionMissing", "check_prediction", "commit_prediction", "person_at_front_end",
           "predictions_required"]
