"""A synchronous parameter server's checkpoints (issue 22 item 5): a run cut after step 3 and resumed ends bit for
bit as the unbroken run (the servers' shards with their AdamW moments and version, the workers' data position),
the checkpoint holds each role's state in its rank's file under the store's manifest, and what cannot resume is
refused before any rank starts: an asynchronous server's checkpoints, a resume on other servers or workers, a
trainer resuming a server's checkpoint.

Tolerance: none. The unbroken and the resumed run apply the same gradients, summed in worker order by the same
server, to the same fp32 shard and Adam moments; the lr of steps 0-3 is warm-up's (warmup=5) whatever --steps
says, so the cut run trains exactly the unbroken run's first four steps. Anything the checkpoint forgot (the
moments, the version that sets the lr, the sampler's position) changes the final parameters' hash.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from workbench.checkpoint.store import list_steps, load, read_manifest, step_dir
from workbench.cli import run_training
from workbench.launch import launch
from workbench.train import RunConfig, train_rank

pytestmark = [pytest.mark.timeout(300), pytest.mark.extended]  # ranks resumed three ways: the extended lane

PS = dict(nproc=3, ps_servers=1, batch_size=8, seq_len=32, ckpt_every=2)  # 2 workers (ranks 0, 1), server rank 2


def _cut_and_resume(full: RunConfig, cut: RunConfig) -> dict:
    """On each rank, in one launch (three launches cost a minute on a busy 2-core machine): the unbroken run, the
    run cut after step 3, and its resume (configured here: validating it reads the cut run's checkpoint)."""
    whole, first = train_rank(full), train_rank(cut)
    resumed = train_rank(dataclasses.replace(cut, steps=full.steps, resume=True))
    return {"full": whole, "cut": first, "resumed": resumed}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ps-ckpt")
    full = RunConfig(ckpt_dir=str(root / "full"), steps=6, **PS)
    cut = RunConfig(ckpt_dir=str(root / "cut"), steps=4, **PS)
    return {"root": root, **launch(_cut_and_resume, 3, full, cut, timeout=240)[0]}


def test_a_resumed_synchronous_run_ends_bit_identical(runs: dict) -> None:
    full, cut, resumed = runs["full"], runs["cut"], runs["resumed"]  # worker 0's results (rank 0: the run's)
    assert resumed["checkpoint"]["resumed_from_step"] == 3
    assert resumed["final_params_sha256"] == full["final_params_sha256"]
    assert cut["final_params_sha256"] != full["final_params_sha256"]  # the resume trained steps 4-5
    losses = [m["loss"] for m in cut["history"] + resumed["history"]]
    assert losses == [m["loss"] for m in full["history"]]
    assert [m["step"] for m in resumed["history"]] == [4, 5]
    assert full["checkpoint"]["written_steps"] == [1, 3, 5] and resumed["checkpoint"]["written_steps"] == [5]


@pytest.mark.extended  # the same through run_training (three launches, ~80 s on a busy 2-core machine)
def test_run_training_resumes_a_parameter_server_run_bit_identical(tmp_path: Path) -> None:
    full = run_training(RunConfig(ckpt_dir=str(tmp_path / "full"), steps=6, **PS), progress=False)
    run_training(RunConfig(ckpt_dir=str(tmp_path / "cut"), steps=4, **PS), progress=False)
    resumed = run_training(RunConfig(ckpt_dir=str(tmp_path / "cut"), steps=6, resume=True, **PS), progress=False)
    assert resumed["final_params_sha256"] == full["final_params_sha256"]
    assert resumed["losses"] == full["losses"]  # the whole run's record (workbench.record): 0-3 cut, 4-5 resumed
    assert resumed["checkpoint"]["resumed_from_step"] == 3
    assert resumed["parameter_server"]["per_server"][0]["updates"] == 2  # this invocation's updates


def test_each_rank_saves_its_roles_state_under_one_manifest(runs: dict) -> None:
    folder = step_dir(runs["root"] / "full", 3)
    manifest = read_manifest(folder)
    assert manifest["world_size"] == 3 and manifest["meta"]["run_config"]["ps_servers"] == 1
    assert list_steps(runs["root"] / "full") == [1, 3, 5]
    workers = [load(folder, rank) for rank in (0, 1)]
    server = load(folder, 2)
    for state in workers:  # the data position: the next step, the seed and global batch that fix the order
        assert state["sampler"] == {"step": 4, "seed": 0, "global_batch": 8, "data_skip": 0} and "server" not in state
    assert server["server"]["version"] == 4  # four updates applied: the lr schedule's next step
    shard = server["server"]["params"]
    assert len(shard) == sum(1 for _ in _model_names()) and all(torch.isfinite(t).all() for t in shard.values())
    moments = server["server"]["optim"]["state"]
    assert len(moments) == len(shard) and all(float(s["step"]) == 4 for s in moments.values())


def _model_names() -> list[str]:
    from workbench.models import build_gpt

    model = build_gpt(RunConfig(nproc=3, ps_servers=1, batch_size=8, seq_len=32).gpt_config(), seed=0)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def test_what_cannot_resume_is_refused_before_ranks_start(runs: dict, tmp_path: Path) -> None:
    cut = str(runs["root"] / "cut")
    with pytest.raises(ValueError, match="resumes on the same servers and workers only"):
        RunConfig(ckpt_dir=cut, steps=8, resume=True, **{**PS, "nproc": 5})  # 4 workers
    with pytest.raises(ValueError, match="--ps-servers 2: its checkpoint was saved with --nproc 3 --ps-servers 1"):
        RunConfig(ckpt_dir=cut, steps=8, resume=True, **{**PS, "nproc": 3, "ps_servers": 2})
    with pytest.raises(ValueError, match="without a parameter server: its checkpoint was saved with"):
        RunConfig(ckpt_dir=cut, steps=8, resume=True, nproc=2, batch_size=8, seq_len=32)
    with pytest.raises(ValueError, match="an asynchronous server applies each gradient in the order"):
        RunConfig(ckpt_dir=str(tmp_path), steps=6, ps_async=True, **PS)
    with pytest.raises(ValueError, match="async_ckpt=True with ps_servers=1"):
        RunConfig(ckpt_dir=str(tmp_path), steps=6, async_ckpt=True, **PS)


def test_a_checkpoint_consolidates_into_the_full_state(runs: dict) -> None:
    """``workbench ckpt export``'s full state from the servers' files alone (``consolidate_ps_checkpoint``): the
    last checkpoint's parameters are the run's final ones, every AdamW moment is there, the step count is 6."""
    from workbench.training.param_server_run import consolidate_ps_checkpoint
    from workbench.training.schedule import params_sha256

    full = torch.load(consolidate_ps_checkpoint(step_dir(runs["root"] / "full", 5)), weights_only=True)
    assert params_sha256(full["params"]) == runs["full"]["final_params_sha256"]
    assert set(full["exp_avg"]) == set(full["exp_avg_sq"]) == set(full["params"]) == set(_model_names())
    assert full["optimizer_step"] == 6.0 and full["sampler"]["step"] == 6
