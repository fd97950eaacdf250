"""Elastic training: when a rank is lost for good, the run goes on with the survivors (the course's row 16).

PyTorch Elastic (``torchrun --nnodes MIN:MAX``) and Horovod Elastic restart the workers that are left at a new
world size. Three things make that safe here, and this module only has to put them together:

1. a checkpoint any layout can load: ``workbench.checkpoint`` reshards a data-parallel or ZeRO checkpoint saved on
   N ranks onto N' ranks (the lost rank's shards are on the shared checkpoint store, which outlives its node);
2. a data order that does not depend on the world size: ``data.ShardedSampler``'s step s is the same B windows on
   any number of data-parallel ranks, so no window is dropped or served twice across the change;
3. the same global batch: the optimizer's problem depends on the batch B, not on how it is split (Goyal et al.
   2017, "Accurate, Large Minibatch SGD"), so the missing ranks' share is made up by gradient accumulation: each
   survivor runs more micro-batches of at most the size a rank ran before (its memory budget).

``--min-nproc M`` turns it on (``RunConfig`` checks it, with ``theory.elastic``'s arithmetic): the run keeps going
while at least M ranks are left; ``run._launch_elastic`` drives the loop and this module resizes the config. A later
``--resume`` with more ranks grows the world back the same way (the resharding resume).
"""

from __future__ import annotations

import dataclasses

from workbench.dist.faults import FaultSpec, parse_faults
from workbench.theory.elastic import elastic_accumulation
from workbench.training.config import RunConfig


def micro_batch(cfg: RunConfig) -> int:
    """Windows in one micro-batch of one rank: the memory budget an elastic run keeps as the world changes."""
    return cfg.batch_size // (cfg.dp * cfg.grad_accum)


def resized(cfg: RunConfig, world: int, budget: int, resume: bool = True,
            faults_left: str | None = None) -> RunConfig:
    """``cfg`` on ``world`` data-parallel ranks with the same global batch (gradient accumulation makes up the
    difference, micro-batches of at most ``budget`` windows), resuming from the newest checkpoint. The injected
    faults that struck are dropped: they happened (a fault fires once, as on a real cluster once the bad node is
    gone); ``faults_left`` are those still to come (``dist.faults.after_shrink``)."""
    accum = elastic_accumulation(cfg.batch_size, budget, world)
    if accum is None:  # RunConfig refused this before the run started; a direct caller gets the same answer
        raise ValueError(f"no gradient accumulation keeps batch_size={cfg.batch_size} on {world} rank(s) with at most "
                         f"{budget} window(s) per micro-batch")
    return dataclasses.replace(cfg, nproc=world, dp=world, grad_accum=accum, resume=resume,
                               inject_fault=faults_left)


def striking_lose(cfg: RunConfig, failed_rank: int) -> FaultSpec | None:
    """The ``lose`` spec that took ``failed_rank`` away: the earliest still in ``cfg`` (its ranks exit together, as a
    node's do; the launcher reports whichever it saw die first), or None where no spec names that rank."""
    lose = next((f for f in parse_faults(cfg.inject_fault) if f.kind == "lose"), None)
    return lose if lose is not None and failed_rank in lose.ranks else None
