"""What this machine can run, said before a run: ``workbench env`` and the first cell of notebook 00.

A learner's first question is "how many ranks can I start here, and where will they run?". The answer
depends on a handful of facts (the torch build, its backends, the GPUs, the cores, the memory), so this
module works in two steps that tests can pull apart:

* ``probe_machine()`` reads those facts and nothing else (the only function that touches the machine);
* ``describe_environment(facts)`` turns them into plain JSON-serialisable data, adding the largest sensible
  ``--nproc`` per backend and what ``workbench run --device auto`` picks for 1, 2 and 4 ranks; tests pass
  invented facts to play a laptop, a one-GPU workstation or an 8-GPU node.

``format_environment`` is the human text. Nothing here starts a process group or calls a collective.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from workbench.dist.launch import DEVICE_ENV, resolve_placement, visible_gpus

GIB = 2**30

#: Memory one gloo rank of ``workbench run`` needs, for the ceiling on ``--nproc``. How it was picked: each
#: rank of ``workbench.launch`` ran ``train_rank`` (``RunConfig(model=..., nproc=n, steps=5)``, the default
#: global batch of 16) and then returned ``VmHWM`` (peak resident set) from ``/proc/self/status`` and ``Pss``
#: from ``/proc/self/smaps_rollup``. Measured on a 2-core CPU machine, torch 2.13 CPU build: a rank that only
#: all-reduces peaks at 0.16 GiB (torch itself, shared copy-on-write with the forkserver: Pss 0.04 GiB);
#: the default "tiny" GPT peaks at 0.26-0.28 GiB per rank for nproc 1, 2, 4 (Pss 0.15-0.19), "small" at
#: 0.32-0.36 GiB. Rounded up to 0.4 GiB for headroom (allocator growth, a bigger batch). The 10.8 M-parameter
#: "bench" preset needs more: 0.53 GiB per rank at nproc 4, 0.77 GiB at nproc 1.
GLOO_RANK_BYTES = int(0.4 * GIB)
GLOO_RANK_SOURCE = "peak RSS of a `workbench run` rank of the tiny GPT: 0.26-0.28 GiB measured, rounded up"

#: The ``--nproc`` values whose ``--device auto`` placement is shown.
AUTO_NPROCS = (1, 2, 4)


# -- probing: the only part that reads the machine ----------------------------------------------------------

def probe_machine() -> dict[str, Any]:
    """Read the raw facts the description is computed from (tests replace this dict with invented ones)."""
    nccl = dist.is_available() and dist.is_nccl_available()
    cores, cores_source = _cpu_cores()
    return {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "gloo_available": dist.is_available() and dist.is_gloo_available(),
        "nccl_available": nccl,
        "nccl_version": _nccl_version() if nccl and torch.version.cuda else None,
        "gpus": _gpus(),
        "cpu_cores": cores,
        "cpu_cores_source": cores_source,
        **_memory(),
        "device_env": os.environ.get(DEVICE_ENV),
    }


def _nccl_version() -> str | None:
    """NCCL's version as "2.21.5"; torch returns a tuple (an int on old builds), or fails without a driver."""
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _gpus() -> list[dict[str, Any]]:
    """Name and total memory of each GPU this process can use (``CUDA_VISIBLE_DEVICES`` applies)."""
    gpus = []
    for index in range(visible_gpus()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "total_memory_bytes": int(props.total_memory)})
    return gpus


def _cpu_cores() -> tuple[int, str]:
    """Cores this process may run on: the affinity mask (taskset, a container's cpuset), else the count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)), "os.sched_getaffinity"
    return os.cpu_count() or 1, "os.cpu_count"


def _memory() -> dict[str, Any]:
    """Total and available RAM, capped by a cgroup v2 limit: inside a container /proc/meminfo shows the host."""
    total, available, source = _meminfo()
    limit = _cgroup_limit()
    if limit is not None and limit < total:
        used = _read_int(Path("/sys/fs/cgroup/memory.current")) or 0
        total, source = limit, "cgroup memory.max"
        available = max(0, limit - used) if available is None else min(available, max(0, limit - used))
    return {"ram_total_bytes": total, "ram_available_bytes": available, "ram_source": source}


def _meminfo() -> tuple[int, int | None, str]:
    """MemTotal and MemAvailable from /proc/meminfo (Linux), else physical pages from ``os.sysconf``."""
    fields = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = int(value.split()[0]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * page, None, "os.sysconf"
    return fields["MemTotal"], fields.get("MemAvailable"), "/proc/meminfo"


def _cgroup_limit() -> int | None:
    """This container's memory limit in bytes, or None when there is none ("max") or no cgroup v2."""
    return _read_int(Path("/sys/fs/cgroup/memory.max"))


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


