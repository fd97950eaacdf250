"""Lab 03: write the heart of bucketed DDP, and a checker that says what went wrong.

The learner subclasses ``BucketedDDPScaffold`` (buckets, flat buffers and hooks are given) and writes three
methods, each with a contract (Li et al. 2020, "PyTorch Distributed", VLDB, section 3.2.3):

* ``broadcast_parameters()``: afterwards every rank holds rank 0's parameters and buffers;
* ``_on_grad_ready(param)``: called by autograd once ``param.grad`` is final; by the end of backward every
  bucket's all-reduce has been started, asynchronously, exactly once, and only once all of its gradients
  are in its buffer, so communication overlaps the rest of backward;
* ``finish_gradient_synchronization()``: afterwards nothing is in flight, every ``.grad`` equals the
  single-process gradient on the global batch, and the wrapper is ready for the next backward.

``check(cls)`` trains a ToyMLP for a few steps on 2 real ranks that start from *different* weights and
compares every step's gradients, bucket by bucket, with single-process training on the global batch. A
failure is a ``LabCheckFailed`` naming the likely mistake; ``hint(1)``, ``hint(2)``, ``hint(3)`` say more.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workbench.dist import comm
from workbench.labs import LabCheckFailed, show_hint, within_rounding
from workbench.parallel.buckets import bucket_params

WORLD_SIZE = 2
STEPS = 3
GLOBAL_BATCH = 8
BUCKET_MB = 0.004  # ~4 KiB: splits the ToyMLP into several buckets
LR = 0.05
# Gradients are compared in units of eps(fp32) × max|reference gradient| (workbench.labs.rounding_error): the
# ranks' half-batch backwards plus the all-reduce add the same terms as one process in another order, so they
# differ by rounding at the scale of the gradient, whatever the CPU's SIMD width (each tensor its own scale: every
# ToyMLP gradient is at least 0.1 of the largest, none is zero in exact arithmetic). The reference solution
# measured at most 2.5 units (ATEN_CPU_CAPABILITY=default and avx2); 64 leaves room for other orders, while a
# rank's local gradient in place of the average is 2.8e6 units off, and a sum 8e6.
ROUNDING_UNITS = 64
MORE = " (more help: hint(1), hint(2), hint(3))"

HINTS = {
    1: "Ask when a bucket is ready to travel: autograd calls _on_grad_ready once per parameter, in roughly "
       "reverse layer order, and a bucket may only be all-reduced once every one of its gradients has arrived. "
       "The scaffold already keeps a per-bucket count of what is still to come. Communication should start "
       "inside backward (asynchronously, so it overlaps the layers still computing) and must be finished before "
       "the optimizer reads .grad. Rank 0's weights, buffers included, are the truth at the start.",
    2: "broadcast_parameters: one comm.broadcast per parameter AND per buffer, from rank 0 (src takes a global "
       "rank: comm.global_rank(self.group, 0)). _on_grad_ready: put param.grad into its place in the bucket "
       "(self.slot(param)) before anything else, then count its bucket down in self.pending; when the count "
       "reaches zero, start that bucket's all-reduce with async_op=True and keep the handle in self.handles. "
       "finish_gradient_synchronization: wait on every handle; an all-reduce sums, and one process on the "
       "global batch would see the mean; write each bucket's result back into its parameters' .grad; then "
       "refill the countdown for the next backward (self.reset_pending()).",
    3: "broadcast_parameters:\n"
       "    for t in [*self.module.parameters(), *self.module.buffers()]:\n"
       "        comm.broadcast(t.detach(), src=comm.global_rank(self.group, 0), group=self.group)\n"
       "_on_grad_ready(param):\n"
       "    i = self.bucket_of(param); self.slot(param).copy_(param.grad); self.pending[i] -= 1\n"
       "    if self.pending[i] == 0:\n"
       "        self.handles.append(comm.all_reduce(self.bucket_buffers[i], group=self.group, async_op=True))\n"
       "finish_gradient_synchronization:\n"
       "    for h in self.handles: h.wait()\n"
       "    for bucket, buf in zip(self.buckets, self.bucket_buffers):\n"
       "        buf.div_(self.world_size)\n"
       "        for p in bucket: p.grad.copy_(self.slot(p))\n"
       "    self.reset_pending()",
}


def hint(level: int = 1) -> str:
    """Print (and return) hint ``level``: 1 the idea, 2 what each method does, 3 nearly the code."""
    return show_hint(HINTS, level)


class BucketedDDPScaffold(nn.Module):
    """Everything around the three methods the lab asks for: buckets, flat buffers, hooks and forward.

    ``self.buckets[i]`` lists bucket i's parameters (reverse registration order: the last layers' gradients
    come first in backward), ``self.bucket_buffers[i]`` is its flat buffer, ``self.slot(p)`` the view of that
    buffer shaped like ``p``, ``self.pending[i]`` how many of bucket i's gradients are still to come and
    ``self.handles`` the async all-reduce handles launched in this backward.
    """

    def __init__(self, module: nn.Module, group: Any = None, bucket_mb: float = BUCKET_MB) -> None:
        super().__init__()
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb!r}")
        self.module = module
        self.group = group
        self.world_size = comm.group_size(group)
        params = [p for p in module.parameters() if p.requires_grad]  # tied weights once, frozen skipped
        # reverse registration order, as BucketedDDP: backward produces the last layers' gradients first
        self.buckets = bucket_params(reversed(params), int(bucket_mb * 2**20))
        self.bucket_buffers = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                               for b in self.buckets]
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._slots = {id(p): view.view_as(p) for b, buf in zip(self.buckets, self.bucket_buffers, strict=True)
                       for p, view in zip(b, buf.split([p.numel() for p in b]), strict=True)}
        self.reset_pending()
        self.broadcast_parameters()
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def bucket_of(self, param: nn.Parameter) -> int:
        return self._bucket_of[id(param)]

    def slot(self, param: nn.Parameter) -> torch.Tensor:
        return self._slots[id(param)]

    def reset_pending(self) -> None:
        """Ready the countdown and the handle list for the next backward."""
        self.pending = [len(b) for b in self.buckets]
        self.handles: list[Any] = []

    def bucket_param_names(self) -> list[list[str]]:
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [[names[id(p)] for p in b] for b in self.buckets]

    # The three methods the learner writes.
    def broadcast_parameters(self) -> None:
        raise NotImplementedError("copy rank 0's parameters and buffers to every rank with comm.broadcast")

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        raise NotImplementedError("once all of a bucket's gradients are in its buffer, start its all-reduce "
                                  "(async_op=True), exactly once per backward")

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError("when this returns, every .grad is the global-batch gradient, nothing is in "
                                  "flight, and the next backward can start")


# ----------------------------------------------------------------------------------------------------
# What runs on each rank.


def _rank_run(cls: type) -> dict[str, Any]:
    from workbench.models import build_mlp, regression_batch

    rank = comm.group_rank()
    launched: list[Any] = []
    original = comm.all_reduce

    def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("async_op"):
            return original(tensor, *args, **kwargs)
        # The all-reduce reads its buffer at launch (as NCCL on a stream would). Gloo may read it a moment
        # later, which would make "copied in after launching" pass by luck; reduce a snapshot instead, so
        # the mistake shows every time.
        snapshot = tensor.detach().clone()
        work = original(snapshot, *args, **kwargs)
        launched.append(work)
        return _CopyBackOnWait(work, snapshot, tensor)

    comm.all_reduce = counting_all_reduce  # this rank process only: count launches, find unwaited ones
    try:
        model = build_mlp(seed=rank)  # ranks start DIFFERENT on purpose: the broadcast must fix it
        model.scale.add_(rank)
        ddp = cls(model, None, BUCKET_MB)
        out: dict[str, Any] = {"after_wrap": {k: v.clone() for k, v in model.state_dict().items()},
                               "buckets": ddp.bucket_param_names(), "steps": []}
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        for step in range(STEPS):
            x, y = (t.chunk(WORLD_SIZE)[rank] for t in regression_batch(GLOBAL_BATCH, step=step))
            launched.clear()
            opt.zero_grad()
            ddp(x, y).backward()
            ddp.finish_gradient_synchronization()
            out["steps"].append({"launched": len(launched), "unwaited": sum(not _waited(w) for w in launched),
                                 "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                                           if p.grad is not None}})
            opt.step()
        return out
    finally:
        comm.all_reduce = original


class _CopyBackOnWait:
    """A comm.Work whose result lands in the learner's buffer when waited on."""

    def __init__(self, work: Any, snapshot: torch.Tensor, target: torch.Tensor) -> None:
        self._work, self._snapshot, self._target = work, snapshot, target

    def wait(self) -> None:
        if not self._work.waited:
            self._work.wait()
            self._target.copy_(self._snapshot)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    @property
    def waited(self) -> bool:
        return self._work.waited


