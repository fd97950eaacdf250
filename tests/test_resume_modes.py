"""Issue 22 item 5: every scheme's state travels in the checkpoint, so a resume ends bit for bit as the unbroken run.
PowerSGD (residuals and Q) and local SGD with DiLoCo's Nesterov outer step are tested through ``workbench run``
(tests/test_compression_run.py, tests/test_local_sgd_run.py), the parameter server in
tests/test_param_server_ckpt.py; here the others: top-k's and sign's error-feedback residuals, and local SGD's
plain averaging resumed in the middle of an outer round (each replica's own parameters and the round's position).

Tolerance: none. The resumed run applies the same operations to the same state in the same order; the lr of steps
0-3 is warm-up's (warmup=5) whatever --steps says, so the cut run trains exactly the unbroken run's first four
steps. A residual left out of the checkpoint would change step 4's update and so the final hash.
"""

from __future__ import annotations

import dataclasses

import pytest

from workbench.launch import launch
from workbench.train import RunConfig, train_rank

# Extended lane: each mode's resume path is also covered in the test command by the PowerSGD and Nesterov resume
# tests (tests/test_compression_run.py, tests/test_local_sgd_run.py), which go through the same CheckpointManager.
pytestmark = [pytest.mark.timeout(300), pytest.mark.extended]

SMALL = dict(nproc=2, batch_size=8, seq_len=32, ckpt_every=2)
MODES = {"topk": dict(grad_compression="topk", topk_ratio=0.1), "sign": dict(grad_compression="sign"),
         "local_sgd_avg": dict(local_steps=3, outer_optimizer="avg")}  # saved after step 3: mid-round (4 % 3 = 1)


def _cut_and_resume(pairs: list[tuple[RunConfig, RunConfig]]) -> list[dict[str, dict]]:
    """Each mode's unbroken run, its run cut after step 3 and the resume, in one launch (the resume is configured
    here: validating it reads the cut run's checkpoint)."""
    out = []
    for full, cut in pairs:
        whole, first = train_rank(full), train_rank(cut)
        resumed = train_rank(dataclasses.replace(cut, steps=full.steps, resume=True))
        out.append({"full": whole, "cut": first, "resumed": resumed})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict]]:
    root = tmp_path_factory.mktemp("resume-modes")
    pairs = [(RunConfig(ckpt_dir=str(root / name / "full"), steps=6, **SMALL, **flags),
              RunConfig(ckpt_dir=str(root / name / "cut"), steps=4, **SMALL, **flags))
             for name, flags in MODES.items()]
    return dict(zip(MODES, launch(_cut_and_resume, 2, pairs, timeout=240)[0], strict=True))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_resumed_run_ends_bit_identical(runs: dict, mode: str) -> None:
    full, cut, resumed = runs[mode]["full"], runs[mode]["cut"], runs[mode]["resumed"]
    assert resumed["checkpoint"]["resumed_from_step"] == 3
    assert cut["final_params_sha256"] != full["final_params_sha256"]  # the resume trained steps 4-5
    assert resumed["final_params_sha256"] == full["final_params_sha256"]
    assert [m["loss"] for m in cut["history"] + resumed["history"]] == [m["loss"] for m in full["history"]]