# -- the description: a pure function of the facts ---------------------------------------------------------

def describe_environment(facts: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a learner needs before a run, as JSON-serialisable data.

    ``facts`` defaults to ``probe_machine()``; pass a dict of the same shape to describe another machine.
    The ``--device auto`` rows come from ``launch.resolve_placement`` itself, so they cannot drift from what
    ``workbench run`` does (under torchrun it counts the ranks of this node, ``LOCAL_WORLD_SIZE``).
    """
    f = probe_machine() if facts is None else facts
    return {
        "torch": {"version": f["torch_version"], "cuda": f["cuda_version"]},
        "backends": {"gloo": {"available": f["gloo_available"]},
                     "nccl": {"available": f["nccl_available"], "version": f["nccl_version"]}},
        "gpus": [dict(g) for g in f["gpus"]],
        "cpu": {"cores": f["cpu_cores"], "source": f["cpu_cores_source"]},
        "memory": {"total_bytes": f["ram_total_bytes"], "available_bytes": f["ram_available_bytes"],
                   "source": f["ram_source"]},
        "max_nproc": {"nccl": _nccl_limit(f), "gloo": _gloo_limit(f)},
        "auto": [_auto_row(n, f) for n in AUTO_NPROCS],
        "device_env": f["device_env"],
    }


def _nccl_limit(f: dict[str, Any]) -> dict[str, Any]:
    """NCCL runs one rank per GPU and refuses two ranks on one GPU, so its ceiling is the GPU count."""
    gpus = len(f["gpus"])
    if not f["nccl_available"]:
        build = "this torch was built without CUDA" if f["cuda_version"] is None else "this torch has no NCCL"
        return {"max": 0, "why": f"NCCL unavailable: {build}"}
    if gpus == 0:
        return {"max": 0, "why": "no GPU visible (NCCL runs one rank per GPU)"}
    return {"max": gpus, "why": f"one rank per GPU: {_plural(gpus, 'GPU')} visible, NCCL refuses two ranks on one GPU"}


def _gloo_limit(f: dict[str, Any]) -> dict[str, Any]:
    """Cores give the recommendation (one rank per core, no oversubscription); memory gives the hard ceiling."""
    if not f["gloo_available"]:
        return {"recommended": 0, "ceiling": 0, "per_rank_bytes": GLOO_RANK_BYTES,
                "per_rank_source": GLOO_RANK_SOURCE, "memory_used_for_ceiling_bytes": 0, "memory_basis": "total",
                "why": "gloo unavailable in this torch build"}
    cores = f["cpu_cores"]
    basis = "available" if f["ram_available_bytes"] is not None else "total"
    usable = f[f"ram_{basis}_bytes"]
    ceiling = max(1, usable // GLOO_RANK_BYTES)
    return {
        "recommended": min(cores, ceiling), "ceiling": ceiling, "per_rank_bytes": GLOO_RANK_BYTES,
        "per_rank_source": GLOO_RANK_SOURCE, "memory_used_for_ceiling_bytes": usable,
        "memory_basis": basis,
        "why": "one rank per core (cores // nproc threads each); more ranks oversubscribe: they take turns on "
               "the cores and each step is slower",
    }


def _auto_row(nproc: int, f: dict[str, Any]) -> dict[str, Any]:
    """What ``workbench run --device auto --nproc N`` picks, and why when it passes over GPUs it saw."""
    p = resolve_placement(nproc, "auto", gpus=len(f["gpus"]), nccl_available=f["nccl_available"])
    cores = f["cpu_cores"]
    threads = max(1, cores // nproc) if p.device == "cpu" else None
    return {"nproc": nproc, "backend": p.backend, "device": p.device, "note": p.note,
            "threads_per_rank": threads, "oversubscribed": p.device == "cpu" and nproc > cores}


# -- the human text -----------------------------------------------------------------------------------------

def format_environment(info: dict[str, Any]) -> str:
    """The description as about a dozen aligned lines, for the terminal and the notebook."""
    lines = [
        f"torch     {info['torch']['version']} ({_cuda_text(info)})",
        f"backends  {_backends_text(info)}",
        f"GPUs      {_gpus_text(info['gpus'])}",
        f"CPU       {_plural(info['cpu']['cores'], 'core')} ({info['cpu']['source']})",
        f"RAM       {_ram_text(info['memory'])}",
        "largest --nproc",
        *_limits_text(info["max_nproc"]),
        "workbench run --device auto",
        *(_auto_text(row) for row in info["auto"]),
    ]
    if info.get("device_env"):
        lines.append(f"note      ${DEVICE_ENV}={info['device_env']}: a run without --device uses that instead")
    return "\n".join(lines)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _cuda_text(info: dict[str, Any]) -> str:
    cuda = info["torch"]["cuda"]
    return f"built with CUDA {cuda}" if cuda else "CPU build, no CUDA"


def _backends_text(info: dict[str, Any]) -> str:
    gloo = "yes" if info["backends"]["gloo"]["available"] else "no"
    nccl = info["backends"]["nccl"]
    nccl_text = "no" if not nccl["available"] else f"yes ({nccl['version']})" if nccl["version"] else "yes"
    return f"gloo: {gloo} | NCCL: {nccl_text}"


def _gpus_text(gpus: list[dict[str, Any]]) -> str:
    """Identical GPUs on one line ("8 x H100, 79.2 GiB each"), so an 8-GPU node stays short."""
    if not gpus:
        return "none visible"
    groups: dict[tuple[str, int], int] = {}
    for g in gpus:
        key = (g["name"], g["total_memory_bytes"])
        groups[key] = groups.get(key, 0) + 1
    return "; ".join(f"{n} x {name}, {mem / GIB:.1f} GiB each" for (name, mem), n in groups.items())


def _ram_text(memory: dict[str, Any]) -> str:
    text = f"{memory['total_bytes'] / GIB:.1f} GiB total"
    if memory["available_bytes"] is not None:
        text += f", {memory['available_bytes'] / GIB:.1f} GiB available"
    return f"{text} ({memory['source']})"


def _limits_text(limits: dict[str, Any]) -> list[str]:
    nccl, gloo = limits["nccl"], limits["gloo"]
    lines = [f"  nccl    {nccl['max']}: {nccl['why']}"]
    if not gloo["ceiling"]:
        return [*lines, f"  gloo    0: {gloo['why']}"]
    memory = f"{gloo['memory_used_for_ceiling_bytes'] / GIB:.1f} GiB {gloo['memory_basis']}"
    ceiling = (f"{gloo['ceiling']} at most: {memory} / {gloo['per_rank_bytes'] / GIB:.1f} GiB per rank "
               f"({gloo['per_rank_source']})")
    return [*lines, *_wrap(f"  gloo    {gloo['recommended']} recommended: {gloo['why']}"),
            *_wrap(" " * 10 + ceiling)]


def _wrap(line: str) -> list[str]:
    """Break a long line at 100 columns, continuing under the value column so the labels stay readable."""
    return textwrap.wrap(line, width=100, subsequent_indent=" " * 10, break_on_hyphens=False)


def _auto_text(row: dict[str, Any]) -> str:
    where = f"{row['backend']} on " + ("one GPU per rank" if row["device"] == "cuda" else "the CPU")
    threads = row["threads_per_rank"]
    if threads is not None:
        where += f", {_plural(threads, 'thread')} per rank"
    if row["oversubscribed"]:
        where += ", oversubscribed (more ranks than cores)"
    if row["note"]:
        where += f" ({row['note'].removeprefix('running gloo on the CPU: ')})"
    return "\n".join(textwrap.wrap(f"  --nproc {row['nproc']}  {where}", width=100, subsequent_indent=" " * 13))
