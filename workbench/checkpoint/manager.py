"""The checkpoints of one training run: when to save, what a save holds, and how a resume puts it back.

The ``Trainer`` (``workbench.training.trainer``) makes one ``CheckpointManager`` and calls it: ``due(step_index)``
after each step, ``save(step_index, data_skip)``, ``finish()`` at the end, ``resume(after_restart)`` at the start
and on a rollback. Each rank saves what its strategy holds (its model's and optimizer's state dicts, shards
included, fp16's loss scaler), the step, its RNG states and the sampler's position; a resume on the same layout
reloads its own shard, one on another layout shards the checkpoint's full state (``FULL_STATE``) this layout's way.

The manager receives what it saves and restores as arguments (the strategy, the sampler, the step and the batches
rollbacks skipped), the run's config only as ``resume.ResumableConfig`` (the resume rules and the manifest need
it), and rebuilding the strategy for a reshard as a callable: it does not import the training floor, which imports
it (a cycle).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench import trace
from workbench.checkpoint.reshard import load_full_training_state
from workbench.checkpoint.resume import (
    FULL_STATE,
    ResumableConfig,
    checkpoint_config,
    find_resume_point,
    layout_changes,
)
from workbench.checkpoint.store import (
    AsyncCheckpointer,
    CheckpointError,
    discard_newer,
    list_steps,
    load,
    read_manifest,
    rng_state,
    save,
    set_rng_state,
    step_dir,
)
from workbench.data import ShardedSampler
from workbench.dist import comm
from workbench.parallel import Parallelized

_NOTHING_SAVED = -2  # rank 0's answer to a restart that finds no checkpoint: start from step 0


@dataclass(frozen=True)
class CheckpointSettings:
    """The run's checkpoint fields (``RunConfig.section(CheckpointSettings)``); ``steps`` says which step is last."""

    ckpt_dir: str | None = None  # None: no checkpoints
    ckpt_every: int | None = None  # save after every K-th step (and after the last); None: after the last only
    keep: int | None = None  # keep the newest K checkpoints; None: keep them all
    async_ckpt: bool = False  # snapshot to CPU and write in a background thread
    steps: int = 0  # the run's length: a checkpoint after the last step lets a finished run be extended


@dataclass(frozen=True)
class Resumed:
    """What ``CheckpointManager.resume`` restored: the checkpoint's step, or None when a restart found nothing saved
    yet (then nothing was loaded and the other fields mean nothing); the warnings of checkpoints skipped on the way;
    the step to take next (the loaded state's step + 1: ``lr_at`` and the sampler read it); the batches that spike
    rollbacks skipped before the save (step s trains on batch s + data_skip)."""

    step: int | None
    skipped: list[str] = field(default_factory=list)
    next_step: int = 0
    data_skip: int = 0


#: ``shard_like_params(values)``: this layout's strategy built on a model whose parameters are ``values`` (by name),
#: returning its optimizer's tensors (``reshard.load_full_training_state``). The trainer knows how to build it.
ShardLikeParams = Callable[[Mapping[str, torch.Tensor]], list[torch.Tensor]]


