"""The four DDP wrappers: equivalence with one process, no_sync, names, broadcast, torch DDP, comm log.

Each multi-rank test is one launch that checks several things and returns a dict. Tolerances are
tests/equivalence.py's (fp32; N ranks sum the gradients in another order than one process): parameters after
AdamW steps by ``assert_adam_params_close``, one backward's gradients within ROUNDOFF_K eps of their scale,
broadcast copies bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from equivalence import (
    assert_adam_params_close,
    assert_all_close_to_scale,
    gpt_batch,
    mlp_batch,
    reference_grads,
    reference_train,
    shard,
)
from torch import nn

from workbench import launch, trace
from workbench.models import GPTConfig, build_gpt, build_mlp
from workbench.parallel.buckets import bucket_params
from workbench.parallel.ddp import DDP_KINDS, BucketedDDP, NaiveDDP, make_ddp

pytestmark = pytest.mark.numerics  # sums in another order: .ci/run's portable-ISA lane

STEPS = 3
GLOBAL_BATCH = 8
TINY = GPTConfig.preset("tiny", seq_len=16)
# Caps (MiB) that split the tiny models into several buckets, so bucket order and launch order matter.
MLP_BUCKET_MB = 0.004
GPT_BUCKET_MB = 0.25
LR_SUM = STEPS * 1e-3  # AdamW's default lr, every step: the scale of assert_adam_params_close's bound
VARIANTS = [(kind, {}) for kind in DDP_KINDS] + [("bucketed", {"gradient_as_bucket_view": False})]


def _build(name: str, seed: int = 0) -> nn.Module:
    return build_mlp(seed=seed) if name == "mlp" else build_gpt(TINY, seed=seed)


def _batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return mlp_batch(step, GLOBAL_BATCH) if name == "mlp" else gpt_batch(step, GLOBAL_BATCH, seq_len=16)


def _wrap(model: nn.Module, kind: str, name: str, **kwargs) -> nn.Module:
    return make_ddp(model, kind, bucket_mb=MLP_BUCKET_MB if name == "mlp" else GPT_BUCKET_MB, **kwargs)


def _train(ddp: nn.Module, name: str, rank: int, world: int, micro_batches: int = 1,
           set_to_none: bool = True) -> dict[str, torch.Tensor]:
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad])
    for step in range(STEPS):
        opt.zero_grad(set_to_none=set_to_none)
        x, y = shard(_batch(name, step), rank, world)
        for k, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True)):
            if k < micro_batches - 1:
                with ddp.no_sync():
                    (ddp(xm, ym) / micro_batches).backward()
            else:
                (ddp(xm, ym) / micro_batches).backward()
        ddp.finish_gradient_synchronization()
        ddp.finish_gradient_synchronization()  # idempotent
        opt.step()
    return {n: p.detach().clone() for n, p in ddp.named_parameters()}


def _equivalence_rank(world: int) -> dict:
    rank = torch.distributed.get_rank()
    out = {}
    for name in ("mlp", "gpt"):
        for kind, kwargs in VARIANTS:
            # Ranks start different (seed, buffer, frozen weight): the wrap-time broadcast must fix that.
            model = _build(name, seed=rank)
            if name == "mlp":
                model.scale.add_(rank)
            ddp = _wrap(model, kind, name, **kwargs)
            key = f"{name}/{kind}{'/copy' if kwargs else ''}"
            out[key] = _train(ddp, name, rank, world)
            out[key + "/state"] = {k: v.clone() for k, v in ddp.state_dict().items()}
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])  # 4 ranks: test_train_cli too
def test_every_variant_matches_single_process(world):
    results = launch(_equivalence_rank, world, world, timeout=60)
    for name in ("mlp", "gpt"):
        want = reference_train(lambda n=name: _build(n), lambda s, n=name: _batch(n, s), steps=STEPS)
        grads0 = reference_grads(lambda n=name: _build(n), lambda s, n=name: _batch(n, s))
        want_state = _build(name).state_dict()
        for kind, kwargs in VARIANTS:
            key = f"{name}/{kind}{'/copy' if kwargs else ''}"
            for rank, got in enumerate(results):
                assert_adam_params_close(got[key], want, grads0, LR_SUM, msg=f"{key} rank {rank} ")
                # buffers and the frozen weight came from rank 0 and never changed: copies, bit for bit
                for k in ("scale", "frozen_proj.weight", "frozen_proj.bias") if name == "mlp" else ():
                    assert torch.equal(got[key + "/state"][k], want_state[k]), f"{key} rank {rank} {k}"


def _accumulation_rank(world: int) -> dict:
    rank = torch.distributed.get_rank()
    out = {}
    for kind, kwargs in VARIANTS:
        for set_to_none in (True, False):
            ddp = _wrap(build_mlp(seed=0), kind, "mlp", **kwargs)
            out[(kind, bool(kwargs), set_to_none)] = _train(ddp, "mlp", rank, world, micro_batches=2,
                                                            set_to_none=set_to_none)
    ddp = _wrap(build_gpt(TINY, seed=0), "bucketed", "gpt")
    out["gpt"] = _train(ddp, "gpt", rank, world, micro_batches=2)
    # Inside no_sync nothing is communicated.
    trace.current().trace.comms.clear()
    ddp = NaiveDDP(build_mlp(seed=0))
    x, y = mlp_batch(0)
    with ddp.no_sync():
        ddp(x, y).backward()
        ddp.finish_gradient_synchronization()
    out["comms_in_no_sync"] = len([c for c in trace.current().trace.comms if c.tag == "grad"])
    return out


@pytest.mark.timeout(180)
def test_no_sync_gradient_accumulation_matches_full_batch():
    results = launch(_accumulation_rank, 2, 2, timeout=60)
    want = reference_train(lambda: build_mlp(seed=0), lambda s: mlp_batch(s, GLOBAL_BATCH), steps=STEPS)
    want_gpt = reference_train(lambda: build_gpt(TINY, seed=0), lambda s: gpt_batch(s, GLOBAL_BATCH, seq_len=16),
                               steps=STEPS)
    grads0 = {n: reference_grads(lambda n=n: _build(n), lambda s, n=n: _batch(n, s)) for n in ("mlp", "gpt")}
    for got in results:
        for key, params in got.items():
            if isinstance(key, tuple):
                assert_adam_params_close(params, want, grads0["mlp"], LR_SUM, msg=f"{key} ")
        assert_adam_params_close(got["gpt"], want_gpt, grads0["gpt"], LR_SUM)
        assert got["comms_in_no_sync"] == 0


def test_names_match_the_wrapped_module_and_tied_hook_fires_once():
    # One process: comm ops are identities, the wrappers still work.
    for kind in DDP_KINDS:
        model = build_mlp(seed=0)
        ddp = make_ddp(model, kind)
        assert ddp.module is model
        assert [n for n, _ in ddp.named_parameters()] == [n for n, _ in model.named_parameters()]
        assert [id(p) for p in ddp.parameters()] == [id(p) for p in model.parameters()]
        assert list(ddp.state_dict()) == list(model.state_dict())
        assert [n for n, _ in ddp.named_buffers()] == ["scale"]
        ddp.load_state_dict(build_mlp(seed=1).state_dict())
    model = build_mlp(seed=0)
    fired = []
    model.tied_a.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    ddp = make_ddp(model, "overlap")
    x, y = mlp_batch(0)
    ddp(x, y).backward()
    ddp.finish_gradient_synchronization()
    assert len(fired) == 1, "a tied weight's hook must fire once, after both uses are accumulated"
    # One process: nothing is reduced after the hook, so the gradient it saw is the final one, bit for bit.
    assert torch.equal(fired[0], model.tied_a.weight.grad)


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="unknown DDP kind 'ring'"):
        make_ddp(build_mlp(), "ring")
    with pytest.raises(ValueError, match="bucket_mb must be a positive"):
        BucketedDDP(build_mlp(), bucket_mb=0)
    with pytest.raises(ValueError, match="torch.nn.Module"):
        make_ddp("model", "naive")


def _step_with_spans(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
    trace.set_step(step)
    with trace.span("forward", "forward"):
        loss = ddp(x, y)
    with trace.span("backward", "backward"):
        loss.backward()
    ddp.finish_gradient_synchronization()
    trace.set_step(None)


def _comm_log_rank() -> dict:
    rank = torch.distributed.get_rank()
    tracer = trace.current()
    out = {}
    x, y = shard(gpt_batch(0, GLOBAL_BATCH, seq_len=16), rank, 2)
    for step, kind in enumerate(DDP_KINDS):
        ddp = make_ddp(build_gpt(TINY, seed=0), kind, bucket_mb=GPT_BUCKET_MB)
        _step_with_spans(ddp, x, y, step)
        grads = [c for c in tracer.trace.comms if c.step == step and c.tag == "grad"]
        backward = next(s for s in tracer.trace.spans if s.step == step and s.category == "backward")
        out[kind] = {"all_reduces": sum(c.op == "all_reduce" for c in grads),
                     "bytes": sum(c.nbytes for c in grads),
                     "first_t0_minus_backward_end": min(c.t0 for c in grads) - backward.t1,
                     "buckets": getattr(ddp, "num_buckets", None)}
    # torch DDP and ours on the same run agree
    ours = make_ddp(build_gpt(TINY, seed=0), "bucketed", bucket_mb=GPT_BUCKET_MB)
    ref = torch.nn.parallel.DistributedDataParallel(build_gpt(TINY, seed=0), bucket_cap_mb=GPT_BUCKET_MB)
    results = []
    for ddp in (ours, ref):
        opt = torch.optim.AdamW(ddp.parameters())
        for step in range(STEPS):
            opt.zero_grad()
            ddp(*shard(gpt_batch(step, GLOBAL_BATCH, seq_len=16), rank, 2)).backward()
            if ddp is ours:
                ddp.finish_gradient_synchronization()
            opt.step()
        results.append({n: p.detach().clone() for n, p in ddp.module.named_parameters()})
    out["ours_vs_torch"] = results
    return out


@pytest.mark.timeout(180)
def test_comm_log_counts_overlap_and_agreement_with_torch_ddp():
    results = launch(_comm_log_rank, 2, timeout=60)
    model = build_gpt(TINY, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    n_bytes = sum(p.numel() * 4 for p in params)
    grads0 = reference_grads(lambda: _build("gpt"), lambda s: _batch("gpt", s))
    expected_buckets = len(bucket_params(reversed(params), int(GPT_BUCKET_MB * 2**20)))
    assert expected_buckets >= 2
    for got in results:
        assert got["naive"]["all_reduces"] == len(params)
        assert got["flat"]["all_reduces"] == 1
        assert got["overlap"]["all_reduces"] == len(params)
        assert got["bucketed"]["all_reduces"] == got["bucketed"]["buckets"] == expected_buckets
        assert {got[k]["bytes"] for k in DDP_KINDS} == {n_bytes}
        # naive and flat communicate after backward; overlap and bucketed start during it
        assert got["naive"]["first_t0_minus_backward_end"] > 0
        assert got["flat"]["first_t0_minus_backward_end"] > 0
        assert got["overlap"]["first_t0_minus_backward_end"] < 0
        assert got["bucketed"]["first_t0_minus_backward_end"] < 0
        ours, torch_ddp = got["ours_vs_torch"]
        assert_adam_params_close(ours, torch_ddp, grads0, LR_SUM)  # both bucket the same sum differently


class Branchy(nn.Module):
    """``b`` is used only when asked (data-dependent), ``c`` never: the unused-parameter cases."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        return (self.b(h) if use_b else h).pow(2).mean()


