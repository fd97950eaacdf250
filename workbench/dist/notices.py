"""Messages for the learner: one plain line each, ``workbench: <message>``, in a terminal and in a notebook.

Two kinds (issue 25, "Messages a learner can read"):

* ``notice(message)``: something went differently than asked, and code may want to catch it (a checkpoint that
  did not verify, so an older one is used). It is a ``WorkbenchNotice`` warning, a ``UserWarning``, so
  ``pytest.warns(UserWarning, match=...)``, ``warnings.catch_warnings(record=True)`` and ``-W error`` treat it as
  any warning. Only its display differs: ``workbench: <message>``, without Python's ``file.py:305: UserWarning:``
  and the line of our source under it, which tell a learner nothing.
* ``say(message)``: a plain note of what the run is doing (a placement, a restart, a resharded resume); not a
  warning, nothing to catch.

Both go to stderr in a terminal (stdout stays the run's results), and to stdout in a Jupyter kernel, where stderr
is drawn as a red box that reads as an error.

The display is customised through ``warnings.formatwarning`` (for ``WorkbenchNotice`` only; every other warning
is formatted by the function that was there before), and the stream through a ``warnings.showwarning`` wrapper
(again for ``WorkbenchNotice`` only). ``catch_warnings`` saves and restores ``showwarning`` but never
``formatwarning``, and its ``record=True`` mode sets ``showwarning`` back to the default to record: so recording
still records, and a notice shown anywhere else is one line, even where the stream wrapper was undone.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any, TextIO

PREFIX = "workbench: "


class WorkbenchNotice(UserWarning):
    """A warning meant for the learner: displayed as one line, ``workbench: <message>`` (``notice``)."""


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (its stdout is ipykernel's stream): output lands in a notebook."""
    return type(sys.stdout).__module__.startswith("ipykernel")


def stream() -> TextIO:
    """Where learner messages go: stdout in a notebook (stderr is a red box there), stderr in a terminal."""
    return sys.stdout if in_kernel() else sys.stderr


def say(message: str) -> None:
    """Print ``workbench: <message>`` on one line to the learner's stream (``stream``), now (flushed)."""
    print(PREFIX + message, file=stream(), flush=True)


def notice(message: str, stacklevel: int = 2) -> None:
    """Warn with ``WorkbenchNotice``: shown as ``workbench: <message>``, caught as any ``UserWarning``.

    ``stacklevel`` is ``warnings.warn``'s: it only decides which module a ``-W``/``filterwarnings`` filter
    matches, since the display names no source location.
    """
    _install()
    warnings.warn(WorkbenchNotice(message), stacklevel=stacklevel + 1)


def _format(message: Warning | str, category: type[Warning], filename: str, lineno: int,
            line: str | None = None) -> str:
    if isinstance(category, type) and issubclass(category, WorkbenchNotice):
        return f"{PREFIX}{message}\n"
    return _previous_format(message, category, filename, lineno, line)


def _show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
          file: TextIO | None = None, line: str | None = None) -> None:
    if isinstance(category, type) and issubclass(category, WorkbenchNotice):
        target = stream() if file is None else file
        try:
            target.write(_format(message, category, filename, lineno, line))
            target.flush()
        except (OSError, AttributeError, ValueError):  # no stream (pythonw) or a closed one: as warnings does
            pass
        return
    _previous_show(message, category, filename, lineno, file, line)


def _recording() -> bool:
    """Whether a ``catch_warnings(record=True)`` block is active: it records through ``_showwarnmsg_impl`` (its
    list's ``append``) only while ``showwarning`` is the default one, so a wrapper installed now would take the
    notices it should record. A private attribute of ``warnings``: unknown means "recording", the safe answer."""
    impl = getattr(warnings, "_showwarnmsg_impl", None)
    return getattr(impl, "__name__", "") != "_showwarnmsg_impl"


def _install() -> None:
    """Put ``_show`` back in front of ``showwarning`` where a ``catch_warnings`` block took it away (restoring what
    was there before this module), but not while one records. Only then: a hook installed after ours may call
    ours, and wrapping it again would loop."""
    if warnings.showwarning is _previous_show and not _recording():
        warnings.showwarning = _show


# Installed at import, each in front of the hook there was (they defer to it for every other warning).
# ``formatwarning`` once for the process: ``catch_warnings`` never restores it. A re-import (importlib.reload)
# leaves the first install in place, whose functions serve the same purpose.
_previous_format: Any = warnings.formatwarning
_previous_show: Any = warnings.showwarning
if not getattr(_previous_format, "_workbench_notice", False):
    _format._workbench_notice = True  # type: ignore[attr-defined]
    _show._workbench_notice = True  # type: ignore[attr-defined]
    warnings.formatwarning = _format
    _install()
