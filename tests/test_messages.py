"""Messages a learner can read (issue 25, item 4): a notice is one ``workbench:`` line, without the source path and
code line Python's warnings print, and outside a terminal the progress is a few lines, each step at most once."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from workbench.dist import notices
from workbench.dist.notices import WorkbenchNotice, notice, say
from workbench.run import LineProgress, progress_bar, run_training
from workbench.train import RunConfig

pytestmark = pytest.mark.timeout(300)

# A process of its own: stderr is a pipe, as in CI, and warnings are shown by Python's own machinery (no pytest
# recording in between). It falls back past a truncated checkpoint (RunConfig's checks and the resume both find
# it: one line all the same), then warns the ordinary way once.
_TERMINAL = textwrap.dedent("""
    import sys, warnings
    import torch
    from workbench.checkpoint import store
    from workbench.checkpoint.resume import checkpoint_config, find_resume_point
    from workbench.training.config import RunConfig

    saved = checkpoint_config(RunConfig(steps=30))
    for step in (10, 20):
        store.save(sys.argv[1], step, {"w": torch.zeros(16), "step": step}, meta={"run_config": saved})
    shard = store.step_dir(sys.argv[1], 20) / "rank-00000.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    run = RunConfig(ckpt_dir=sys.argv[1], steps=30, resume=True)  # its checks look for the resume point too
    print(find_resume_point(run).name)
    warnings.warn("an ordinary warning")
""")


def test_a_fallback_in_a_terminal_is_one_plain_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _TERMINAL, str(tmp_path)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "step-000010"
    fallback, *rest = done.stderr.splitlines()
    assert fallback.startswith("workbench: falling back to checkpoint step-000010: newer checkpoint(s) did not "
                               "verify: step-000020: ")
    assert "truncated" in fallback and ".py:" not in fallback and "UserWarning" not in fallback
    # Shown once, nothing under it (Python prints the source line there), and other warnings keep Python's
    # format (`python -c` has no source line to print under it).
    assert len(rest) == 1 and re.fullmatch(r"<string>:\d+: UserWarning: an ordinary warning", rest[0]), rest
    assert "latest_good" not in done.stderr


def test_a_notice_is_still_a_user_warning_to_catch() -> None:
    with pytest.warns(UserWarning, match="falling back"):
        notice("falling back to checkpoint step-000001")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notice("recorded, not printed")
    assert [(w.category, str(w.message)) for w in caught] == [(WorkbenchNotice, "recorded, not printed")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(WorkbenchNotice):
            notice("-W error makes it raise, as any warning")


def test_a_notice_is_formatted_as_one_line_whoever_shows_it() -> None:
    line = warnings.formatwarning("resharding step-000004", WorkbenchNotice, "/x/workbench/run.py", 305, "x = y")
    assert line == "workbench: resharding step-000004\n"
    other = warnings.formatwarning("plain", UserWarning, "/x/mod.py", 7, "x = y")
    assert other.startswith("/x/mod.py:7: UserWarning: plain")


def test_say_goes_to_stderr_in_a_terminal_and_to_stdout_in_a_notebook(capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    say("rank 1 failed (killed); restarting all 2 rank(s), restart 1 of 1")
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "workbench: rank 1 failed (killed); restarting all 2 rank(s), "
                                                "restart 1 of 1\n")
    kernel_stream = type("OutStream", (io.StringIO,), {"__module__": "ipykernel.iostream"})()
    monkeypatch.setattr(sys, "stdout", kernel_stream)
    assert notices.in_kernel()
    say("2 rank(s), gloo on the CPU")  # stderr would be a red box in the notebook
    assert kernel_stream.getvalue() == "workbench: 2 rank(s), gloo on the CPU\n"


def _steps(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"step (\d+)/", text)]


def test_non_tty_progress_is_a_few_lines_each_step_once() -> None:
    log = io.StringIO()  # not a TTY, not a notebook: what CI captures
    bar = progress_bar(50, "training on 2 rank(s)", file=log)
    assert isinstance(bar, LineProgress)
    for done in [*range(1, 31), *range(21, 51)]:  # a restart at step 30 goes back to step 20's checkpoint
        bar.update(done, 3.0, 1000.0)
    bar.close()
    lines = log.getvalue().splitlines()
    assert 5 <= len(lines) <= 20 and _steps(log.getvalue()) == [1, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50]
    assert lines[-1].startswith("training on 2 rank(s): step 50/50, loss 3.000, 1000 tok/s, ")


def test_a_stopped_run_still_shows_its_last_step() -> None:
    log = io.StringIO()
    bar = LineProgress(50, "training", log)
    for done in range(1, 8):
        bar.update(done, 3.0, 1000.0)
    bar.close()
    assert _steps(log.getvalue()) == [1, 5, 7]


def test_a_50_step_run_logs_at_most_20_progress_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """A real run with stderr captured (not a TTY): what a CI log shows."""
    run_training(RunConfig(nproc=1, steps=50, model="tiny", seq_len=16, batch_size=2, timeout=240))
    err = capsys.readouterr().err
    progress = [line for line in err.splitlines() if line.startswith("training on")]
    steps = _steps("\n".join(progress))
    assert 5 <= len(progress) <= 20 and steps == sorted(set(steps)) and steps[-1] == 50, err
    assert "\r" not in err and "it/s" not in err  # no tqdm redraws