def _waited(work: Any) -> bool:
    # is_completed() would also be true for work that finished unobserved; `waited` means wait() was called.
    return bool(getattr(work, "waited", True))


# ----------------------------------------------------------------------------------------------------
# The reference and the diagnosis, in the caller.


def _reference() -> list[dict[str, Any]]:
    """Per step: the full-batch gradient (what averaging must give) and each rank's local gradient."""
    from workbench.models import build_mlp, regression_batch

    model = build_mlp(seed=0)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    steps = []
    for step in range(STEPS):
        x, y = regression_batch(GLOBAL_BATCH, step=step)
        local = []
        for r in range(WORLD_SIZE):
            model.zero_grad()
            model(x.chunk(WORLD_SIZE)[r], y.chunk(WORLD_SIZE)[r]).backward()
            local.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.zero_grad()
        model(x, y).backward()
        steps.append({"average": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                      "local": local})
        opt.step()
    return steps


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return within_rounding(a, b, ROUNDING_UNITS)


def _classify(names: list[str], got: dict, want: dict, local: dict) -> str:
    """How one bucket's gradients on one rank relate to the right answer."""
    if any(n not in got for n in names):
        return "missing"
    if all(_close(got[n], want[n]) for n in names):
        return "ok"
    if all(_close(got[n], WORLD_SIZE * want[n]) for n in names):
        return "summed"
    if all(_close(got[n], local[n]) for n in names):
        return "local"
    return "wrong"


