"""The sharded model a PyTorch user expects (coming from FSDP and DDP): ZeRO-3 wrap policies (by module type, by
size, by a callable) and a warning when the whole model is one unit; replicated (ignored) parameters; state dicts
under the unwrapped model's names for every strategy (sharded by default, full on request); ``BucketedDDP`` with
one bucket (``bucket_mb=None``).

Multi-rank tests run 2 gloo ranks and compare with one process on the same global batch (tests/equivalence.py).
"""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from equivalence import assert_adam_params_close, assert_params_identical, gpt_batch, mlp_batch, reference_grads, shard
from torch import nn

from workbench import comm, launch, trace
from workbench.mesh import Mesh
from workbench.models import GPTConfig, build_gpt
from workbench.parallel import ParallelConfig, parallelize, replicated_names
from workbench.parallel.ddp import make_ddp
from workbench.parallel.zero import FullyShardedModel, ZeroOptimizer, units_from_policy

STEPS = 3
LR = 1e-3
TINY = GPTConfig.preset("tiny", seq_len=16)
# The brief's bound for losses and grad norms against one process (fp32, 3 AdamW steps). Relative, so it holds at
# any scale: a loss is a mean of positive terms and a norm a root of a sum of squares, whose rounding in any
# order is relative to the result (84 eps here); parameters by tests/equivalence.py's assert_adam_params_close.
LOSS_RTOL = 1e-5


class SeqRegressor(nn.Module):
    """No ``nn.ModuleList`` anywhere: ``default_units`` finds nothing, so only a wrap policy makes units."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 32),
                                 nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        y = self.net(x)
        return y if targets is None else F.mse_loss(y, targets)


def build_seq(seed: int = 0) -> SeqRegressor:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SeqRegressor()


def _is_norm(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm)


# Linear(16,32) 544, LayerNorm 64, Linear(32,32) 1056, Linear(32,16) 528 elements. Size 1000, bottom-up: only
# net.3 reaches it alone; then `net` holds the 1200 elements no smaller unit took, so it is a unit too and the
# root keeps nothing.
POLICIES = {"type": {nn.Linear}, "size": 1000, "callable": _is_norm}
EXPECTED_UNITS = {"type": ["root", "net.0", "net.3", "net.6"], "size": ["net", "net.3"],
                  "callable": ["root", "net.1", "net.4"]}


def _global_loss(loss: torch.Tensor) -> float:
    """The mean over the global batch: every rank's local mean over an equal share, averaged."""
    loss = loss.detach().clone().reshape(1)
    comm.all_reduce(loss, op="avg")
    return float(loss)


def _policies_rank() -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for name, policy in POLICIES.items():
        model = FullyShardedModel(build_seq(), wrap_policy=policy)
        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=3, lr=LR)
        losses = []
        for step in range(STEPS):
            opt.zero_grad()
            loss = model(*shard(mlp_batch(step), rank, world))
            loss.backward()
            opt.step()
            losses.append(_global_loss(loss))
        out[name] = {"units": model.units, "losses": losses, "params": model.full_parameters()}
    with pytest.warns(UserWarning, match="no parameter memory is saved during forward.*wrap_policy"):
        FullyShardedModel(build_seq())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # GPT's default units (its blocks) are fine: no warning
        FullyShardedModel(build_gpt(TINY))
        FullyShardedModel(build_seq(), wrap_policy={nn.Linear})
    return out


