"""Run every benchmark side by side with its PyTorch reference; print a table and write JSON rows.

    python benchmarks/run.py --quick --json results.json
    python benchmarks/run.py --only launch,ddp --timeout 300
    python benchmarks/run.py --device cuda

Each ``benchmarks/bench_<topic>.py`` exposes ``rows(quick: bool) -> list[dict]`` with rows
``{benchmark, ours, reference, ratio, unit, config}`` measured in one run on this machine, and may declare
``DEVICES = ("cpu", "cuda")`` (default: cpu only; on another device its rows are skipped). Only ratios
measured side by side mean anything on a shared machine (see ../shared/BENCHMARKS.md in the project docs).

Each module runs in a fresh Python subprocess under a time limit (``--timeout``); on timeout its whole
process group is killed. A module that times out or raises becomes a row with ``"status": "failed"`` and a
``reason``, and the run goes on; the exit code is nonzero when any row failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # harness.py lives beside this file

from harness import DEVICE_ENV, declared_devices, run_bounded  # noqa: E402

#: Seconds one bench module may take (full, quick): several times a normal run on a 2-core machine.
DEFAULT_TIMEOUT_S = {False: 600.0, True: 240.0}
DEVICES = ("cpu", "cuda")


def bench_modules(only: set[str] | None, directory: Path = HERE) -> list[Path]:
    """The ``bench_*.py`` files in ``directory``, launch first, filtered to the topics in ``only``."""
    found = sorted(Path(directory).glob("bench_*.py"))
    # The launch benchmark is the first row by contract.
    found.sort(key=lambda p: (p.stem != "bench_launch", p.stem))
    return [p for p in found if only is None or p.stem.removeprefix("bench_") in only]


def _module_row(path: Path, status: str, reason: str, device: str, elapsed: float | None = None) -> dict[str, Any]:
    """A stand-in row for a module that produced no rows (failed or skipped): named after the module."""
    config: dict[str, Any] = {"device": device}
    if elapsed is not None:
        config["elapsed_s"] = round(elapsed, 1)
    return {"benchmark": path.stem, "module": path.stem, "status": status, "reason": reason, "ours": None,
            "reference": None, "ratio": None, "unit": None, "config": config}


def run_module(path: Path, quick: bool, timeout: float, device: str = "cpu") -> list[dict[str, Any]]:
    """Run one bench module in a fresh, bounded subprocess; always returns rows, failed ones included."""
    if device not in declared_devices(path):
        return [_module_row(path, "skipped", f"{path.stem} does not declare {device} support "
                                             f"(DEVICES = {declared_devices(path)!r})", device)]
    env = {**os.environ, DEVICE_ENV: device}
    with tempfile.TemporaryDirectory(prefix="workbench-bench-") as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(HERE / "harness.py"), str(path), str(out)] + (["--quick"] if quick else [])
        outcome = run_bounded(cmd, timeout, env=env)
        result = None
        if out.exists():
            try:
                result = json.loads(out.read_text())
            except ValueError:
                result = None  # a half-written file: the process died mid-write; fall through to its exit status
    if outcome.timed_out:
        return [_module_row(path, "failed", outcome.describe(timeout), device, outcome.elapsed_s)]
    if result is None:
        return [_module_row(path, "failed", f"{outcome.describe(timeout)} without writing rows", device,
                            outcome.elapsed_s)]
    if result["status"] != "ok":
        return [_module_row(path, "failed", result["reason"], device, outcome.elapsed_s)]
    rows = result["rows"]
    for row in rows:
        row.setdefault("module", path.stem)
    return rows


def format_row(row: dict[str, Any]) -> str:
    """One table line: figures for an ok row, FAILED/SKIPPED with the reason otherwise."""
    status = row.get("status", "ok")
    if status != "ok":
        return f"{row['benchmark']:<44} {status.upper()}: {row.get('reason', '')}"
    return (f"{row['benchmark']:<44} ours {row['ours']:>10.4g}  ref {row['reference']:>10.4g}  "
            f"ratio {row['ratio']:>6.3f}  {row['unit']}")


def run_benchmarks(paths: list[Path], quick: bool, timeout: float, device: str = "cpu",
                   json_path: str | None = None) -> tuple[list[dict[str, Any]], int]:
    """Run ``paths`` one after another; print each row as it comes; return (rows, exit code)."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        t0 = time.time()
        new = run_module(path, quick, timeout, device)
        for row in new:
            print(format_row(row), flush=True)
        rows += new
        print(f"  ({path.stem}: {time.time() - t0:.1f} s)", flush=True)
        if json_path:
            # Written after every module, so an interrupted run keeps what it measured.
            Path(json_path).write_text(json.dumps(rows, indent=2))
    if json_path:
        print(f"wrote {len(rows)} rows to {json_path}")
    failed = [r["benchmark"] for r in rows if r.get("status") == "failed"]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return rows, 1
    return rows, 0


def _cuda_problem() -> str | None:
    """Why ``--device cuda`` cannot run here, or None. Imports torch only when CUDA is asked for."""
    try:
        import torch
    except ImportError as exc:
        return f"--device cuda needs torch: {exc}"
    if not torch.cuda.is_available():
        return "--device cuda: torch.cuda.is_available() is False (no visible GPU, or torch built without CUDA)"
    return None


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats: minutes, not tens of minutes")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.add_argument("--only", default=None, help="comma-separated topics, e.g. launch,ddp")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds each bench module may run before it is killed and marked failed "
                             f"(default {DEFAULT_TIMEOUT_S[False]:g}, with --quick {DEFAULT_TIMEOUT_S[True]:g})")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help=f"device the benchmarks run on (passed as ${DEVICE_ENV}); modules that do not "
                             f"declare it are skipped")
    parser.add_argument("--dir", default=str(HERE), help="directory holding the bench_*.py modules")
    args = parser.parse_args(argv)
    timeout = DEFAULT_TIMEOUT_S[args.quick] if args.timeout is None else args.timeout
    if not timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    directory = Path(args.dir)
    if not directory.is_dir():
        parser.error(f"--dir {args.dir}: not a directory")
    if args.device == "cuda" and (problem := _cuda_problem()):
        print(problem, file=sys.stderr)
        return 2
    only = set(args.only.split(",")) if args.only else None
    paths = bench_modules(only, directory)
    if not paths:
        print(f"no bench_*.py modules in {directory}" + (f" matching --only {args.only}" if only else ""),
              file=sys.stderr)
        return 2
    try:
        _, code = run_benchmarks(paths, args.quick, timeout, args.device, args.json)
    except KeyboardInterrupt:  # the running module's process group is already killed (run_bounded's finally)
        print("interrupted" + (f"; rows of the modules that finished are in {args.json}" if args.json else ""),
              file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
