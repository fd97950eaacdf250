"""The GPU lane: NCCL ranks on real GPUs. Every test here is marked `gpu` and skips, saying why, where no
CUDA device is visible; `scripts/gpu_lane.sh` runs them (and the CUDA benchmark rows) on a GPU machine and
writes a results file. One GPU covers every single-rank CUDA path and the fallback to gloo for more ranks;
two or more also run the strategies on NCCL across GPUs."""

from __future__ import annotations

import pytest
import torch

from workbench import comm, launch, trace
from workbench.cli import run_training
from workbench.launch import rank_device
from workbench.train import RunConfig

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(GPUS == 0, reason="no CUDA device visible (the GPU lane runs on a GPU machine: "
                                         "scripts/gpu_lane.sh)"),
]

# Loss of one process on CUDA vs N NCCL ranks on CUDA: fp32 sums in a different order (as on CPU) and
# NCCL's own reduction order; the CPU suite's bound, with room for cuBLAS's split-K choices.
LOSS_RTOL = 5e-4
SMALL = dict(steps=4, batch_size=8, seq_len=32)


def _nccl_all_reduce() -> tuple[str, str, float]:
    t = torch.full((4,), float(comm.group_rank() + 1), device=rank_device())
    comm.all_reduce(t)
    return torch.distributed.get_backend(), str(t.device), float(t[0])


def test_nccl_launch_on_every_visible_gpu() -> None:
    results = launch(_nccl_all_reduce, GPUS, device="cuda", timeout=120)
    expected = GPUS * (GPUS + 1) / 2
    assert [r[0] for r in results] == ["nccl"] * GPUS
    assert [r[1] for r in results] == [f"cuda:{i}" for i in range(GPUS)]  # one GPU per rank, in rank order
    assert all(r[2] == expected for r in results)


@pytest.fixture(scope="module")
def cuda_baseline() -> dict:
    return run_training(RunConfig(nproc=1, device="cuda", **SMALL), progress=False)


def test_one_process_trains_on_the_gpu(cuda_baseline: dict) -> None:
    placement = cuda_baseline["placement"]
    assert placement["device"] == "cuda:0" and placement["backend"] == "nccl"
    assert cuda_baseline["losses"][-1] < cuda_baseline["losses"][0]


def test_gpu_matches_cpu(cuda_baseline: dict) -> None:
    """Same seed, same weights (drawn on the CPU, then moved), same batches: the curves agree."""
    cpu = run_training(RunConfig(nproc=1, device="cpu", **SMALL), progress=False)
    torch.testing.assert_close(torch.tensor(cuda_baseline["losses"]), torch.tensor(cpu["losses"]),
                               rtol=1e-3, atol=0)


STRATEGIES = [dict(ddp="naive"), dict(ddp="flat"), dict(ddp="overlap"), dict(ddp="bucketed", bucket_mb=0.05),
              dict(zero=1), dict(zero=2), dict(zero=3), dict(zero=1, offload=True), dict(zero=2, offload=True),
              dict(zero=3, offload=True), dict(zero=3, grad_accum=2)]


@pytest.mark.parametrize("flags", STRATEGIES, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()))
def test_every_strategy_on_cuda_matches_one_process(flags: dict, cuda_baseline: dict) -> None:
    """On every visible GPU (one rank each, NCCL); with one GPU that is dp=1, which still runs each
    strategy's CUDA buffers, hooks and (with offload) its pinned host copies."""
    world = min(GPUS, 4)
    summary = run_training(RunConfig(nproc=world, device="cuda", **SMALL, **flags), progress=False)
    assert summary["placement"]["backend"] == "nccl"
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(cuda_baseline["losses"]),
                               rtol=LOSS_RTOL, atol=0)


def test_more_ranks_than_gpus_falls_back_to_gloo_on_cpu(capfd) -> None:
    summary = run_training(RunConfig(nproc=GPUS + 1, device="auto", steps=2, batch_size=4 * (GPUS + 1),
                                     seq_len=32), progress=False)
    assert summary["placement"] == {"backend": "gloo", "device": "cpu", "device_name": "cpu"}
    assert "running gloo on the CPU" in capfd.readouterr().err