def _seq_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_seq()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(*mlp_batch(step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(180)
def test_wrap_policies_unit_a_model_without_module_list_and_train_like_one_process():
    results = launch(_policies_rank, 2, timeout=60)
    want_losses, want_params = _seq_reference()
    grads0 = reference_grads(build_seq, mlp_batch)
    for got in results:
        for name, expected in EXPECTED_UNITS.items():
            assert got[name]["units"] == expected, (name, got[name]["units"])
            assert got[name]["losses"] == pytest.approx(want_losses, rel=LOSS_RTOL), name
            assert_adam_params_close(got[name]["params"], want_params, grads0, STEPS * LR, msg=f"{name} ")


def test_wrap_policy_resolution_and_bad_input():
    """One process (no warning there: nothing is sharded); bad policies are named with what is valid."""
    model = build_seq()
    assert units_from_policy(model, nn.Linear) == units_from_policy(model, (nn.Linear,))
    assert units_from_policy(model, lambda n, m: n == "net.3") == [model.net[3]]
    gpt = build_gpt(TINY)
    assert units_from_policy(gpt, None) == list(gpt.blocks)
    # Size-based: excluded (replicated) parameters do not count: without net.0's and net.6's, net's leftover is
    # the two LayerNorms' 128 elements, below 1000, so only net.3 is a unit.
    ends = [*model.net[0].parameters(), *model.net[6].parameters()]
    assert units_from_policy(model, 1000, exclude=ends) == [model.net[3]]
    assert units_from_policy(model, 1000) == [model.net, model.net[3]]
    assert FullyShardedModel(build_seq(), wrap_policy={nn.Linear}).units == EXPECTED_UNITS["type"]
    with pytest.raises(ValueError, match="not both"):
        FullyShardedModel(build_seq(), units=[model.net[0]], wrap_policy={nn.Linear})
    for bad in ("Linear", 0, -3, 2.5, [1, 2], {nn.Linear, "x"}, True):
        with pytest.raises(ValueError, match=r"wrap_policy .*valid"):
            FullyShardedModel(build_seq(), wrap_policy=bad)
    with pytest.raises(ValueError, match="without a forward|has no forward"):
        FullyShardedModel(build_gpt(TINY), wrap_policy={nn.ModuleList})
    gpt = build_gpt(TINY)
    with pytest.raises(ValueError, match="without a forward|has no forward"):
        FullyShardedModel(gpt, units=[gpt.blocks])
    with pytest.raises(ValueError, match="not a parameter"):
        FullyShardedModel(build_gpt(TINY), replicate=["ln_f.weight", "nope.weight"])
    with pytest.raises(ValueError, match="replicate"):
        FullyShardedModel(build_gpt(TINY), replicate="ln_f.weight")
    with pytest.raises(ValueError, match="each item"):
        FullyShardedModel(build_gpt(TINY), replicate=[nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="matches no trainable parameter"):
        replicated_names(build_gpt(TINY), ("*batchnorm",))
    names = replicated_names(build_gpt(TINY), ("*norm",))
    assert names == [n for n, _ in build_gpt(TINY).named_parameters() if ".ln" in n or n.startswith("ln_f")]
    assert replicated_names(build_gpt(TINY), ("ln_f.*",)) == ["ln_f.weight", "ln_f.bias"]
    with pytest.raises(ValueError, match="needs zero=3"):
        parallelize(build_gpt(TINY), Mesh(), ParallelConfig(zero=1, zero3_replicate=("*norm",)))


# -- replicated (ignored) parameters ------------------------------------------------------------------------

NORMS = ("*norm",)  # every LayerNorm weight and bias of the GPT: ln1, ln2 of each block and ln_f
MAX_NORM = 0.5  # binds on the tiny GPT's first steps (grad norms ~1-3), so clipping is exercised


def _run_strategy(strategy, rank: int, world: int, accum_batches: int = 8) -> dict:
    losses, norms = [], []
    for step in range(STEPS):
        trace.set_step(step)
        x, y = shard(gpt_batch(step, accum_batches, seq_len=16), rank, world)
        local = strategy.forward_backward(x, y)
        strategy.finish_grad_sync()
        norms.append(float(strategy.optimizer_step(MAX_NORM)["grad_norm"]))  # a device tensor
        strategy.optimizer.zero_grad(set_to_none=True)
        losses.append(_global_loss(local) if world > 1 else float(local))
    trace.set_step(None)
    return {"losses": losses, "norms": norms}


def _replicated_rank() -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for accum in (1, 2):  # 2: the first micro-batch's backward inside no_sync
        tracer = trace.Tracer(rank, world)
        with trace.tracing(tracer):
            s = parallelize(build_gpt(TINY, seed=0), Mesh(dp=world),
                            ParallelConfig(zero=3, zero3_replicate=NORMS, lr=LR, grad_accum=accum))
            got = _run_strategy(s, rank, world)
        names = replicated_names(build_gpt(TINY), NORMS)
        named = dict(s.model.named_parameters())
        got["replicated"] = {n: named[n].detach().clone() for n in names}
        got["plain"] = all(type(named[n]) is nn.Parameter and not hasattr(named[n], "_zero_shard") for n in names)
        got["params"] = s.full_parameters()
        # one flat all-reduce per step for the replicated gradients, beside the units' reduce-scatters
        got["all_reduces"] = [c.nbytes for c in tracer.trace.comms
                              if c.tag == "grad" and c.op == "all_reduce" and c.step == 1]
        got["replicated_bytes"] = sum(named[n].numel() * 4 for n in names)
        out[accum] = got
    return out


def _reference_strategy_run(grad_accum: int = 1) -> dict:
    s = parallelize(build_gpt(TINY, seed=0), Mesh(), ParallelConfig(lr=LR, grad_accum=grad_accum))
    got = _run_strategy(s, 0, 1)
    got["params"] = s.full_parameters()
    return got


@pytest.mark.timeout(180)
def test_replicated_norms_train_like_one_process_and_stay_identical_across_ranks():
    results = launch(_replicated_rank, 2, timeout=90)
    want = _reference_strategy_run()
    grads0 = reference_grads(lambda: build_gpt(TINY, seed=0), lambda s: gpt_batch(s, 8, seq_len=16))
    for accum in (1, 2):
        for got in (r[accum] for r in results):
            assert got["losses"] == pytest.approx(want["losses"], rel=LOSS_RTOL), accum
            assert got["norms"] == pytest.approx(want["norms"], rel=LOSS_RTOL), accum
            assert all(n > MAX_NORM for n in got["norms"][:1]), "clipping must bind to test its count"
            assert_adam_params_close(got["params"], want["params"], grads0, STEPS * LR, msg=f"accum {accum} ")
            assert got["plain"], "replicated parameters stay plain nn.Parameters under their own names"
            assert got["all_reduces"] == [got["replicated_bytes"]], got["all_reduces"]  # step 1: exactly one
        a, b = (r[accum]["replicated"] for r in results)
        assert all(torch.equal(a[n], b[n]) for n in a), "replicated parameters must be bit-identical across ranks"


# -- replicated parameters under a mixed-precision policy ------------------------------------------------------

# net.6 (a Linear) whole; net.1 (a LayerNorm) whole; net.4 (a LayerNorm) half: its weight whole, its bias sharded
MIXED_REPLICATE = ["net.6.weight", "net.6.bias", "net.1.weight", "net.1.bias", "net.4.weight"]
BF16_LOSS_RTOL = 2e-2  # bf16 keeps 8 mantissa bits (~4e-3 a rounding); 3 steps of a tiny regressor: <= 2.5e-3 measured


def _mixed_replicated_rank() -> dict:
    from workbench.precision import MixedPrecision

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = FullyShardedModel(build_seq(), wrap_policy={nn.Linear}, replicate=MIXED_REPLICATE,
                              mp_policy=MixedPrecision(torch.bfloat16, torch.float32))
    net = model.module.net
    seen: dict[str, set] = {"linear": set(), "whole_norm": set(), "half_norm": set()}
    for key, layer in (("linear", net[6]), ("whole_norm", net[1]), ("half_norm", net[4])):
        layer.register_forward_pre_hook(lambda m, args, key=key: seen[key].add((m.weight.dtype, m.bias.dtype)))
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=3, lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(*shard(mlp_batch(step), rank, world))  # fp32 features: cast to bf16 at the model's door
        loss.float().backward()
        opt.step()
        losses.append(_global_loss(loss.float()))
    named = dict(model.named_parameters())
    replicated = {n: named[n] for n in MIXED_REPLICATE}
    out = {"losses": losses, "seen": seen, "loss_dtype": loss.dtype,
           "masters": {n: (p.dtype, p.grad.dtype) for n, p in replicated.items()},
           "same_objects": net[6].weight is named["net.6.weight"] and net[4].weight is named["net.4.weight"],
           "replicated": {n: p.detach().clone() for n, p in replicated.items()}}
    net[6].register_forward_pre_hook(lambda m, args: 1 / 0)  # a forward that raises inside a cast module ...
    try:
        model(*mlp_batch(0))
    except ZeroDivisionError:
        pass
    out["restored_after_error"] = type(net[6]._parameters["weight"]) is nn.Parameter  # ... leaves the master
    return out


@pytest.mark.timeout(180)
def test_replicated_parameters_compute_in_the_policy_dtype_with_fp32_masters():
    """A replicated Linear and a half-replicated LayerNorm compute in bf16 (fp32 masters, fp32 gradients); a
    LayerNorm replicated whole computes in fp32; the run tracks fp32 single-process training."""
    results = launch(_mixed_replicated_rank, 2, timeout=90)
    want_losses, _ = _seq_reference()
    bf16, fp32 = torch.bfloat16, torch.float32
    for got in results:
        assert got["seen"] == {"linear": {(bf16, bf16)}, "whole_norm": {(fp32, fp32)},
                               "half_norm": {(bf16, bf16)}}, got["seen"]
        assert got["loss_dtype"] == bf16
        assert got["masters"] == {n: (fp32, fp32) for n in MIXED_REPLICATE}, got["masters"]
        assert got["same_objects"] and got["restored_after_error"]
        assert got["losses"] == pytest.approx(want_losses, rel=BF16_LOSS_RTOL), (got["losses"], want_losses)
    a, b = (r["replicated"] for r in results)
    assert all(torch.equal(a[n], b[n]) for n in a), "replicated parameters must stay bit-identical across ranks"


def _tensor_parallel_replicated_rank() -> dict:
    """dp=2 x tp=2, ZeRO-3 over dp with SP inside: a replicated LayerNorm is whole on every rank, its gradient a
    partial sum over tp (SP) and an average over dp, and its squared norm counted once (share 1/tp per tp rank)."""
    mesh = Mesh(dp=2, tp=2)
    s = parallelize(build_gpt(TINY, seed=0), mesh, ParallelConfig(zero=3, sp=True, zero3_replicate=NORMS, lr=LR))
    losses, norms = [], []
    for step in range(STEPS):
        x, y = shard(gpt_batch(step, 8, seq_len=16), mesh.dp_rank, mesh.dp_size)
        loss = s.forward_backward(x, y).reshape(1)
        s.finish_grad_sync()
        norms.append(float(s.optimizer_step(MAX_NORM)["grad_norm"]))  # a device tensor
        s.optimizer.zero_grad(set_to_none=True)
        comm.all_reduce(loss, op="avg", group=mesh.dp_group)
        losses.append(float(loss))
    return {"losses": losses, "norms": norms}


@pytest.mark.timeout(240)
def test_replicated_norms_compose_with_tensor_and_sequence_parallelism():
    results = launch(_tensor_parallel_replicated_rank, 4, timeout=120)
    want = _reference_strategy_run()
    for got in results:
        assert got["losses"] == pytest.approx(want["losses"], rel=LOSS_RTOL)
        assert got["norms"] == pytest.approx(want["norms"], rel=LOSS_RTOL)


# -- state dicts under the unwrapped model's names ------------------------------------------------------------

def _state_dict_rank() -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    keys = list(build_gpt(TINY).state_dict())
    model = FullyShardedModel(build_gpt(TINY, seed=0), replicate=["ln_f.weight", "ln_f.bias"])
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=3, lr=LR)
    for step in range(2):
        opt.zero_grad()
        model(*shard(gpt_batch(step, seq_len=16), rank, world)).backward()
        opt.step()
    out: dict = {}
    sd = model.state_dict()
    out["keys"] = list(sd) == keys
    full = model.full_state_dict()
    out["full_keys"] = list(full) == keys
    ranges = model.shard_ranges()
    out["pieces_are_slices"] = all(sd[k].dim() == 1 and torch.equal(sd[k], full[k].reshape(-1)[lo:hi])
                                   for k, (lo, hi) in ranges.items())
    out["whole"] = all(torch.equal(sd[k], full[k]) for k in keys if k not in ranges)
    out["pieces"] = {k: tuple(v.shape) for k, v in sd.items()}
    # the sharded layout round-trips bit-exact, also through torch.save / torch.load(weights_only=True)
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    fresh = FullyShardedModel(build_gpt(TINY, seed=1), replicate=["ln_f.weight", "ln_f.bias"])
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    out["round_trip"] = _same_parameters(fresh, model)
    # a full state dict: a plain GPT loads it strictly; a sharded model loads it too (this rank's pieces)
    plain = build_gpt(TINY, seed=1)
    plain.load_state_dict(full, strict=True)
    out["plain_equals_full"] = all(torch.equal(p, model.full_parameters()[n]) for n, p in plain.named_parameters())
    other = FullyShardedModel(build_gpt(TINY, seed=2), replicate=["ln_f.weight", "ln_f.bias"])
    other.load_state_dict(plain.state_dict())
    out["full_into_sharded"] = _same_parameters(other, model)
    # the flat-shard layout older checkpoints hold still loads
    legacy = nn.Module.state_dict(model)
    out["legacy_keys"] = any(k.endswith("_flat_param") for k in legacy)
    old = FullyShardedModel(build_gpt(TINY, seed=3), replicate=["ln_f.weight", "ln_f.bias"])
    old.load_state_dict(legacy)
    out["legacy_round_trip"] = _same_parameters(old, model)
    bad_dicts = {"shape": {**sd, "wpe.weight": torch.zeros(3, 3)}, "missing": {"wte.weight": sd["wte.weight"]}}
    for name, bad in bad_dicts.items():
        try:
            FullyShardedModel(build_gpt(TINY), replicate=["ln_f.weight", "ln_f.bias"]).load_state_dict(bad)
            out[f"error_{name}"] = ""
        except ValueError as e:
            out[f"error_{name}"] = str(e)
    return out


def _same_parameters(a: nn.Module, b: nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return list(pa) == list(pb) and all(torch.equal(pa[n], pb[n]) for n in pa)


@pytest.mark.timeout(180)
def test_state_dict_has_the_unwrapped_names_sharded_or_full():
    results = launch(_state_dict_rank, 2, timeout=60)
    for got in results:
        for check in ("keys", "full_keys", "pieces_are_slices", "whole", "round_trip", "plain_equals_full",
                      "full_into_sharded", "legacy_keys", "legacy_round_trip"):
            assert got[check], check
        assert "wpe.weight" in got["error_shape"] and "piece" in got["error_shape"]
        assert "missing keys" in got["error_missing"]
    # every element of every sharded parameter is on exactly one rank: the pieces add up to the parameter
    full = build_gpt(TINY).state_dict()
    for key, value in full.items():
        shapes = [r["pieces"][key] for r in results]
        if key.startswith("ln_f."):
            assert all(s == tuple(value.shape) for s in shapes)
        else:
            assert sum(math.prod(s) for s in shapes) == value.numel(), key


# -- every strategy's model has GPT's names ------------------------------------------------------------------

STRATEGIES = {
    "ddp": ({"dp": 2}, {}), "ddp-naive": ({"dp": 2}, {"ddp": "naive"}), "zero1": ({"dp": 2}, {"zero": 1}),
    "zero2": ({"dp": 2}, {"zero": 2}), "zero3": ({"dp": 2}, {"zero": 3}),
    "zero3-replicate": ({"dp": 2}, {"zero": 3, "zero3_replicate": NORMS}),
    "zero3-recompute": ({"dp": 2}, {"zero": 3, "recompute": "full"}),
    "tp": ({"tp": 2}, {}), "sp": ({"tp": 2}, {"sp": True}), "tp-zero3": ({"tp": 2}, {"zero": 3}),
    "pp": ({"pp": 2}, {"schedule": "1f1b", "microbatches": 2}),
    "pp-zb": ({"pp": 2}, {"schedule": "zb", "microbatches": 2}),
}


def _strategy_keys_rank() -> dict:
    out = {}
    for name, (mesh_kw, cfg_kw) in STRATEGIES.items():
        s = parallelize(build_gpt(TINY, seed=0), Mesh(**mesh_kw), ParallelConfig(**cfg_kw))
        out[name] = list(s.model.state_dict())
        if hasattr(s.model, "full_state_dict") and "tp" not in mesh_kw:  # under TP, "full" is this tp rank's slice
            build_gpt(TINY).load_state_dict(s.model.full_state_dict(), strict=True)
    return out


@pytest.mark.timeout(180)
def test_every_strategy_state_dict_has_the_gpt_names():
    results = launch(_strategy_keys_rank, 2, timeout=90)
    keys = list(build_gpt(TINY).state_dict())
    stage_keys = [[k for k in keys if k.startswith(("wte.", "wpe.", "blocks.0."))],
                  [k for k in keys if k.startswith(("blocks.1.", "ln_f.", "lm_head."))]]
    for rank, got in enumerate(results):
        for name in STRATEGIES:
            if name.startswith("pp"):  # a stage holds its layers, under the full model's indices
                assert sorted(got[name]) == sorted(stage_keys[rank]), (name, rank, got[name])
            else:
                assert got[name] == keys, (name, got[name])


# -- BucketedDDP with one bucket ------------------------------------------------------------------------------

def _one_bucket_rank() -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = {}
    for name, kind, kwargs in (("one", "bucketed", {"bucket_mb": None}), ("flat", "flat", {})):
        tracer = trace.Tracer(rank, world)
        with trace.tracing(tracer):
            ddp = make_ddp(build_gpt(TINY, seed=0), kind, **kwargs)
            opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
            for step in range(STEPS):
                trace.set_step(step)
                opt.zero_grad(set_to_none=False)
                ddp(*shard(gpt_batch(step, seq_len=16), rank, world)).backward()
                ddp.finish_gradient_synchronization()
                opt.step()
            trace.set_step(None)
        grads = [c for c in tracer.trace.comms if c.tag == "grad"]
        out[name] = {"per_step": [sum(c.op == "all_reduce" for c in grads if c.step == s) for s in range(STEPS)],
                     "bytes": sum(c.nbytes for c in grads if c.step == 0),
                     "buckets": getattr(ddp, "num_buckets", None),
                     "params": {n: p.detach().clone() for n, p in ddp.named_parameters()}}
    return out


@pytest.mark.timeout(180)
def test_bucketed_ddp_with_one_bucket_all_reduces_once_per_step():
    results = launch(_one_bucket_rank, 2, timeout=60)
    n_bytes = 4 * sum(p.numel() for p in build_gpt(TINY).parameters())
    for got in results:
        assert got["one"]["buckets"] == 1
        assert got["one"]["per_step"] == [1] * STEPS
        assert got["one"]["bytes"] == got["flat"]["bytes"] == n_bytes
        assert_params_identical(got["one"]["params"], got["flat"]["params"])  # the same sum, bit for bit
    with pytest.raises(ValueError, match="or None for one bucket"):
        make_ddp(build_gpt(TINY), "bucketed", bucket_mb=-1)


# a CLI run, a resume and a reshard: the extended lane (the API tests above cover the numbers)
@pytest.mark.extended
def test_replicated_norms_from_the_cli_resume_and_reshard(tmp_path) -> None:
    """`--zero 3 --zero3-replicate '*norm'` trains as one process does, resumes on the same layout and reshards to
    one process (the replicated parameters' whole moments are gathered like the shards')."""
    from workbench.cli import _config_from_args, build_parser, run_training
    from workbench.train import RunConfig

    def train_config(argv: list[str]) -> RunConfig:  # what `workbench run ...` trains
        return _config_from_args(build_parser().parse_args(argv))

    base = dict(steps=4, batch_size=8, seq_len=32)
    one = run_training(RunConfig(nproc=1, **base), progress=False)["losses"]
    flags = ["--nproc", "2", "--zero", "3", "--zero3-replicate", "*norm", "--batch-size", "8", "--seq-len", "32",
             "--ckpt-dir", str(tmp_path), "--ckpt-every", "1"]
    first = run_training(train_config(["run", *flags, "--steps", "2"]), progress=False)
    assert "replicated: *norm" in first["strategy"]
    resumed = run_training(train_config(["run", *flags, "--steps", "3", "--resume"]), progress=False)
    resharded = run_training(RunConfig(nproc=1, ckpt_dir=str(tmp_path), resume=True, **base), progress=False)
    got = first["losses"] + resumed["losses"][-1:] + resharded["losses"][-1:]
    # relative to the loss, the bound every strategy meets against one process (tests/test_train_cli.py)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(one), rtol=2e-4, atol=0)
