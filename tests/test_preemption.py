"""Graceful preemption (docs/preemption.md): SIGTERM or SIGINT stops every rank after the same step, checkpoints
there, writes summary.json and report.html marked "preempted" and exits with ``PREEMPTED_EXIT_CODE``; a resume then
ends bit for bit where an unbroken run ends; a signal during a checkpoint write never costs the previous checkpoint;
a second signal stops at once. The Slurm template forwards its warning signal, requeues and resumes.

Runs are slowed by an emulated straggler (sleeps inside rank 1's compute spans: the numbers are untouched) so that
a signal sent after a checkpoint appears still finds the run training on a loaded machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from workbench.checkpoint import latest_good, list_steps, step_dir, verify
from workbench.run import PREEMPTED_EXIT_CODE, run_training
from workbench.train import RunConfig
from workbench.training import trainer

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[1]
STEPS = 24
FLAGS = ["--nproc", "2", "--batch-size", "4", "--seq-len", "32", "--timeout", "60", "--no-progress"]
CKPT = ["--ckpt-every", "3"]


def _start_cli(args: list[str], marker: str, log: Path) -> subprocess.Popen:
    """``workbench run`` in a process of its own; ``marker`` in its environment finds every process it started."""
    env = {**os.environ, "WORKBENCH_PREEMPT_TEST": marker}
    return subprocess.Popen([sys.executable, "-m", "workbench.cli", "run", *args], env=env, cwd=os.getcwd(),
                            stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, proc: subprocess.Popen | None = None, timeout: float = 90.0) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {path} appeared")
        if time.time() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)


def _processes_with(marker: str) -> list[int]:
    """Live processes (not zombies) whose environment holds ``marker``: the run's ranks, forkserver, trackers."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # ended meanwhile, or not ours
                continue
    return found


