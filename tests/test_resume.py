"""Checkpoint and resume in the trainer: a run stopped and resumed ends bit-for-bit where an unbroken run ends.

Same-layout resume: every rank reloads the shard its strategy holds (model and optimizer state dicts, RNG, the
sampler's step), so the resumed run does the very same operations in the same order as the unbroken one, on the
same CPU: bit for bit (sha256 of the parameters, losses compared with ==) on any machine. The 4-step runs below
share the 6-step run's learning rates because the default warm-up (5 steps) covers steps 0-3; past warm-up the
cosine depends on ``steps``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from workbench.checkpoint import list_steps, step_dir, verify
from workbench.cli import main, run_training
from workbench.train import RunConfig

pytestmark = pytest.mark.timeout(300)

SMALL = dict(nproc=2, batch_size=8, seq_len=32, ckpt_every=2)
SMALL_FLAGS = ["--nproc", "2", "--batch-size", "8", "--seq-len", "32", "--ckpt-every", "2", "--no-progress"]


def _full_run(ckpt_dir: Path, **flags: object) -> dict:
    return run_training(RunConfig(steps=6, ckpt_dir=str(ckpt_dir), **SMALL, **flags), progress=False)


@pytest.fixture(scope="module")
def ddp_full(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    ckpt = tmp_path_factory.mktemp("ddp") / "ckpt"
    return _full_run(ckpt), ckpt


def _assert_same_ending(full: dict, resumed: dict) -> None:
    """The resumed run's summary is the whole run's (its record, workbench.record): steps 0-3 as the first piece
    trained them (the same learning rates: warm-up covers them), 4-5 as the resume did, equal to the unbroken run."""
    assert resumed["final_params_sha256"] == full["final_params_sha256"]
    assert resumed["losses"] == full["losses"]
    assert [m["step"] for m in resumed["history"]] == list(range(6))
    assert resumed["attempts"][-1]["cause"] == "resume" and resumed["attempts"][-1]["first_step"] == 4


@pytest.mark.parametrize("zero", [0, pytest.param(1, marks=pytest.mark.extended)])  # ZeRO-1: also the crash case below
def test_stop_at_4_then_resume_to_6_matches_an_unbroken_run(zero: int, ddp_full, tmp_path: Path) -> None:
    full = ddp_full[0] if zero == 0 else _full_run(tmp_path / "full", zero=zero)
    assert full["checkpoint"]["written_steps"] == [1, 3, 5]
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    run_training(RunConfig(steps=4, ckpt_dir=str(ckpt), zero=zero, **SMALL), progress=False)
    assert list_steps(ckpt) == [1, 3]
    code = main(["run", "--steps", "6", "--zero", str(zero), "--ckpt-dir", str(ckpt), "--resume", "--out", str(out),
                 *SMALL_FLAGS])
    assert code == 0
    resumed = json.loads((out / "summary.json").read_text())
    _assert_same_ending(full, resumed)
    assert resumed["checkpoint"]["resumed_from_step"] == 3
    assert resumed["checkpoint"]["written_steps"] == [5]
    assert list_steps(ckpt) == [1, 3, 5] and verify(step_dir(ckpt, 5)) == []


@pytest.mark.parametrize("flags", [dict(zero=3), dict(pp=2), dict(zero=1, offload=True)],
                         ids=["zero3", "pp2", "zero1-offload"])
def test_resume_after_a_crash_matches_for_zero3_pipeline_and_offload(flags: dict, tmp_path: Path) -> None:
    full = _full_run(tmp_path / "full", keep=2, **flags)
    assert list_steps(tmp_path / "full") == [3, 5]  # keep=2 pruned step 1 once step 5 verified
    crashed = tmp_path / "crashed"  # the same run, killed after step 4: step 5 was never saved
    shutil.copytree(tmp_path / "full", crashed)
    shutil.rmtree(step_dir(crashed, 5))
    resumed = run_training(RunConfig(steps=6, ckpt_dir=str(crashed), resume=True, **SMALL, **flags), progress=False)
    _assert_same_ending(full, resumed)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(ddp_full, tmp_path: Path) -> None:
    full, source = ddp_full
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source, ckpt)
    shard = step_dir(ckpt, 5) / "rank-00001.pt"
    shard.write_bytes(shard.read_bytes()[:100])  # a torn write
    with pytest.warns(UserWarning, match="falling back to checkpoint step-000003"):
        cfg = RunConfig(steps=6, ckpt_dir=str(ckpt), resume=True, **SMALL)
    resumed = run_training(cfg, progress=False)
    _assert_same_ending(full, resumed)
    assert resumed["checkpoint"]["resumed_from_step"] == 3
    assert any("truncated" in w for w in resumed["checkpoint"]["skipped_on_resume"])
    assert verify(step_dir(ckpt, 5)) == []  # discarded on resume, then saved again whole


@pytest.mark.parametrize("kwargs, message", [
    (dict(ckpt_dir="{tmp}", keep=0), "keep must be an int >= 1"),
    (dict(ckpt_dir="{tmp}", ckpt_every=0), "ckpt_every must be a positive int"),
    (dict(keep=2), "keep=2 needs ckpt_dir"),
    (dict(ckpt_every=2), "ckpt_every=2 needs ckpt_dir"),
    (dict(resume=True), "resume needs ckpt_dir"),
    (dict(ckpt_dir="{tmp}/missing", resume=True), "cannot resume: no checkpoints in"),
    (dict(ckpt_dir="{tmp}/a-file/ckpt"), "is not writable"),
])
def test_bad_checkpoint_config_is_rejected_before_spawning(kwargs: dict, message: str, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    kwargs = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        RunConfig(**kwargs)
    assert not (tmp_path / "missing").exists()  # a failed --resume creates nothing


@pytest.mark.parametrize("kwargs, message", [
    (dict(seq_len=16), r"saved with seq_len=32 \(this run: 16\)"),
    (dict(seed=1, batch_size=4), r"batch_size=8 \(this run: 4\), seed=0 \(this run: 1\)"),
    (dict(val_every=2), r"val_every=None \(this run: 2\).*the layout may change: nproc"),
    (dict(steps=6), r"steps=6 leaves nothing to train; pass --steps > 6"),
])
def test_resume_refuses_another_model_or_data_order_or_nothing_to_do(kwargs: dict, message: str, ddp_full) -> None:
    cfg = {**SMALL, "steps": 8, "ckpt_dir": str(ddp_full[1]), "resume": True, **kwargs}
    with pytest.raises(ValueError, match=message):
        RunConfig(**cfg)


def test_cli_bad_checkpoint_flag_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--ckpt-dir", str(tmp_path / "empty"), "--resume", "--no-progress"])
    assert info.value.code == 2
    assert "cannot resume: no checkpoints in" in capsys.readouterr().err