def _unused_rank() -> dict:
    rank = torch.distributed.get_rank()
    out = {}
    x = torch.arange(8.0).view(2, 4) + rank
    for kind in DDP_KINDS:
        for find_unused in (False, True):
            ddp = make_ddp(Branchy(), kind, bucket_mb=1e-5, find_unused_parameters=find_unused)
            ddp(x, use_b=rank == 0).backward()
            ddp.finish_gradient_synchronization()
            out[(kind, find_unused)] = {n: None if p.grad is None else p.grad.clone()
                                        for n, p in ddp.named_parameters()}
    return out


@pytest.mark.timeout(180)
def test_unused_parameters_do_not_hang_and_average_correctly():
    results = launch(_unused_rank, 2, timeout=30)
    ref = Branchy()
    loss = sum(ref(torch.arange(8.0).view(2, 4) + r, use_b=r == 0) for r in range(2)) / 2
    loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters() if not n.startswith("c.")}
    for got in results:
        for (kind, find_unused), grads in got.items():
            for n, p in ref.named_parameters():
                if n.startswith("c.") and find_unused:
                    assert grads[n] is None, f"{kind}: a parameter no rank used keeps grad None"
                elif n.startswith("c."):
                    assert torch.equal(grads[n], torch.zeros_like(p)), kind
            # an average of two ranks' gradients vs one backward of the averaged loss: another summation order
            assert_all_close_to_scale({n: grads[n] for n in want}, want, msg=f"{kind} {find_unused} ")


def test_a_backward_outside_forward_needs_a_post_backward_wrapper() -> None:
    """A pipeline runs its stage's backward itself; hooked wrappers would have reduced inside it."""
    from workbench.models import build_mlp
    from workbench.parallel.ddp import BucketedDDP, FlatDDP

    with pytest.raises(ValueError, match="BucketedDDP reduces from autograd hooks.*NaiveDDP or FlatDDP"):
        BucketedDDP(build_mlp()).synchronize_external_backward()
    flat = FlatDDP(build_mlp())
    flat.module(torch.ones(2, 16)).sum().backward()
    flat.synchronize_external_backward()  # one rank: the average is the gradient itself
    assert all(p.grad is not None for p in flat.parameters() if p.requires_grad)
