"""Silent-corruption checks (``--sdc-check-every``): a bit flipped in one replica's weights (``bitflip:`` fault) is
found at the next check, the rank and tensor are named, and ``--on-spike``'s action is taken; a clean run reports
nothing; bad flags fail before any rank starts.

Three short launches (about 7 s each on 2 cores): dp=3 (a majority names rank 1), dp=2 with a rollback (no majority:
both ranks named; the rollback reloads a checkpoint written after a passing check), and a clean ZeRO-1 run checked
every step. The fingerprints are integer sums of the tensors' bits, so the verdicts are exact on any CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from workbench.cli import main, run_training
from workbench.dist.faults import flip_bit, parse_fault
from workbench.train import RunConfig
from workbench.training.health import compare_fingerprints, fingerprint

pytestmark = pytest.mark.timeout(120)

SMALL = dict(batch_size=12, seq_len=32, steps=6, device="cpu")
FLIP = "bitflip:rank=1:step=3"


def test_a_flipped_bit_is_named_by_the_majority(tmp_path: Path) -> None:
    summary = run_training(RunConfig(nproc=3, inject_fault=FLIP, sdc_check_every=2, **{**SMALL, "steps": 5}),
                           out=tmp_path / "out", progress=False)
    sdc = summary["health"]["sdc"]
    # Checks at steps 0 and 2 (before the flip) pass; the one at step 4 names rank 1 and the flipped tensor alone
    # (the averaged gradient keeps every other tensor and AdamW's state equal).
    [found] = sdc["detections"]
    assert (found["step"], found["ranks"], found["majority"], found["action"]) == (4, [1], True, "warn")
    assert found["tensors"] == ["wte.weight"]
    assert summary["stopped_after_step"] is None  # warn: the run goes on
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written["health"]["sdc"]["detections"] == sdc["detections"]


def test_with_two_replicas_both_are_named_and_rollback_reloads_a_clean_checkpoint(tmp_path: Path) -> None:
    cfg = RunConfig(nproc=2, inject_fault=FLIP, sdc_check_every=2, on_spike="rollback",
                    ckpt_dir=str(tmp_path / "ckpt"), ckpt_every=2, **SMALL)
    summary = run_training(cfg, progress=False)
    # The checkpoint due after step 3 is preceded by a check, which finds the flip before the save: the run
    # rolls back to step 1's checkpoint (written after a passing check), replays, and ends with equal replicas.
    [detection] = summary["health"]["sdc"]["detections"]
    assert (detection["step"], detection["ranks"], detection["majority"]) == (3, [0, 1], False)
    assert detection["action"] == "rollback"
    [event] = summary["health"]["events"]
    assert event["rolled_back_to_step"] == 1
    assert [m["step"] for m in summary["history"]] == list(range(6))
    # The batches were not what went wrong: the replay trains the same ones (no data skipped), so the run ends
    # where the uncorrupted run does, bit for bit (a spike's rollback skips its batches instead: test_health).
    assert summary["health"]["data_skip"] == 0
    clean = run_training(RunConfig(nproc=2, **SMALL), progress=False)
    assert summary["final_params_sha256"] == clean["final_params_sha256"]


def test_a_clean_run_reports_nothing() -> None:
    summary = run_training(RunConfig(nproc=2, zero=1, sdc_check_every=1, **{**SMALL, "steps": 4}), progress=False)
    assert summary["health"]["sdc"] == {"check_every": 1, "detections": []}
    assert summary["health"]["events"] == []


def test_fingerprints_see_one_bit_and_the_majority_names_the_odd_rank() -> None:
    weights = torch.linspace(-1, 1, 50, device="cpu")
    clean = fingerprint([weights], torch.device("cpu")).tolist()
    before, after = flip_bit(weights)
    assert before != after and torch.isfinite(weights).all()
    flipped = fingerprint([weights], torch.device("cpu")).tolist()
    assert flipped != clean
    assert compare_fingerprints([clean, flipped, clean], ["w"]) == [{"tensor": "w", "ranks": [1], "majority": True}]
    assert compare_fingerprints([clean, flipped], ["w"]) == [{"tensor": "w", "ranks": [0, 1], "majority": False}]
    assert compare_fingerprints([clean, clean], ["w"]) == []


@pytest.mark.parametrize("flags, message", [
    (["--sdc-check-every", "0"], "sdc_check_every must be a positive int, got 0"),
    (["--sdc-check-every", "-3"], "sdc_check_every must be a positive int, got -3"),
    (["--nproc", "2", "--zero", "3", "--sdc-check-every", "2"], "sdc_check_every=2 with zero=3"),
    (["--nproc", "2", "--inject-fault", "bitflip:rank=1"], "fault spec 'bitflip:rank=1' is malformed"),
    (["--nproc", "2", "--inject-fault", "bitflip:rank=2:step=1"], "names rank 2 but the run has ranks 0..1"),
])
def test_bad_input_is_one_line_before_spawning(flags: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--no-progress", "--steps", "4", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_bitflip_is_a_fault_kind_with_the_usual_spec() -> None:
    spec = parse_fault("bitflip:rank=1:step=3", nproc=2, steps=6)
    assert (spec.kind, spec.rank, spec.step) == ("bitflip", 1, 3)
    with pytest.raises(ValueError, match="malformed.*bitflip"):
        parse_fault("bitflip:step=3")
