"""The GPU lane: NCCL ranks on real GPUs. Every test here is marked `gpu` and skips, saying why, where no
CUDA device is visible; `scripts/gpu_lane.sh` runs them (and the CUDA benchmark rows) on a GPU machine and
writes a results file. One GPU covers every single-rank CUDA path and the fallback to gloo for more ranks;
two or more also run the strategies on NCCL across GPUs."""

from __future__ import annotations

import pytest
import torch

from workbench import comm, launch
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
    allocator holds at least them, and little else (the batch, the loss, small scratch)."""
    dm = cuda_baseline["device_memory"][0]
    assert dm is not None and dm["device"] == "cuda:0"
    n = cuda_baseline["n_params"]
    assert dm["ledger_total"] >= 16 * n  # parameters + gradients + AdamW's two moments, fp32
    assert dm["allocated"] >= dm["ledger_total"]
    assert dm["allocated"] - dm["ledger_total"] <= 0.25 * dm["ledger_total"] + 8 * 2**20
    assert dm["peak_allocated"] >= dm["ledger_peak"]


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
