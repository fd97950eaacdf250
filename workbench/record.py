"""One run, one record: the history of a run across every attempt and every invocation of ``workbench run``.

A run is often trained in pieces: restarted after a failure (``--max-restarts``), stopped by a preemption and
resumed (``--resume``), or resized. Each piece's summary alone starts where that piece started; the record keeps
them together so that summary.json and report.html cover the whole run from step 0.

Where it lives: ``<ckpt_dir>/record.jsonl`` (``RECORD_NAME``), beside the checkpoints, because that is the folder
a resume is given: whatever directory ``--resume`` finds its checkpoint in, it finds the run's past there too.
``write_outputs`` keeps a copy in ``--out``. A run without ``--ckpt-dir`` cannot be resumed, so its record lives
in memory only, for that invocation (its restarts start from step 0 and are still marked).

A new run (no ``--resume``, not a restarted torchrun attempt) starts a fresh record, replacing an old one in the
same folder: its checkpoints replace the old run's too.

Format: JSON Lines, one object per line, appended in the order things happened:

* ``{"kind": "metrics", "step": S, ...}``: rank 0's metrics of a step, as it streamed them to the parent
  (``run_training``'s ``on_report``), written as they arrive;
* ``{"kind": "attempt", "cause": "start"|"resume"|"restart"|..., "world_size": N, "layout": {...}}``: an attempt
  begins (an invocation's first, or a restart the parent saw in a new attempt number);
* ``restart`` (attempt, rank, reason), ``checkpoint`` (step), ``preempted`` (step, signal), ``world_size``
  (world_size, step, reason), ``end`` (outcome, last_step): what the attempt's end, or the summary, knows.

Every line carries ``time`` (seconds since the epoch) and ``invocation`` (how many ``attempt``/start lines with a
new invocation came before it). Each line is written with one ``os.write`` on a file opened ``O_APPEND``, so two
writers never interleave inside a line; a process killed mid-write can leave a torn last line, which the reader
skips and the next writer ends with a newline first. Not fsync-ed per step: the record survives the process being
killed (the kernel has the bytes), not the machine losing power, where the checkpoints' own fsync is what counts.

Reading (``whole_run``): a step's metrics replace any recorded for the same step or a later one, so steps redone
after a restart or a rollback count once, as the attempt that ran them last ran them, and steps a failed attempt
trained past the checkpoint the next attempt resumed from are dropped (that attempt's work was lost).

Public API: ``record_event(ckpt_dir, kind, **fields)`` appends an event (the elastic-resize code marks a world
size change with ``record_event(ckpt_dir, "world_size", world_size=3, step=S, reason=...)`` and starts the next
attempt with ``record_event(ckpt_dir, "attempt", cause="shrink", world_size=3)``); ``read_record``;
``whole_run``; ``RunRecord`` (what ``workbench.run`` holds while a run trains).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from workbench.dist.notices import notice

#: The record's file name inside a checkpoint directory (and in ``--out``).
RECORD_NAME = "record.jsonl"
#: The kinds of line a record holds; ``record_event`` refuses any other.
EVENT_KINDS = ("attempt", "restart", "checkpoint", "preempted", "world_size", "end", "note")
#: What starts an attempt (``attempt`` lines' ``cause``); the elastic code may add its own words.
ATTEMPT_CAUSES = ("start", "resume", "restart", "shrink", "grow")
#: Metric keys that belong to one rank's stream, not to the step: left out of the record.
_STREAM_ONLY = ("rank", "memory_peak", "comm_bytes")

_ACTIVE: dict[Path, RunRecord] = {}  # the records this process is writing, by file: record_event goes through them


def record_path(ckpt_dir: str | os.PathLike) -> Path:
    """Where the record of the run checkpointed in ``ckpt_dir`` is kept."""
    return Path(ckpt_dir) / RECORD_NAME


def record_event(ckpt_dir: str | os.PathLike, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event to the record of the run checkpointed in ``ckpt_dir``; returns the line written.

    ``kind`` is one of ``EVENT_KINDS``; ``fields`` are plain JSON values (e.g. ``step``, ``world_size``,
    ``reason``). An ``attempt`` event starts a new attempt: the metrics that follow belong to it."""
    if kind not in EVENT_KINDS or kind == "metrics":
        raise ValueError(f"record_event: kind {kind!r} is not an event; valid: {', '.join(EVENT_KINDS)}")
    path = record_path(ckpt_dir).resolve()
    active = _ACTIVE.get(path)
    if active is not None:
        return active.event(kind, **fields)
    return RunRecord(path, fresh=False).event(kind, **fields)