def test_ledger_beside_the_allocator(cuda_baseline: dict) -> None:
    """The ledger's categories are real bytes: at the record point (after the step, before zero_grad) the
    allocator holds them, plus what the trace names beside them, each measured: cuBLAS's workspaces (tens of
    MiB on an H100, against the tiny GPT's 1.8 MiB of model states) and the batch. What is left unexplained
    is scalars (the loss, the grad norm) and each block's rounding up to 512 bytes: under 5 % of the ledger
    plus 1 MiB, where a forgotten category (a second copy of the gradients, say: +25 %) would not fit."""
    from workbench.trace import DeviceMemory

    dm = DeviceMemory(**cuda_baseline["device_memory"][0])
    assert dm.device == "cuda:0"
    n = cuda_baseline["n_params"]
    assert dm.ledger_total >= 16 * n  # parameters + gradients + AdamW's two moments, fp32
    assert dm.cublas_workspaces is not None and dm.cublas_workspaces > 0, dm
    assert dm.batch > 0, dm
    assert dm.allocated >= dm.ledger_total + dm.cublas_workspaces + dm.batch, dm
    assert dm.unexplained <= 0.05 * dm.ledger_total + 2**20, dm
    assert dm.peak_allocated >= dm.ledger_peak


#: (RunConfig overrides, host-device syncs per steady step). fp16 adds one: every rank must know whether any
#: gradient overflowed before it steps or skips (torch.amp.GradScaler reads the same flag for AdamW). The
#: compressors run at one rank inside ZeRO-1's wrapper (plain dp=1 builds no DDP wrapper, so nothing to compress).
SYNC_CASES = [(dict(), 1), (dict(precision="bf16"), 1), (dict(precision="fp16"), 2), (dict(zero=1), 1),
              (dict(zero=2), 1), (dict(zero=3), 1), (dict(zero=1, grad_compression="powersgd"), 1),
              (dict(zero=1, grad_compression="topk"), 1), (dict(zero=1, grad_compression="sign"), 1),
              (dict(local_steps=2), 1)]


def _count_syncs(overrides: dict, warm: int, windows: tuple[int, int]) -> tuple[list[int], list[str]]:
    """Steps ``warm`` steps, then counts the host-device syncs of two windows of more steps under torch's sync
    debug mode (each synchronizing CUDA call warns, attributed to the Python line that made it). The first
    window takes a sync torch makes once, the first time the mode is on (H100, torch 2.11: one, in
    torch/cuda/__init__.py); the second is the steady state."""
    import warnings

    from workbench.train import RunConfig, Trainer

    trainer = Trainer(RunConfig(nproc=1, device="cuda", steps=warm + sum(windows), batch_size=8, seq_len=32,
                                trace_steps=0, **overrides))
    for _ in range(warm):
        trainer.step()
    counts, where = [], set()
    for steps in windows:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    trainer.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        counts.append(len(syncs))
        where |= set(syncs)
    return counts, sorted(where)


@pytest.mark.parametrize("overrides, per_step", SYNC_CASES,
                         ids=["-".join(f"{k}{v}" for k, v in o.items()) or "fp32" for o, _ in SYNC_CASES])
def test_one_host_device_sync_per_step_after_the_optimizer_is_queued(overrides: dict, per_step: int) -> None:
    """A steady step reads its metrics (loss, grad norm) in ONE copy once ``optimizer.step()`` is queued:
    nothing between backward and the optimizer waits for the GPU, so the host queues the optimizer's kernels
    while the backward still runs (the 1.67x of issue 18 at batch 64 came from ``float(grad_norm)`` there)."""
    windows = (3, 8)
    counts, where = launch(_count_syncs, 1, overrides, 3, windows, device="cuda", timeout=300)[0]
    assert counts[-1] == per_step * windows[-1], f"{counts} syncs in windows of {windows} steps, at {where}"
    assert any("training/trainer.py" in w for w in where), where  # the one read: _read_scalars


def test_cuda_records_allocator_figures_and_utilisation_or_none() -> None:
    device = torch.device("cuda", 0)
    with trace.tracing() as tracer:
        tracer.memory.set("parameters", 4 * 2**20)
        held = torch.empty(2**20, device=device)  # 4 MiB the allocator counts
        trace.record_device_memory(device)
    dm = tracer.trace.device_memory
    assert dm is not None and dm.device == "cuda:0"
    assert dm.allocated >= held.numel() * held.element_size() and dm.ledger_total == 4 * 2**20
    assert dm.reserved >= dm.allocated and dm.peak_allocated >= dm.allocated
    assert dm.cublas_workspaces is not None and dm.cublas_workspaces >= 0
    assert dm.utilization is None or 0.0 <= dm.utilization <= 100.0