def _check_broadcast(results: list[dict]) -> None:
    first = results[0]["after_wrap"]
    for rank, res in enumerate(results[1:], start=1):
        # bit for bit: a broadcast copies rank 0's bytes, no arithmetic
        differ = [k for k, v in res["after_wrap"].items() if not torch.equal(v, first[k])]
        if not differ:
            continue
        if all(k == "scale" for k in differ):
            raise LabCheckFailed("parameters match after wrapping but the buffer 'scale' differs between ranks: "
                                 "broadcast_parameters must broadcast module.buffers() too, not only parameters.")
        raise LabCheckFailed(f"right after wrapping, rank {rank} holds different weights than rank 0 ({differ[:3]}"
                             "...): the replicas diverge from step 0. broadcast_parameters must copy rank 0's "
                             "parameters AND buffers to every rank: comm.broadcast(t.detach(), "
                             "src=comm.global_rank(self.group, 0), group=self.group) for each.")


def _check_launches(step: int, info: dict, n_buckets: int, results: list[dict]) -> None:
    if info["unwaited"]:
        raise LabCheckFailed(f"step {step}: {info['unwaited']} all-reduce(s) were still in flight when "
                             "finish_gradient_synchronization returned: it must call .wait() on every handle "
                             "before reading the buckets.")
    if info["launched"] == 0 and step > 0 and results[0]["steps"][0]["launched"] == n_buckets:
        raise LabCheckFailed(f"step 0 launched its {n_buckets} bucket all-reduces but step {step} launched none: "
                             "the countdown was not reset. Call self.reset_pending() at the end of "
                             "finish_gradient_synchronization.")
    if info["launched"] == 0:
        raise LabCheckFailed("no all-reduce was launched during backward: in _on_grad_ready, when a bucket's last "
                             "gradient arrives (self.pending[i] reaches 0), start "
                             "comm.all_reduce(self.bucket_buffers[i], group=self.group, async_op=True) and keep "
                             "the handle in self.handles.")
    if info["launched"] != n_buckets:
        raise LabCheckFailed(f"step {step}: {info['launched']} all-reduces for {n_buckets} buckets: launch each "
                             "bucket exactly once, when its countdown reaches 0 (not once per parameter).")


