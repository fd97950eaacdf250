"""Real network namespaces joined by a shaped link: proof that the link emulation is not a fantasy (issue 20).

``workbench.dist.emulation`` makes every ``comm`` op *sleep* until Hockney's α-β model says it ends. That is only
worth teaching if a real link of the same α and bandwidth gives the same times. This module builds such a link on
one machine and measures it:

* **One namespace per node.** Each emulated node gets a network namespace of its own, with one veth end at
  ``10.213.0.(i + 1)`` for node i. Ranks of one node talk over their namespace's loopback (unshaped, as the
  emulation's fast intra-node link); traffic between nodes crosses the veth ends. Nothing changes in the machine's
  own namespace (no address, route, bridge or qdisc that anyone else could see or clash with), and the ports
  inside the namespaces are ours alone.
* **Two nodes: one veth pair; more: a switch.** Two nodes are joined directly (``10.213.0.1/30`` and ``.2/30``),
  the link README's figures were measured on. From three nodes on, a leaf-to-switch star: a "switch" namespace
  holds a Linux bridge, and each node's veth pair runs from the node to a port of that bridge (``/24``), as each
  server's NIC runs to its top-of-rack switch. Every path between two nodes then crosses exactly two shaped
  links, the sender's uplink and the receiver's downlink, and the bridge forwards between them (no routing, no
  address on the switch).
* **A token bucket on every end.** ``tc ... tbf`` shapes what an interface *sends*, so each veth end gets one
  (on a node: its egress; on a switch port: the node's ingress): each node's link is then ``rate`` bytes/s each
  way, like a full-duplex NIC. Two buckets of one rate in series pass that rate (the port's has a larger burst, so
  it absorbs the sender's clumps on a busy machine: ``TokenBucket.for_switch_port``); what the star adds is that
  several nodes sending to one share its downlink (incast), as on a real switch. ``netem`` (delay) is not needed:
  the latency α is what gloo, TCP, Python (and the bridge) add per message, and ``measure_link`` measures it.
* **Ranks enter before they connect.** A rank of a node calls ``setns(2)`` on ``/var/run/netns/<name>`` first
  thing: a socket belongs to the namespace its process was in when it was created, so every socket (the store's,
  gloo's) must come after. ``GLOO_SOCKET_IFNAME`` names the veth end, so gloo advertises an address the other nodes
  can reach. Rank 0 hosts the rendezvous store on its veth address, ``10.213.0.1``, which every node reaches.

``compare`` then times all-reduce (4 ranks as 2 nodes x 2 by default; any nodes x ranks) and send/recv (rank 0 to
the first rank of the last node) over the shaped link, measures the link's α and bandwidth, and sets beside each
time what the emulation predicts for that link (``LinkEmulation.modelled_time``) and what it measures when it
emulates it on the loopback (``launch(..., nodes=N, inter_link=...)``). Needs root (``unavailable_reason`` says
what is missing); everything it creates is removed again, after a failure too.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import itertools
import os
import queue as queue_module
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from workbench.dist import comm
from workbench.dist.emulation import LinkEmulation, op_seconds, timed
from workbench.dist.launch import (
    TIMEOUT_ENV,
    RankError,
    RankResults,
    death_error,
    exit_when_parent_dies,
    launch,
    main_not_reimported,
    mp_context,
    stop_all,
)
from workbench.theory.comm import Link

NETNS_DIR = Path("/var/run/netns")  # where `ip netns add` bind-mounts a namespace: what setns(2) opens
CLONE_NEWNET = 0x40000000
# The addresses exist only inside our own namespaces, so no other network on the machine can clash with them: node i
# is 10.213.0.(i + 1), on a /30 when two nodes share one veth pair, on a /24 behind the switch (up to MAX_NODES).
SUBNET = "10.213.0"
PAIR_PREFIX_LEN, SWITCH_PREFIX_LEN = 30, 24
MAX_NODES = 64  # interface names (15 characters) hold a node index of two digits; 64 nodes is far past 2 cores
IFNAMSIZ = 15  # the longest interface name Linux takes
STORE_PORT_BASE = 29500  # free for sure: the namespaces are new; one port per run, so no TIME_WAIT socket is hit
# bytes/s (200 Mbit/s): 64 MiB all-reduced in ~4 s, far slower than the loopback's GB/s; 256 KiB then takes ~10 ms,
# well above the ~3 ms a busy machine's scheduler may add to any op
DEFAULT_RATE = 25e6
INTRA_LINK = "nvlink"  # the emulation's link inside a node: the real one is the loopback, never the bottleneck
TINY_BYTES = 4  # one float32: a message that is all latency (for the ping-pong that measures α)
PROBE_BYTES = 8 << 20  # a message that is all bandwidth (its latency and the token bucket's burst are < 0.5 %)
_COMMAND_TIMEOUT_S = 20.0
_DEATH_GRACE_S = 0.5
# The namespaces have no DNS, so torch's store warns once per connection that it cannot name the peer: harmless.
_RESOLVER_NOISE = b"hostname of the client socket cannot be retrieved"
_tags = itertools.count()
# shaped_link's namespaces (nodes and switch): the pid of the process that made them
_NAME = re.compile(r"wb(\d+)x\d+-(?:node\d+|switch)")
_ports = itertools.count()


class NetnsError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message holds the command and what it printed."""