def test_cublas_workspaces_are_measured_after_a_matmul() -> None:
    device = torch.device("cuda", 0)
    a = torch.randn(256, 256, device=device)
    (a @ a).sum()  # cuBLAS takes its workspace from the caching allocator at its first matmul on this stream
    measured = trace.cublas_workspace_bytes(device)
    assert measured is not None and measured > 0
    assert trace.cublas_workspace_bytes(device) == 0, "cleared: none is held until the next matmul"
    (a @ a).sum()
    assert trace.cublas_workspace_bytes(device) == measured


def test_zero3_offload_keeps_shards_in_pinned_host_memory() -> None:
    def probe() -> tuple[bool, bool]:
        from workbench.mesh import Mesh
        from workbench.models import GPTConfig, build_gpt
        from workbench.parallel import ParallelConfig, parallelize

        mesh = Mesh(dp=1)
        model = build_gpt(GPTConfig.preset("tiny", seq_len=32), device=mesh.device)
        strategy = parallelize(model, mesh, ParallelConfig(zero=3, offload=True))
        shards = list(strategy.model.parameters())
        return all(s.device.type == "cpu" for s in shards), all(s.is_pinned() for s in shards)

    on_host, pinned = launch(probe, 1, device="cuda", timeout=120)[0]
    assert on_host and pinned


def test_trainer_step_benchmark_runs_on_cuda(tmp_path) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    runner = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(runner), "--device", "cuda", "--quick", "--only", "trainer_step",
                           "--json", str(out)], capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {r["config"]["precision"] for r in rows} == {"fp32", "bf16"}
    assert all(r["status"] == "ok" and r["config"]["device"] == "cuda" and r["ratio"] > 0 for r in rows), rows


def test_benchmark_rows_run_on_cuda(tmp_path) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    runner = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(runner), "--device", "cuda", "--quick", "--only", "ddp", "--json",
                           str(out)], capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["status"] == "ok" and row["config"]["backend"] == "nccl"
    assert row["ours"] > 0 and row["reference"] > 0


# -- context parallelism, compression and local SGD on CUDA (issues 21, 22). One GPU: world 1 (two NCCL ranks
# cannot share a GPU), which still runs every CUDA kernel these paths add: ring attention's explicit blocks (the
# fused block kernel is CPU-only), the compressors' QR, top-k and bit packing, the outer optimizer's buffers.

def _ring_vs_full_attention(device: str, dtype: torch.dtype, causal: bool) -> dict[str, float]:
    """max |ring − reference| / max |reference| for out, lse, dq, dk, dv. The reference is the explicit softmax in
    fp64 on the same (dtype-rounded) inputs; ring attention runs its explicit block path (one rank, zigzag: two
    chunks, so a masked diagonal block and a full one) on ``device``."""
    import math

    from workbench.parallel.context import ring_attention_with_lse

    g = torch.Generator(device="cpu").manual_seed(0)
    b, h, s, hd = 2, 4, 64, 16
    qkv = [torch.randn(b, h, s, hd, generator=g, device="cpu").to(dtype) for _ in range(3)]
    probe_out, probe_lse = torch.randn(b, h, s, hd, generator=g), torch.randn(b, h, s, generator=g)
    q, k, v = (t.to(device).clone().requires_grad_() for t in qkv)
    out, lse = ring_attention_with_lse(q, k, v, None, causal=causal)
    ((out.float() * probe_out.to(device)).sum() + (lse * probe_lse.to(device)).sum()).backward()
    rq, rk, rv = (t.double().clone().requires_grad_() for t in qkv)
    scores = rq @ rk.transpose(-1, -2) / math.sqrt(hd)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    r_lse, r_out = torch.logsumexp(scores, -1), torch.softmax(scores, -1) @ rv
    ((r_out * probe_out.double()).sum() + (r_lse * probe_lse.double()).sum()).backward()
    pairs = {"out": (out, r_out), "lse": (lse, r_lse), "dq": (q.grad, rq.grad), "dk": (k.grad, rk.grad),
             "dv": (v.grad, rv.grad)}
    return {n: float((got.detach().cpu().double() - want.detach()).abs().max() / want.detach().abs().max())
            for n, (got, want) in pairs.items()}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ring_attention_explicit_blocks_on_cuda_match_full_attention(dtype: torch.dtype, causal: bool) -> None:
    """fp32: the blocks' sums in another order than the reference's, a few roundings each (bound 64 eps of the
    quantity's largest element; the CPU suite measures ≤ 4.2 eps). bf16: the blocks compute in fp32 and round
    out, dq, dk, dv once to bf16 (half an ulp, 2^-8 of the value) on top of the inputs' own rounding, which the
    reference shares: bound 4 bf16 eps. A wrong mask or merge is off by O(1) of the scale."""
    bound = 64 * torch.finfo(torch.float32).eps if dtype == torch.float32 else 4 * torch.finfo(torch.bfloat16).eps
    errors = _ring_vs_full_attention("cuda", dtype, causal)
    assert all(e <= bound for e in errors.values()), (errors, bound)


