"""Reference solution of lab 03 (``labs/03_bucketed_ddp.ipynb``): the three methods of ``BucketedDDPScaffold``
the learner writes (Li et al. 2020, "PyTorch Distributed", §3.2.3). Kept beside the labs, outside the package."""

from __future__ import annotations

from torch import nn

from workbench import comm
from workbench.labs.bucketed_ddp import BucketedDDPScaffold


class LearnerBucketedDDP(BucketedDDPScaffold):
    def broadcast_parameters(self) -> None:
        # Seeded construction is not a guarantee: rank 0's copy is the truth, buffers included.
        src = comm.global_rank(self.group, 0)  # broadcast takes a global rank
        for tensor in [*self.module.parameters(), *self.module.buffers()]:
            comm.broadcast(tensor.detach(), src=src, group=self.group)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        i = self.bucket_of(param)
        self.slot(param).copy_(param.grad)  # copy first: the all-reduce reads the whole buffer
        self.pending[i] -= 1
        if self.pending[i] == 0:  # last gradient of this bucket: communicate while backward goes on
            self.handles.append(comm.all_reduce(self.bucket_buffers[i], group=self.group, async_op=True))

    def finish_gradient_synchronization(self) -> None:
        for handle in self.handles:
            handle.wait()
        for bucket, buffer in zip(self.buckets, self.bucket_buffers, strict=True):
            buffer.div_(self.world_size)  # sum -> average: the step equals one process on the global batch
            for p in bucket:
                p.grad.copy_(self.slot(p))
        self.reset_pending()
