"""One run, one record (issue 23 item 2): a run trained in pieces keeps one history across its attempts.

The rules of ``workbench.record`` on hand-written records (no ranks: fast), then a real run of 2 ranks trained in
three invocations (``--steps 4``, resumed to 8, resumed to 12) whose summary, report and ``workbench report`` page
show steps 0..11 as one curve in 3 attempts. The learning rate is constant past warm-up (``min_lr_ratio=1``) so
that the pieces train exactly what an unbroken 12-step run trains (the cosine otherwise depends on ``--steps``);
bit-identical resume itself is tests/test_resume.py's, so the comparison with an unbroken run is in the extended
lane.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.record import (
    RECORD_NAME,
    RunRecord,
    checkpoint_steps,
    read_record,
    record_event,
    record_path,
    whole_run,
)
from workbench.viz.report import read_embedded_json, read_figures

BASE_FLAGS = ["--nproc", "2", "--batch-size", "8", "--seq-len", "32", "--min-lr-ratio", "1", "--no-progress"]
SMALL_FLAGS = [*BASE_FLAGS, "--ckpt-every", "2"]


def _metrics(step: int, loss: float, attempt: int = 0) -> dict:
    return {"step": step, "loss": loss, "attempt": attempt, "rank": 0, "memory_peak": {}, "comm_bytes": {}}


def test_a_resume_continues_the_record_and_drops_what_the_resume_point_lost(tmp_path: Path) -> None:
    """Invocation 1 trains 0..5 (checkpoint after 3) and is killed; invocation 2 resumes from 3: its steps 4, 5
    replace the lost ones, and the first attempt ends "interrupted" (it never wrote its end)."""
    first = RunRecord(record_path(tmp_path), fresh=True)
    first.start("start", 2, {"dp": 2})
    for step in range(6):
        first.metrics(_metrics(step, 10.0 - step))
    first.event("checkpoint", step=3)
    second = RunRecord(record_path(tmp_path), fresh=False)
    second.start("resume", 2, {"dp": 2})
    for step in (4, 5, 6):
        second.metrics(_metrics(step, 1.0 + step))
    second.event("end", outcome="finished", last_step=6)
    run = whole_run(read_record(tmp_path))
    assert [(m["step"], m["loss"]) for m in run["history"]] == [(0, 10.0), (1, 9.0), (2, 8.0), (3, 7.0), (4, 5.0),
                                                              (5, 6.0), (6, 7.0)]
    assert [(a["cause"], a["first_step"], a["last_step"], a["outcome"]) for a in run["attempts"]] == [
        ("start", 0, 5, "interrupted"), ("resume", 4, 6, "finished")]
    assert all("rank" not in m and "memory_peak" not in m for m in run["history"])  # one rank's stream, not the step's
    assert checkpoint_steps(read_record(tmp_path)) == [3]


def test_a_restart_seen_in_the_stream_starts_an_attempt_and_its_reason_lands_on_the_failed_one() -> None:
    record = RunRecord(None, fresh=True)  # no checkpoints: in memory only
    record.start("start", 2, {"dp": 2})
    for step in range(4):
        record.metrics(_metrics(step, 5.0))
    for step in (2, 3, 4):  # the launcher restarted the ranks from the checkpoint of step 1
        record.metrics(_metrics(step, 4.0, attempt=1))
    record.event("restart", attempt=1, world=0, rank=1, reason="rank 1 died")
    record.event("end", outcome="finished")
    run = record.whole_run()
    assert [m["step"] for m in run["history"]] == [0, 1, 2, 3, 4]
    assert [m["loss"] for m in run["history"]] == [5.0, 5.0, 4.0, 4.0, 4.0]  # redone steps as the restart ran them
    failed, restarted = run["attempts"]
    assert (failed["outcome"], failed["failure"]) == ("failed", {"rank": 1, "reason": "rank 1 died"})
    assert (restarted["cause"], restarted["first_step"], restarted["outcome"]) == ("restart", 2, "finished")


def test_a_rollback_and_a_preemption_and_a_world_size_change(tmp_path: Path) -> None:
    with RunRecord(record_path(tmp_path), fresh=True) as record:
        record.start("start", 4, {"dp": 4})
        for step in (0, 1, 2, 3, 2, 3):  # a spike at step 3 rolled back to the checkpoint of step 1
            record.metrics(_metrics(step, float(step)), world_size=4)
        # the elastic code, through the public API, while this record is the active one
        record_event(tmp_path, "world_size", world_size=3, step=3, reason="rank 2 lost")
        record_event(tmp_path, "attempt", cause="shrink", world_size=3, layout={"dp": 3})
        for step in (2, 3, 4):
            record.metrics({**_metrics(step, 0.5), "world": 1}, world_size=3)
        record.event("preempted", step=4, signal="SIGTERM")
        record.event("end", outcome="preempted", last_step=4)
    run = whole_run(read_record(tmp_path))
    assert [m["step"] for m in run["history"]] == [0, 1, 2, 3, 4]
    first, shrunk = run["attempts"]  # the explicit attempt line, not a second one guessed from the new world
    assert (first["world_size"], first["world_size_change"]["world_size"]) == (4, 3)
    assert (shrunk["cause"], shrunk["world_size"], shrunk["outcome"]) == ("shrink", 3, "preempted")
    assert shrunk["preempted"] == {"step": 4, "signal": "SIGTERM"}


def test_a_new_world_nobody_announced_is_an_attempt_of_its_size() -> None:
    record = RunRecord(None, fresh=True)
    record.start("start", 4, {"dp": 4})
    record.metrics(_metrics(0, 1.0), world_size=4)
    record.metrics({**_metrics(1, 1.0), "world": 1}, world_size=3)  # a relaunch on 3: attempt numbers start again
    assert [(a["cause"], a["world_size"]) for a in record.whole_run()["attempts"]] == [("start", 4), ("shrink", 3)]


def test_a_torn_last_line_is_skipped_and_the_next_line_starts_on_its_own(tmp_path: Path) -> None:
    record = RunRecord(record_path(tmp_path), fresh=True)
    record.start("start", 1)
    record.metrics(_metrics(0, 2.0))
    with record_path(tmp_path).open("a") as f:
        f.write('{"kind": "metrics", "step": 1, "lo')  # killed mid-write
    again = RunRecord(record_path(tmp_path), fresh=False)
    again.start("resume", 1)
    again.metrics(_metrics(1, 1.5))
    assert [m["loss"] for m in whole_run(read_record(tmp_path))["history"]] == [2.0, 1.5]
    assert all(json.loads(line) for line in record_path(tmp_path).read_text().splitlines()[3:])


def test_a_new_run_starts_a_fresh_record(tmp_path: Path) -> None:
    RunRecord(record_path(tmp_path), fresh=True).start("start", 2)
    RunRecord(record_path(tmp_path), fresh=True).start("start", 2)
    assert [line["kind"] for line in read_record(tmp_path)] == ["attempt"]


@pytest.mark.parametrize("kind", ["metrics", "restarted", ""])
def test_record_event_names_the_valid_kinds(tmp_path: Path, kind: str) -> None:
    with pytest.raises(ValueError, match=r"is not an event; valid: attempt, restart, checkpoint"):
        record_event(tmp_path, kind, step=1)
    assert not record_path(tmp_path).exists()


# ---------------------------------------------------------------------------------------------------------------
# A real run in three invocations.


@pytest.fixture(scope="module")
def resumed_twice(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("record")
    ckpt = root / "ckpt"
    for steps, resume in (("4", []), ("8", ["--resume"]), ("12", ["--resume"])):
        code = main(["run", "--steps", steps, "--ckpt-dir", str(ckpt), "--out", str(root / f"out{steps}"), *resume,
                     *SMALL_FLAGS])
        assert code == 0
    return {"root": root, "ckpt": ckpt, "out": root / "out12"}


@pytest.mark.extended  # three launches (~15 s); notebook 16 and the GPU lane read a resumed run's record too
@pytest.mark.timeout(300)
def test_a_run_resumed_twice_is_one_run_from_step_0(resumed_twice: dict[str, Path]) -> None:
    summary = json.loads((resumed_twice["out"] / "summary.json").read_text())
    assert [m["step"] for m in summary["history"]] == list(range(12))
    assert summary["losses"] == [m["loss"] for m in summary["history"]]
    assert [(a["cause"], a["first_step"], a["last_step"], a["world_size"], a["outcome"])
            for a in summary["attempts"]] == [("start", 0, 3, 2, "finished"), ("resume", 4, 7, 2, "finished"),
                                             ("resume", 8, 11, 2, "finished")]
    assert summary["record"]["checkpoint_steps"] == [1, 3, 5, 7, 9, 11]
    assert summary["checkpoint"]["written_steps"] == [9, 11]  # this invocation's own saves stay as they were
    first = json.loads((resumed_twice["root"] / "out4" / "summary.json").read_text())
    assert summary["losses"][:4] == first["losses"]  # the first piece, as it was trained
    # the record follows the checkpoints; --out keeps a copy of it
    assert (resumed_twice["ckpt"] / RECORD_NAME).read_text() == (resumed_twice["out"] / RECORD_NAME).read_text()


@pytest.mark.extended  # three launches (~15 s); notebook 16 and the GPU lane read a resumed run's record too
@pytest.mark.timeout(300)
def test_the_report_and_workbench_report_show_one_curve_marked_per_attempt(resumed_twice: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    page = (resumed_twice["out"] / "report.html").read_text()
    loss = read_figures(page)[0]
    assert loss["data"][0]["x"] == list(range(12))
    labels = [a["text"] for a in loss["layout"]["annotations"]]
    assert labels == ["attempt 1: started, world size 2", "attempt 2: resumed, world size 2",
                      "attempt 3: resumed, world size 2"]
    shaded = [(s["x0"], s["x1"]) for s in loss["layout"]["shapes"] if s["type"] == "rect"]
    assert shaded == [(-0.5, 3.5), (3.5, 7.5), (7.5, 11.5)]
    assert "one run in 3 attempts" in page and len(read_embedded_json(page)["attempts"]) == 3
    compare = tmp_path / "compare.html"
    assert main(["report", str(resumed_twice["out"]), "--out", str(compare)]) == 0
    overlay = read_figures(compare.read_text())[0]
    assert overlay["data"][0]["x"] == list(range(12))  # one continuous curve, not the last piece's 4 steps


@pytest.mark.extended  # a fourth run of 12 steps; bit-identical resume is tests/test_resume.py's in the test command
@pytest.mark.timeout(300)
def test_the_pieces_equal_an_unbroken_run(resumed_twice: dict[str, Path], tmp_path: Path) -> None:
    unbroken = tmp_path / "unbroken"
    assert main(["run", "--steps", "12", "--out", str(unbroken), *BASE_FLAGS]) == 0
    full = json.loads((unbroken / "summary.json").read_text())
    pieces = json.loads((resumed_twice["out"] / "summary.json").read_text())
    assert pieces["losses"] == full["losses"]  # bit for bit: == on floats
    assert pieces["final_params_sha256"] == full["final_params_sha256"]
