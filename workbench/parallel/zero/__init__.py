"""ZeRO stages 1-3 and CPU offload: why keep N copies of the optimizer at all?

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC'20).
Plain data parallelism replicates all model states on every rank: 4Ψ bytes of fp32 parameters, 4Ψ of
gradients and 8Ψ of Adam moments. ZeRO partitions them over the N data-parallel ranks:

stage 1 (P_os)      ``ZeroOptimizer(..., stage=1)``: each rank keeps optimizer state for, and updates, only
                    its 1/N shard of the parameters, then the updated shards are all-gathered.
stage 2 (P_os+g)    ``ZeroOptimizer(..., stage=2)``: gradients are reduce-scattered (averaged) bucket by
                    bucket while backward runs, so each rank keeps only its gradient shard.
stage 3 (P_os+g+p)  ``FullyShardedModel`` + ``ZeroOptimizer(..., stage=3)``: parameters are sharded too and
                    each unit's are all-gathered just before its forward and again before its backward
                    (FSDP: Zhao et al. 2023, "PyTorch FSDP", VLDB). 3Ψ moved per step instead of 2Ψ (§7.2).
offload             ZeRO-Offload (Ren et al. 2021): optimizer state (and with ``offload_params`` the stage-3
                    parameter shards) live on ``offload_device`` and are copied to the compute device to be used.

Every stage lays parameters end to end in *flat buckets*, each padded to a multiple of N, and rank r owns
the contiguous slice r of every bucket: one ``reduce_scatter`` and one ``all_gather`` per bucket, per-rank
bytes exactly Ψ/N plus padding (``flat.py`` says how and why).

Where each idea lives (read them in this order):

``flat.py``           the flat-bucket layout all stages share: ``Bucket``, step pieces, sizes (which parameters
                      share a bucket: ``workbench.parallel.buckets.bucket_params``, as DDP's buckets)
``optimizer.py``      ``ZeroOptimizer``: stage 1's sharded step and all-gather, clipping over shards, stage 3's step
``gradients.py``      stage 2: each bucket's gradient reduce-scattered into the shard while backward runs
``fully_sharded.py``  stage 3's runtime: ``FullyShardedModel``, per-unit gather / free / reduce-scatter, the
                      replicated parameters' all-reduce, no_sync
``units.py``          stage 3's layout decisions: which submodules are units (``default_units``,
                      ``units_from_policy``), which parameters stay replicated
``sharded_unit.py``   one stage-3 unit: its flat shard and transient full buffer (``ShardedUnit``)
``casts.py``          stage 3's mixed precision: what is cast to ``param_dtype`` around each forward
``state_dict.py``     stage 3's state dicts and full parameters under the unwrapped model's names (a mixin of
                      ``FullyShardedModel``)
``offload.py``        ZeRO-Offload: host copies (pinned on CUDA) and the optimizer's master shards

Why this split: one file per idea, named after it, rather than one per stage number. Stages 1 and 2 differ
only in *when* gradients are reduced, so they share one optimizer class and stage 2's extra machinery
(hooks, in-flight reduce-scatters) sits beside it in ``gradients.py``; stage 3 changes the *model*, so it is
a module wrapper of its own, and its parts that are not the runtime (choosing units, casts, state dicts) each
have a file; offload is orthogonal to the stages (ZeroOptimizer and FullyShardedModel both use it); the flat
layout is what every stage shares. Dependencies run one way: ``flat``, ``offload``, ``units`` and ``casts``
import nothing of the package; ``gradients`` imports ``flat``; ``sharded_unit`` imports ``flat`` and
``offload``; ``state_dict`` imports ``sharded_unit``; ``optimizer`` imports ``flat``, ``gradients`` and
``offload``; ``fully_sharded`` imports ``flat``, ``offload``, ``units``, ``casts``, ``sharded_unit`` and
``state_dict`` (and re-exports ``default_units``, ``units_from_policy`` and ``VALID_WRAP_POLICIES``, so their
old path works); and only this file imports ``optimizer`` and ``fully_sharded``. Outside the package they
import only the dist floor (``workbench.dist.comm``, ``workbench.dist.launch``), ``workbench.trace``,
``workbench.theory`` and the helpers ``workbench.parallel.buckets`` and (for a type only)
``workbench.parallel.precision``, never another strategy.

Memory is recorded in the tracer's ledger (``workbench.trace``): "parameters" (what this rank permanently
holds), "gradients", "optimizer_state" (tensors of the inner optimizer's state, its 0-dim step counters
excluded as bookkeeping), "gathered_params" (stage 3's transient full units; its peak is what matters),
"comm_buffers" (staging buffers of collectives). Frozen parameters are not ZeRO's business: they stay
replicated, are never communicated and are not counted. Offloaded bytes are not device bytes: they are
reported by ``offloaded_bytes()``. Collectives are tagged "grad" (gradient reduction), "param" (parameter
all-gathers), "clip" (the one-scalar norm all-reduce) and "checkpoint" (``full_parameters``), so the bytes
per step and purpose come straight from ``trace.comms``.
"""

from workbench.parallel.zero.flat import DEFAULT_BUCKET_MB
from workbench.parallel.zero.flat import STEP_CHUNK_BYTES as STEP_CHUNK_BYTES  # public, though not in __all__
from workbench.parallel.zero.fully_sharded import FullyShardedModel, default_units, units_from_policy
from workbench.parallel.zero.optimizer import VALID_STAGES, ZeroOptimizer

__all__ = ["DEFAULT_BUCKET_MB", "VALID_STAGES", "FullyShardedModel", "ZeroOptimizer", "default_units",
           "units_from_policy"]
