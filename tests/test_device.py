"""One device per rank: where ranks run (placement), that tensors are born there, and the errors that
name the fix when a device cannot be had. Everything here runs without a GPU; tests/test_gpu.py is the
CUDA lane."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from device_scan import scan_source, scan_tree

from workbench import comm, launch
from workbench.launch import RankError, rank_device, resolve_placement
from workbench.mesh import Mesh

pytestmark = pytest.mark.timeout(120)

PACKAGE = Path(__file__).resolve().parent.parent / "workbench"


# -- the static check --------------------------------------------------------------------------------------

def test_every_tensor_the_package_creates_names_its_device() -> None:
    findings = scan_tree(PACKAGE)
    assert not findings, "tensors created without device= (use device=..., *_like or .new_*):\n" + "\n".join(
        map(str, findings))


PLANTED = '''
import torch
import torch as T

def buffers(p, n):
    a = torch.zeros(n)                        # planted: born on the default device
    b = T.empty(n, dtype=torch.float32)       # planted, through an alias
    g = torch.Generator()                     # planted: a CPU generator nobody chose
    c = torch.zeros(n, device=p.device)       # fine
    d = torch.zeros_like(p)                   # fine: inherits p's device
    e = p.new_zeros(n)                        # fine
    return a, b, g, c, d, e
'''


def test_the_scan_catches_planted_factory_calls() -> None:
    found = scan_source(PLANTED, "planted.py")
    assert [(f.line, f.call) for f in found] == [(6, "zeros"), (7, "empty"), (8, "Generator")]
    assert "planted.py:6: torch.zeros(...) without device=" in str(found[0])


# -- placement: the rule, on machines of every kind (faked), and this one ----------------------------------

@pytest.mark.parametrize("world, gpus, expected", [
    (1, 0, ("gloo", "cpu")),
    (4, 0, ("gloo", "cpu")),
    (1, 1, ("nccl", "cuda")),
    (2, 1, ("gloo", "cpu")),
    (8, 8, ("nccl", "cuda")),
    (4, 8, ("nccl", "cuda")),
])
def test_auto_uses_cuda_only_with_one_gpu_per_rank(world: int, gpus: int, expected: tuple) -> None:
    p = resolve_placement(world, "auto", gpus=gpus, nccl_available=True)
    assert (p.backend, p.device) == expected


def test_falling_back_from_gpus_says_why_in_one_line() -> None:
    p = resolve_placement(2, "auto", gpus=1, nccl_available=True)
    assert p.note == "running gloo on the CPU: 2 ranks but 1 GPU(s) visible and NCCL needs one GPU per rank"
    assert "\n" not in p.note
    assert resolve_placement(2, "auto", gpus=0).note == ""  # nothing surprising on a CPU machine
    assert "no NCCL" in resolve_placement(1, "auto", gpus=1, nccl_available=False).note


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=2, device="cuda", gpus=0), "no CUDA device is available"),
    (dict(world_size=2, device="cuda", gpus=1, nccl_available=True), "one GPU per rank: 2 ranks but 1 GPU"),
    (dict(world_size=2, backend="nccl", gpus=1, nccl_available=True), "one GPU per rank"),
    (dict(world_size=1, device="cuda", gpus=1, nccl_available=False), "needs NCCL"),
    (dict(world_size=1, device="cuda", backend="gloo", gpus=1), "gloo collectives on CUDA tensors"),
    (dict(world_size=1, device="cpu", backend="nccl", gpus=1), "needs CUDA tensors"),
    (dict(world_size=1, device="tpu"), "device must be one of"),
    (dict(world_size=1, backend="mpi"), "backend must be one of"),
])
def test_impossible_placements_name_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_placement(**kwargs)


def test_environment_sets_the_default_device_and_an_explicit_backend_wins(monkeypatch) -> None:
    monkeypatch.setenv("WORKBENCH_DEVICE", "cuda")
    with pytest.raises(ValueError, match="device='cuda'"):
        resolve_placement(1, gpus=0)
    assert resolve_placement(1, backend="gloo", gpus=0).backend == "gloo"
    monkeypatch.setenv("WORKBENCH_DEVICE", "cpu")
    assert resolve_placement(1, gpus=1, nccl_available=True).device == "cpu"


def test_under_torchrun_the_ranks_of_this_node_need_the_gpus(monkeypatch) -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "LOCAL_WORLD_SIZE": "4"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert resolve_placement(8, "auto", gpus=4, nccl_available=True).backend == "nccl"  # 2 nodes x 4 GPUs
    assert resolve_placement(8, "auto", gpus=2, nccl_available=True).backend == "gloo"


def test_this_machine_picks_what_it_has() -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p = resolve_placement(max(2, gpus + 1), "auto")
    assert (p.backend, p.device) == ("gloo", "cpu")  # more ranks than GPUs: always the CPU


def test_cuda_asked_for_without_one_fails_before_spawning() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="no CUDA device is available"):
        launch(print, 1, device="cuda")


# -- inside ranks ------------------------------------------------------------------------------------------

def _where_am_i() -> tuple[str, str]:
    return str(rank_device()), str(Mesh(dp=2).device)


def test_ranks_and_mesh_know_their_device() -> None:
    assert list(launch(_where_am_i, 2, device="cpu", timeout=30)) == [("cpu", "cpu")] * 2
    assert rank_device() == torch.device("cpu")  # outside launch: the CPU


def _nccl_on_cpu_tensor() -> None:
    comm.dist.get_backend = lambda group=None: "nccl"  # play an NCCL group: the check must refuse CPU data
    comm.all_reduce(torch.ones(2, device="cpu"))


def test_nccl_with_cpu_tensors_is_refused_with_the_fix() -> None:
    with pytest.raises(RankError, match="NCCL backend needs CUDA tensors.*rank_device"):
        launch(_nccl_on_cpu_tensor, 2, device="cpu", timeout=30)


def test_a_taken_rendezvous_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"rendezvous port {port} on 127.0.0.1 is already in use.*port=0"):
            launch(print, 2, device="cpu", port=port, timeout=10)


@pytest.mark.parametrize("port", [-1, 70000, "80"])
def test_bad_port_is_rejected(port) -> None:
    with pytest.raises(ValueError, match="port must be an int"):
        launch(print, 1, port=port)
