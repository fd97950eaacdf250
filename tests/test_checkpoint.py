"""Checkpoint store: round trip, atomic writes, verification and fallback, keep-k, async save, RNG, 2 ranks."""

from __future__ import annotations

import json
import os
import random
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from workbench import launch
from workbench.checkpoint import store as ck  # the store itself: tests patch its functions

pytestmark = pytest.mark.timeout(120)


def _trained_state(seed: int = 0) -> dict:
    """A model + AdamW optimizer after two steps (so the optimizer has exp_avg/exp_avg_sq/step state)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2, "config": {"lr": 1e-2}}


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _save_steps(root: Path, *steps: int, keep: int | None = None) -> None:
    for s in steps:
        ck.save(root, s, {"w": torch.full((16,), float(s), device="cpu"), "step": s}, keep=keep)


# -- round trip --------------------------------------------------------------------------------------------------

def test_model_and_adamw_round_trip(tmp_path: Path) -> None:
    state = _trained_state()
    path = ck.save(tmp_path, 123, state, meta={"mesh": [1], "zero_stage": 0})
    assert path == tmp_path / "step-000123" and (path / "rank-00000.pt").is_file()
    assert ck.verify(path) == []
    loaded = ck.load(path, 0)
    _assert_same(state, loaded)
    # the optimizer accepts it back and continues exactly as the original
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model.load_state_dict(loaded["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(loaded["optim"])
    assert opt.state_dict()["state"][0]["exp_avg"].equal(state["optim"]["state"][0]["exp_avg"])
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 123 and manifest["world_size"] == 1 and manifest["meta"]["zero_stage"] == 0
    assert manifest["format_version"] == ck.FORMAT_VERSION
    (shard,) = manifest["shards"]
    assert shard["bytes"] == (path / "rank-00000.pt").stat().st_size and len(shard["sha256"]) == 64


def test_rng_round_trip_reproduces_the_same_numbers(tmp_path: Path) -> None:
    random.seed(7)
    torch.manual_seed(7)
    random.random(), torch.rand(3)  # somewhere in the middle of the streams, not at a seed
    ck.save(tmp_path, 1, {"rng": ck.rng_state()})
    expected = ([random.random() for _ in range(5)], torch.rand(5), random.gauss(0, 1))
    random.seed(99)
    torch.manual_seed(99)
    ck.set_rng_state(ck.load(ck.latest_good(tmp_path))["rng"])
    got = ([random.random() for _ in range(5)], torch.rand(5), random.gauss(0, 1))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1]) and got[2] == expected[2]
    with pytest.raises(ValueError, match="keys 'python', 'torch'"):
        ck.set_rng_state({"torch": torch.get_rng_state()})


# -- atomicity, verification, fallback --------------------------------------------------------------------------

def test_crash_between_temp_write_and_rename_leaves_no_checkpoint(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _save_steps(tmp_path, 1)

    def crash(src: str, dst: str) -> None:
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        _save_steps(tmp_path, 2)
    monkeypatch.undo()
    # no half-written file under a real name, no temp file left, and step 2 is not a checkpoint
    assert sorted(p.name for p in (tmp_path / "step-000002").iterdir()) == []
    assert "manifest" in ck.verify(tmp_path / "step-000002")[0]
    with pytest.warns(UserWarning, match="step-000002: .*manifest.json is missing"):
        assert ck.latest_good(tmp_path) == tmp_path / "step-000001"


def test_truncated_newest_shard_falls_back_with_a_warning(tmp_path: Path) -> None:
    _save_steps(tmp_path, 10, 20)
    shard = tmp_path / "step-000020" / "rank-00000.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    (problem,) = ck.verify(tmp_path / "step-000020")
    assert "rank-00000.pt is truncated: 100 bytes" in problem
    with pytest.warns(UserWarning, match=r"falling back to checkpoint step-000010.*step-000020.*truncated"):
        good = ck.latest_good(tmp_path)
    assert good == tmp_path / "step-000010"
    assert ck.load(good)["step"] == 10
    with pytest.raises(ck.CheckpointError, match="truncated"):
        ck.load(tmp_path / "step-000020")


def test_flipped_byte_is_a_checksum_mismatch(tmp_path: Path) -> None:
    _save_steps(tmp_path, 5)
    shard = tmp_path / "step-000005" / "rank-00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (problem,) = ck.verify(tmp_path / "step-000005")
    assert "checksum mismatch" in problem and "rank-00000.pt" in problem
    with pytest.raises(ck.CheckpointError, match="checksum mismatch"):
        ck.load(tmp_path / "step-000005")


def test_no_good_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ck.CheckpointError, match="no checkpoints in .*no step-"):
        ck.latest_good(tmp_path / "nothing-here")
    _save_steps(tmp_path, 1, 2)
    (tmp_path / "step-000001" / "manifest.json").unlink()
    (tmp_path / "step-000002" / "rank-00000.pt").unlink()
    with pytest.raises(ck.CheckpointError) as e:
        ck.latest_good(tmp_path)
    text = str(e.value)
    assert str(tmp_path) in text and "step-000001: " in text and "manifest.json is missing" in text
    assert "step-000002: rank-00000.pt is missing" in text


def test_weights_only_refuses_a_pickled_custom_object(tmp_path: Path) -> None:
    folder = ck.step_dir(tmp_path, 1)
    folder.mkdir()
    torch.save({"x": _Sneaky()}, folder / ck.shard_name(0))  # written around save(), which would refuse it
    ck.write_manifest(tmp_path, 1, 1)
    assert ck.verify(folder) == []  # intact bytes; refused on load, not on checksum
    with pytest.raises(ck.CheckpointError, match="refused to load .*weights_only=True"):
        ck.load(folder)
    with pytest.raises(ValueError, match=r"state\['x'\] is a .*_Sneaky.*weights_only"):
        ck.save(tmp_path, 2, {"x": _Sneaky()})
    assert not (tmp_path / "step-000002").exists()


class _Sneaky:
    def __reduce__(self) -> tuple:
        return (print, ("this must never run on load",))


# -- keep-k ------------------------------------------------------------------------------------------------------

def test_keep_k_deletes_older_ones_after_the_new_one_verifies(tmp_path: Path) -> None:
    _save_steps(tmp_path, 1, 2, 3, 4, keep=2)
    assert ck.list_steps(tmp_path) == [3, 4]
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        ck.save(tmp_path, 5, {"w": torch.zeros(1, device="cpu")}, keep=0)
    assert ck.list_steps(tmp_path) == [3, 4]  # refused before writing


def test_keep_k_deletes_nothing_when_the_new_one_does_not_verify(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _save_steps(tmp_path, 1, 2)
    monkeypatch.setattr(ck, "verify", lambda path: ["rank-00000.pt has a checksum mismatch (planted)"])
    with pytest.raises(ck.CheckpointError, match="did not verify.*planted.*older checkpoints were kept"):
        _save_steps(tmp_path, 3, keep=1)
    monkeypatch.undo()
    assert ck.list_steps(tmp_path) == [1, 2, 3]
    assert ck.verify(tmp_path / "step-000001") == [] and ck.verify(tmp_path / "step-000002") == []


# -- bad input ---------------------------------------------------------------------------------------------------

def test_unwritable_directory_is_refused_before_writing(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="checkpoint directory .*a-file/ckpt.* is not writable"):
        ck.save(blocker / "ckpt", 1, {"w": torch.zeros(1, device="cpu")})
    with pytest.raises(ValueError, match="not writable"):
        ck.AsyncCheckpointer(blocker / "ckpt")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="not writable"):
            ck.save(ro, 1, {"w": torch.zeros(1, device="cpu")})
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("kwargs, match", [
    ({"step": -1}, "step must be an int >= 0"),
    ({"keep": 0}, "keep must be an int >= 1"),
    ({"rank": 2, "world_size": 2}, "rank must be < world_size=2"),
    ({"meta": {"bad": object()}}, "meta must be JSON-serialisable"),
])
def test_bad_arguments_are_value_errors(tmp_path: Path, kwargs: dict, match: str) -> None:
    args = {"step": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        ck.save(tmp_path, args.pop("step"), {"w": torch.zeros(1, device="cpu")}, **args)
    assert ck.list_steps(tmp_path) == []


def test_manifest_needs_every_rank_shard(tmp_path: Path) -> None:
    with pytest.raises(ck.CheckpointError, match=r"shard\(s\) \['rank-00001.pt'\] do not exist yet"):
        ck.save(tmp_path, 1, {"w": torch.zeros(1, device="cpu")}, rank=0, world_size=2)
    ck.save_shard(tmp_path, 2, 1, {"w": torch.ones(1, device="cpu")})
    ck.save(tmp_path, 2, {"w": torch.zeros(1, device="cpu")}, rank=0, world_size=2)
    assert ck.verify(ck.latest_good(tmp_path)) == []
    assert ck.load(tmp_path / "step-000002", 1)["w"].item() == 1.0


# -- async -------------------------------------------------------------------------------------------------------

def test_async_save_writes_the_snapshot_not_later_mutations(tmp_path: Path) -> None:
    state = _trained_state()
    expected = ck.snapshot_to_cpu(state)
    with ck.AsyncCheckpointer(tmp_path, keep=2) as saver:
        saver.save(7, state, meta={"mesh": [1]})
        for t in state["model"].values():  # training goes on at once, in place
            t.add_(1.0)
        state["optim"]["state"][0]["exp_avg"].mul_(0)
        path = saver.wait()
    assert path == tmp_path / "step-000007" and ck.verify(path) == []
    _assert_same(expected, ck.load(path))


def test_async_saves_reuse_the_staging_memory_and_write_each_steps_values(tmp_path: Path) -> None:
    """From the second save on, the snapshot is copied into the first one's CPU tensors (no new allocation), and
    each checkpoint still holds the values of its own step, not later ones."""
    state = _trained_state()
    with ck.AsyncCheckpointer(tmp_path, keep=3) as saver:
        expected, storages = {}, []
        for step in (1, 2, 3):
            for t in state["model"].values():  # a training step, in place
                t.add_(1.0)
            expected[step] = ck.snapshot_to_cpu(state)
            saver.save(step, state)
            storages.append({t.untyped_storage().data_ptr() for t in saver._staging["model"].values()})
        saver.wait()
        fresh = ck.AsyncCheckpointer(tmp_path / "fresh", reuse_staging=False)
        fresh.save(1, state)
        first = {t.untyped_storage().data_ptr() for t in fresh._staging["model"].values()}
        fresh.save(2, state)
        assert first != {t.untyped_storage().data_ptr() for t in fresh._staging["model"].values()}
        fresh.close()
    assert storages[0] == storages[1] == storages[2], "the staging tensors were reallocated"
    for step in (1, 2, 3):
        _assert_same(expected[step], ck.load(tmp_path / f"step-{step:06d}"))


def test_snapshot_into_staging_of_another_shape_allocates() -> None:
    staging = {"w": torch.zeros(3), "b": [torch.zeros(2)]}
    out = ck.snapshot_to_cpu({"w": torch.ones(4), "b": [torch.ones(2)]}, staging)
    assert out["w"].shape == (4,) and out["w"] is not staging["w"]
    assert out["b"][0] is staging["b"][0] and out["b"][0].tolist() == [1.0, 1.0]


def test_async_at_most_one_save_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release, started = threading.Event(), threading.Event()
    writing = []
    real = ck.save_shard

    def slow_save_shard(directory: Path, step: int, rank: int, state: dict) -> Path:
        writing.append(step)
        started.set()
        assert len([s for s in writing if s is not None]) == 1, "two saves in flight at once"
        release.wait(timeout=30)
        out = real(directory, step, rank, state)
        writing[writing.index(step)] = None
        return out

    monkeypatch.setattr(ck, "save_shard", slow_save_shard)
    saver = ck.AsyncCheckpointer(tmp_path)
    saver.save(1, {"w": torch.zeros(4, device="cpu")})
    assert started.wait(timeout=30) and saver.in_flight
    second = threading.Thread(target=saver.save, args=(2, {"w": torch.ones(4, device="cpu")}))
    second.start()
    second.join(timeout=0.3)
    assert second.is_alive(), "the second save must wait for the first to finish"
    assert writing == [1]
    release.set()
    second.join(timeout=30)
    saver.close()
    assert ck.list_steps(tmp_path) == [1, 2] and all(ck.verify(ck.step_dir(tmp_path, s)) == [] for s in (1, 2))


def test_async_error_is_raised_on_the_next_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failed = threading.Event()

    def broken(*args: object) -> None:
        failed.set()
        raise OSError("disk full (planted)")

    saver = ck.AsyncCheckpointer(tmp_path)
    monkeypatch.setattr(ck, "save_shard", broken)
    saver.save(1, {"w": torch.zeros(1, device="cpu")})  # returns; the failure happens in the thread
    assert failed.wait(timeout=30)
    monkeypatch.undo()
    with pytest.raises(OSError, match="disk full"):
        saver.save(2, {"w": torch.zeros(1, device="cpu")})
    saver.save(3, {"w": torch.zeros(1, device="cpu")})  # the error was reported once; saving goes on
    saver.close()
    assert ck.latest_good(tmp_path) == tmp_path / "step-000003"
    with pytest.raises(RuntimeError, match="closed"):
        saver.save(4, {"w": torch.zeros(1, device="cpu")})


# -- two real ranks ----------------------------------------------------------------------------------------------

def _two_rank_save(root: str, use_async: bool) -> list[str]:
    rank = dist.get_rank()
    state = {"shard": torch.full((8,), float(rank), device="cpu"), "rank": rank}
    meta = {"mesh": [2], "dp": 2, "shard_of_rank": {"0": [0, 8], "1": [8, 16]}}
    if use_async:
        with ck.AsyncCheckpointer(root, keep=1) as saver:
            saver.save(1, state, meta=meta)
            saver.save(2, state, meta=meta)
        dist.barrier()  # rank 0's manifest exists once rank 0 closed
    else:
        ck.save(root, 1, state, meta=meta)
        ck.save(root, 2, state, meta=meta, keep=1)
    path = ck.latest_good(root)
    assert ck.load(path)["shard"].eq(rank).all()
    return sorted(p.name for p in path.iterdir())


@pytest.mark.parametrize("use_async", [False, True])
def test_two_ranks_save_and_rank0_manifest_lists_both(tmp_path: Path, use_async: bool) -> None:
    results = launch(_two_rank_save, 2, str(tmp_path), use_async, timeout=60)
    assert list(results) == [["manifest.json", "rank-00000.pt", "rank-00001.pt"]] * 2
    manifest = json.loads((tmp_path / "step-000002" / "manifest.json").read_text())
    assert [s["rank"] for s in manifest["shards"]] == [0, 1] and manifest["world_size"] == 2
    assert manifest["meta"]["shard_of_rank"]["1"] == [8, 16]
    assert ck.list_steps(tmp_path) == [2]  # keep=1 pruned step 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ck.latest_good(tmp_path) == tmp_path / "step-000002"


def test_discard_newer_on_resume_removes_what_the_dead_run_left(tmp_path: Path) -> None:
    _save_steps(tmp_path, 1, 2, 3)
    (tmp_path / "step-000003" / "manifest.json").unlink()  # the run died while saving step 3
    assert ck.discard_newer(tmp_path, 2) == [tmp_path / "step-000003"]
    assert ck.list_steps(tmp_path) == [1, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ck.latest_good(tmp_path) == tmp_path / "step-000002"
