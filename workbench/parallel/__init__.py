"""Parallel strategies, one file (or folder) per idea, and ``parallelize``: the one place that composes them.

Strategies: ``ddp`` (replicas, bucketed all-reduce), ``zero/`` (ZeRO 1/2/3), ``tensor/`` (Megatron TP and
sequence parallelism, one plan with two styles), ``pipeline`` (the cut and the schedule executor). Helpers any
strategy may use: ``collectives`` (ring and tree algorithms over ``comm``), ``grad_norm`` (clipping a split model),
``buckets`` (size-capped gradient buckets), and the two wrappers applied around every strategy, ``precision``
(mixed precision, loss scaling) and ``recompute`` (activation recomputation). ``parallelize`` (the composer)
applies them to a plain model from outside and hands the training loop one uniform ``Parallelized`` object.
No strategy imports another, or this package: the composer is the only module that sees them all.
"""

from workbench.parallel.parallelize import (
    DDP_KINDS,
    ParallelConfig,
    Parallelized,
    parallelize,
    replicated_names,
)
from workbench.theory.composition import PP_COMPOSES_WITH
from workbench.theory.memory import ZERO_STAGES

__all__ = ["DDP_KINDS", "PP_COMPOSES_WITH", "ZERO_STAGES", "ParallelConfig", "Parallelized", "parallelize",
           "replicated_names"]