class CheckpointManager:
    """Saves and restores one rank's training state in ``settings.ckpt_dir`` (``workbench.checkpoint.store``)."""

    def __init__(self, settings: CheckpointSettings, run: ResumableConfig, strategy: Parallelized,
                 sampler: ShardedSampler, device: torch.device, shard_like_params: ShardLikeParams) -> None:
        self.settings, self.run = settings, run
        self.strategy, self.sampler, self.device = strategy, sampler, device
        self.shard_like_params = shard_like_params
        self.writer: AsyncCheckpointer | None = None  # --async-ckpt's writer, made at the first save
        self.stalls: list[dict[str, float]] = []  # how long each save held the training loop

    def due(self, step_index: int) -> bool:
        """After every ``ckpt_every``-th step and after the last (so a finished run can be extended);
        ``step_index`` counts the steps taken."""
        s = self.settings
        every = s.ckpt_every or s.steps
        return s.ckpt_dir is not None and (step_index % every == 0 or step_index == s.steps)

    def save(self, step_index: int, data_skip: int = 0) -> int:
        """Every rank saves the state its strategy holds after the step just taken (``step_index`` steps are done);
        returns that step's index."""
        s, step, settings = self.strategy, step_index - 1, self.settings
        state = {"model": s.model.state_dict(), "optim": s.optimizer.state_dict(), "step": step,
                 "rng": rng_state(), "sampler": {**self.sampler.state_dict(), "step": step_index,
                                                 "data_skip": data_skip}}
        if s.scaler is not None:
            state["scaler"] = s.scaler.state_dict()
        if s.compressor is not None:  # this rank's error-feedback residuals, PowerSGD's Q, the step count
            state["compressor"] = s.compressor.state_dict()
        if s.outer is not None:  # local SGD: the global parameters, the outer momentum, where in the H steps
            state["outer"] = s.outer.state_dict()
        meta = {"run_config": checkpoint_config(self.run), "strategy": s.describe}
        t0 = time.perf_counter()
        with trace.span(f"checkpoint step {step}", "other"):
            if settings.async_ckpt:  # snapshot to CPU here, write in a background thread (store.AsyncCheckpointer)
                if self.writer is None:
                    self.writer = AsyncCheckpointer(settings.ckpt_dir, keep=settings.keep)
                self.writer.save(step, state, meta=meta)
            else:
                save(settings.ckpt_dir, step, state, meta=meta, keep=settings.keep)
        self.stalls.append({"step": step, "stall_s": time.perf_counter() - t0})
        return step

    def finish(self) -> None:
        """Wait for an async save in flight (its errors surface here) and stop its writer thread."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def resume(self, after_restart: bool = False) -> Resumed:
        """Load the newest good checkpoint into the strategy, sampler, loss scaler and RNG states.

        ``after_restart``: this attempt follows a failure (``faults.restart_count() > 0``); with no checkpoint
        written yet it starts from step 0 (``Resumed(None)``, nothing loaded), as the seeded run it replaces did.

        Rank 0 alone picks the checkpoint and broadcasts its step: ``latest_good`` hashes every shard, and ranks
        picking on their own could disagree (a file changing between their reads) and load different steps.
        Rank 0 also removes newer, unusable checkpoints (``discard_newer``) before any rank saves again."""
        step, problem, skipped = self._pick_step(after_restart)
        if step == _NOTHING_SAVED:
            return Resumed(None, skipped)
        if step < 0:
            raise ValueError(problem or "rank 0 found no checkpoint to resume from (its error says why)")
        folder = step_dir(self.settings.ckpt_dir, step)
        if layout_changes(self.run, read_manifest(folder)["meta"]["run_config"]):
            return Resumed(step, skipped, *self._load_resharded(folder))
        state = load(folder, map_location=self.device)
        if state["step"] != step:
            raise CheckpointError(f"{step_dir(self.settings.ckpt_dir, step)} holds step {state['step']}, not {step}")
        self.strategy.model.load_state_dict(state["model"])
        self.strategy.optimizer.load_state_dict(state["optim"])
        if self.strategy.compressor is not None and state.get("compressor"):  # same layout: this rank's residuals
            self.strategy.compressor.load_state_dict(state["compressor"])
        if self.strategy.outer is not None and state.get("outer"):
            self.strategy.outer.load_state_dict(state["outer"])
        return Resumed(step, skipped, *self._restore_progress(state))

    def _pick_step(self, after_restart: bool) -> tuple[int, str, list[str]]:
        """Rank 0's choice, broadcast to every rank: (the step to load, or ``_NOTHING_SAVED``, or -1 with rank 0's
        error; that error, on rank 0 only; the warnings of checkpoints skipped, on rank 0 only)."""
        step, problem, skipped = -1, "", []
        if comm.group_rank() == 0:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")  # every skipped checkpoint is reported, not only the first
                try:
                    if after_restart and not list_steps(self.settings.ckpt_dir):
                        step = _NOTHING_SAVED
                    else:
                        step = read_manifest(find_resume_point(self.run, finished_ok=after_restart))["step"]
                        discard_newer(self.settings.ckpt_dir, step)
                except ValueError as e:
                    problem = str(e)
            skipped = [str(w.message) for w in caught]
        return _broadcast_step(step, self.device), problem, skipped

    def _restore_progress(self, state: dict[str, Any]) -> tuple[int, int]:
        """What a checkpoint holds besides the model and optimizer: the sampler's position, fp16's loss scaler, the
        RNG states. Returns the step to take next and the batches rollbacks skipped (the caller's ``data_skip``)."""
        self.sampler.load_state_dict(state["sampler"])  # refuses another seed or global batch
        if self.strategy.scaler is not None and state.get("scaler"):  # absent: saved in fp32/bf16, start afresh
            self.strategy.scaler.load_state_dict(state["scaler"])
        set_rng_state(state["rng"])
        return int(state["step"]) + 1, int(state["sampler"].get("data_skip", 0))

    def _load_resharded(self, folder: Path) -> tuple[int, int]:
        """Another layout saved this checkpoint: load its full state (``prepare_resharded_resume`` wrote it) and
        shard it this layout's way. The RNG state is rank 0's on every rank: per-rank streams of another world
        size have no counterpart here (the tiny GPT's dropout is off, so training does not draw from them)."""
        file = folder / FULL_STATE
        if not file.is_file():
            raise CheckpointError(f"{folder} was saved on another layout and has no {FULL_STATE}; resume through "
                                  f"workbench run / run_training, which writes it before the ranks start")
        full = torch.load(file, map_location="cpu", weights_only=True)
        load_full_training_state(self.strategy, full, self.shard_like_params)
        if self.strategy.outer is not None:  # local SGD: a new outer round from the loaded (rank 0's) replica
            self.strategy.outer.restart_from_model()
        return self._restore_progress(full)


def _broadcast_step(step: int, device: torch.device) -> int:
    """Rank 0's ``step`` on every rank (one process: ``step`` itself)."""
    if not comm.is_distributed():
        return step
    t = torch.tensor([step], dtype=torch.int64, device=device)
    comm.broadcast(t, src=0, tag="checkpoint")
    return int(t.item())
