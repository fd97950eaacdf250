"""Stopping a parameter-server run (issue 23 item 1): the stop file that SIGTERM/SIGINT (``run.preemptible``) or the
dashboard's Stop button creates reaches the servers in the next push (``PSWorker.push(stop=True)``): a synchronous
run stops after one step on every rank, keeps a checkpoint there, and resumes bit for bit to the unbroken run's end;
an asynchronous run's server 0 stops each worker it answers. Before, neither loop looked at the stop file, so a
signal left the run training to its last step.

Tolerance: none for the resume: the same gradients summed in worker order by the same server, as in
tests/test_param_server_ckpt.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from workbench.checkpoint.store import step_dir, verify
from workbench.run import PREEMPTED_EXIT_CODE, run_training
from workbench.train import RunConfig

pytestmark = pytest.mark.timeout(240)

PS = dict(nproc=3, ps_servers=1, batch_size=8, seq_len=32, steps=5)  # workers: ranks 0 and 1; server: rank 2


def _stopped_before_start(tmp_path: Path, **flags: object) -> dict:
    """A run whose stop file exists from the start: the first push asks to stop, so it ends after step 0."""
    stop = tmp_path / "stop"
    stop.touch()
    return run_training(RunConfig(**{**PS, **flags}, extra={"stop_file": str(stop)}), progress=False)


def test_a_stop_request_ends_a_synchronous_run_after_one_step_with_a_checkpoint(tmp_path: Path) -> None:
    summary = _stopped_before_start(tmp_path, ckpt_dir=str(tmp_path / "ck"), ckpt_every=2)
    assert summary["stopped_after_step"] == 0 and [m["step"] for m in summary["history"]] == [0]
    assert summary["checkpoint"]["written_steps"] == [0] and verify(step_dir(tmp_path / "ck", 0)) == []
    assert summary["parameter_server"]["per_server"][0]["updates"] == 1


def test_a_stop_request_ends_an_asynchronous_run_early(tmp_path: Path) -> None:
    summary = _stopped_before_start(tmp_path, ps_async=True)
    server = summary["parameter_server"]["per_server"][0]
    assert server["updates"] < PS["steps"] * 2  # 2 workers: the unbroken run applies steps x W gradients
    assert summary["stopped_after_step"] == summary["history"][-1]["step"] < PS["steps"] - 1


@pytest.mark.extended  # a `workbench run` subprocess signalled mid-run, a resume and the unbroken run (~40 s)
def test_sigterm_preempts_a_parameter_server_run_and_its_resume_is_bit_identical(tmp_path: Path) -> None:
    ckpt, out, log, steps = tmp_path / "ck", tmp_path / "pre", tmp_path / "log", 40
    flags = ["--nproc", "3", "--ps-servers", "1", "--batch-size", "8", "--seq-len", "32", "--steps", str(steps),
             "--timeout", "60", "--no-progress", "--ckpt-every", "4", "--ckpt-dir", str(ckpt), "--out", str(out)]
    env = {**os.environ, "WORKBENCH_PREEMPT_TEST": uuid.uuid4().hex}
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "run", *flags], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (step_dir(ckpt, 3) / "manifest.json").exists():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=90)
    text = log.read_text()
    assert proc.returncode == PREEMPTED_EXIT_CODE, text[-3000:]
    pre = json.loads((out / "summary.json").read_text())
    n = pre["preempted"]["step"]
    assert 3 <= n < steps - 1 and pre["checkpoint"]["written_steps"][-1] == n, text[-3000:]
    same = dict(nproc=3, ps_servers=1, batch_size=8, seq_len=32, steps=steps, ckpt_every=4)
    resumed = run_training(RunConfig(**same, ckpt_dir=str(ckpt), resume=True), progress=False)
    full = run_training(RunConfig(**{**same, "ckpt_every": None}), progress=False)
    assert resumed["checkpoint"]["resumed_from_step"] == n
    assert resumed["final_params_sha256"] == full["final_params_sha256"]
    assert resumed["losses"] == full["losses"]