def _check_grads(step: int, rank: int, got: dict, ref: dict, buckets: list[list[str]]) -> None:
    kinds = [_classify(names, got, ref["average"], ref["local"][rank]) for names in buckets]
    if all(k == "ok" for k in kinds):
        return
    bad = [i for i, k in enumerate(kinds) if k != "ok"]
    if all(k == "summed" for k in kinds):
        raise LabCheckFailed("gradients were summed, not averaged: after waiting, divide each bucket by the "
                             "world size (self.world_size), so the step equals one process on the global batch.")
    if "missing" in kinds:
        raise LabCheckFailed(f"step {step}: some parameters have no .grad after synchronisation (buckets {bad}).")
    if all(k in ("ok", "local") for k in kinds):
        if kinds.count("ok") == 1:
            raise LabCheckFailed(f"step {step}: only bucket {kinds.index('ok')} was averaged; buckets {bad} still "
                                 "hold each rank's local gradient. Wait on EVERY handle in self.handles and copy "
                                 "EVERY bucket back into its parameters' .grad, not just the last one.")
        if all(k == "local" for k in kinds):
            raise LabCheckFailed(f"step {step}: .grad still holds each rank's local gradient: after waiting, copy "
                                 "each bucket's averaged slice back into param.grad (p.grad.copy_(self.slot(p))).")
        raise LabCheckFailed(f"step {step}: buckets {bad} were never averaged: every bucket must be all-reduced "
                             "and copied back into .grad.")
    raise LabCheckFailed(f"step {step}: the gradients of buckets {bad} are wrong (neither the average, the sum "
                         "nor the local gradient). Did a bucket's all-reduce start before all of its gradients "
                         "were copied in? Copy param.grad into self.slot(param) first, then count down, and "
                         "launch only when self.pending[i] == 0.")


def check(cls: type, world_size: int = WORLD_SIZE, timeout: float = 30.0) -> None:
    """Run ``cls`` (a BucketedDDPScaffold subclass) on real ranks; raise LabCheckFailed with a hint if wrong."""
    if world_size != WORLD_SIZE:
        raise ValueError(f"this checker runs on {WORLD_SIZE} ranks, got world_size={world_size}")
    try:
        _check(cls, world_size, timeout)
    except LabCheckFailed as error:
        raise LabCheckFailed(f"{error}{MORE}") from None


def _check(cls: type, world_size: int, timeout: float) -> None:
    from workbench.dist.launch import RankError, launch

    if not (isinstance(cls, type) and issubclass(cls, BucketedDDPScaffold)):
        raise LabCheckFailed(f"check expects your class (a subclass of BucketedDDPScaffold), got {cls!r}")
    try:
        results = launch(_rank_run, world_size, cls, timeout=timeout)
    except RankError as err:
        raise LabCheckFailed(_explain_rank_error(err)) from None
    _check_broadcast(results)
    reference = _reference()
    buckets = results[0]["buckets"]
    for step in range(STEPS):
        for rank, res in enumerate(results):
            _check_launches(step, res["steps"][step], len(buckets), results)
            _check_grads(step, rank, res["steps"][step]["grads"], reference[step], buckets)
    print(f"Correct! {len(buckets)} buckets, {STEPS} steps on {world_size} ranks that started from different "
          "weights: every bucket was all-reduced during backward and every gradient equals single-process "
          "training on the global batch.")


def _explain_rank_error(err: Exception) -> str:
    text = str(err)
    if "NotImplementedError" in text:
        line = next((ln for ln in text.splitlines() if "NotImplementedError" in ln), text.splitlines()[0])
        return f"a method is not written yet: {line.split('NotImplementedError:', 1)[-1].strip()}"
    if "timed out" in text.lower() or "timeout" in text.lower():
        return ("a collective waited forever: every rank must launch every bucket's all-reduce, the same number "
                "of times and in the same order (and broadcast every tensor from the same src).")
    return f"your code raised on a rank: {text.splitlines()[0]}"


__all__ = ["BucketedDDPScaffold", "HINTS", "check", "hint"]
