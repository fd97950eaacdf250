"""Fault tolerance: a rank killed, raising or hanging mid-run is restarted with all its peers, and the run resumes
from the newest good checkpoint to end bit-identical to an unbroken run (fixed seed): our launcher's
``max_restarts`` and torchrun's ``--max-restarts`` both.

The 6-step runs save after steps 1, 3 and 5 (``ckpt_every=2``). A fault planted before step 3 loses step 2's work:
the restarted ranks reload step 1's checkpoint and train steps 2..5 again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench import comm, launch
from workbench.checkpoint import list_steps
from workbench.cli import main, run_training
from workbench.faults import parse_fault, restart_count
from workbench.launch import RankError
from workbench.train import RunConfig

pytestmark = pytest.mark.timeout(300)

SMALL = dict(nproc=2, batch_size=8, seq_len=32, steps=6)


@pytest.fixture(scope="module")
def unbroken() -> dict:
    return run_training(RunConfig(**SMALL), progress=False)


def _faulty(tmp_path: Path, fault: str, **flags: object) -> dict:
    cfg = RunConfig(**SMALL, ckpt_dir=str(tmp_path / "ckpt"), ckpt_every=2, inject_fault=fault, **flags)
    return run_training(cfg, out=tmp_path / "out", progress=False)


# One kind of failure in the test command; a killed and a hung rank (the same restart path, reached by the watchdog
# and the collective timeout) in the extended lane.
@pytest.mark.parametrize("fault, timeout", [
    pytest.param("kill:rank=1:step=3", 120.0, id="sigkill", marks=pytest.mark.extended),
    pytest.param("raise:rank=0:step=3", 120.0, id="raise"),
    pytest.param("hang:rank=1:step=3", 6.0, id="hang", marks=pytest.mark.extended)])
def test_a_failed_rank_is_restarted_and_ends_bit_identical(fault: str, timeout: float, unbroken: dict,
                                                           tmp_path: Path) -> None:
    summary = _faulty(tmp_path, fault, max_restarts=1, timeout=timeout)
    assert summary["final_params_sha256"] == unbroken["final_params_sha256"]
    [restart] = summary["restarts"]
    spec = parse_fault(fault)
    assert restart["attempt"] == 1 and restart["last_step_done"] == 2
    if spec.kind != "hang":  # a hang is reported by whichever rank's collective timed out first
        assert restart["rank"] == spec.rank
    assert {"kill": "SIGKILL", "raise": "injected fault", "hang": "timed out"}[spec.kind].lower() in \
        restart["reason"].lower()
    assert summary["checkpoint"]["resumed_from_step"] == 1
    # The loss curve: steps 0-1 from the failed attempt, 2-5 from the restart, equal to the unbroken run's.
    assert [m["step"] for m in summary["history"]] == list(range(6))
    assert summary["losses"] == unbroken["losses"]
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written["restarts"] == summary["restarts"]
    assert list_steps(tmp_path / "ckpt") == [1, 3, 5]


def test_a_restart_rendezvouses_again_on_a_fixed_port(unbroken: dict, tmp_path: Path) -> None:
    """--port P: the restarted ranks meet on the same port the SIGKILLed attempt used, and still end
    bit-identical (the rendezvous of the first attempt must not hold the port)."""
    import socket

    with socket.socket() as probe:  # a port free right now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    summary = _faulty(tmp_path, "kill:rank=1:step=3", max_restarts=1, port=port)
    assert summary["final_params_sha256"] == unbroken["final_params_sha256"]
    assert [r["attempt"] for r in summary["restarts"]] == [1]


def test_async_checkpoints_restart_bit_identical_too(unbroken: dict, tmp_path: Path) -> None:
    """--async-ckpt: each save is snapshotted to CPU and written in a thread while the next steps train; the
    SIGKILLed run still resumes from a complete, verified checkpoint and ends bit-identical."""
    summary = _faulty(tmp_path, "kill:rank=1:step=4", max_restarts=1, async_ckpt=True)
    assert summary["final_params_sha256"] == unbroken["final_params_sha256"]
    # Step 3's save may still have been in its writer thread when SIGKILL came: then it has no manifest and the
    # restart falls back to step 1's. Either is correct; a torn one is never used.
    resumed = summary["checkpoint"]["resumed_from_step"]
    assert summary["checkpoint"]["async"] and resumed in (1, 3)
    assert [s["step"] for s in summary["checkpoint"]["stalls"]] == [s for s in (3, 5) if s > resumed]
    assert list_steps(tmp_path / "ckpt") == [1, 3, 5]


def test_without_restarts_the_fault_is_reported_naming_the_rank(tmp_path: Path) -> None:
    with pytest.raises(RankError, match="SIGKILL") as info:
        _faulty(tmp_path, "kill:rank=1:step=2")
    assert info.value.rank == 1


def test_a_restart_with_no_checkpoint_yet_starts_over(unbroken: dict, tmp_path: Path) -> None:
    summary = _faulty(tmp_path, "raise:rank=1:step=0", max_restarts=2)
    assert summary["final_params_sha256"] == unbroken["final_params_sha256"]
    assert summary["checkpoint"]["resumed_from_step"] is None
    assert [r["last_step_done"] for r in summary["restarts"]] == [None]


def test_a_stall_is_spent_in_its_rank_data_wait_and_changes_no_number(unbroken: dict) -> None:
    """``stall:rank=1:step=2:seconds=1``: rank 1 waits a second for its batch; rank 0 has its batch at once and waits
    the same second in the step's first collective, so the step takes a second on both ranks and only rank 1's
    data_wait_s says why. The numbers are the unbroken run's, bit for bit (a stall changes time, not data)."""
    seen: dict[tuple[int, int], dict] = {}
    summary = run_training(RunConfig(**SMALL, inject_fault="stall:rank=1:step=2:seconds=1"), progress=False,
                           on_metrics=lambda rank, m: seen.setdefault((rank, m["step"]), m))
    assert summary["final_params_sha256"] == unbroken["final_params_sha256"]
    assert seen[1, 2]["data_wait_s"] >= 1.0 and seen[0, 2]["data_wait_s"] < 0.5
    assert seen[0, 2]["step_time_s"] >= 0.9  # waited for rank 1 in a collective, not in its own data
    assert all(seen[1, s]["data_wait_s"] < 0.5 for s in (1, 3))  # once, at its step
    assert str(parse_fault("stall:rank=1:step=2")) == "stall:rank=1:step=2:seconds=2"  # DEFAULT_STALL_S


