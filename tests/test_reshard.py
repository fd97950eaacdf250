"""Resharded resume: a checkpoint saved on one layout resumes on another (dp=4 ZeRO-3 -> dp=2 ZeRO-1, TP -> ZeRO-2,
a pipeline -> one process) and goes on as the unbroken run does.

Not bit-identical: another layout sums gradients in another order. The tolerance is the one every strategy meets
against one process (tests/test_train_cli.py): losses within rtol 2e-4, relative to the loss, so it holds whatever
order a CPU sums in. Adam's moments by tests/equivalence.py's ROUNDOFF_K eps of their largest element.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from equivalence import assert_all_close_to_scale

from workbench.checkpoint import step_dir
from workbench.cli import run_training
from workbench.train import FULL_STATE, RunConfig

pytestmark = [pytest.mark.numerics, pytest.mark.timeout(400)]  # numerics: .ci/run's portable-ISA lane

DATA = dict(batch_size=8, seq_len=32)


# All three in the extended lane: the test command resumes ZeRO-3 shards of dp 4 on dp 2 with ZeRO-1 in notebook 10
# (asserted against one process), and test_the_gathered_full_state_equals_one_process_adam_state checks the gather.
@pytest.mark.parametrize("saved, resumed", [
    pytest.param(dict(nproc=4, zero=3), dict(nproc=2, zero=1), id="dp4-zero3-to-dp2-zero1", marks=pytest.mark.extended),
    pytest.param(dict(nproc=2, tp=2), dict(nproc=2, zero=2), id="tp2-to-dp2-zero2", marks=pytest.mark.extended),
    pytest.param(dict(nproc=2, pp=2), dict(nproc=1), id="pp2-to-one-process", marks=pytest.mark.extended),
])
def test_resume_on_another_layout_continues_the_run(saved: dict, resumed: dict, tmp_path: Path) -> None:
    full = run_training(RunConfig(steps=8, **DATA, **saved), progress=False)
    ckpt = tmp_path / "ckpt"
    run_training(RunConfig(steps=4, ckpt_dir=str(ckpt), ckpt_every=2, **DATA, **saved), progress=False)
    after = run_training(RunConfig(steps=8, ckpt_dir=str(ckpt), resume=True, **DATA, **resumed), progress=False)
    assert (step_dir(ckpt, 3) / FULL_STATE).is_file()
    assert after["checkpoint"]["resumed_from_step"] == 3
    # the summary is the whole run's (workbench.record): steps 0-3 from the first layout, 4-7 resharded
    assert [m["step"] for m in after["history"]] == list(range(8))  # 3 updates after the reload use its moments
    assert after["losses"][4:] == pytest.approx(full["losses"][4:], rel=2e-4)
    assert after["history"][4]["grad_norm"] == pytest.approx(full["history"][4]["grad_norm"], rel=2e-4)


@pytest.mark.extended  # the test command gathers shards in test_ckpt_cli's export and notebook 10's resume
def test_the_gathered_full_state_equals_one_process_adam_state(tmp_path: Path) -> None:
    """The moments gathered from dp=2 ZeRO-3 shards (and ZeRO-1 buckets) are, by parameter name, the moments one
    process's AdamW holds after the same steps: the resharding itself adds no error."""
    import torch

    from workbench.checkpoint import load
    from workbench.models import build_gpt
    from workbench.train import prepare_resharded_resume

    single = RunConfig(steps=3, nproc=1, ckpt_dir=str(tmp_path / "one"), **DATA)
    run_training(single, progress=False)
    reference = load(step_dir(tmp_path / "one", 2), 0)["optim"]
    names = [n for n, _ in build_gpt(single.gpt_config()).named_parameters()]
    for flags in (dict(zero=3), dict(zero=1, offload=True)):
        ckpt = tmp_path / f"zero{flags['zero']}"
        run_training(RunConfig(steps=3, nproc=2, ckpt_dir=str(ckpt), **DATA, **flags), progress=False)
        note = prepare_resharded_resume(RunConfig(steps=4, nproc=1, ckpt_dir=str(ckpt), resume=True, **DATA))
        assert note is not None and "nproc: 2 -> 1" in note
        full = torch.load(step_dir(ckpt, 2) / FULL_STATE, weights_only=True)
        assert full["optimizer_step"] == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            # Each moment is a family computed together: an element's rounding is at the scale of the largest
            # (attn.k.bias's gradient is rounding noise, its moments too), not of its own value.
            want = {name: reference["state"][i][key] for i, name in enumerate(names)}
            assert_all_close_to_scale({name: full[key][name] for name in names}, want, msg=f"{flags} {key} ")
