"""Elastic resize (``--min-nproc``): a rank lost for good (``lose:rank=R:step=S``) and the run goes on with the
survivors from the newest checkpoint, resharded, with the same global batch and the same data order.

Not bit-identical to the unbroken run: the survivors sum the batch in another order (more micro-batches per rank,
fewer ranks). The tolerance is the one every layout meets against one process (tests/test_train_cli.py's
LOSS_RTOL): losses within rtol 2e-4 of the loss, which holds whatever order a CPU sums in, while a step on a wrong
batch (a window dropped or served twice) moves the loss by ~1e-2. The data order is checked exactly, from the
windows every rank reports it trained on (the sampler's record).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from workbench.cli import main, run_training
from workbench.data import ShardedSampler, make_lm_data
from workbench.dist.faults import after_shrink, parse_faults
from workbench.run import torchrun_world
from workbench.theory.elastic import elastic_accumulation, fitting_batch_size
from workbench.training.config import RunConfig
from workbench.training.elastic import resized, striking_lose

pytestmark = pytest.mark.timeout(300)

LOSS_RTOL = 2e-4  # tests/test_train_cli.py: another summation order, a few AdamW steps (see the module docstring)
BASE = dict(model="tiny", batch_size=12, steps=6, ckpt_every=2, device="cpu", timeout=60.0)


@pytest.mark.parametrize(("batch", "budget", "world", "accum"), [
    (12, 3, 4, 1), (12, 3, 3, 2), (12, 3, 2, 2), (12, 3, 1, 4),  # 3 windows per micro-batch at most
    (16, 4, 3, None),  # 16 is not a multiple of 3: no split keeps the batch
    (12, 1, 2, 6), (24, 6, 3, 2), (24, 6, 5, None)])
def test_accumulation_keeps_the_global_batch_within_the_micro_batch_budget(batch, budget, world, accum) -> None:
    got = elastic_accumulation(batch, budget, world)
    assert got == accum
    if got is not None:
        assert batch == world * got * (batch // (world * got)) and batch // (world * got) <= budget


@pytest.mark.parametrize(("batch", "split", "worlds", "fits"), [
    (16, 4, range(3, 4), 24), (16, 4, range(2, 4), 24), (12, 4, range(2, 4), 12), (10, 5, range(2, 5), 60)])
def test_the_suggested_batch_size_fits_every_world(batch, split, worlds, fits) -> None:
    got = fitting_batch_size(batch, split, worlds)
    assert got == fits and got % split == 0
    assert all(elastic_accumulation(got, got // split, w) is not None for w in worlds)


def test_resized_config_keeps_the_batch_and_drops_the_fault(tmp_path: Path) -> None:
    cfg = RunConfig(**BASE, nproc=4, ckpt_dir=str(tmp_path), min_nproc=2, inject_fault="lose:rank=3:step=3")
    smaller = resized(cfg, 3, budget=3, resume=False)  # resume=True checks that a checkpoint is there to resume
    assert (smaller.nproc, smaller.dp, smaller.grad_accum, smaller.batch_size) == (3, 3, 2, 12)
    assert smaller.inject_fault is None and smaller.min_nproc == 2


def test_several_lose_specs_each_shrink_the_world_they_strike() -> None:
    faults = parse_faults("lose:rank=1,2:step=4;lose:rank=3:step=2", nproc=4, steps=6)
    assert [(f.ranks, f.step) for f in faults] == [((3,), 2), ((1, 2), 4)]  # in step order
    assert after_shrink(faults, 2) == "lose:rank=1,2:step=4" and after_shrink(faults, 4) is None
    cfg = RunConfig(**BASE, nproc=4, ckpt_dir="ck", min_nproc=1, inject_fault="lose:rank=3:step=2;lose:rank=1,2:step=4")
    assert striking_lose(cfg, 3).ranks == (3,) and striking_lose(cfg, 1) is None  # rank 1 goes at step 4
    smaller = resized(cfg, 3, budget=3, resume=False, faults_left=after_shrink(faults, 2))
    assert smaller.inject_fault == "lose:rank=1,2:step=4" and striking_lose(smaller, 2).ranks == (1, 2)


def test_under_torchrun_each_attempt_takes_the_world_the_rendezvous_formed(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """``run.torchrun_world``: torchrun --nnodes 1:2 restarted the workers in a world of 2 after a node was lost (the
    end-to-end run with a node killed is tests/test_torchrun_elastic.py, extended lane)."""
    cfg = RunConfig(**BASE, nproc=4, ckpt_dir=str(tmp_path), min_nproc=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    smaller, event = torchrun_world(cfg)
    assert (smaller.nproc, smaller.dp, smaller.grad_accum, smaller.batch_size) == (2, 2, 2, 12)
    assert smaller.resume is False and event["world_size"] == 2  # nothing saved yet: it starts from step 0
    assert torchrun_world(dataclasses.replace(cfg, min_nproc=None)) == (dataclasses.replace(cfg, min_nproc=None), None)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="torchrun formed a world of 1 ranks; this elastic run goes on with 2..4"):
        torchrun_world(cfg)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(nproc=4, min_nproc=5), "min_nproc=5 must be an int in 1..nproc=4"),
    (dict(nproc=4, min_nproc=0), "min_nproc=0 must be an int in 1..nproc=4"),
    (dict(nproc=4, min_nproc=2, ckpt_dir=None, ckpt_every=None), "min_nproc=2 needs --ckpt-dir"),
    (dict(nproc=4, min_nproc=2, tp=2), "tp=2 would need a layout"),
    (dict(nproc=4, min_nproc=3, batch_size=16), "on 3 rank(s) no gradient accumulation keeps the global batch"),
    (dict(nproc=4, inject_fault="lose:rank=3:step=2"), "needs --min-nproc M"),
    (dict(nproc=4, min_nproc=2, inject_fault="lose:rank=4:step=2"), "names rank 4 but the run has ranks 0..3"),
    (dict(nproc=4, min_nproc=2, inject_fault="lose:rank=1"), "is malformed"),
    (dict(nproc=4, min_nproc=1, inject_fault="lose:rank=3:step=2;lose:rank=3:step=4"),
     "names rank 3 but the run has ranks 0..2 by step 4 (the world left after the earlier lose specs"),
    (dict(nproc=4, min_nproc=1, inject_fault="lose:rank=3:step=2;lose:rank=2:step=2"), "name them in one spec"),
    (dict(nproc=4, min_nproc=2, inject_fault="lose:rank=2,2:step=2"), "names a rank twice"),
])
def test_bad_elastic_input_is_refused_before_any_rank_starts(kwargs: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        RunConfig(**{**BASE, "ckpt_dir": str(tmp_path), **kwargs})
    assert message in str(err.value)


def test_cli_refuses_a_min_nproc_above_nproc_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--nproc", "2", "--min-nproc", "3", "--ckpt-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "min_nproc=3 must be an int in 1..nproc=2" in capsys.readouterr().err


def _run(tmp_path: Path, name: str, stop_when: tuple[int, int] | None = None, **flags: Any) -> tuple[dict, list[dict]]:
    """A run with every rank's streamed metrics (each carries the windows that rank trained on). ``stop_when=(world,
    step)``: preempt it (the Stop file a signal or the dashboard's button creates) once that world reached that step:
    every rank stops after the step they agree on and a checkpoint is saved there."""
    seen: list[dict] = []
    stop_file = tmp_path / f"stop-{name}-{len(list(tmp_path.glob('stop-*')))}"

    def on_metrics(rank: int, metrics: dict) -> None:
        seen.append({**metrics, "rank": rank})
        if stop_when is not None and (metrics.get("world", 0), metrics["step"]) >= stop_when:
            stop_file.touch()

    cfg = RunConfig(**{**BASE, "ckpt_dir": str(tmp_path / name), "extra": {"stop_file": str(stop_file)}, **flags})
    return run_training(cfg, progress=False, on_metrics=on_metrics), seen


def _windows_by_step(seen: list[dict]) -> dict[int, list[int]]:
    """Each step's windows over all ranks of the last world that trained it (an earlier world's steps after the
    checkpoint it resumed from were trained again, and only the last time counts, as in the model's state)."""
    last_world: dict[int, int] = {}
    for m in seen:
        last_world[m["step"]] = max(last_world.get(m["step"], 0), m.get("world", 0))
    windows: dict[int, list[int]] = defaultdict(list)
    for m in seen:
        if m.get("world", 0) == last_world[m["step"]]:
            windows[m["step"]] += m["windows"]
    return windows


def _assert_each_step_trained_its_global_batch_once(seen: list[dict], cfg: RunConfig, steps: int) -> None:
    sampler = ShardedSampler(len(make_lm_data(cfg.gpt_config().seq_len)), cfg.batch_size, seed=cfg.seed)
    windows = _windows_by_step(seen)
    assert sorted(windows) == list(range(steps))
    for step, got in windows.items():
        assert len(got) == len(set(got)), f"step {step}: a window served twice: {sorted(got)}"
        assert sorted(got) == sorted(sampler.global_indices(step)), f"step {step}: not the step's global batch"


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> dict:
    summary, _ = _run(tmp_path_factory.mktemp("unbroken"), "ck", nproc=4)
    return summary


@pytest.mark.extended  # ~30 s of launches on 2 cores (4 ranks, a consolidation, 3 ranks, and the unbroken run)
def test_a_lost_rank_shrinks_the_world_and_the_run_goes_on(unbroken: dict, tmp_path: Path) -> None:
    summary, seen = _run(tmp_path, "ck", nproc=4, min_nproc=2, inject_fault="lose:rank=3:step=3")
    [change] = summary["elastic"]
    assert change["lost_rank"] == 3 and change["nproc"] == [4, 3] and change["grad_accum"] == [1, 2]
    assert change["resumed_from_step"] == 1 and change["last_step_done"] == 2  # saved after step 1, lost before 3
    assert summary["config"]["nproc"] == 3 and summary["config"]["grad_accum"] == 2
    assert [m["step"] for m in summary["history"]] == list(range(6))  # one curve from step 0
    assert summary["losses"] == pytest.approx(unbroken["losses"], rel=LOSS_RTOL)
    _assert_each_step_trained_its_global_batch_once(seen, RunConfig(**{**BASE, "ckpt_every": None}, nproc=4), 6)


@pytest.mark.extended  # ~35 s: three worlds, two reshards
def test_a_run_loses_one_rank_then_a_node_of_two_and_goes_on_alone(unbroken: dict, tmp_path: Path) -> None:
    """``lose:rank=3:step=2;lose:rank=1,2:step=4``: 4 ranks -> 3 (from step 1's checkpoint) -> 1 (from step 3's),
    one invocation, the same global batch throughout (micro-batches of at most the first world's 3 windows)."""
    summary, seen = _run(tmp_path, "ck", nproc=4, min_nproc=1, inject_fault="lose:rank=3:step=2;lose:rank=1,2:step=4")
    first, second = summary["elastic"]
    assert (first["lost_ranks"], first["nproc"], first["grad_accum"], first["resumed_from_step"]) == \
        ([3], [4, 3], [1, 2], 1)
    assert (second["lost_ranks"], second["nproc"], second["grad_accum"], second["resumed_from_step"]) == \
        ([1, 2], [3, 1], [2, 4], 3)
    assert summary["config"]["nproc"] == 1 and summary["config"]["inject_fault"] is None
    assert summary["losses"] == pytest.approx(unbroken["losses"], rel=LOSS_RTOL)
    _assert_each_step_trained_its_global_batch_once(seen, RunConfig(**{**BASE, "ckpt_every": None}, nproc=4), 6)


@pytest.mark.extended
def test_too_few_survivors_stop_the_run_naming_min_nproc(tmp_path: Path) -> None:
    from workbench.dist.launch import RankError

    with pytest.raises(RankError, match=r"only 1 rank\(s\) are left, fewer than min_nproc=2"):
        _run(tmp_path, "ck", nproc=2, min_nproc=2, inject_fault="lose:rank=1:step=3")


@pytest.mark.extended
@pytest.mark.parametrize("zero", [1, 3])
def test_zero_runs_shrink_to_three_then_two_and_grow_back_to_four(zero: int, tmp_path: Path) -> None:
    """4 ranks lose one at step 3 and 3 go on until preempted; resumed on 3, they lose another and 2 go on until
    preempted; resumed on 4, the world grows back. Every invocation plans 12 steps (the learning-rate schedule
    depends on it): the curve over all three is the unbroken ZeRO run's, and every step trained its global batch
    exactly once."""
    full, _ = _run(tmp_path, "full", nproc=4, zero=zero, steps=12)
    common = dict(zero=zero, steps=12)
    first, seen = _run(tmp_path, "ck", stop_when=(1, 4), nproc=4, min_nproc=3,
                       inject_fault="lose:rank=3:step=3", **common)
    stop = first["stopped_after_step"]
    assert first["elastic"][0]["nproc"] == [4, 3] and stop is not None and stop < 8
    second, more = _run(tmp_path, "ck", stop_when=(1, stop + 3), nproc=3, grad_accum=2, min_nproc=2, resume=True,
                        inject_fault=f"lose:rank=2:step={stop + 2}", **common)
    change = second["elastic"][0]
    assert change["nproc"] == [3, 2] and change["grad_accum"] == [2, 3]  # 2 windows a micro-batch, as on 3 ranks
    assert second["stopped_after_step"] is not None and second["stopped_after_step"] < 11
    third, last = _run(tmp_path, "ck", nproc=4, resume=True, **common)
    assert (third["config"]["nproc"], third["config"]["grad_accum"]) == (4, 1)
    assert third["checkpoint"]["resumed_from_step"] == second["stopped_after_step"]
    for later, invocation in ((more, 1), (last, 2)):  # a later invocation's steps come after the earlier ones'
        for m in later:
            m["world"] = m.get("world", 0) + 10 * invocation
    _assert_each_step_trained_its_global_batch_once(seen + more + last,
                                                    RunConfig(**{**BASE, "ckpt_every": None}, nproc=4), 12)
    by_step = {m["step"]: m["loss"] for summary in (first, second, third) for m in summary["history"]}
    assert sorted(by_step) == list(range(12))  # a later invocation's step replaces an earlier one's
    assert [by_step[s] for s in range(12)] == pytest.approx(full["losses"], rel=LOSS_RTOL)