@dataclass(frozen=True)
class TokenBucket:
    """A ``tc tbf`` qdisc: ``rate`` bytes/s, ``burst`` bytes sent at line speed after a pause, ``limit`` bytes
    queued before packets are dropped."""

    rate: float
    burst: int
    limit: int

    @classmethod
    def for_rate(cls, rate: float) -> TokenBucket:
        """The bucket we use at ``rate`` bytes/s.

        ``burst`` = 0.25 ms of the rate, at least 8 KiB (five full-size packets): a bucket refilled during a pause
        lets one burst through at line speed, so a message of S bytes takes (S - burst) / rate, and the model
        (S / rate) would be wrong by burst / S: 3 % at 256 KiB, the smallest size compared. The kernel refills
        the bucket with a high-resolution timer, so a small burst costs no throughput (measured: the same
        bandwidth as a 64 KiB burst, within 1 %). ``limit`` = 100 ms of the rate, at least 4 MiB: TCP small
        queues keep ~1 MiB per socket in the qdisc, so a few sockets never overflow it; a drop would cost TCP a
        retransmission timeout (200 ms) and wreck the timing.
        """
        return cls(rate=rate, burst=max(8 << 10, int(rate * 2.5e-4)), limit=max(4 << 20, int(rate * 0.1)))

    @classmethod
    def for_switch_port(cls, rate: float) -> TokenBucket:
        """The bucket on a switch port (a node's ingress): ``for_rate``'s, with a burst of 64 KiB (or 2.5 ms of the
        rate, if more).

        What reaches a port has already been shaped to ``rate`` by the sending node's own bucket, so this one only
        matters where several nodes send to one (incast) and never lets a single path run faster. But on a busy
        machine the sender's bucket releases its packets in clumps (its refill timer fires late), and a second
        bucket with a small burst wastes the tokens it gains while waiting for a clump: measured, 3 nodes, a 4 MiB
        and a 16 MiB all-reduce's predicted / real 0.85..0.93 with an 8 KiB port burst, 0.93..0.98 with 64 KiB, and
        messages 0.98..1.00 with either (the sender's bucket still sets the message's start)."""
        return cls(rate=rate, burst=max(64 << 10, int(rate * 2.5e-3)), limit=max(4 << 20, int(rate * 0.1)))

    def tc_args(self) -> list[str]:
        """``tbf rate <bits>bit burst <bytes> limit <bytes>`` for ``tc qdisc add``."""
        return ["tbf", "rate", f"{int(self.rate * 8)}bit", "burst", str(self.burst), "limit", str(self.limit)]

    def describe(self) -> dict[str, Any]:
        return {"rate_mbit_s": self.rate * 8 / 1e6, "rate_bytes_s": self.rate, "burst_bytes": self.burst,
                "limit_bytes": self.limit}


def node_address(node: int) -> str:
    """Node ``node``'s address on the shaped network (``10.213.0.1`` for node 0, where rank 0 hosts the store)."""
    return f"{SUBNET}.{node + 1}"


@dataclass(frozen=True)
class ShapedLink:
    """One namespace per node (``namespaces``), each with a veth end ``interfaces[i]`` at ``node_address(i)`` shaped
    by ``bucket``. Two nodes: the two ends are one veth pair (``switch`` None). More: every node's veth pair runs to
    ``switch``, a namespace holding the bridge ``bridge`` with the other ends ``ports[i]`` as its ports, each shaped
    by ``port_bucket`` (the same rate; a leaf-to-switch star: node i to node j crosses i's uplink and j's
    downlink)."""

    namespaces: tuple[str, ...]
    interfaces: tuple[str, ...]
    bucket: TokenBucket
    switch: str | None = None
    ports: tuple[str, ...] = ()
    bridge: str | None = None
    port_bucket: TokenBucket | None = None  # on the switch's ports (``TokenBucket.for_switch_port``)

    @property
    def nodes(self) -> int:
        return len(self.namespaces)

    @property
    def prefix_len(self) -> int:
        return PAIR_PREFIX_LEN if self.switch is None else SWITCH_PREFIX_LEN

    def node_of(self, rank: int, world_size: int) -> int:
        """Node-major placement, as the emulation's: ranks 0 .. world_size / nodes - 1 on node 0, and so on."""
        return rank // (world_size // self.nodes)

    def all_namespaces(self) -> tuple[str, ...]:
        """The nodes' namespaces, and the switch's where there is one: what teardown deletes."""
        return self.namespaces + ((self.switch,) if self.switch else ())

    def all_interfaces(self) -> tuple[str, ...]:
        return self.interfaces + self.ports + ((self.bridge,) if self.bridge else ())


