"""benchmarks/run.py never hangs: a module that hangs or raises becomes a failed row, the run goes on, and
nothing it started survives. Planted bench modules (no torch) keep these tests to seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
TIMEOUT_S = 3

# Hangs forever, after starting two descendants that would be orphaned by killing only the module's process:
# a forked copy of itself (like a fork-based launcher's worker) and a subprocess (like a spawned rank).
HANGS = """
import os, subprocess, sys, time
from pathlib import Path

def rows(quick):
    pids = Path(__file__).with_suffix(".pids")
    worker = os.fork()
    if worker == 0:
        time.sleep(10**6)
        os._exit(0)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(10**6)"])
    pids.write_text(f"{os.getpid()} {worker} {rank.pid}")
    time.sleep(10**6)
"""

RAISES = """
def rows(quick):
    raise ValueError("planted failure")
"""

GOOD = """
import os

def rows(quick):
    return [{"benchmark": "good_row", "ours": 1.0, "reference": 2.0, "ratio": 0.5, "unit": "s",
             "config": {"quick": quick, "env_device": os.environ.get("WORKBENCH_DEVICE")}}]
"""

CUDA_GOOD = 'DEVICES = ("cpu", "cuda")\n' + GOOD


def _plant(directory: Path, **modules: str) -> Path:
    for name, source in modules.items():
        (directory / f"bench_{name}.py").write_text(textwrap.dedent(source))
    return directory


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for a parent (or init) to reap it."""
    try:
        import psutil
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        stat = Path(f"/proc/{pid}/stat")
        return not stat.exists() or stat.read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _run(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(RUN), *args], capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - t0


@pytest.mark.timeout(90)
def test_hang_and_error_become_failed_rows_and_nothing_survives(tmp_path: Path) -> None:
    benches = _plant(tmp_path, hangs=HANGS, raises=RAISES, good=GOOD)
    out = tmp_path / "rows.json"
    done, elapsed = _run("--dir", str(benches), "--timeout", str(TIMEOUT_S), "--json", str(out), "--quick")

    # one timeout (3 s) plus the SIGTERM grace and three interpreter starts, far from "forever"
    assert elapsed < 30, elapsed
    assert done.returncode != 0, done.stdout + done.stderr
    rows = {r["benchmark"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"bench_hangs", "bench_raises", "good_row"}, rows
    assert rows["bench_hangs"]["status"] == "failed"
    assert "timed out" in rows["bench_hangs"]["reason"]
    assert rows["bench_raises"]["status"] == "failed"
    assert rows["bench_raises"]["reason"] == "ValueError: planted failure"
    good = rows["good_row"]
    assert good["status"] == "ok" and good["ratio"] == 0.5
    assert good["config"]["device"] == "cpu" and good["config"]["env_device"] == "cpu"
    assert good["config"]["quick"] is True
    # the table says FAILED with the reason, and every module ran (the run went on after the failures)
    assert f"FAILED: timed out after {TIMEOUT_S} s" in done.stdout
    assert "FAILED: ValueError: planted failure" in done.stdout
    assert "good_row" in done.stdout

    pids = [int(p) for p in (benches / "bench_hangs.pids").read_text().split()]
    assert len(pids) == 3  # the module's process, its forked worker, its subprocess "rank"
    deadline = time.monotonic() + 5  # killed already; allow init a moment to reap them
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "a process started by the hung module survived the runner"


@pytest.mark.timeout(60)
def test_in_process_api_and_cuda_skip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(RUN.parent))
    try:
        import run
    finally:
        sys.path.remove(str(RUN.parent))
    _plant(tmp_path, good=GOOD, cuda_good=CUDA_GOOD, raises=RAISES)

    paths = run.bench_modules(None, tmp_path)
    assert [p.stem for p in paths] == ["bench_cuda_good", "bench_good", "bench_raises"]
    assert [p.stem for p in run.bench_modules({"good"}, tmp_path)] == ["bench_good"]

    # Under cuda a module that does not declare it is skipped (no subprocess); skipped is not failed.
    rows, code = run.run_benchmarks(run.bench_modules({"good"}, tmp_path), quick=True, timeout=TIMEOUT_S,
                                    device="cuda")
    assert code == 0
    assert rows[0]["status"] == "skipped" and "does not declare cuda" in rows[0]["reason"]
    assert "SKIPPED" in capsys.readouterr().out

    rows, code = run.run_benchmarks(paths, quick=False, timeout=30, device="cpu")
    assert code == 1
    assert [r["status"] for r in rows] == ["ok", "ok", "failed"]
    assert rows[0]["config"]["quick"] is False


@pytest.mark.timeout(60)
def test_device_cuda_fails_fast_without_a_gpu(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: --device cuda is allowed here")
    _plant(tmp_path, good=GOOD)
    done, _ = _run("--dir", str(tmp_path), "--device", "cuda")
    assert done.returncode == 2
    assert "torch.cuda.is_available() is False" in done.stderr
    assert "good_row" not in done.stdout


def test_every_module_that_can_run_on_one_gpu_declares_cuda() -> None:
    """Single-rank rows (precision, the trainer's step) and rows whose lesson holds per rank (DDP, recompute,
    checkpoint: one NCCL rank per GPU, up to their world) run in the GPU lane; the rest need 2+ ranks that
    exchange data to mean anything (collectives, ZeRO, TP, PP, launch)."""
    sys.path.insert(0, str(RUN.parent))
    from harness import declared_devices

    for topic in ("precision", "trainer_step", "ddp", "recompute", "checkpoint"):
        assert "cuda" in declared_devices(RUN.parent / f"bench_{topic}.py"), topic


def test_multi_rank_modules_take_one_rank_per_gpu_up_to_their_world(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    sys.path.insert(0, str(RUN.parent))
    from harness import DEVICE_ENV, device_and_world

    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert device_and_world(2) == ("cpu", 2)
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    for gpus, world in ((1, 1), (2, 2), (8, 2)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda n=gpus: n)
        assert device_and_world(2) == ("cuda", world)
