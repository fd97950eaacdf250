"""Reference solution of lab 04 (``labs/04_zero1_sharded_optimizer.ipynb``): a ZeRO-1 sharded optimizer
(parameter-wise partition, one broadcast per parameter). Kept beside the labs, outside the package.

The partition is torch ``ZeroRedundancyOptimizer``'s: parameters sorted by size, biggest first, each given
to the rank that owns the fewest elements so far (greedy "longest processing time" balancing). It depends
only on the parameter sizes and order, so every rank computes the same one without communicating.
"""

from __future__ import annotations

from workbench import comm
from workbench.labs.zero1 import ShardedOptimizerScaffold


class LearnerShardedOptimizer(ShardedOptimizerScaffold):
    def partition(self) -> list[int]:
        load = [0] * self.world_size
        owners = [0] * len(self.params)
        # sorted() is stable: equal sizes keep model order, so the result is identical on every rank
        for i in sorted(range(len(self.params)), key=lambda i: -self.params[i].numel()):
            owner = min(range(self.world_size), key=lambda r: (load[r], r))
            owners[i] = owner
            load[owner] += self.params[i].numel()
        return owners

    def step(self) -> None:
        self.optimizer.step()  # updates only the parameters this rank owns
        for p, owner in zip(self.params, self.owners, strict=True):
            comm.broadcast(p.data, src=comm.global_rank(self.group, owner), group=self.group, tag="param")
