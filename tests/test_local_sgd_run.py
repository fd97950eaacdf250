"""Local SGD / DiLoCo as a user runs it: ``workbench run --local-steps H`` through the trainer (only outer steps
communicate: one all-reduce of the parameters every H steps, tag "outer"), a checkpoint saved in the middle of
an outer round resumed bit for bit, a resume on another layout restarting the outer loop, the report's section,
and bad input refused before any rank starts. The equivalence ladder (H = 1 with inner SGD and outer averaging
equals DDP; outer SGD at lr 1 equals averaging) and Nesterov's arithmetic are tested in tests/test_local_sgd.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.cli import main, run_training
from workbench.models import build_gpt
from workbench.theory.local_sgd import bytes_per_step
from workbench.train import RunConfig

pytestmark = pytest.mark.timeout(300)

SMALL = dict(nproc=2, batch_size=8, seq_len=32)


def test_only_outer_steps_communicate_and_the_report_says_when(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["run", "--nproc", "2", "--steps", "6", "--batch-size", "8", "--seq-len", "32", "--no-progress",
                 "--local-steps", "3", "--outer-optimizer", "nesterov", "--trace-steps", "6", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [m["outer_step"] for m in summary["history"]] == [False, False, True, False, False, True]
    traces = json.loads((out / "traces.json").read_text())
    cfg = RunConfig(**SMALL)
    numel = sum(p.numel() for p in build_gpt(cfg.gpt_config()).parameters())
    per_step = {}
    for c in traces[0]["comms"]:
        if c["step"] is not None and c["tag"] not in ("metrics", "clip"):
            per_step.setdefault(c["step"], []).append((c["op"], c["tag"], c["nbytes"]))
    assert per_step == {2: [("all_reduce", "outer", numel * 4)], 5: [("all_reduce", "outer", numel * 4)]}
    assert bytes_per_step(numel, 2, local_steps=3)["tensor"] == numel * 4 / 3
    report = (out / "report.html").read_text()
    assert "local SGD: H=3, outer nesterov" in report and "after steps 2, 5" in report


def test_a_resume_in_the_middle_of_an_outer_round_ends_bit_identical(tmp_path: Path) -> None:
    """Saved after step 3 of 6 with H = 4: the replicas differ there, and the resume needs each one's own
    parameters, its AdamW state, the global parameters and the outer momentum."""
    flags = dict(local_steps=4, ckpt_every=2, steps=8, **SMALL)
    full = run_training(RunConfig(ckpt_dir=str(tmp_path / "full"), **flags), progress=False)
    run_training(RunConfig(ckpt_dir=str(tmp_path / "cut"), **{**flags, "steps": 6}), progress=False)
    resumed = run_training(RunConfig(ckpt_dir=str(tmp_path / "cut"), resume=True, **flags), progress=False)
    assert resumed["losses"][6:] == full["losses"][6:]  # the summary is the whole run's: 0-5 were cut at steps=6
    assert resumed["final_params_sha256"] == full["final_params_sha256"]


@pytest.mark.parametrize("flags, message", [
    (dict(local_steps=0), "local_steps"),
    (dict(local_steps=2, outer_optimizer="adam"), "avg, sgd, nesterov"),
    (dict(local_steps=2, outer_lr=0.0), "outer_lr"),
    (dict(local_steps=2, outer_momentum=1.0), "outer_momentum"),
    (dict(local_steps=2, zero=1), "local_steps=2 (local SGD / DiLoCo)"),
    (dict(local_steps=2, nproc=2, tp=2), "local_steps=2 (local SGD / DiLoCo)"),
    (dict(local_steps=2, grad_compression="powersgd"), "local_steps=2 (local SGD / DiLoCo)"),
])
def test_bad_local_sgd_input_is_refused_before_ranks_start(flags: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        RunConfig(**{**SMALL, **flags})
    assert message in str(info.value)
