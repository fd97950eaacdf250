"""Bad `workbench run` flags: each is one clear line (exit 2) before any rank starts, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from workbench.cli import main

pytestmark = pytest.mark.timeout(120)

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize("flags, message", [
    (["--nproc", "0"], "nproc must be a positive int, got 0"),
    (["--nproc", "-2"], "nproc must be a positive int, got -2"),
    (["--warmup", "-5"], "warmup must be an int >= 0"),
    (["--lr", "-1"], "lr must be a positive finite number, got -1.0"),
    (["--lr", "nan"], "lr must be a positive finite number, got nan"),
    (["--lr", "inf"], "lr must be a positive finite number, got inf"),
    (["--timeout", "0"], "timeout must be a positive finite number, got 0.0"),
    (["--data", "no/such/corpus.txt"], "data file not found: 'no/such/corpus.txt'"),
    (["--seq-len", "10000000"], "seq_len=10000000 leaves 0 window(s)"),
    (["--seq-len", "0"], "seq_len must be a positive int"),
    (["--clip", "-1"], "clip must be >= 0"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--backend", "mpi"], "invalid choice: 'mpi'"),
    (["--port", "70000"], "port must be an int in 0..65535"),
    (["--bucket-mb", "0"], "expected a positive number of MiB or 'none' (one bucket), got '0'"),
    (["--bucket-mb", "lots"], "expected a positive number of MiB or 'none' (one bucket), got 'lots'"),
    (["--val-fraction", "1.5"], "val_fraction must be a number in (0, 1)"),
    (["--val-fraction", "0"], "val_fraction must be a number in (0, 1)"),
    (["--val-every", "2", "--val-fraction", "-0.1"], "val_fraction must be a number in (0, 1)"),
    (["--nproc", "4", "--nodes", "3"], "nodes=3 must divide the 4 ranks"),
    (["--nodes", "0"], "nodes must be a positive int, got 0"),
    (["--inter-link", "fast"], "unknown link 'fast'"),
    (["--intra-link", "0,10"], "bandwidth must be a finite number of GB/s > 0"),
    (["--inter-link", "12.5"], "unknown link '12.5': expected BANDWIDTH_GBPS,LATENCY_US"),
    (["--time-scale", "2"], "time_scale='2' scales emulated links: it needs --nodes N"),
    (["--nodes", "1", "--time-scale", "tpu"], "time_scale 'tpu': expected a number > 0 or a GPU name"),
    (["--nodes", "1", "--time-scale", "-3"], "time_scale must be a finite number > 0"),
    (["--straggler", "rank=2:factor=3"], "straggler rank 2 does not exist: the run has ranks 0..0"),
    (["--straggler", "rank=0:factor=0"], "straggler factor must be a finite number >= 1"),
    (["--straggler", "rank0"], "straggler 'rank0': expected rank=R:factor=F"),
])
def test_bad_flag_is_one_line_before_spawning(flags: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--no-progress", "--steps", "2", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("content", ["", "x"], ids=["empty", "one-byte"])
def test_a_data_file_too_small_for_one_window_is_one_line(content: str, tmp_path, capsys) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(content)
    with pytest.raises(SystemExit) as info:
        main(["run", "--no-progress", "--steps", "2", "--data", str(corpus)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert f"holds {len(content)} token(s) (bytes): too few to train on" in err, err
    assert "-1 window" not in err


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA: --device cuda is valid here")
@pytest.mark.parametrize("flags, message", [
    (["--device", "cuda"], "device='cuda' but no CUDA device is available"),
    (["--backend", "nccl", "--nproc", "2"], "backend='nccl' but no CUDA device is available"),
])
def test_cuda_without_cuda_is_one_line(flags: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--no-progress", "--steps", "2", *flags])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_nccl_with_more_ranks_than_gpus_is_one_line(capsys) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(SystemExit):
        main(["run", "--no-progress", "--backend", "nccl", "--nproc", str(gpus + 1), "--batch-size", "16"])
    err = capsys.readouterr().err
    assert ("one GPU per rank" if gpus else "no CUDA device is available") in err


def test_a_taken_port_is_one_line_in_a_subprocess(tmp_path) -> None:
    """As a learner meets it: the real command, its stderr, no traceback, exit 2."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "workbench.cli", "run", "--nproc", "2", "--steps", "2",
                               "--batch-size", "4", "--seq-len", "32", "--port", str(port), "--no-progress",
                               "--out", str(tmp_path)], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2
    assert f"rendezvous port {port} on 127.0.0.1 is already in use" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_failing_rank_is_one_paragraph_not_a_launcher_traceback(monkeypatch, capsys) -> None:
    import workbench.cli as cli
    from workbench.launch import RankError

    remote = ('Traceback (most recent call last):\n  File "train.py", line 9, in step\n    loss.backward()\n'
              'RuntimeError: boom on rank 1\n')

    def fail(*args, **kwargs):
        raise RankError(1, "RuntimeError: boom on rank 1", remote)

    monkeypatch.setattr(cli, "run_training", fail)
    assert cli.main(["run", "--nproc", "2", "--steps", "2", "--batch-size", "4", "--seq-len", "32"]) == 1
    err = capsys.readouterr().err
    assert "workbench run: rank 1 failed: RuntimeError: boom on rank 1" in err
    assert "loss.backward()" in err  # where it failed, from the rank's own traceback
    assert "Traceback (most recent call last)" not in err
