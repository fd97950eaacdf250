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
#: gradient overflowed before it steps or skips (torch.amp.GradScaler reads the same flag for AdamW).
SYNC_CASES = [(dict(), 1), (dict(precision="bf16"), 1), (dict(precision="fp16"), 2), (dict(zero=1), 1),
              (dict(zero=2), 1), (dict(zero=3), 1)]


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
