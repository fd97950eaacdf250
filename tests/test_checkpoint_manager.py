"""The checkpoint manager on one process: when a save is due, what a save holds, async saves, and a resume that
puts back the model, the optimizer, the sampler, the RNG, the loss scaler's absence and the step (issue 19).

The multi-rank behaviour (bit-for-bit resume, restarts, resharding across world sizes) is tested through the
trainer in test_resume.py, test_reshard.py and test_faults.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from workbench import trace
from workbench.checkpoint.manager import CheckpointManager, CheckpointSettings, Resumed
from workbench.checkpoint.reshard import full_training_state
from workbench.checkpoint.resume import FULL_STATE
from workbench.checkpoint.store import CheckpointError, list_steps, load, read_manifest, step_dir, verify, write_atomic
from workbench.training.config import RunConfig
from workbench.training.trainer import Trainer

pytestmark = pytest.mark.timeout(180)

TINY = dict(nproc=1, batch_size=4, seq_len=16, steps=6, device="cpu")


def _trainer(ckpt: Path, **flags: object) -> Trainer:
    torch.manual_seed(0)
    return Trainer(RunConfig(ckpt_dir=str(ckpt), **{**TINY, **flags}))


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _manager(**settings: object) -> CheckpointManager:
    """A manager for due() alone: it reads nothing but its settings there."""
    return CheckpointManager(CheckpointSettings(**settings), run=None, strategy=None, sampler=None,  # type: ignore
                             device=torch.device("cpu"), shard_like_params=lambda values: [])


def test_due_after_every_kth_step_and_after_the_last() -> None:
    every_3 = _manager(ckpt_dir="x", ckpt_every=3, steps=10)
    assert [n for n in range(1, 11) if every_3.due(n)] == [3, 6, 9, 10]
    last_only = _manager(ckpt_dir="x", steps=10)
    assert [n for n in range(1, 11) if last_only.due(n)] == [10]
    assert not any(_manager(ckpt_every=1, steps=10).due(n) for n in range(1, 11)), "no ckpt_dir: never due"


def test_the_trainer_gives_its_manager_the_run_checkpoint_fields(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, ckpt_every=2, keep=3, async_ckpt=True)
    assert trainer.checkpoints.settings == CheckpointSettings(str(tmp_path), 2, 3, True, 6)
    assert trainer.checkpoints.strategy is trainer.strategy and trainer.checkpoints.sampler is trainer.sampler
    trainer.step_index = 4
    assert trainer.checkpoint_due()
    trainer.step_index = 5
    assert not trainer.checkpoint_due()


def test_save_then_resume_restores_model_optimizer_sampler_rng_and_step(tmp_path: Path) -> None:
    saver = _trainer(tmp_path)
    for _ in range(2):
        saver.step()
    with trace.tracing() as tracer:
        assert saver.checkpoints.save(saver.step_index, data_skip=3) == 1
    assert [s.name for s in tracer.trace.spans] == ["checkpoint step 1"]
    assert [s["step"] for s in saver.checkpoints.stalls] == [1] and saver.checkpoints.stalls[0]["stall_s"] >= 0
    expected_rng = torch.rand(4)  # what the next draw is after the save
    assert list_steps(tmp_path) == [1] and verify(step_dir(tmp_path, 1)) == []
    meta = read_manifest(step_dir(tmp_path, 1))["meta"]
    assert meta["strategy"] == saver.strategy.describe
    assert meta["run_config"]["ckpt_dir"] == str(tmp_path) and "extra" not in meta["run_config"]
    saved = load(step_dir(tmp_path, 1))
    assert saved["step"] == 1 and saved["sampler"]["step"] == 2 and saved["sampler"]["data_skip"] == 3
    assert "scaler" not in saved, "fp32 has no loss scaler to save"

    resumer = _trainer(tmp_path, resume=True)
    torch.rand(100)  # the RNG moves on, as it would in another process: the resume must set it back
    resumed = resumer.checkpoints.resume()
    assert resumed == Resumed(step=1, skipped=[], next_step=2, data_skip=3)
    assert torch.equal(torch.rand(4), expected_rng), "the RNG states were not restored"
    _assert_same(resumer.strategy.model.state_dict(), saver.strategy.model.state_dict())
    _assert_same(resumer.strategy.optimizer.state_dict(), saver.strategy.optimizer.state_dict())
    assert resumer.sampler.state_dict() == saver.sampler.state_dict() | {"step": 2}
    assert resumer.step_index == 0, "the manager reports the step; the trainer applies it"


def test_trainer_resume_applies_the_step_and_skipped_batches(tmp_path: Path) -> None:
    saver = _trainer(tmp_path, ckpt_every=2)
    saver.step()
    saver.step()
    saver.data_skip = 5
    assert saver.checkpoint_due() and saver.save_checkpoint() == 1
    resumer = _trainer(tmp_path, resume=True)
    assert resumer.resume() == (1, [])
    assert (resumer.step_index, resumer.data_skip) == (2, 5)
    # the next step trains on the same batch and LR as the saver's next step would
    assert torch.equal(torch.tensor(resumer.step()["loss"]), torch.tensor(saver.step()["loss"]))


def test_async_save_is_on_disk_after_finish(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "async", async_ckpt=True)
    trainer.step()
    assert trainer.checkpoints.save(trainer.step_index) == 0
    writer = trainer.checkpoints.writer
    assert writer is not None, "an async save goes through the background writer"
    trainer.checkpoints.finish()
    assert trainer.checkpoints.writer is None
    assert list_steps(tmp_path / "async") == [0] and verify(step_dir(tmp_path / "async", 0)) == []
    sync = _trainer(tmp_path / "sync")
    sync.step()
    sync.checkpoints.save(sync.step_index)
    assert sync.checkpoints.writer is None, "a synchronous save starts no writer"
    a, b = load(step_dir(tmp_path / "async", 0)), load(step_dir(tmp_path / "sync", 0))
    _assert_same(a["model"], b["model"])
    _assert_same(a["optim"], b["optim"])


def test_resume_after_a_restart_with_nothing_saved_starts_afresh(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    before = {k: v.clone() for k, v in trainer.strategy.model.state_dict().items()}
    assert trainer.checkpoints.resume(after_restart=True).step is None
    assert trainer.resume(after_restart=True) == (None, [])
    assert trainer.step_index == 0
    _assert_same(trainer.strategy.model.state_dict(), before)
    with pytest.raises(ValueError, match="cannot resume"):
        trainer.checkpoints.resume()  # not after a restart: a missing checkpoint is an error


def test_a_corrupt_newer_checkpoint_is_skipped_with_a_warning_and_removed(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    trainer.step()
    trainer.checkpoints.save(trainer.step_index)
    trainer.step()
    trainer.checkpoints.save(trainer.step_index)
    shard = next(p for p in step_dir(tmp_path, 1).iterdir() if p.suffix == ".pt")
    shard.write_bytes(shard.read_bytes()[:-8] + b"corrupt!")
    resumed = _trainer(tmp_path).checkpoints.resume()
    assert resumed.step == 0 and resumed.next_step == 1
    assert len(resumed.skipped) == 1 and "step-" in resumed.skipped[0]
    assert list_steps(tmp_path) == [0], "the newer, unusable checkpoint is discarded before saving again"


def test_another_layout_without_full_state_is_refused(tmp_path: Path) -> None:
    saver = _trainer(tmp_path)
    saver.step()
    saver.checkpoints.save(saver.step_index)
    other_layout = _trainer(tmp_path, grad_accum=2)  # a layout field: the checkpoint must be resharded
    with pytest.raises(CheckpointError, match=f"saved on another layout and has no {FULL_STATE}; resume through "
                                              "workbench run / run_training"):
        other_layout.checkpoints.resume()


def test_another_layout_with_full_state_is_resharded_through_the_trainer_callable(tmp_path: Path) -> None:
    saver = _trainer(tmp_path)
    saver.step()
    saver.step()
    saver.checkpoints.save(saver.step_index, data_skip=1)
    state = load(step_dir(tmp_path, 1))
    full = full_training_state(saver.strategy)
    write_atomic(step_dir(tmp_path, 1) / FULL_STATE, {**full, **{k: state[k] for k in ("step", "sampler", "rng")}})

    resumer = _trainer(tmp_path, grad_accum=2)
    calls = []
    real = resumer.checkpoints.shard_like_params
    resumer.checkpoints.shard_like_params = lambda values: calls.append(1) or real(values)
    assert resumer.resume() == (1, [])
    assert len(calls) == 3, "params and both Adam moments are sharded through the trainer's callable"
    assert (resumer.step_index, resumer.data_skip) == (2, 1)
    _assert_same(resumer.strategy.model.state_dict(), saver.strategy.model.state_dict())
    mine, theirs = resumer.strategy.optimizer.state_dict()["state"], saver.strategy.optimizer.state_dict()["state"]
    _assert_same(mine, theirs)


def test_settings_are_a_frozen_section_of_the_run_config() -> None:
    cfg = RunConfig(ckpt_dir="d", ckpt_every=4, keep=2, async_ckpt=True, steps=9)
    settings = cfg.section(CheckpointSettings)
    assert settings == CheckpointSettings("d", 4, 2, True, 9)
    with pytest.raises(AttributeError):
        settings.keep = 1  # type: ignore[misc]
    assert replace(settings, keep=None).keep is None