def _fails_once_on_rank_1() -> int:
    if comm.group_rank() == 1 and restart_count() == 0:
        raise RuntimeError("first attempt fails")
    return restart_count()


def test_launch_restarts_every_rank_and_says_which_attempt() -> None:
    results = launch(_fails_once_on_rank_1, 2, max_restarts=1, timeout=30)
    assert list(results) == [1, 1]  # both ranks are in the second attempt
    assert [(r["attempt"], r["rank"]) for r in results.restarts] == [(1, 1)]
    with pytest.raises(RankError, match="first attempt fails") as info:
        launch(_fails_once_on_rank_1, 2, timeout=30)
    assert info.value.restarts == []


@pytest.mark.parametrize("flags, message", [
    (dict(inject_fault="kill:rank=1"), "malformed; expected KIND:rank=R:step=S"),
    (dict(inject_fault="explode:rank=0:step=1"), "fault kind 'explode'.*valid: kill, raise, hang"),
    (dict(inject_fault="kill:rank=2:step=1"), "names rank 2 but the run has ranks 0..1"),
    (dict(inject_fault="kill:rank=0:step=6"), "names step 6 but the run has steps 0..5"),
    (dict(max_restarts=-1), "max_restarts must be an int >= 0"),
    (dict(inject_fault="kill:rank=1:step=2:seconds=3"), "only a stall lasts a number of seconds"),
    (dict(inject_fault="stall:rank=1:step=2:seconds=0"), "a stall must last seconds > 0"),
    (dict(inject_fault="stall:rank=1:step=2:seconds=9", timeout=5.0), "at least --timeout=5 s.*which is a hang"),
    (dict(inject_fault="stall:rank=1:step=2;kill:rank=2:step=3"), "names rank 2 but the run has ranks 0..1"),
])
def test_bad_fault_flags_are_rejected_before_spawning(flags: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunConfig(**SMALL, **flags)


def test_cli_bad_fault_spec_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--nproc", "2", "--inject-fault", "kill:rank=9:step=1", "--no-progress"])
    assert info.value.code == 2
    assert "names rank 9" in capsys.readouterr().err


@pytest.mark.extended  # torchrun's own restarts end to end (about a minute); launch's restarts are tested above
def test_torchrun_max_restarts_resumes_too(unbroken: dict, tmp_path: Path) -> None:
    """torchrun's elastic agent restarts every worker after rank 1's SIGKILL; each sees TORCHELASTIC_RESTART_COUNT
    and resumes from the newest checkpoint, ending with the unbroken run's parameters."""
    workbench_cli = Path(sys.executable).with_name("workbench")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "1", "--monitor-interval", "0.2", str(workbench_cli), "run", "--steps", "6",
           "--batch-size", "8", "--seq-len", "32", "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "2",
           "--inject-fault", "kill:rank=1:step=3", "--out", str(tmp_path / "out"), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["final_params_sha256"] == unbroken["final_params_sha256"]
    assert summary["checkpoint"]["resumed_from_step"] == 1
    assert summary["attempt"] == 1  # torchrun's restart count, seen by the ranks


@pytest.mark.parametrize("flags", [dict(), dict(zero=3), dict(tp=2), dict(pp=2)], ids=["ddp", "zero3", "tp2", "pp2"])
def test_export_is_a_full_state_dict_a_plain_model_loads(flags: dict, tmp_path: Path) -> None:
    """Whatever the shards, --export writes the unwrapped model's state dict; a plain GPT loads it strictly and
    hashes to the run's final_params_sha256."""
    import torch

    from workbench.models import build_gpt
    from workbench.train import params_sha256

    cfg = RunConfig(**{**SMALL, "steps": 2, **flags}, export=str(tmp_path / "model.pt"))
    summary = run_training(cfg, progress=False)
    plain = build_gpt(cfg.gpt_config(), seed=1)  # other weights, so the load must replace every one
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    assert params_sha256(dict(plain.named_parameters())) == summary["final_params_sha256"]
