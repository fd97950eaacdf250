#!/usr/bin/env bash
# The GPU lane: on a machine with CUDA, run the tests marked `gpu` and the CUDA benchmark rows, and write
# one results file. From a checkout with torch (CUDA build), the package's dependencies and pytest present:
#
#     bash scripts/gpu_lane.sh [OUT_DIR]        # default OUT_DIR: gpu-lane
#
# It writes OUT_DIR/results.json (GPU, torch, NCCL, test counts, benchmark rows) beside the raw logs.
# Exit status: nonzero when a test failed or no CUDA device is visible (a lane that ran nothing is no proof).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-lane}"
mkdir -p "$out"
# Works without `pip install -e .` too (a GPU machine without registry access can carry the folder).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible: the GPU lane needs one')" || exit 2
# The package's own dependencies must be there (a GPU machine without registry access: carry their wheels and
# `python -m pip install --no-deps` them); without plotly the runs that write a report would fail for that alone.
python -c "import plotly, cloudpickle, tqdm, numpy" || { echo "the GPU lane needs the package's dependencies (plotly, cloudpickle, tqdm, numpy) importable by this python" >&2; exit 2; }
python -m workbench.cli env --json > "$out/environment.json"
python -m pytest -q -m gpu tests/test_gpu.py -rs --junitxml "$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
python benchmarks/run.py --device cuda --quick --json "$out/gpu-benchmarks.json" 2>&1 | tee "$out/gpu-benchmarks.log"
bench_rc=${PIPESTATUS[0]}

python - "$out" "$tests_rc" "$bench_rc" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, tests_rc, bench_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
suite = ET.parse(out / "gpu-tests.xml").getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
bench = out / "gpu-benchmarks.json"
results = {
    "environment": json.loads((out / "environment.json").read_text()),
    "tests": {**counts, "exit_code": tests_rc},
    "benchmarks": {"rows": json.loads(bench.read_text()) if bench.exists() else [], "exit_code": bench_rc},
}
(out / "results.json").write_text(json.dumps(results, indent=2))
print(f"GPU lane: {counts['tests'] - counts['failures'] - counts['errors'] - counts['skipped']} passed, "
      f"{counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped; "
      f"{len(results['benchmarks']['rows'])} benchmark rows; wrote {out / 'results.json'}")
PY
exit "$tests_rc"
