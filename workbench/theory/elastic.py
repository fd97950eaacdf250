"""The arithmetic of an elastic world (``--min-nproc``, ``workbench.training.elastic``): keep the global batch when
ranks are lost, by giving each survivor more micro-batches of at most the size a rank ran before.

The optimizer's problem depends on the global batch B, not on how it is split (Goyal et al. 2017, "Accurate, Large
Minibatch SGD"): N ranks x a micro-batches x m windows = B before and after, with m within a rank's memory budget.
"""

from __future__ import annotations


def elastic_accumulation(batch_size: int, micro_batch: int, world: int) -> int | None:
    """The fewest micro-batches per rank that keep the global batch of ``batch_size`` windows on ``world``
    data-parallel ranks with at most ``micro_batch`` windows in each (a rank's memory budget); None if no count
    splits the batch evenly (``batch_size`` not a multiple of ``world``, or only into micro-batches too large)."""
    if batch_size % world:
        return None
    per_rank = batch_size // world
    return next((a for a in range(1, per_rank + 1) if per_rank % a == 0 and per_rank // a <= micro_batch), None)


def check_elastic_batch(batch_size: int, nproc: int, grad_accum: int, min_nproc: int) -> None:
    """``ValueError`` naming the first world size from ``nproc - 1`` down to ``min_nproc`` on which no gradient
    accumulation keeps ``batch_size`` within the micro-batch of ``nproc`` ranks x ``grad_accum``, with a batch size
    that would work."""
    budget = batch_size // (nproc * grad_accum)
    for world in range(nproc - 1, min_nproc - 1, -1):
        if elastic_accumulation(batch_size, budget, world) is None:
            raise ValueError(f"min_nproc={min_nproc}: on {world} rank(s) no gradient accumulation keeps the global "
                             f"batch of batch_size={batch_size} with at most {budget} window(s) per micro-batch "
                             f"({batch_size} is not {world} x k x m with m <= {budget}); use batch_size="
                             f"{fitting_batch_size(batch_size, nproc * grad_accum, range(min_nproc, nproc))} or a "
                             f"larger min_nproc")


def fitting_batch_size(batch_size: int, split: int, worlds: range) -> int:
    """The smallest batch size >= ``batch_size`` that is a multiple of ``split`` (ranks x micro-batches now) and that
    every world in ``worlds`` can keep within the micro-batch it implies; found by counting up in steps of ``split``.
    Any multiple of a world fits it (micro-batches of one window at worst), so the count ends by the lcm of
    ``split`` and the worlds."""
    batch = batch_size + (-batch_size) % split
    while any(elastic_accumulation(batch, batch // split, w) is None for w in worlds):
        batch += split  # ends by the next multiple of math.lcm(split, *worlds)
    return batch
