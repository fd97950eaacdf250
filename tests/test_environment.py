"""``workbench env``: what this machine can run. The real machine (whatever it is) and invented ones (a CPU
laptop, one GPU, an 8-GPU node) fed to ``describe_environment`` as probe facts. No ranks are started."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from workbench import environment
from workbench.environment import GIB, describe_environment, format_environment, probe_machine

pytestmark = pytest.mark.timeout(60)


def machine(gpus: int = 0, gpu_gib: float = 80.0, cores: int = 16, ram_gib: float = 64.0,
            nccl: bool | None = None) -> dict:
    """Probe facts of an invented machine (the same keys ``probe_machine`` returns)."""
    cuda = gpus > 0
    nccl = cuda if nccl is None else nccl
    return {
        "torch_version": "2.13.0+cu128" if cuda else "2.13.0+cpu",
        "cuda_version": "12.8" if cuda else None,
        "gloo_available": True,
        "nccl_available": nccl,
        "nccl_version": "2.27.3" if nccl else None,
        "gpus": [{"index": i, "name": "NVIDIA H100 80GB HBM3", "total_memory_bytes": int(gpu_gib * GIB)}
                 for i in range(gpus)],
        "cpu_cores": cores, "cpu_cores_source": "os.sched_getaffinity",
        "ram_total_bytes": int(ram_gib * GIB), "ram_available_bytes": int(ram_gib * GIB * 0.9),
        "ram_source": "/proc/meminfo",
        "device_env": None,
    }


def auto(info: dict, nproc: int) -> dict:
    return next(row for row in info["auto"] if row["nproc"] == nproc)


# -- the real machine ---------------------------------------------------------------------------------------

def test_probe_reports_this_machine() -> None:
    facts = probe_machine()
    assert facts["torch_version"] == torch.__version__
    assert facts["cuda_version"] == torch.version.cuda
    assert facts["gloo_available"] == dist.is_gloo_available()
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert facts["cpu_cores"] == expected
    assert 0 < facts["ram_total_bytes"]
    assert facts["ram_available_bytes"] is None or facts["ram_available_bytes"] <= facts["ram_total_bytes"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU is told")
def test_without_a_gpu_nccl_is_out_and_gloo_is_recommended() -> None:
    info = describe_environment()
    assert info["gpus"] == []
    assert info["max_nproc"]["nccl"]["max"] == 0
    assert "NCCL unavailable" in info["max_nproc"]["nccl"]["why"] or "no GPU" in info["max_nproc"]["nccl"]["why"]
    gloo = info["max_nproc"]["gloo"]
    assert gloo["recommended"] == min(info["cpu"]["cores"], gloo["ceiling"]) >= 1
    assert [(r["backend"], r["device"]) for r in info["auto"]] == [("gloo", "cpu")] * 3
    text = format_environment(info)
    assert "GPUs      none visible" in text
    assert ("NCCL: yes" if info["backends"]["nccl"]["available"] else "NCCL: no") in text


def test_real_description_is_plain_json() -> None:
    info = describe_environment()
    assert json.loads(json.dumps(info)) == info


# -- invented machines --------------------------------------------------------------------------------------

def test_one_gpu_runs_one_rank_on_nccl_and_two_on_gloo_saying_why() -> None:
    info = describe_environment(machine(gpus=1))
    assert (auto(info, 1)["backend"], auto(info, 1)["device"]) == ("nccl", "cuda")
    assert auto(info, 1)["threads_per_rank"] is None
    two = auto(info, 2)
    assert (two["backend"], two["device"]) == ("gloo", "cpu")
    assert "2 ranks but 1 GPU(s) visible" in two["note"] and "one GPU per rank" in two["note"]
    assert info["max_nproc"]["nccl"]["max"] == 1
    assert "2 ranks but 1 GPU(s) visible" in format_environment(info)


def test_eight_gpus_of_80_gib_allow_eight_nccl_ranks() -> None:
    info = describe_environment(machine(gpus=8, gpu_gib=80))
    assert info["max_nproc"]["nccl"]["max"] == 8
    assert [(r["backend"], r["device"]) for r in info["auto"]] == [("nccl", "cuda")] * 3
    assert info["backends"]["nccl"] == {"available": True, "version": "2.27.3"}
    text = format_environment(info)
    assert "GPUs      8 x NVIDIA H100 80GB HBM3, 80.0 GiB each" in text
    assert "nccl    8: one rank per GPU: 8 GPUs visible" in text
    assert "NCCL: yes (2.27.3)" in text and "built with CUDA 12.8" in text


def test_gpus_without_nccl_fall_back_to_gloo() -> None:
    info = describe_environment(machine(gpus=2, nccl=False))
    assert info["max_nproc"]["nccl"] == {"max": 0, "why": "NCCL unavailable: this torch has no NCCL"}
    assert auto(info, 1)["backend"] == "gloo" and "no NCCL" in auto(info, 1)["note"]


def test_gloo_recommends_one_rank_per_core_and_says_when_ranks_oversubscribe() -> None:
    info = describe_environment(machine(cores=2, ram_gib=64))
    gloo = info["max_nproc"]["gloo"]
    assert gloo["recommended"] == 2
    assert "oversubscribe" in gloo["why"]
    assert [(r["threads_per_rank"], r["oversubscribed"]) for r in info["auto"]] == [
        (2, False), (1, False), (1, True)]
    assert "--nproc 4  gloo on the CPU, 1 thread per rank, oversubscribed" in format_environment(info)


def test_memory_is_the_hard_ceiling_for_gloo() -> None:
    facts = machine(cores=64, ram_gib=4.0)  # 3.6 GiB available / 0.4 GiB per rank
    info = describe_environment(facts)
    gloo = info["max_nproc"]["gloo"]
    assert gloo["ceiling"] == int(3.6 * GIB) // environment.GLOO_RANK_BYTES == 9
    assert gloo["recommended"] == 9  # fewer than the 64 cores: memory binds first
    assert gloo["per_rank_bytes"] == int(0.4 * GIB) and "measured" in gloo["per_rank_source"]
    facts["ram_available_bytes"] = None  # no MemAvailable (os.sysconf fallback): the total is used
    assert describe_environment(facts)["max_nproc"]["gloo"]["ceiling"] == 10


def test_invented_descriptions_survive_a_json_round_trip() -> None:
    for facts in (machine(), machine(gpus=1), machine(gpus=8)):
        info = describe_environment(facts)
        assert json.loads(json.dumps(info)) == info


def test_text_has_the_key_lines() -> None:
    text = format_environment(describe_environment(machine(gpus=1, cores=8)))
    lines = text.splitlines()
    for start in ("torch ", "backends ", "GPUs ", "CPU ", "RAM ", "largest --nproc", "  nccl ", "  gloo ",
                  "workbench run --device auto", "  --nproc 1 ", "  --nproc 2 ", "  --nproc 4 "):
        assert any(line.startswith(start) for line in lines), f"no line starts with {start!r}:\n{text}"
    assert 12 <= len(lines) <= 18  # about a dozen: long reasons wrap at 100 columns
    assert max(map(len, lines)) <= 100


def test_device_env_is_mentioned_when_set() -> None:
    facts = machine(gpus=1)
    facts["device_env"] = "cpu"
    assert "$WORKBENCH_DEVICE=cpu" in format_environment(describe_environment(facts))


def test_probing_can_be_monkeypatched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(environment, "probe_machine", lambda: machine(gpus=8))
    assert describe_environment()["max_nproc"]["nccl"]["max"] == 8


def test_workbench_env_cli_prints_text_and_json(capsys) -> None:
    import json

    from workbench.cli import main

    assert main(["env"]) == 0
    assert "largest --nproc" in capsys.readouterr().out
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cpu"]["cores"] >= 1 and "nccl" in info["backends"]
