"""Run every benchmark side by side with its PyTorch reference; print a table and write JSON rows.

    python benchmarks/run.py --quick --json results.json
    python benchmarks/run.py --only launch,ddp

Each ``benchmarks/bench_<topic>.py`` exposes ``rows(quick: bool) -> list[dict]`` with rows
``{benchmark, ours, reference, ratio, unit, config}`` measured in one run on this machine. Only ratios
measured side by side mean anything on a shared machine (see ../shared/BENCHMARKS.md in the project docs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
# A bench module may import its neighbours (e.g. a shared timing helper).
sys.path.insert(0, str(HERE))


def bench_modules(only: set[str] | None) -> list[Path]:
    found = sorted(HERE.glob("bench_*.py"))
    # The launch benchmark is the first row by contract.
    found.sort(key=lambda p: (p.stem != "bench_launch", p.stem))
    return [p for p in found if only is None or p.stem.removeprefix("bench_") in only]


def load(path: Path):  # noqa: ANN201
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats: minutes, not tens of minutes")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.add_argument("--only", default=None, help="comma-separated topics, e.g. launch,ddp")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    rows, failures = [], []
    for path in bench_modules(only):
        t0 = time.time()
        try:
            new = load(path).rows(args.quick)
        except Exception:  # noqa: BLE001 - one broken benchmark must not hide the others' figures
            failures.append(path.stem)
            traceback.print_exc()
            continue
        for row in new:
            print(f"{row['benchmark']:<44} ours {row['ours']:>10.4g}  ref {row['reference']:>10.4g}  "
                  f"ratio {row['ratio']:>6.3f}  {row['unit']}", flush=True)
        rows += new
        print(f"  ({path.stem}: {time.time() - t0:.1f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
        print(f"wrote {len(rows)} rows to {args.json}")
    if failures:
        print(f"FAILED: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