def _run(*cmd: str) -> str:
    """Run ``cmd``; its stdout, or ``NetnsError`` with its stderr (never hangs: a timeout bounds it)."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {error}") from None
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def unavailable_reason(nodes: int = 2) -> str | None:
    """None where this process can build a shaped link of ``nodes`` nodes; otherwise one line saying what is missing.

    Checked by doing it: a throwaway link (two namespaces and a veth pair; from three nodes on, a switch namespace
    with a bridge too) with tbf on every end, its last node entered once with ``ip netns exec`` (the same setns(2)
    the ranks make), then removed."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "not root: creating network namespaces and shaping a link with tc needs root (CAP_SYS_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if not hasattr(os, "setns") and not hasattr(ctypes.CDLL(None), "setns"):
        return "this C library has no setns(2): a rank could not enter a namespace"
    try:
        with shaped_link(DEFAULT_RATE, nodes=nodes) as link:
            _run("ip", "netns", "exec", link.namespaces[-1], "ip", "link", "show", link.interfaces[-1])
    except NetnsError as error:
        return f"cannot build a shaped link: {error}"
    return None


def check_nodes(nodes: int) -> None:
    """``ValueError`` unless ``nodes`` is an int in 2 .. ``MAX_NODES``."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 2 <= nodes <= MAX_NODES:
        raise ValueError(f"a shaped link joins 2 to {MAX_NODES} nodes, got nodes={nodes!r}")


@contextlib.contextmanager
def shaped_link(rate: float = DEFAULT_RATE, bucket: TokenBucket | None = None, nodes: int = 2,
                switch: bool | None = None) -> Iterator[ShapedLink]:
    """``nodes`` namespaces whose every path to another crosses links shaped to ``rate`` bytes/s each way; removed
    on leaving the block.

    Two nodes (``switch`` False, the default for 2): one veth pair, a token bucket on both ends: the link whose
    figures README and tests/test_netns.py give. Three or more (``switch`` True, the default from 3): a switch
    namespace with a Linux bridge, and per node a veth pair from the node to a bridge port, a bucket on the node's
    end (its egress) and one on the port (the node's ingress, ``TokenBucket.for_switch_port``): every node has a
    full-duplex uplink of ``rate``, like a NIC on a leaf switch, and a message crosses two buckets in series, which
    together still pass ``rate``.
    (Two nodes through the switch are there for measuring that the bridge costs the link nothing: ``switch=True``.)
    The switch is a namespace of its own, not the machine's: nothing is added where anyone else would see it.

    Names carry this process's id and a counter, so concurrent users (other processes, other links of this one)
    never collide; teardown removes whatever part was built, also when building failed half-way, and also when
    the process is stopped with SIGTERM (a benchmark runner's timeout): namespaces outlive the process that made
    them. What a SIGKILLed process left behind, the next ``shaped_link`` removes (``remove_stale``)."""
    check_nodes(nodes)
    remove_stale()
    link = _plan(f"wb{os.getpid()}x{next(_tags)}", nodes, nodes > 2 if switch is None else switch,
                 bucket or TokenBucket.for_rate(rate))
    try:
        with _sigterm_unwinds():
            _build(link)
            yield link
    finally:
        _teardown(link)


def _plan(tag: str, nodes: int, switch: bool, bucket: TokenBucket) -> ShapedLink:
    """The names: namespaces ``<tag>-node<i>`` (and ``<tag>-switch``), interfaces ``<tag>n<i>`` on the nodes,
    ``<tag>s<i>`` and ``<tag>br`` on the switch, all unique on the machine, so ``leftovers`` can look for them."""
    interfaces = tuple(f"{tag}n{i}" for i in range(nodes))
    ports = tuple(f"{tag}s{i}" for i in range(nodes)) if switch else ()
    longest = max((*interfaces, *ports), key=len)
    if len(longest) > IFNAMSIZ:  # a 7-digit pid and a 3-digit counter: refuse before building anything
        raise NetnsError(f"interface name {longest!r} is longer than Linux's {IFNAMSIZ} characters")
    return ShapedLink(namespaces=tuple(f"{tag}-node{i}" for i in range(nodes)), interfaces=interfaces,
                      bucket=bucket, switch=f"{tag}-switch" if switch else None, ports=ports,
                      bridge=f"{tag}br" if switch else None,
                      port_bucket=TokenBucket.for_switch_port(bucket.rate) if switch else None)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While in the block, SIGTERM raises SystemExit, so ``finally`` clauses run (its default kills at once).
    Only where this is the main thread and nobody else handles SIGTERM already."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def unwind(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def remove_stale() -> list[str]:
    """Delete the namespaces of ``shaped_link`` (nodes' and switch's) whose process no longer exists (it was
    SIGKILLed mid-block); the names removed. A namespace of a live process, one that a process is still inside, or
    one named otherwise, is never touched."""
    removed = []
    for path in sorted(NETNS_DIR.glob("wb*x*-*")) if NETNS_DIR.is_dir() else ():
        match = _NAME.fullmatch(path.name)
        if not match or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(NetnsError):  # a namespace that will not go is no reason to fail a new link
            if not _run("ip", "netns", "pids", path.name).strip():
                _run("ip", "netns", "delete", path.name)
                removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def _build(link: ShapedLink) -> None:
    for namespace in link.all_namespaces():
        _run("ip", "netns", "add", namespace)
    if link.switch is None:
        # Created inside the namespaces at once: the pair never appears in the machine's own namespace.
        _run("ip", "link", "add", link.interfaces[0], "netns", link.namespaces[0], "type", "veth", "peer", "name",
             link.interfaces[1], "netns", link.namespaces[1])
    else:
        _build_switch(link)
    for node, (namespace, interface) in enumerate(zip(link.namespaces, link.interfaces, strict=True)):
        _run("ip", "-n", namespace, "addr", "add", f"{node_address(node)}/{link.prefix_len}", "dev", interface)
        _run("ip", "-n", namespace, "link", "set", "lo", "up")  # ranks of one node talk over it
        _run("ip", "-n", namespace, "link", "set", interface, "up")
        # tbf shapes egress only: one on each end of every veth pair shapes both directions.
        _run("tc", "-n", namespace, "qdisc", "add", "dev", interface, "root", *link.bucket.tc_args())


def _build_switch(link: ShapedLink) -> None:
    """The switch: a bridge in its own namespace, one port per node, each port's egress (the node's ingress)
    shaped (``TokenBucket.for_switch_port``). STP stays off (the bridge's default), so a port forwards as soon as
    it is up: no loop to guard against in a star."""
    switch, bridge = link.switch, link.bridge
    _run("ip", "-n", switch, "link", "add", bridge, "type", "bridge")
    _run("ip", "-n", switch, "link", "set", bridge, "up")
    for namespace, interface, port in zip(link.namespaces, link.interfaces, link.ports, strict=True):
        _run("ip", "link", "add", interface, "netns", namespace, "type", "veth", "peer", "name", port, "netns",
             switch)
        _run("ip", "-n", switch, "link", "set", port, "master", bridge)
        _run("ip", "-n", switch, "link", "set", port, "up")
        _run("tc", "-n", switch, "qdisc", "add", "dev", port, "root", *link.port_bucket.tc_args())


def _teardown(link: ShapedLink) -> None:
    """Delete every namespace (deleting one end of a veth pair deletes the pair and its qdiscs; the bridge goes
    with the switch's namespace)."""
    for namespace in link.all_namespaces():
        if (NETNS_DIR / namespace).exists():
            try:
                _run("ip", "netns", "delete", namespace)
            except NetnsError as error:  # keep going: the others must go too
                warnings.warn(f"could not remove network namespace {namespace}: {error}", stacklevel=3)


def leftovers(link: ShapedLink) -> list[str]:
    """What of ``link`` still exists: its namespaces (switch included), and any of its interfaces (veth ends,
    bridge) that is in the machine's namespace."""
    left = [name for name in link.all_namespaces() if (NETNS_DIR / name).exists()]
    interfaces = _run("ip", "-o", "link", "show")
    return left + [name for name in link.all_interfaces() if f" {name}@" in interfaces or f" {name}:" in interfaces]


def enter_namespace(name: str) -> None:
    """Move the calling thread into network namespace ``name``: sockets it makes afterwards live there, and so do
    those of the threads it starts afterwards (gloo's, the store's), which inherit its namespace."""
    fd = os.open(NETNS_DIR / name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "setns"):  # Python >= 3.12
            os.setns(fd, CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------------------------
# Ranks in the namespaces


@dataclass(frozen=True)
class RankPlan:
    """Where one rank runs and how it finds the others."""

    rank: int
    world_size: int
    namespace: str
    interface: str
    store_port: int
    timeout: float


def run_ranks(fn: Callable[..., Any], world_size: int, link: ShapedLink, *args: Any, timeout: float = 120.0,
              group_timeout: float | None = None, **kwargs: Any) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks, node-major, ``world_size / link.nodes`` in each
    node's namespace; their results in rank order. ``fn`` travels by value (cloudpickle). ``timeout`` bounds the
    whole call: a rank that fails, dies or is not done by then makes all ranks stop (``RankError`` or
    ``TimeoutError``); ``group_timeout`` bounds each collective (default: ``timeout``)."""
    nodes = link.nodes
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < nodes or world_size % nodes:
        raise ValueError(f"world_size must be a multiple of the {nodes} nodes (as many ranks on each), got "
                         f"{world_size!r}")
    ctx = mp_context()  # the forkserver launch uses: ranks start without re-importing torch
    payload = cloudpickle.dumps((fn, args, kwargs))
    port = STORE_PORT_BASE + next(_ports) % 1000
    messages = ctx.Queue()
    procs: list[Any] = []
    try:
        with main_not_reimported():
            for rank in range(world_size):
                node = link.node_of(rank, world_size)
                plan = RankPlan(rank, world_size, link.namespaces[node], link.interfaces[node], port,
                                timeout if group_timeout is None else group_timeout)
                proc = ctx.Process(target=_rank_main, args=(plan, payload, messages, os.getpid()),
                                   name=f"workbench-netns-rank{rank}", daemon=True)
                proc.start()
                procs.append(proc)
        return _collect(procs, messages, time.monotonic() + timeout, timeout)
    finally:
        stop_all(procs)
        messages.close()
        messages.join_thread()


def _collect(procs: list[Any], messages: Any, deadline: float, timeout: float) -> list[Any]:
    """Every rank's result; the first error, a death or the deadline raises (the caller then stops all ranks)."""
    results: dict[int, Any] = {}
    dead_since: dict[int, float] = {}
    while len(results) < len(procs):
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(procs))) - set(results))
            raise TimeoutError(f"ranks {missing} were not done after timeout={timeout:g}s; all ranks stopped")
        with contextlib.suppress(queue_module.Empty):
            kind, rank, *rest = messages.get(timeout=0.1)
            if kind == "error":
                raise RankError(rank, rest[0], rest[1])
            results[rank] = cloudpickle.loads(rest[0])
        for rank, proc in enumerate(procs):
            # A result may still be in the pipe when its rank has exited: give it a moment before calling it dead.
            if rank not in results and proc.exitcode is not None:
                if time.monotonic() - dead_since.setdefault(rank, time.monotonic()) > _DEATH_GRACE_S:
                    raise death_error(rank, proc.exitcode)
    return [results[rank] for rank in range(len(procs))]


def launch_shaped(fn: Callable[..., Any], world_size: int, rate: float, *args: Any, nodes: int = 2,
                  timeout: float = 600.0, group_timeout: float = 120.0, **kwargs: Any) -> RankResults:
    """``launch`` over a real shaped link (``workbench run --netns``): ``fn`` on ``world_size`` ranks placed node-major
    on ``nodes`` namespaces, every path between two of them shaped to ``rate`` bytes/s each way (``shaped_link``: one
    veth pair for 2 nodes, a switch from 3); each rank traced as under ``launch``, no emulation (the link itself is
    slow). ``nodes`` is launch_shaped's own keyword, as in ``launch``. Needs root: see ``unavailable_reason``."""
    with shaped_link(rate, nodes=nodes) as link:
        pairs = run_ranks(_traced_call, world_size, link, fn, args, kwargs, timeout=timeout,
                          group_timeout=group_timeout)
    return RankResults([value for value, _ in pairs], [t for _, t in pairs])


def _traced_call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, Any]:
    from workbench import trace

    with trace.tracing(rank=dist.get_rank(), world_size=dist.get_world_size()) as tracer:
        result = fn(*args, **kwargs)
    return result, tracer.trace


def _rank_main(plan: RankPlan, payload: bytes, messages: Any, parent_pid: int) -> None:
    ok = False
    relay = _drop_stderr_lines(_RESOLVER_NOISE)  # its thread stays outside the namespace: it makes no socket
    try:
        enter_namespace(plan.namespace)  # first: the store's and gloo's sockets must be born in it
        exit_when_parent_dies(parent_pid)
        os.environ["GLOO_SOCKET_IFNAME"] = plan.interface  # gloo advertises the address the other nodes reach
        os.environ[TIMEOUT_ENV] = str(plan.timeout)  # sub-groups (a Mesh's) get the same collective timeout
        torch.set_num_threads(1)  # 4 ranks on a 2-core machine: more threads only fight over the cores
        fn, args, kwargs = cloudpickle.loads(payload)
        _init_group(plan)
        result = fn(*args, **kwargs)
        messages.put(("ok", plan.rank, cloudpickle.dumps(result)))
        ok = True
    except BaseException as exc:  # noqa: BLE001 - everything a rank raises goes to the caller
        messages.put(("error", plan.rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        messages.close()
        messages.join_thread()
        _flush_stderr(relay)
    # Skip interpreter teardown: after a failure, gloo's destructors can block on dead peers.
    os._exit(0 if ok else 1)


def _drop_stderr_lines(noise: bytes) -> threading.Thread:
    """Relay this process's fd 2 (C++ logs included) to where it pointed, without the lines holding ``noise``."""
    read_end, write_end = os.pipe()
    target = os.dup(2)
    os.dup2(write_end, 2)
    os.close(write_end)

    def relay() -> None:
        with open(read_end, "rb") as lines, open(target, "wb", buffering=0) as out:
            for line in lines:
                if noise not in line:
                    out.write(line)

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    return thread


def _flush_stderr(relay: threading.Thread) -> None:
    """Close the pipe's last write end (fd 2 -> /dev/null) and let the relay pass on what is left."""
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    relay.join(2.0)


def _init_group(plan: RankPlan) -> None:
    """Gloo over a store rank 0 hosts on node 0's veth address (reachable from every node's namespace)."""
    td = datetime.timedelta(seconds=plan.timeout)
    store = dist.TCPStore(node_address(0), plan.store_port, plan.world_size, is_master=plan.rank == 0,
                          timeout=td, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=plan.rank, world_size=plan.world_size, timeout=td)


# ----------------------------------------------------------------------------------------------------------------
# What the ranks time (the same function over the shaped link and under the emulation)


Span = tuple[float, float] | None  # one rank's (start, end) of one rep, None where the rank takes no part


def reps_for(nbytes: int, reps: int) -> int:
    """``reps`` at 16 MiB and above, up to 8 times as many below: small messages are cheap, and a scheduler slice
    (or another user's burst of work) is a larger share of their time, so their median needs more samples."""
    return reps * min(8, max(1, (16 << 20) // max(1, nbytes)))


def time_ops(sizes: dict[str, int], reps: int, ops: tuple[str, ...] = ("all_reduce", "send"), nodes: int = 2) -> dict:
    """Per size label and op, this rank's (start, end) of every rep after one warm-up (``reps_for`` reps), as
    bench_topology times: ``all_reduce`` over all ranks, ``send`` from rank 0 to the first rank of the last of
    ``nodes`` nodes (``message_peer``; None elsewhere). ``time.time()`` is one clock for every rank here: namespaces
    do not change clocks."""
    rank, peer = dist.get_rank(), message_peer(dist.get_world_size(), nodes)
    out: dict[str, dict[str, list[Span]]] = {}
    for label, nbytes in sizes.items():
        x = torch.ones(max(1, nbytes // 4), device="cpu")  # gloo ranks on the CPU
        steps = {"all_reduce": lambda x=x: comm.all_reduce(x),
                 "send": {0: lambda x=x: comm.send(x, peer), peer: lambda x=x: comm.recv(x, 0)}.get(rank)}
        out[label] = {op: [] for op in ops}
        for rep in range(reps_for(nbytes, reps) + 1):
            for op in ops:
                comm.barrier()  # every rank starts together, so a span is link time, not waiting for a peer
                span = timed(steps[op]) if steps[op] is not None else None
                if rep:  # the first rep opens gloo's connections and warms its buffers
                    out[label][op].append(span)
    return out


def message_peer(world_size: int, nodes: int) -> int:
    """The rank rank 0 sends to: the first of the last node (node-major), so the message crosses the shaped link
    (for 2 nodes, node 1's first rank, as before; from 3, it crosses node 0's uplink and the last node's downlink,
    the switch between)."""
    return world_size - world_size // nodes


def ranks_of_op(world_size: int, nodes: int) -> dict[str, tuple[int, ...]]:
    """The ranks each op of ``time_ops`` runs on: every rank for the all-reduce, rank 0 and ``message_peer``."""
    return {"all_reduce": tuple(range(world_size)), "send": (0, message_peer(world_size, nodes))}


def op_time(per_rank: list[dict], label: str, op: str) -> float:
    """``op_seconds`` of one op and size from ``time_ops``' per-rank results."""
    return op_seconds([result[label][op] for result in per_rank])


# ----------------------------------------------------------------------------------------------------------------
# The link as measured, and the emulation beside it


def measure_link(link: ShapedLink, reps: int = 60, timeout: float = 120.0) -> Link:
    """The shaped link's α and effective bandwidth as ``comm.send``/``recv`` between node 0 and the last node see
    them (one rank per node; the others only join the barriers).

    α: the lower quartile of a 4-byte ping-pong's half round trips (timed on one rank's clock). On two busy cores
    a rank that waits for a core loses a scheduler slice (~3 ms, ten times α) in a quarter to a half of the
    round trips (measured: lower quartile 150..310 µs over runs, median 290..590 µs); that wait is the machine's,
    not the link's, and the lower quartile leaves it out. Bandwidth: an 8 MiB message's one-way time (timed as
    ``time_ops`` times every op) less α; TCP/IP headers and gloo's framing put it a few % under the tbf rate,
    and that is the link the ops see. 8 MiB is none of the compared sizes, so no comparison is its own fit."""
    alpha, probe = run_ranks(_probe, link.nodes, link, reps, timeout=timeout)[0]
    return Link(alpha=alpha, bandwidth=PROBE_BYTES / (probe - alpha), name="shaped veth (measured)")


def _probe(reps: int) -> tuple[float, float] | None:
    """On rank 0: (lower quartile of a tiny message's half round trips to the last rank, one-way seconds of
    ``PROBE_BYTES``), one rank per node."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = {0: world - 1, world - 1: 0}.get(rank)
    tiny = torch.ones(TINY_BYTES // 4, device="cpu")
    half_trips = []
    for rep in range(reps + 1):
        comm.barrier()
        if peer is None:  # a node between the two: in the barriers only
            continue
        start = time.time()
        for step in ((comm.send, comm.recv) if rank == 0 else (comm.recv, comm.send)):
            step(tiny, peer)
        if rep:
            half_trips.append((time.time() - start) / 2)
    # Six reps of the large message (``reps_for`` doubles 3 at 8 MiB; ~0.35 s each): one rep slowed by a busy
    # machine must not set the bandwidth.
    per_rank = comm.all_gather_object(time_ops({"probe": PROBE_BYTES}, 3, ops=("send",), nodes=world))
    if rank != 0:
        return None
    return statistics.quantiles(half_trips, n=4)[0], op_time(per_rank, "probe", "send")


MODEL_SLACK = 0.10
SCHEDULER_WAIT_S = 8e-3
# An all-reduce over the switch (3 nodes and more) gets 10 % more: measured (3 ranks, one per node, a busy machine)
# predicted / real 0.85 at 256 KiB, 0.93..0.95 at 1 to 16 MiB, 0.91 at 64 MiB (0.85..0.93 from 4 MiB on before the
# switch ports got their larger burst), against 0.93..0.97 over the pair. Each ring step crosses two token buckets
# and the bridge, whose per-packet work (softirq) runs on the same busy cores, and a step waits for the slowest of
# its inter-node hops, three of them instead of two. A message over the same two buckets keeps the pair's agreement
# (0.97..1.02), so the link itself is priced right.
STAR_ALL_REDUCE_SLACK = 0.10


def agreement_bound(seconds: float) -> float:
    """How far (relative) a time over the real link may sit from the emulation's for an op taking ``seconds``.

    ``MODEL_SLACK`` (10 %) for what the α-β model leaves out. It has no term for an all-reduce's arithmetic and
    copies: four ranks reducing on two busy cores take 20 ms at 4 MiB and 320 ms at 64 MiB with no shaping at all
    (~8 % of the shaped link's time at every size, both growing with the bytes), and gloo's ring does part of that
    between its transfers (measured: the all-reduce 3-7 % slower than the link fitted on a one-way send; a send,
    with nothing to add, within 1 %). A bucket refilled during a pause lets its burst through at once (3 % of
    256 KiB); the rate drifts by a % or two between the fit and the measurement. Plus ``SCHEDULER_WAIT_S`` (8 ms)
    as a share of the op's time: four ranks and whatever else runs share two cores, so a rank waits ~3-4 ms for a
    core now and then (a 256 KiB all-reduce with no shaping at all takes a median 10 ms here, 4 to 95 ms), and an
    all-reduce has six ring steps at which to wait; part of it does not overlap the link's time, even in a median
    (measured: the 256 KiB all-reduce's median 1 to 7.5 ms over the model in a dozen runs, so two such waits). The
    emulation's own wake-up after its modelled sleep (~1 ms) fits in the same allowance."""
    return MODEL_SLACK + SCHEDULER_WAIT_S / seconds


@dataclass(frozen=True)
class OpTiming:
    """One op at one size: seconds over the shaped link, predicted by the model, measured under the emulation."""

    op: str
    label: str
    nbytes: int
    shaped_s: float
    predicted_s: float
    emulated_s: float | None = None
    extra_slack: float = 0.0  # added to agreement_bound: STAR_ALL_REDUCE_SLACK for an all-reduce over the switch

    @property
    def ratio(self) -> float:
        """Predicted / measured over the real link (1 is perfect agreement)."""
        return self.predicted_s / self.shaped_s

    @property
    def allowed(self) -> float:
        """``agreement_bound`` for this op's time over the real link (plus ``extra_slack``)."""
        return agreement_bound(self.shaped_s) + self.extra_slack

    def within_bound(self) -> bool:
        """Whether the prediction and (when measured) the emulated time are both within ``allowed`` of the real."""
        emulated = self.emulated_s / self.shaped_s if self.emulated_s is not None else 1.0
        return abs(self.ratio - 1) <= self.allowed and abs(emulated - 1) <= self.allowed

    def describe(self) -> dict[str, Any]:
        row = {"shaped_ms": round(self.shaped_s * 1e3, 2), "predicted_ms": round(self.predicted_s * 1e3, 2),
               "ratio": round(self.ratio, 3), "allowed": round(self.allowed, 3), "within": self.within_bound()}
        if self.emulated_s is not None:
            row.update(emulated_ms=round(self.emulated_s * 1e3, 2),
                       emulated_ratio=round(self.emulated_s / self.shaped_s, 3))
        return row


@dataclass(frozen=True)
class Comparison:
    """``compare``'s answer: the link as measured, its token bucket, one ``OpTiming`` per op and size, and the
    layout they were timed on (``world_size`` ranks on ``nodes`` nodes, node-major)."""

    link: Link
    bucket: TokenBucket
    timings: list[OpTiming]
    world_size: int = 4
    nodes: int = 2

    def worst_ratio(self) -> float:
        """The predicted / measured ratio farthest from 1 over every op and size."""
        return max((t.ratio for t in self.timings), key=lambda r: abs(r - 1))

    def worst_emulated_ratio(self) -> float | None:
        """The same for emulated / measured (None when the emulation was not run)."""
        ratios = [t.emulated_s / t.shaped_s for t in self.timings if t.emulated_s is not None]
        return max(ratios, key=lambda r: abs(r - 1)) if ratios else None


WORLD_SIZE, NODES = 4, 2  # the layout README's netns_vs_emulation row was measured on
RANKS_OF_OP = ranks_of_op(WORLD_SIZE, NODES)  # node-major: ranks 0 and 2 sit on different nodes


def compare(link: ShapedLink, sizes: dict[str, int], reps: int = 3, emulate: bool = True,
            timeout: float = 300.0, ranks_per_node: int = 2) -> Comparison:
    """Time all-reduce (``ranks_per_node`` ranks on each of ``link.nodes`` nodes) and send/recv (rank 0 to the first
    rank of the last node) at ``sizes`` over ``link``; measure the link (``measure_link``); predict each time with
    the emulation's model for that link and, with ``emulate``, measure it under the emulation too
    (``launch(..., nodes=link.nodes, inter_link=<the measured link>)``)."""
    nodes = link.nodes
    world = nodes * ranks_per_node
    measured = measure_link(link, timeout=timeout)
    shaped = run_ranks(time_ops, world, link, sizes, reps, ("all_reduce", "send"), nodes, timeout=timeout)
    emulated = None
    if emulate:
        emulated = list(launch(time_ops, world, sizes, reps, ("all_reduce", "send"), nodes, nodes=nodes,
                               intra_link=INTRA_LINK, inter_link=measured, timeout=timeout))
    model = LinkEmulation.build(world, nodes, intra_link=INTRA_LINK, inter_link=measured)
    op_ranks = ranks_of_op(world, nodes)
    timings = [OpTiming(op, label, nbytes, op_time(shaped, label, op),
                        model.modelled_time(op, nbytes, op_ranks[op]),
                        op_time(emulated, label, op) if emulated else None, extra_slack(link, op))
               for label, nbytes in sizes.items() for op in op_ranks]
    return Comparison(measured, link.bucket, timings, world, nodes)


def extra_slack(link: ShapedLink, op: str) -> float:
    """What ``compare`` adds to ``agreement_bound`` for ``op`` over ``link``: ``STAR_ALL_REDUCE_SLACK`` for an
    all-reduce through the switch, nothing otherwise (the pair's bound is unchanged)."""
    return STAR_ALL_REDUCE_SLACK if link.switch is not None and op == "all_reduce" else 0.0


def size_label(nbytes: int) -> str:
    """``262144`` -> ``256KiB``, ``67108864`` -> ``64MiB``."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


__all__ = [
    "Comparison", "NetnsError", "OpTiming", "ShapedLink", "TokenBucket", "agreement_bound", "check_nodes",
    "compare", "enter_namespace", "extra_slack", "launch_shaped", "leftovers", "measure_link", "message_peer",
    "node_address", "ranks_of_op", "remove_stale", "reps_for", "run_ranks", "shaped_link", "size_label",
    "time_ops", "unavailable_reason",
]