SCHEMES = ["bf16", "powersgd", "topk", "sign"]


def _compressed_steps(steps: int) -> dict[str, dict]:
    """Each compressor in FlatDDP (one unit: every gradient) on this rank's GPU, AdamW, ``steps`` steps from the
    first (no plain warm-up): its losses, the bytes it sent each step and theory's payload for the same units. The
    trainer builds no DDP wrapper for one rank, so the wrapper is built here."""
    from workbench.mesh import Mesh
    from workbench.models import GPTConfig, build_gpt
    from workbench.parallel.compression import make_compressor
    from workbench.parallel.ddp import FlatDDP
    from workbench.theory.compression import step_bytes

    device = Mesh(dp=1).device
    cfg = GPTConfig.preset("tiny", seq_len=32)
    g = torch.Generator(device="cpu").manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (8, 33), generator=g).to(device)] * steps  # one batch: loss falls
    out = {}
    for scheme in SCHEMES:
        compressor = make_compressor(scheme, powersgd_rank=4, topk_ratio=0.01, warmup_steps=0)
        ddp = FlatDDP(build_gpt(cfg, seed=0, device=device), compressor=compressor)
        opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
        losses, sent = [], []
        for x in batches:
            opt.zero_grad()
            loss = ddp(x[:, :-1], x[:, 1:])
            loss.backward()
            ddp.finish_gradient_synchronization()
            opt.step()
            losses.append(float(loss))
            sent.append(compressor.history[-1].sent)
        theory = step_bytes(scheme, ddp.reduction_units(), 1, powersgd_rank=4, topk_ratio=0.01)
        out[scheme] = {"losses": losses, "sent": sent, "theory": theory["payload"],
                       "device": str(next(ddp.parameters()).device)}
    return out


