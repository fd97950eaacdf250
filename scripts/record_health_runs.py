"""Record the short runs lab 11 grades a spike/NaN/divergence detector on (workbench/assets/health_runs.json).

Each run is a real ``run_training`` on 2 gloo ranks (the tiny GPT, 80 steps); what the lab keeps of it is rank 0's
loss and gradient norm per step, rounded to 5 significant digits, with the step the fault was planted at:

* clean runs: nothing planted (two seeds, and a smaller batch whose loss is noisier);
* ``nan``: ``--inject-fault nan:rank=R:step=S`` (rank R's weights turn NaN before step S), late and early;
* ``spike`` (late and early): step S's whole global batch corrupted in the corpus (random printable characters
  where text was: ``health.corrupted_corpus``), found from the sampler, a pure function of (seed, step);
* ``divergence``: from step S on, a growing share of every batch corrupted (one more window every 3 steps): the
  loss rises for good, a step at a time, never by a jump.

Usage: python scripts/record_health_runs.py  (about 2 minutes on 2 cores)
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from workbench.run import run_training
from workbench.training.config import RunConfig
from workbench.training.health import corrupted_corpus

OUT = Path(__file__).resolve().parent.parent / "workbench" / "assets" / "health_runs.json"
STEPS = 80
DRIFT = 40  # the divergence run's first corrupted step
BASE = {"model": "tiny", "nproc": 2, "steps": STEPS, "batch_size": 8, "seq_len": 64, "warmup": 10}


def _round(x: float) -> float | None:
    return None if not math.isfinite(x) else float(f"{x:.5g}")  # JSON has no NaN: null stands for it


def _record(name: str, kind: str | None, step: int | None, how: str, cfg: RunConfig) -> dict:
    summary = run_training(cfg, progress=False)
    history = sorted(summary["history"], key=lambda h: h["step"])
    assert [h["step"] for h in history] == list(range(STEPS)), name
    return {"name": name, "fault": kind, "step": step, "how": how,
            "config": {k: v for k, v in vars(cfg).items() if k in BASE or k in ("seed", "inject_fault")},
            "loss": [_round(h["loss"]) for h in history], "grad_norm": [_round(h["grad_norm"]) for h in history]}


def _spike(tmp: str, name: str, step: int, seed: int) -> dict:
    cfg = RunConfig(**BASE, seed=seed)
    corrupted_corpus(cfg, f"{tmp}/{name}.txt", {step: cfg.batch_size})
    return _record(name, "spike", step, f"step {step}'s whole batch corrupted in the corpus",
                   RunConfig(**BASE, seed=seed, data=f"{tmp}/{name}.txt"))


def main() -> None:
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        runs.append(_record("clean", None, None, "nothing planted", RunConfig(**BASE)))
        runs.append(_record("clean-seed1", None, None, "nothing planted, another seed", RunConfig(**BASE, seed=1)))
        runs.append(_record("clean-small-batch", None, None, "nothing planted, batch 4: a noisier loss",
                            RunConfig(**{**BASE, "batch_size": 4}, seed=2)))
        runs.append(_record("nan", "nan", 45, "--inject-fault nan:rank=1:step=45",
                            RunConfig(**BASE, inject_fault="nan:rank=1:step=45")))
        runs.append(_record("nan-early", "nan", 3, "--inject-fault nan:rank=0:step=3, inside any warm-up",
                            RunConfig(**BASE, seed=2, inject_fault="nan:rank=0:step=3")))
        runs.append(_spike(tmp, "spike", 50, seed=1))
        runs.append(_spike(tmp, "spike-early", 25, seed=0))
        drift = RunConfig(**BASE, seed=1)  # clean-seed1's twin: every difference is the corruption's
        corrupted_corpus(drift, f"{tmp}/drift.txt", {s: (s - DRIFT) // 3 + 1 for s in range(DRIFT, STEPS)})
        runs.append(_record("divergence", "divergence", DRIFT, f"from step {DRIFT}, one more window of every "
                            "batch corrupted every 3 steps", RunConfig(**BASE, seed=1, data=f"{tmp}/drift.txt")))
    OUT.write_text(json.dumps({"steps": STEPS, "runs": runs}, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