def _assert_nothing_left(marker: str) -> None:
    deadline = time.time() + 10.0  # the forkserver and resource tracker leave when they see the caller gone
    while (left := _processes_with(marker)) and time.time() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (the forkserver reaps its ranks; a zombie has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the run did not end within {timeout} s:\n{log.read_text()[-3000:]}") from None
    return log.read_text()


@pytest.mark.extended  # the test command keeps the signal-during-a-write cases; the GPU lane preempts a CUDA run
def test_sigterm_stops_at_one_step_checkpoints_and_a_resume_matches_an_unbroken_run(tmp_path: Path) -> None:
    ckpt, marker, log = tmp_path / "ckpt", uuid.uuid4().hex, tmp_path / "log"
    slow = ["--straggler", "rank=1:factor=4"]  # ~0.1 s a step: 20 steps after the signal
    proc = _start_cli(["--steps", str(STEPS), *FLAGS, *CKPT, *slow, "--ckpt-dir", str(ckpt),
                       "--out", str(tmp_path / "pre")], marker, log)
    _wait_for(step_dir(ckpt, 2) / "manifest.json", proc)
    proc.send_signal(signal.SIGTERM)
    text = _finish(proc, log)
    assert proc.returncode == PREEMPTED_EXIT_CODE, text[-3000:]
    assert "leaked semaphore" not in text and "Traceback" not in text, text[-3000:]
    pre = json.loads((tmp_path / "pre" / "summary.json").read_text())
    n = pre["preempted"]["step"]
    assert pre["preempted"] == {"step": n, "signal": "SIGTERM", "exit_code": PREEMPTED_EXIT_CODE}
    assert 2 <= n < STEPS - 1 and pre["history"][-1]["step"] == n == pre["stopped_after_step"]
    assert pre["checkpoint"]["written_steps"][-1] == n and verify(step_dir(ckpt, n)) == []
    assert "preempted" in (tmp_path / "pre" / "report.html").read_text()
    _assert_nothing_left(marker)

    # the same flags as the command line's (RunConfig's defaults are the flags' defaults: test_cli_config)
    same = dict(nproc=2, steps=STEPS, batch_size=4, seq_len=32, timeout=60)
    resumed = run_training(RunConfig(**same, ckpt_dir=str(ckpt), ckpt_every=3, resume=True), progress=False)
    full = run_training(RunConfig(**same), progress=False)
    assert "preempted" not in resumed and resumed["checkpoint"]["resumed_from_step"] == n
    assert resumed["final_params_sha256"] == full["final_params_sha256"]
    # the resumed run's summary is the whole run's (workbench.record): the preempted piece, then the resume
    assert resumed["losses"][:n + 1] == pre["losses"] and resumed["losses"] == full["losses"]
    assert [(a["cause"], a["outcome"]) for a in resumed["attempts"]] == [("start", "preempted"), ("resume", "finished")]


# -- a signal while a checkpoint is being written (in this process: run_training catches it here) -----------------

_TRAIN_RANK = trainer.train_rank


def _rank_with_slow_save(cfg: RunConfig) -> dict[str, Any]:
    """``train_rank`` whose save of step ``extra["slow_save"]["step"]`` writes this rank's shard, touches the marker
    and holds ``hold_s`` before the manifest: a signal sent on the marker lands in the middle of a checkpoint."""
    from workbench.checkpoint import store

    slow, write = cfg.extra["slow_save"], store.save_shard
    (Path(slow["marker"]).parent / f"rank-pid-{os.getpid()}").touch()  # for the test to see it gone

    def save_shard(directory: Any, step: int, rank: int, state: Any) -> Path:
        path = write(directory, step, rank, state)
        if step == slow["step"]:
            Path(slow["marker"]).touch()
            time.sleep(slow["hold_s"])
        return path

    store.save_shard = save_shard
    return _TRAIN_RANK(cfg)


@pytest.fixture
def signals_caught() -> Iterator[list[int]]:
    """SIGTERM and SIGINT reaching this process outside a run are recorded, not fatal (the run's own handlers are
    put back to these when it ends)."""
    stray: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: stray.append(signum)) for s in (signal.SIGTERM,
                                                                                            signal.SIGINT)}
    yield stray
    for s, handler in previous.items():
        signal.signal(s, handler)


def _signal_on(marker: Path, signum: int, times: int) -> list[float]:
    """Send ``signum`` to this process ``times`` times (0.3 s apart) once ``marker`` exists; the send times."""
    sent: list[float] = []

    def send() -> None:
        _wait_for(marker, timeout=90.0)
        for i in range(times):
            time.sleep(0.3 if i else 0.0)
            sent.append(time.time())
            os.kill(os.getpid(), signum)

    threading.Thread(target=send, daemon=True).start()
    return sent


def _slow_cfg(tmp_path: Path, step: int, hold_s: float) -> RunConfig:
    return RunConfig(nproc=2, steps=STEPS, batch_size=4, seq_len=32, timeout=60, ckpt_dir=str(tmp_path / "ckpt"),
                     ckpt_every=3, extra={"slow_save": {"step": step, "marker": str(tmp_path / "writing"),
                                                        "hold_s": hold_s}})


def test_a_signal_during_a_checkpoint_write_waits_for_it(tmp_path: Path, signals_caught: list[int],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer, "train_rank", _rank_with_slow_save)
    _signal_on(tmp_path / "writing", signal.SIGINT, times=1)
    summary = run_training(_slow_cfg(tmp_path, step=2, hold_s=1.0), progress=False)
    assert summary["preempted"] == {"step": 2, "signal": "SIGINT", "exit_code": PREEMPTED_EXIT_CODE}
    assert summary["checkpoint"]["written_steps"] == [2]  # finished, not cut, and not saved twice
    assert list_steps(tmp_path / "ckpt") == [2] and verify(step_dir(tmp_path / "ckpt", 2)) == []
    assert signals_caught == []


