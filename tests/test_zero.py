"""ZeRO stages 0-3 (+ offload): equivalence with one process and with torch's built-ins, memory = theory,
communication bytes = theory.

Each multi-rank test is one launch that checks several things and returns a dict. Tolerances are
tests/equivalence.py's: AdamW parameters by ``assert_adam_params_close``, SGD's (linear in the gradients) within
ROUNDOFF_K eps of the gradients' scale times the distance SGD moved them (``_assert_sgd_close``).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from equivalence import (
    assert_adam_params_close,
    assert_close_to_scale,
    gpt_batch,
    mlp_batch,
    reference_grads,
    reference_train,
    scale_of,
    shard,
)
from torch import nn

from workbench import launch, trace
from workbench.models import GPTConfig, build_gpt, build_mlp
from workbench.parallel.zero import FullyShardedModel, ZeroOptimizer, default_units
from workbench.theory.comm import dp_step_volume
from workbench.theory.memory import model_state_bytes, offloaded_bytes

pytestmark = pytest.mark.numerics  # sums in another order: .ci/run's portable-ISA lane

STEPS = 3
LR = 1e-3
MAX_NORM = 0.05  # the tiny models' gradient norms are 1-3 here, so clipping binds on every step
TINY = GPTConfig.preset("tiny", seq_len=16)
# Small caps split the tiny models into many flat buckets, so bucket order and launch order matter.
BUCKET_MB = {"mlp": 0.004, "gpt": 0.1}
# (name, extra options): accumulation into the shard, accumulation under no_sync, clipping, offload.
CONFIGS = {"plain": {}, "accum": {"accum": 2}, "no_sync": {"accum": 2, "no_sync": True},
           "clip": {"max_norm": MAX_NORM}, "offload": {"offload": True}}


def _build(kind: str) -> nn.Module:
    return build_mlp(seed=0) if kind == "mlp" else build_gpt(TINY, seed=0)


def _batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return mlp_batch(step) if kind == "mlp" else gpt_batch(step, seq_len=16)


def _grads0(kind: str) -> dict[str, torch.Tensor | None]:
    return reference_grads(lambda: _build(kind), lambda s: _batch(kind, s))


def _assert_sgd_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], grads0: dict, lr: float,
                      momentum: float, msg: str = "") -> None:
    """SGD is linear in the gradients: after STEPS steps a parameter has moved by lr times at most
    sum_t sum_(i<=t) momentum^i gradients, so it differs by that many gradients' rounding (ROUNDOFF_K eps at the
    largest gradient's scale); a frozen parameter not at all."""
    moves = sum(momentum**i for t in range(STEPS) for i in range(t + 1))
    scale = lr * moves * scale_of(g for g in grads0.values() if g is not None)
    for name, w in want.items():
        if grads0[name] is None:
            assert torch.equal(got[name], w), f"{msg}{name}: a frozen parameter changed"
        else:
            assert_close_to_scale(got[name], w, scale=scale, msg=f"{msg}{name}")


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _train(kind: str, stage: int, accum: int = 1, no_sync: bool = False, max_norm: float | None = None,
           offload: bool = False, units: str | None = None, steps: int = STEPS) -> dict:
    """Train ``kind`` with ZeRO ``stage`` on this rank's shard of each global batch; full params + norms."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = _build(kind)
    if stage == 3:
        unit_list = [model.tied_a, model.tied_b, *model.layers] if units == "tied_split" else None
        fwd = sync = FullyShardedModel(model, units=unit_list, offload_params=offload)
        opt = ZeroOptimizer(fwd.parameters(), torch.optim.AdamW, stage=3, offload=offload, lr=LR)
    else:
        fwd = model
        opt = sync = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, reduce_grads=True,
                                   offload=offload, bucket_cap_mb=BUCKET_MB[kind], lr=LR)
    norms = []
    for step in range(steps):
        trace.set_step(step)
        x, y = shard(_batch(kind, step), rank, world)
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
            with sync.no_sync() if no_sync and i < accum - 1 else nullcontext():
                (fwd(xm, ym) / accum).backward()
        if max_norm is not None:
            norms.append(float(opt.clip_grad_norm_(max_norm)))
        opt.step()
        if step < steps - 1:
            opt.zero_grad()
    trace.set_step(None)
    params = fwd.full_parameters() if stage == 3 else {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "norms": norms, "opt": opt, "model": fwd}


def _matrix_rank(world: int) -> dict:
    """Every stage x config on both models (world 2), a lighter set on 4 ranks to keep the file fast."""
    out = {}
    configs = CONFIGS if world == 2 else {k: CONFIGS[k] for k in ("plain", "no_sync")}
    for kind in ("mlp", "gpt"):
        for stage in (0, 1, 2, 3):
            for name, cfg in configs.items():
                got = _train(kind, stage, **cfg)
                out[(kind, stage, name)] = {"params": got["params"], "norms": got["norms"]}
    out[("mlp", 3, "tied_split")] = {"params": _train("mlp", 3, units="tied_split")["params"]}
    out["default_units"] = FullyShardedModel(build_mlp(seed=0)).units
    return out


def _references() -> dict:
    refs = {}
    for kind in ("mlp", "gpt"):
        refs[kind] = reference_train(lambda k=kind: _build(k), lambda s, k=kind: _batch(k, s), STEPS, lr=LR)
        refs[kind + "/clip"] = reference_train(lambda k=kind: _build(k), lambda s, k=kind: _batch(k, s), STEPS,
                                               lr=LR, max_norm=MAX_NORM)
    return refs


@pytest.mark.timeout(180)
@pytest.mark.extended  # the test command keeps each stage against one process through test_train_cli's runs
@pytest.mark.parametrize("world", [2, 4])
def test_every_stage_matches_single_process(world):
    results = launch(_matrix_rank, world, world, timeout=60)
    refs = _references()
    grads0 = {kind: _grads0(kind) for kind in ("mlp", "gpt")}
    for rank, got in enumerate(results):
        for key, value in got.items():
            if key == "default_units":
                assert value == ["root", "layers.0", "layers.1", "layers.2"], value
                continue
            kind, stage, name = key
            want = refs[kind + ("/clip" if name == "clip" else "")]
            # clipping scales every gradient alike, so the unclipped step-0 gradients classify the elements
            assert_adam_params_close(value["params"], want, grads0[kind], STEPS * LR,
                                     msg=f"rank {rank} {kind} stage {stage} {name}: ")
            if name == "clip":
                assert all(n > MAX_NORM for n in value["norms"]), "clipping must bind to test it"


def _other_optimizers_rank() -> dict:
    """Stage 1 from a generator with SGD-momentum; param groups + LambdaLR; shard-local state_dict."""
    rank = torch.distributed.get_rank()
    out = {}
    for stage in (1, 2):
        model = build_mlp(seed=0)
        opt = ZeroOptimizer((p for p in model.parameters()), torch.optim.SGD, stage=stage, reduce_grads=True,
                            bucket_cap_mb=BUCKET_MB["mlp"], lr=0.05, momentum=0.9)
        for step in range(STEPS):
            opt.zero_grad()
            model(*shard(mlp_batch(step), rank, 2)).backward()
            opt.step()
        out[f"sgd{stage}"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Two param groups (no weight decay on biases) and a scheduler halving lr each step.
    model = build_mlp(seed=0)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = ZeroOptimizer([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                        torch.optim.AdamW, stage=1, reduce_grads=True, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    for step in range(STEPS):
        opt.zero_grad()
        model(*shard(mlp_batch(step), rank, 2)).backward()
        opt.step()
        sched.step()
    out["groups"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["lr"] = [g["lr"] for g in opt.param_groups]
    state = opt.state_dict()
    fresh = ZeroOptimizer(build_mlp(seed=0).parameters(), torch.optim.AdamW, stage=1, lr=1e-2)
    try:
        fresh.load_state_dict({**state, "rank": 1 - rank})
        out["wrong_rank_error"] = ""
    except ValueError as e:
        out["wrong_rank_error"] = str(e)
    return out


def _ref_groups() -> dict[str, torch.Tensor]:
    model = build_mlp(seed=0)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.requires_grad]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight") and p.requires_grad]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    for step in range(STEPS):
        opt.zero_grad()
        model(*mlp_batch(step)).backward()
        opt.step()
        sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(180)
def test_generator_sgd_momentum_param_groups_scheduler_and_state_dict():
    results = launch(_other_optimizers_rank, 2, timeout=60)
    want_sgd = reference_train(lambda: build_mlp(seed=0), mlp_batch, STEPS, torch.optim.SGD, lr=0.05, momentum=0.9)
    want_groups = _ref_groups()
    grads0 = _grads0("mlp")
    for got in results:
        _assert_sgd_close(got["sgd1"], want_sgd, grads0, lr=0.05, momentum=0.9, msg="stage 1 ")
        _assert_sgd_close(got["sgd2"], want_sgd, grads0, lr=0.05, momentum=0.9, msg="stage 2 ")
        assert_adam_params_close(got["groups"], want_groups, grads0, sum(1e-2 * 0.5**s for s in range(STEPS)))
        assert got["lr"] == [1e-2 * 0.5**STEPS] * 2
        assert "(stage, rank, world)" in got["wrong_rank_error"]


def _torch_builtins_rank() -> dict:
    """ZeRO-1 + torch DDP vs ZeroRedundancyOptimizer + torch DDP; ZeRO-3 vs FSDP2 fully_shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = torch.distributed.get_rank()
    out = {}
    for name in ("ours", "torch"):
        model = build_gpt(TINY, seed=0)
        ddp = DDP(model)
        if name == "ours":
            opt = ZeroOptimizer(ddp.parameters(), torch.optim.AdamW, stage=1, lr=LR)
        else:
            opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        for step in range(STEPS):
            opt.zero_grad()
            ddp(*shard(gpt_batch(step, seq_len=16), rank, 2)).backward()
            opt.step()
        out["zero1/" + name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["zero3/ours"] = _train("gpt", 3)["params"]
    model = build_gpt(TINY, seed=0)
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        model(*shard(gpt_batch(step, seq_len=16), rank, 2)).backward()
        opt.step()
    out["zero3/torch"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.timeout(180)
def test_zero1_agrees_with_zero_redundancy_optimizer_and_zero3_with_fsdp2():
    results = launch(_torch_builtins_rank, 2, timeout=60)
    want = reference_train(lambda: _build("gpt"), lambda s: _batch("gpt", s), STEPS, lr=LR)
    grads0 = _grads0("gpt")
    for got in results:
        assert_adam_params_close(got["zero1/ours"], got["zero1/torch"], grads0, STEPS * LR, msg="zero1 vs torch ")
        assert_adam_params_close(got["zero3/ours"], got["zero3/torch"], grads0, STEPS * LR, msg="zero3 vs FSDP2 ")
        assert_adam_params_close(got["zero3/ours"], want, grads0, STEPS * LR, msg="zero3 vs one process ")


def _memory_and_comm_rank() -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        for offload in (False, True):
            tracer = trace.Tracer(torch.distributed.get_rank(), 2)
            with trace.tracing(tracer):
                got = _train("gpt", stage, offload=offload, steps=2)
            offloaded = got["opt"].offloaded_bytes()
            if stage == 3:
                offloaded.update(got["model"].offloaded_bytes())
            comms = [c for c in tracer.trace.comms if c.step == 1 and c.tag in ("grad", "param")]
            out[(stage, offload)] = {
                "ledger": dict(tracer.memory.current), "peak": dict(tracer.memory.peak), "offloaded": offloaded,
                # dp_step_volume's "logical" count: an all-reduce moves 2x its tensor, the others 1x.
                "logical": sum(c.nbytes * (2 if c.op == "all_reduce" else 1) for c in comms),
                "ops": sorted({(c.op, c.tag) for c in comms}),
                "units": got["model"].unit_numels() if stage == 3 else None,
                "buckets": len(got["opt"].buckets),
            }
    return out


@pytest.mark.timeout(180)
def test_memory_ledger_and_comm_bytes_equal_theory():
    results = launch(_memory_and_comm_rank, 2, timeout=60)
    n = _n_params(_build("gpt"))
    world = 2
    for got in results:
        for (stage, offload), r in got.items():
            theory = model_state_bytes(n, world, stage, "fp32", "adamw", offload)
            # Flat shards pad each bucket/unit to a multiple of N: at most N-1 elements per bucket, stored
            # once per fp32 copy (params, grads) and twice more for Adam's two moments.
            pieces = len(r["units"]) if stage == 3 else r["buckets"]
            slack = 4 * (world - 1) * pieces
            ledger = r["ledger"]
            expect = {"parameters": theory["parameters"], "gradients": theory["gradients"],
                      "optimizer_state": theory["optimizer_state"]}
            if stage == 3 and offload:
                expect["gradients"] = 0.0  # shard gradients live with the offloaded shards (as in FSDP2)
            for category, slack_mult in (("parameters", 1), ("gradients", 1), ("optimizer_state", 2)):
                assert 0 <= ledger[category] - expect[category] <= slack * slack_mult, (stage, offload, category,
                                                                                      ledger[category], expect)
            if offload:
                cpu = offloaded_bytes(n, world, stage, "fp32", "adamw", True)
                assert 0 <= r["offloaded"]["optimizer_state"] - cpu["optimizer_state"] <= 2 * slack
                if stage == 3:
                    assert 0 <= r["offloaded"]["parameters"] - n * 4 / world <= slack
            if stage == 3:
                # transient full units: at most the root (gathered for the whole forward), the unit computing
                # and the one prefetched (tiny GPT has only 2 blocks, so here that is the whole model)
                sizes = r["units"]
                bound = 4 * (sizes["root"] + 2 * max(v for k, v in sizes.items() if k != "root"))
                assert 0 < r["peak"]["gathered_params"] <= bound + slack
            # communication per step: logical bytes of "grad" + "param" collectives
            volume = dp_step_volume(n, 4, stage, world)["logical"]
            if stage == 0 or offload:
                continue
            assert 0 <= r["logical"] - volume <= 3 * slack, (stage, r["logical"], volume)
        # stage 0 (reduce_grads=True) is plain data parallelism: one all-reduce, 2Ψ
        ddp = got[(0, False)]
        assert ddp["ops"] == [("all_reduce", "grad")]
        assert ddp["logical"] == dp_step_volume(n, 4, 0, world)["logical"]
        assert got[(1, False)]["ops"] == got[(2, False)]["ops"] == [("all_gather", "param"), ("reduce_scatter", "grad")]
        ratio = got[(3, False)]["logical"] / ddp["logical"]
        assert ratio == pytest.approx(1.5, rel=0.01), ratio  # byte counts, not float sums: no rounding involved


def test_single_process_api_and_errors():
    """World of one (no process group): the collectives are identities; bad input gets pointed errors."""
    model = build_mlp(seed=0)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)  # 1e-2 * 0.1 in Python floats: no SIMD involved
    model(*mlp_batch(0)).backward()
    assert all(p.grad is None for p in model.parameters()), "stage 2 frees the full gradients"
    opt.step()
    sched.step()
    assert len(default_units(build_gpt(TINY))) == TINY.n_layer
    with pytest.raises(ValueError, match="stage"):
        ZeroOptimizer(build_mlp().parameters(), torch.optim.AdamW, stage=4)
    with pytest.raises(ValueError, match="optimizer_cls"):
        ZeroOptimizer(build_mlp().parameters(), "adam")
    with pytest.raises(ValueError, match="FullyShardedModel"):
        ZeroOptimizer(build_mlp().parameters(), torch.optim.AdamW, stage=3)
    with pytest.raises(ValueError, match="empty"):
        ZeroOptimizer([], torch.optim.AdamW)
    with pytest.raises(ValueError, match="submodule"):
        FullyShardedModel(build_mlp(), units=[nn.Linear(2, 2)])
    fsm = FullyShardedModel(build_mlp(seed=0))
    with pytest.raises(ValueError, match="stage=3"):
        ZeroOptimizer(fsm.parameters(), torch.optim.AdamW, stage=1)
    with pytest.raises(ValueError, match="norm_type"):
        opt.clip_grad_norm_(1.0, norm_type=1.0)


def test_norm_shares_weight_the_clipping_norm_and_bad_keys_are_named():
    """A param group's ``norm_share`` scales its squared norm (what tensor parallelism's replicated tensors
    need); the inner optimizer never sees the key; bad values and stage 3 are refused with the key named."""
    model = build_mlp(seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    model(*mlp_batch(0)).backward()
    grads = [p.grad.clone() for p in params]
    half = len(params) // 2
    opt = ZeroOptimizer([{"params": params[:half], "norm_share": 0.25}, {"params": params[half:]}],
                        torch.optim.AdamW, stage=1, lr=1e-2)
    assert all("norm_share" not in g for g in opt.param_groups)
    want = (0.25 * sum(g.double().pow(2).sum() for g in grads[:half])
            + sum(g.double().pow(2).sum() for g in grads[half:])).sqrt()
    # an fp32 sum of squares (positive terms: its rounding is relative to the result) against a float64 one
    assert_close_to_scale(float(opt.clip_grad_norm_(1e9)), float(want), msg="weighted norm")
    with pytest.raises(ValueError, match="'norm_share' must be a number in \\[0, 1\\]"):
        ZeroOptimizer([{"params": build_mlp().parameters(), "norm_share": 2}], torch.optim.AdamW)
    with pytest.raises(ValueError, match="'partial_grads' must be \\(process group, comm tag\\)"):
        ZeroOptimizer([{"params": build_mlp().parameters(), "partial_grads": "tp"}], torch.optim.AdamW)
    with pytest.raises(ValueError, match="need stages 0-2"):
        ZeroOptimizer([{"params": FullyShardedModel(build_mlp()).parameters(), "norm_share": 0.5}],
                      torch.optim.AdamW, stage=3)
