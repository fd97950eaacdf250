"""IPython magics for interactive ranks: ``%load_ext workbench.magics``.

::

    %ranks start 4 [--timeout 60] [--device cpu]   # a persistent pool of 4 ranks (workbench.rank_pool)
    %%ranks                                        # run the cell on every rank, outputs side by side
    %%ranks 0,2 [--timeout 5]                      # ... on ranks 0 and 2 only
    %ranks status | restart | stop | timeline
    %ranks start 8 --nodes 2 --inter-link ethernet # ... on 2 emulated nodes joined by a slow link

Each rank keeps its variables across cells; ``rank``, ``world_size``, ``device``, ``torch``, ``dist`` and
``comm`` are predefined. A cell's last expression is shown per rank, an exception on a rank as that
rank's traceback (in red), and the pool survives it. A collective in a cell run on a subset of ranks (or
behind ``if rank == 0``) waits for ranks that never join: that is yours to try, and the timeout reports
which rank hung; ``%ranks restart`` then brings the pool back.
"""

from __future__ import annotations

import html
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from workbench.dist.rank_pool import PoolBrokenError, RankPool, RankResult

_LINE_USAGE = ("usage: %ranks start N [--timeout S] [--device auto|cpu|cuda] [--nodes K] [--intra-link SPEC] "
               "[--inter-link SPEC] [--time-scale X|GPU] [--straggler rank=R:factor=F] | status | restart | stop | "
               "timeline")
_CELL_USAGE = "usage: %%ranks [RANKS, e.g. 0,2] [--timeout S]"


@magics_class
class RankMagics(Magics):
    """``%ranks`` / ``%%ranks``; the pool lives on this object, one per shell."""

    pool: RankPool | None = None

    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None) -> None:
        """Control a pool of persistent ranks (line) or run a cell on them (cell); see the module docstring."""
        try:
            words = shlex.split(line)
        except ValueError as exc:
            raise UsageError(f"%ranks: cannot parse {line!r} ({exc})") from None
        if cell is None:
            self._line(words)
        else:
            self._cell(words, cell)

    # -- line magic ------------------------------------------------------------------------------------

    def _line(self, words: list[str]) -> None:
        if not words:
            raise UsageError(_LINE_USAGE)
        command, rest = words[0], words[1:]
        if command == "start":
            self._start(rest)
        elif command in ("status", "restart", "stop", "timeline") and rest:
            raise UsageError(f"%ranks {command} takes no arguments, got {' '.join(rest)!r}")
        elif command == "status":
            self._show_status()
        elif command == "restart":
            self._require_pool().restart()
            print(f"restarted: {self.pool.placement.describe(self.pool.world_size)}")
        elif command == "stop":
            self.stop()
        elif command == "timeline":
            self._timeline()
        else:
            raise UsageError(f"%ranks: unknown command {command!r}; {_LINE_USAGE}")

    def _start(self, args: list[str]) -> None:
        options = _options(args, {"--timeout", "--device", _STRAGGLER, *_LINK_OPTIONS}, "%ranks start")
        if len(options["positional"]) != 1:
            raise UsageError(f"%ranks start needs the number of ranks, e.g. %ranks start 4; {_LINE_USAGE}")
        world_size = _int(options["positional"][0], "the number of ranks")
        if world_size < 1:
            raise UsageError(f"%ranks start: the number of ranks must be at least 1, got {world_size}")
        timeout = _float(options.get("--timeout", "60"), "--timeout")
        if self.pool is not None:
            self.stop()  # one pool per kernel: the new one replaces it
        try:
            links = _links(options, world_size)
            self.pool = RankPool(world_size, timeout=timeout, device=options.get("--device"), links=links,
                                 straggler=options.get(_STRAGGLER))
        except ValueError as exc:
            raise UsageError(f"%ranks start: {exc}") from None
        print(f"started {self.pool.placement.describe(world_size)}; collective timeout {timeout:g}s")
        if links is not None:
            print(f"emulated: {links.describe()}")
        if self.pool.straggler is not None:
            s = self.pool.straggler
            print(f"emulated straggler: rank {s.rank} computes {s.factor:g}x slower")

    def stop(self, quiet: bool = False) -> None:
        """Stop the pool if there is one (also called when the extension is unloaded)."""
        if self.pool is None:
            if not quiet:
                print("no rank pool is running")
            return
        self.pool.stop()
        self.pool = None
        if not quiet:
            print("stopped the rank pool")

    def _require_pool(self) -> RankPool:
        if self.pool is None:
            raise UsageError("no rank pool is running: start one with %ranks start N (e.g. %ranks start 2)")
        return self.pool

    def _show_status(self) -> None:
        pool = self._require_pool()
        state = f"broken: {pool.broken}" if pool.broken else "ready"
        print(f"{pool.placement.describe(pool.world_size)}; {state}")
        for s in pool.status():
            memory = f"{s.rss_bytes / 2**20:.0f} MiB" if s.rss_bytes is not None else "?"
            print(f"  rank {s.rank}: pid {s.pid}, {'alive' if s.alive else 'DEAD'}, device {s.device}, "
                  f"RSS {memory}")

    def _timeline(self) -> None:
        traces = [r.trace for r in self._require_pool().last_results if r.trace is not None]
        if not any(t.comms or t.spans for t in traces):
            print("the last %%ranks cell recorded no collectives (use workbench.comm, e.g. comm.all_reduce)")
            return
        from workbench.viz.timeline import timeline

        display(timeline(traces, title="last %%ranks cell: per-rank timeline (measured)"))

    # -- cell magic ------------------------------------------------------------------------------------

    def _cell(self, words: list[str], cell: str) -> None:
        options = _options(words, {"--timeout"}, "%%ranks")
        if len(options["positional"]) > 1:
            raise UsageError(f"%%ranks: give ranks as one comma-separated list, e.g. 0,2; {_CELL_USAGE}")
        pool = self._require_pool()
        ranks = _rank_list(options["positional"][0], pool.world_size) if options["positional"] else None
        timeout = _float(options["--timeout"], "--timeout") if "--timeout" in options else None
        try:
            results = pool.run(cell, ranks=ranks, timeout=timeout)
        except PoolBrokenError as exc:
            raise UsageError(str(exc)) from None
        display(RankTable(results))
        if pool.broken:
            print(f"the pool is broken ({pool.broken}): run %ranks restart")