@pytest.fixture(scope="module")
def compressed() -> dict[str, dict]:
    return launch(_compressed_steps, 1, 6, device="cuda", timeout=300)[0]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_compressed_gradients_on_cuda_send_theory_bytes_and_train(scheme: str, compressed: dict) -> None:
    run = compressed[scheme]
    assert run["device"] == "cuda:0"
    assert run["sent"] == [run["theory"]] * len(run["sent"]), run
    losses = run["losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


def test_local_sgd_on_cuda_with_one_step_rounds_is_the_plain_run(cuda_baseline: dict) -> None:
    """H = 1 with outer SGD at lr 1: θ_g − 1·(θ_g − θ) = θ after every inner step, up to one rounding of each
    parameter per step (far inside LOSS_RTOL); nesterov with H = 2 trains."""
    h1 = run_training(RunConfig(nproc=1, device="cuda", local_steps=1, outer_optimizer="sgd", outer_lr=1.0, **SMALL),
                      progress=False)
    torch.testing.assert_close(torch.tensor(h1["losses"]), torch.tensor(cuda_baseline["losses"]),
                               rtol=LOSS_RTOL, atol=0)
    h2 = run_training(RunConfig(nproc=1, device="cuda", local_steps=2, **SMALL), progress=False)
    assert h2["placement"]["backend"] == "nccl" and h2["losses"][-1] < h2["losses"][0]


# -- mixture of experts on CUDA (issue 21) --------------------------------------------------------------------------

MOE = dict(moe_experts=4, moe_top_k=2, moe_capacity_factor=None)


@pytest.fixture(scope="module")
def moe_cuda() -> dict:
    return run_training(RunConfig(nproc=1, device="cuda", **SMALL, **MOE), progress=False)


def test_moe_on_cuda_matches_cpu(moe_cuda: dict) -> None:
    """Same seed and weights: the router picks the same experts (fp32 logits; a near tie could flip one token,
    which moves a loss by far less than this bound) and the curves agree as the dense model's do."""
    cpu = run_training(RunConfig(nproc=1, device="cpu", **SMALL, **MOE), progress=False)
    assert moe_cuda["placement"]["device"] == "cuda:0"
    torch.testing.assert_close(torch.tensor(moe_cuda["losses"]), torch.tensor(cpu["losses"]), rtol=1e-3, atol=0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_moe_in_16_bit_on_cuda_tracks_fp32(precision: str, moe_cuda: dict) -> None:
    """Under autocast the rows go to the experts in 16 bits and come back in 16 bits (models.moe); the curve
    follows fp32's within 16-bit rounding averaged over a batch (the CPU suite measured 3e-4 for bf16)."""
    got = run_training(RunConfig(nproc=1, device="cuda", precision=precision, **SMALL, **MOE), progress=False)
    assert all(torch.isfinite(torch.tensor(got["losses"])))
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(moe_cuda["losses"]), rtol=2e-2, atol=0)


def test_moe_host_syncs_are_the_same_every_step_and_bounded_per_layer(record_property) -> None:
    """A MoE layer must copy its split sizes to the host (one expert's rows are a Python-sized block): so a MoE
    step waits for the GPU more than once. Bounded by the trainer's one read, the routing stats' one copy per step
    (models.moe.take_moe_stats) and at most three per layer (the router's one-hot, the balance loss's, the split
    sizes); the count and where each comes from are recorded in the lane's junit file."""
    windows = (3, 8)
    counts, where = launch(_count_syncs, 1, MOE, 3, windows, device="cuda", timeout=300)[0]
    per_step = counts[-1] / windows[-1]
    record_property("moe_syncs_per_step", per_step)
    record_property("moe_sync_sites", "; ".join(where))
    n_layer = RunConfig(nproc=1, **MOE).gpt_config().n_layer
    assert per_step == int(per_step) and per_step <= 2 + 3 * n_layer, (counts, where)
    assert any("models/moe.py" in w for w in where), where


def test_sigterm_preempts_a_cuda_run_whose_checkpoint_verifies_and_exports(tmp_path) -> None:
    """Issue 23 on a GPU: SIGTERM after the first checkpoint stops the CUDA run at a step boundary with exit 75 and a
    summary saying so; its checkpoint (written from CUDA tensors) verifies and exports on the CPU."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from workbench.checkpoint import latest_good, list_steps, step_dir, verify
    from workbench.models import GPT

    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    cli = [sys.executable, "-m", "workbench.cli"]
    proc = subprocess.Popen([*cli, "run", "--nproc", "1", "--device", "cuda", "--steps", "3000", "--batch-size", "8",
                             "--seq-len", "32", "--ckpt-dir", str(ckpt), "--ckpt-every", "5", "--out", str(out),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while not any(not verify(step_dir(ckpt, s)) for s in list_steps(ckpt)) and proc.poll() is None \
            and time.time() < deadline:
        time.sleep(0.05)  # until the first checkpoint is complete: the run is training
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=240)[0]
    assert proc.returncode == 75, log[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    step = summary["preempted"]["step"]
    assert summary["preempted"]["signal"] == "SIGTERM" and step < 3000
    assert latest_good(ckpt).name.endswith(f"{step:06d}")
    verified = subprocess.run([*cli, "ckpt", "verify", str(ckpt)], capture_output=True, text=True, timeout=240)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    exported = subprocess.run([*cli, "ckpt", "export", str(ckpt), "--out", str(tmp_path / "model.pt")],
                              capture_output=True, text=True, timeout=240)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    state = torch.load(tmp_path / "model.pt", weights_only=True, map_location="cpu")
    GPT(RunConfig(nproc=1, batch_size=8, seq_len=32).gpt_config()).load_state_dict(state)


def test_a_cuda_run_resumed_twice_is_one_record_with_the_unbroken_curve(tmp_path) -> None:
    """Issue 23 item 2 on a GPU: three invocations (4, then --resume to 8, then to 12 steps) write one record beside
    their checkpoints; the last summary's curve covers steps 0..11 with three attempts and follows the unbroken run.
    min_lr_ratio=1: the learning rate after warm-up does not depend on --steps, so the pieces train what the
    unbroken run trains. Within LOSS_RTOL rather than bit for bit: cuDNN/flash attention backward may accumulate in
    another order from one launch to the next."""
    flags = dict(nproc=1, device="cuda", batch_size=8, seq_len=32, min_lr_ratio=1.0, ckpt_every=2)
    full = run_training(RunConfig(steps=12, ckpt_dir=str(tmp_path / "full"), **flags), progress=False)
    for steps, resume in ((4, False), (8, True), (12, True)):
        last = run_training(RunConfig(steps=steps, resume=resume, ckpt_dir=str(tmp_path / "ck"), **flags),
                            progress=False)
    assert [m["step"] for m in last["history"]] == list(range(12))
    assert [a["cause"] for a in last["attempts"]] == ["start", "resume", "resume"]
    assert last["losses"] == pytest.approx(full["losses"], rel=LOSS_RTOL)