def test_a_second_signal_during_a_checkpoint_write_keeps_the_previous_checkpoint(
        tmp_path: Path, signals_caught: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainer, "train_rank", _rank_with_slow_save)
    hold_s = 4.0
    sent = _signal_on(tmp_path / "writing", signal.SIGTERM, times=2)
    with pytest.raises(SystemExit) as stopped:
        run_training(_slow_cfg(tmp_path, step=5, hold_s=hold_s), progress=False)
    assert stopped.value.code == 128 + signal.SIGTERM  # `workbench run`'s exit status
    assert len(sent) == 2 and time.time() - sent[0] < hold_s - 1.0, "the forced stop waited for the write"
    pids = [int(f.name.rsplit("-", 1)[1]) for f in tmp_path.glob("rank-pid-*")]
    assert len(pids) == 2 and not [pid for pid in pids if _alive(pid)], "a rank outlived the forced stop"
    ckpt = tmp_path / "ckpt"
    assert list_steps(ckpt) == [2, 5] and verify(step_dir(ckpt, 5)) != []  # shards written, no manifest
    with pytest.warns(UserWarning, match="falling back to checkpoint step-000002"):
        assert latest_good(ckpt) == step_dir(ckpt, 2) and verify(step_dir(ckpt, 2)) == []
    assert signals_caught == []


# -- the Slurm template -------------------------------------------------------------------------------------------

SBATCH = REPO / "cluster" / "slurm" / "workbench.sbatch"


def _sbatch(tmp_path: Path, args: list[str]) -> subprocess.Popen:
    """The Slurm script with stand-ins: srun records its arguments and, like the ranks, ends on SIGTERM; scontrol
    prints the node list or records a requeue."""
    stubs = {"scontrol": 'if [ "$1" = requeue ]; then echo "$@" > "$OUT/requeue"; else printf "gpu-a17\\n"; fi',
             "srun": 'printf "%s\\n" "$@" > "$OUT/srun.args"\nsleep 30 & SLEEP=$!\n'
                     'trap \'echo TERM > "$OUT/srun.term"; kill $SLEEP; exit 0\' TERM\n'
                     'touch "$OUT/srun.started"\nwait $SLEEP',
             "workbench": "exit 0"}
    for name, body in stubs.items():
        (tmp_path / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (tmp_path / name).chmod(0o755)
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}", "OUT": str(tmp_path),
           "SLURM_JOB_NODELIST": "gpu-a17", "SLURM_NNODES": "1", "SLURM_JOB_ID": "4123456",
           "SLURM_GPUS_ON_NODE": "2", "SLURM_CPUS_PER_TASK": "4"}
    return subprocess.Popen(["bash", str(SBATCH), *args], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(60)
def test_sbatch_forwards_its_warning_signal_requeues_and_resumes(tmp_path: Path) -> None:
    text = SBATCH.read_text()
    assert "#SBATCH --signal=B:TERM@" in text and "#SBATCH --requeue" in text
    args = ["--steps", "100", "--ckpt-dir", "ck"]
    job = _sbatch(tmp_path, args)
    _wait_for(tmp_path / "srun.started", timeout=30)
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=30)
    assert job.returncode == 0, out
    assert (tmp_path / "srun.term").exists(), "srun did not get the SIGTERM"
    assert (tmp_path / "requeue").read_text().split() == ["requeue", "4123456"]
    assert "--resume" not in (tmp_path / "srun.args").read_text().split()  # nothing saved yet: a fresh start

    (tmp_path / "ck" / "step-000005").mkdir(parents=True)
    (tmp_path / "ck" / "step-000005" / "manifest.json").write_text("{}")
    (tmp_path / "srun.started").unlink()
    job = _sbatch(tmp_path, args)
    _wait_for(tmp_path / "srun.started", timeout=30)
    job.send_signal(signal.SIGTERM)
    out, _ = job.communicate(timeout=30)
    srun = (tmp_path / "srun.args").read_text().splitlines()
    assert srun[-len(args) - 2:] == ["run", "--resume", *args], out