def read_record(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The lines of a record file (or of ``<dir>/record.jsonl``), oldest first; [] where there is none. A torn or
    unreadable line (a process killed mid-write) is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / RECORD_NAME
    if not path.is_file():
        return []
    lines = []
    for text in path.read_text(errors="replace").splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(line, dict) and "kind" in line:
            lines.append(line)
    return lines


class RunRecord:
    """The record one invocation appends to: in memory always, and in ``path`` when there is one.

    ``fresh``: start a new record (a new run), else continue the one at ``path`` (a resume or a restart)."""

    def __init__(self, path: str | os.PathLike | None, fresh: bool) -> None:
        self.path = None if path is None else Path(path).resolve()
        self.lines: list[dict[str, Any]] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if fresh:
                self.path.unlink(missing_ok=True)
            else:
                self.lines = read_record(self.path)
                self._end_torn_line()
        self.invocation = sum(1 for line in self.lines if line["kind"] == "attempt" and line.get("new_invocation"))
        self.attempt: int | None = None  # the attempt number the ranks stream (``restart_count``) in this invocation
        self._adopt = False  # an attempt line was just written: the next metrics' attempt number is its own

    def __enter__(self) -> RunRecord:
        if self.path is not None:
            _ACTIVE[self.path] = self
        return self

    def __exit__(self, *exc: object) -> None:
        if self.path is not None and _ACTIVE.get(self.path) is self:
            del _ACTIVE[self.path]

    def _end_torn_line(self) -> None:
        """A torn last line (no newline) gets one, so the next line starts on its own."""
        assert self.path is not None
        if self.path.is_file() and self.path.stat().st_size:
            with self.path.open("rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._write_bytes(b"\n")

    def _write_bytes(self, data: bytes) -> None:
        assert self.path is not None
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _append(self, line: dict[str, Any]) -> dict[str, Any]:
        line = {**line, "invocation": self.invocation, "time": round(time.time(), 3)}
        self.lines.append(line)
        if self.path is not None:
            text = json.dumps(json_safe(line), allow_nan=False, separators=(",", ":"), default=str)
            try:
                self._write_bytes(text.encode() + b"\n")
            except OSError as exc:  # a full or vanished disk must not stop the training: the record goes on in memory
                notice(f"cannot append to the run's record {self.path} ({exc}); this invocation's summary still "
                       f"covers what it holds in memory")
                self.path = None
        return line

    def start(self, cause: str, world_size: int, layout: dict[str, Any] | None = None,
              **fields: Any) -> dict[str, Any]:
        """This invocation's first attempt begins (``cause``: start, resume, or restart under torchrun)."""
        self.invocation += 1
        return self.event("attempt", cause=cause, world_size=world_size, layout=layout or {},
                          new_invocation=True, **fields)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append an event line (see ``record_event``)."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"RunRecord.event: kind {kind!r} is not an event; valid: {', '.join(EVENT_KINDS)}")
        if kind == "attempt":
            self._adopt = True
        return self._append({"kind": kind, **fields})

    def metrics(self, metrics: dict[str, Any], world_size: int | None = None) -> None:
        """Rank 0's metrics of one step, trained by ``world_size`` ranks. A new attempt number, or a new world (an
        elastic run's ``world`` count), that the parent had not announced with an ``attempt`` line starts a new
        attempt first: a restart by the launcher, or a shrink/grow where the world size changed."""
        key = (metrics.get("world", 0), metrics.get("attempt", 0))
        if self._adopt:
            self._adopt = False
        elif self.attempt is not None and key != self.attempt:
            last = self._last_attempt_line()
            size = last.get("world_size") if world_size is None else world_size
            before = last.get("world_size")
            cause = "restart" if size == before or None in (size, before) else ("shrink" if size < before else "grow")
            self.event("attempt", cause=cause, number=key[1], world=key[0], world_size=size,
                       layout=last.get("layout", {}))
            self._adopt = False
        self.attempt = key
        self._append({"kind": "metrics", **{k: v for k, v in metrics.items() if k not in _STREAM_ONLY}})

    def _last_attempt_line(self) -> dict[str, Any]:
        return next((line for line in reversed(self.lines) if line["kind"] == "attempt"), {})

    def whole_run(self) -> dict[str, Any]:
        """``whole_run`` of what this record holds."""
        return whole_run(self.lines)


def whole_run(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The run as one: ``history`` (each step once, as the attempt that ran it last ran it; see the module
    docstring), ``attempts`` (in order: cause, world size, layout, first and last step, outcome) and ``events``
    (every line that is not metrics, in order)."""
    history: dict[int, dict[str, Any]] = {}
    attempts: list[dict[str, Any]] = []
    events = []
    for line in lines:
        kind = line["kind"]
        if kind == "metrics":
            step = line["step"]
            while history and next(reversed(history)) >= step:  # steps ascend in the dict: drop from the end
                history.popitem()
            history[step] = {k: v for k, v in line.items() if k not in ("kind", "invocation", "time", "attempt")}
            if not attempts:  # metrics before any attempt line: a record begun by hand
                attempts.append(_attempt({"cause": "start", "invocation": line.get("invocation", 0)}, 0))
            current = attempts[-1]
            current["first_step"] = step if current["first_step"] is None else current["first_step"]
            current["last_step"] = step
            continue
        events.append({k: v for k, v in line.items() if k != "kind"} | {"kind": kind})
        if kind == "attempt":
            if attempts and attempts[-1]["outcome"] is None:  # ended without saying how: failed, or killed
                attempts[-1]["outcome"] = "failed" if not line.get("new_invocation") else "interrupted"
            attempts.append(_attempt(line, len(attempts)))
        elif kind == "restart":
            _failed(attempts, line)
        elif attempts:
            _apply_event(attempts[-1], kind, line)
    return {"history": [history[s] for s in sorted(history)], "attempts": attempts, "events": events}


def _attempt(line: dict[str, Any], index: int) -> dict[str, Any]:
    return {"index": index, "invocation": line.get("invocation", 0), "number": line.get("number", 0),
            "world": line.get("world", 0),
            "cause": line.get("cause", "start"), "world_size": line.get("world_size"),
            "layout": line.get("layout") or {}, "first_step": None, "last_step": None, "outcome": None}


def _failed(attempts: list[dict[str, Any]], line: dict[str, Any]) -> None:
    """A restart line (``attempt``: the number of the attempt that followed) names why the one before it failed:
    written when the invocation ends, so it is matched by invocation and number, not by position."""
    number = line.get("attempt")
    for attempt in attempts:
        if (attempt["invocation"], attempt["world"]) == (line.get("invocation"), line.get("world", 0)) \
                and number is not None and attempt["number"] == number - 1:
            attempt["outcome"] = "failed"
            attempt["failure"] = {k: line.get(k) for k in ("rank", "reason")}


def _apply_event(attempt: dict[str, Any], kind: str, line: dict[str, Any]) -> None:
    """What an event line says of the attempt it falls in."""
    if kind == "preempted":
        attempt["outcome"] = "preempted"
        attempt["preempted"] = {k: line.get(k) for k in ("step", "signal")}
    elif kind == "world_size":
        attempt["world_size_change"] = {k: line.get(k) for k in ("world_size", "step", "reason")}
    elif kind == "end" and attempt["outcome"] is None:
        attempt["outcome"] = line.get("outcome", "finished")


def checkpoint_steps(lines: list[dict[str, Any]]) -> list[int]:
    """Every step the run saved a checkpoint after, over all attempts, each once, in order."""
    return sorted({line["step"] for line in lines if line["kind"] == "checkpoint" and line.get("step") is not None})


def json_safe(value: Any) -> Any:
    """``value`` for strict JSON (summary.json, traces.json and the record): NaN and inf (a diverged loss, a skipped
    fp16 step's gradient norm) as null, since strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