class RankTable:
    """Per-rank results side by side: an HTML table (one column per rank) with a plain-text fallback."""

    def __init__(self, results: list[RankResult]) -> None:
        self.results = results

    def _repr_html_(self) -> str:
        head = "".join(f"<th style='text-align:left'>rank {r.rank} <small>({r.elapsed:.2f}s)</small></th>"
                       for r in self.results)
        cells = "".join(f"<td style='vertical-align:top;text-align:left'>{_cell_html(r)}</td>"
                        for r in self.results)
        return f"<table class='workbench-ranks'><tr>{head}</tr><tr>{cells}</tr></table>"

    def __repr__(self) -> str:
        return "\n".join(_cell_text(r) for r in self.results)


def _pre(text: str, style: str = "") -> str:
    return f"<pre style='margin:0;white-space:pre-wrap;{style}'>{html.escape(text)}</pre>"


def _cell_html(r: RankResult) -> str:
    parts = []
    if r.stdout:
        parts.append(_pre(r.stdout))
    if r.stderr:
        parts.append(_pre(r.stderr, "background:#fff3e0"))
    if r.value is not None:
        parts.append(_pre(r.value, "font-weight:bold"))
    if r.error is not None:
        parts.append(_pre(r.error, "color:#c62828"))
    return "".join(parts) or "<i>(no output)</i>"


def _cell_text(r: RankResult) -> str:
    lines = [f"--- rank {r.rank} ({r.elapsed:.2f}s) ---"]
    for label, text in (("", r.stdout), ("[stderr] ", r.stderr), ("Out: ", r.value), ("ERROR: ", r.error)):
        if text:
            lines.append(label + text.rstrip("\n"))
    return "\n".join(lines)


def _options(words: list[str], allowed: set[str], where: str) -> dict[str, Any]:
    """``--name value`` pairs from ``allowed`` and the positional words, or a UsageError naming the bad one."""
    options: dict[str, Any] = {"positional": []}
    it = iter(words)
    for word in it:
        if word.startswith("--"):
            if word not in allowed:
                raise UsageError(f"{where}: unknown option {word!r}; valid: {', '.join(sorted(allowed))}")
            value = next(it, None)
            if value is None:
                raise UsageError(f"{where}: {word} needs a value")
            options[word] = value
        else:
            options["positional"].append(word)
    return options


_LINK_OPTIONS = ("--nodes", "--intra-link", "--inter-link", "--time-scale", "--distribution")
_STRAGGLER = "--straggler"


def _links(options: dict[str, Any], world_size: int) -> Any:
    """The emulated topology ``%ranks start`` was given (``--nodes`` etc., as ``workbench run`` takes them), or
    None; a ValueError names the bad value."""
    from workbench.dist.launch import link_emulation

    if not any(name in options for name in _LINK_OPTIONS):
        return None
    nodes = _int(options.get("--nodes", "1"), "--nodes")
    return link_emulation(world_size, nodes, options.get("--intra-link", "nvlink"),
                          options.get("--inter-link", "infiniband"), options.get("--time-scale", "1"),
                          options.get("--distribution", "block"))


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{what} must be an integer, got {text!r}") from None


def _float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise UsageError(f"{what} must be a positive number of seconds, got {text!r}")
    return value


def _rank_list(text: str, world_size: int) -> list[int]:
    """``"0,2"`` -> ``[0, 2]``, every rank in 0..world_size-1, or a UsageError naming what is valid."""
    ranks = [_int(word, "a rank") for word in text.split(",") if word.strip()]
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad or not ranks:
        raise UsageError(f"%%ranks: rank(s) {bad or text!r} out of range: the pool has {world_size} rank(s), "
                         f"valid ranks are 0..{world_size - 1}")
    return sorted(set(ranks))


def load_ipython_extension(ip: Any) -> None:
    """``%load_ext workbench.magics``: register ``%ranks`` / ``%%ranks``."""
    ip.register_magics(RankMagics)


def unload_ipython_extension(ip: Any) -> None:
    """``%unload_ext workbench.magics``: stop the pool so no rank outlives the extension."""
    magics = ip.magics_manager.registry.get("RankMagics")
    if magics is not None:
        magics.stop(quiet=True)
