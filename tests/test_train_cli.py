"""The training loop and `workbench run`: validation, schedule, summary/report, and strategy equivalence."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from workbench.cli import main, run_training
from workbench.launch import launch
from workbench.train import RunConfig, lr_at, params_sha256, train_rank

pytestmark = pytest.mark.timeout(300)

# Loss of the same global batch, one process vs N ranks: fp32 sums in a different order, amplified by a few
# AdamW steps; measured differences are ~1e-6, the bound leaves room for other BLAS paths. Relative to the loss
# (a mean of positive terms, whose rounding in any order is relative to it), so it holds whatever order a CPU's
# vector width sums in; a step on wrong gradients moves the loss by ~1e-2 relative.
LOSS_RTOL = 2e-4


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_size=6, nproc=4), "multiple of dp x grad_accum"),
    (dict(batch_size=8, nproc=2, grad_accum=3), "multiple of dp x grad_accum"),
    (dict(ddp="fast"), "ddp='fast'; valid: naive, flat, overlap, bucketed"),
    (dict(zero=4), "zero=4"),
    (dict(bucket_mb=0), "bucket_mb must be > 0 MiB, or None for one bucket, got 0"),
    (dict(bucket_mb="none"), "bucket_mb must be > 0 MiB, or None for one bucket, got none"),
    (dict(model="huge"), "unknown model 'huge'"),
    (dict(steps=0), "steps must be a positive int"),
    (dict(precision="fp16", init_loss_scale=0.5), "init_loss_scale must be a finite number >= 1"),
    (dict(precision="fp16", loss_scale_growth_interval=0), "loss_scale_growth_interval must be a positive int"),
    (dict(offload=True), "offload needs a ZeRO stage"),
    (dict(nproc=2, dp=4), "dp x tp x pp = 4 x 1 x 1 = 4 but nproc=2"),
    (dict(nproc=4, tp=3), "dp x tp x pp = 1 x 3 x 1 = 3 but nproc=4"),
    (dict(nproc=3, tp=3), "tp=3 must divide the GPT's n_head"),
    (dict(nproc=2, tp=0), "tp must be a positive int"),
    (dict(nproc=2, tp=2, sp=True, seq_len=33), "seq_len"),
    (dict(nproc=1, sp=True), "sp \\(sequence parallelism\\) needs tp > 1"),
    (dict(nproc=2, pp=2, schedule="2f2b"), "unknown pipeline schedule '2f2b'; valid: naive, gpipe, 1f1b"),
    (dict(nproc=4, pp=4), "stages"),
    (dict(nproc=2, pp=2, microbatches=1), "micro-batches"),
    (dict(nproc=2, pp=2, schedule="interleaved", virtual_stages=2), "4 pipeline stages but the model has only 2"),
    (dict(nproc=2, pp=2, schedule="interleaved", virtual_stages=2, model="small", microbatches=3),
     "multiple of"),
    (dict(nproc=2, pp=2, zero=2), "ZeRO-2/3 would communicate once per micro-batch"),
    (dict(nproc=2, pp=2, batch_size=6, microbatches=4), "batch_size=6 must divide into dp x microbatches"),
    (dict(nproc=1, microbatches=4), "pipeline settings: they need pp > 1"),
    (dict(recompute="partial"), "unknown recompute mode 'partial'; valid modes: 'none', 'selective', 'full'"),
    (dict(recompute=None), "unknown recompute mode None"),
])
def test_bad_config_is_rejected_before_spawning(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunConfig(**kwargs)


def test_cli_bad_flag_exits_with_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--nproc", "3", "--batch-size", "16", "--no-progress"])
    assert info.value.code == 2
    assert "batch_size=16 must be a positive multiple of dp x grad_accum = 3 x 1" in capsys.readouterr().err


def test_lr_schedule_warms_up_then_decays_to_min() -> None:
    cfg = RunConfig(steps=20, warmup=4, lr=1.0, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert lrs[-1] == pytest.approx(0.1)  # a cosine in Python floats: no tensor sums, the same on any CPU


def test_the_loss_scalers_settings_reach_the_ranks() -> None:
    """``init_loss_scale`` starts fp16's scaler there; with a growth interval of 2 it doubles after every 2 clean
    steps (each step reports the scale its gradients were scaled by)."""
    summary = run_training(RunConfig(nproc=1, steps=4, batch_size=4, seq_len=16, precision="fp16",
                                     init_loss_scale=1024.0, loss_scale_growth_interval=2), progress=False)
    assert [m["skipped"] for m in summary["history"]] == [False] * 4
    assert [m["loss_scale"] for m in summary["history"]] == [1024.0, 1024.0, 2048.0, 2048.0]


def test_params_sha256_depends_on_values_and_names() -> None:
    a = {"w": torch.ones(3), "b": torch.zeros(2)}
    assert params_sha256(a) == params_sha256(dict(reversed(list(a.items()))))
    assert params_sha256(a) != params_sha256({"w": torch.ones(3), "c": torch.zeros(2)})
    assert params_sha256(a) != params_sha256({"w": torch.ones(3) * 1.0001, "b": torch.zeros(2)})


@pytest.fixture(scope="module")
def baseline() -> dict:
    return run_training(RunConfig(nproc=1, steps=4, batch_size=8, seq_len=32), progress=False)


def test_run_writes_summary_and_report(tmp_path) -> None:
    cfg = RunConfig(nproc=2, steps=4, batch_size=8, seq_len=32)
    run_training(cfg, tmp_path, progress=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["nproc"] == 2 and len(summary["losses"]) == 4
    assert len(summary["final_params_sha256"]) == 64 and summary["tokens_per_s"] > 0
    assert summary["losses"][-1] < summary["losses"][0]
    assert all(0 <= m["data_wait_s"] <= m["step_time_s"] for m in summary["history"]), "data wait: a part of a step"
    assert summary["data_wait_s"] <= summary["step_time_s"]
    report = (tmp_path / "report.html").read_text()
    assert "rank 1" in report and "all_reduce" in report and "plotly" in report.lower()
    assert "data wait (s)" in report
    traces = json.loads((tmp_path / "traces.json").read_text())
    spans = {s["category"] for s in traces[1]["spans"]}
    assert {"forward", "backward", "optimizer"} <= spans


def test_cli_bucket_mb_none_is_one_bucket(tmp_path) -> None:
    """``--bucket-mb none`` reaches the config as None (BucketedDDP's one bucket) and the run trains."""
    assert main(["run", "--nproc", "2", "--steps", "2", "--batch-size", "4", "--seq-len", "16", "--no-progress",
                 "--bucket-mb", "none", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["bucket_mb"] is None and len(summary["losses"]) == 2


def test_same_seed_same_run_different_seed_differs(baseline: dict) -> None:
    again = run_training(RunConfig(nproc=1, steps=4, batch_size=8, seq_len=32), progress=False)
    assert again["losses"] == baseline["losses"]
    assert again["final_params_sha256"] == baseline["final_params_sha256"]
    other = run_training(RunConfig(nproc=1, steps=4, batch_size=8, seq_len=32, seed=1), progress=False)
    assert other["final_params_sha256"] != baseline["final_params_sha256"]


STRATEGIES = [
    dict(nproc=2, ddp="naive"), dict(nproc=2, ddp="flat"), dict(nproc=2, ddp="overlap"),
    dict(nproc=2, ddp="bucketed", bucket_mb=0.05), dict(nproc=2, ddp="bucketed", bucket_mb=None),
    dict(nproc=4, ddp="bucketed"),
    dict(nproc=2, grad_accum=2), dict(nproc=2, zero=1), dict(nproc=2, zero=2), dict(nproc=2, zero=3),
    dict(nproc=4, zero=3, grad_accum=2), dict(nproc=2, zero=3, offload=True), dict(nproc=2, zero=1, offload=True),
    dict(nproc=2, tp=2), dict(nproc=4, tp=2, ddp="bucketed"), dict(nproc=4, tp=2, zero=1, grad_accum=2),
    dict(nproc=2, tp=2, sp=True), dict(nproc=4, tp=2, sp=True, zero=1),
    dict(nproc=4, tp=2, zero=2), dict(nproc=4, tp=2, sp=True, zero=2), dict(nproc=4, tp=2, zero=3, grad_accum=2),
    dict(nproc=4, tp=2, sp=True, zero=3), dict(nproc=4, tp=2, zero=3, offload=True),
    dict(nproc=2, pp=2, schedule="naive", microbatches=2), dict(nproc=2, pp=2, schedule="gpipe", microbatches=4),
    dict(nproc=2, pp=2, schedule="1f1b", microbatches=4), dict(nproc=2, pp=2, schedule="zb", microbatches=4),
    dict(nproc=4, pp=2, microbatches=2), dict(nproc=4, pp=2, schedule="gpipe", microbatches=4, zero=1),
    dict(nproc=4, tp=2, pp=2, schedule="zb", microbatches=4),
    dict(nproc=4, tp=2, sp=True, pp=2, schedule="1f1b", microbatches=4),
    dict(nproc=8, dp=2, tp=2, pp=2, schedule="1f1b", microbatches=4),  # the 3D command
    dict(nproc=2, recompute="full"), dict(nproc=2, tp=2, recompute="selective"),
    dict(nproc=2, tp=2, sp=True, recompute="full"), dict(nproc=2, zero=3, recompute="full"),
    dict(nproc=2, pp=2, schedule="1f1b", microbatches=4, recompute="full"),
    # context parallelism (ring attention): alone, over both layouts, with dp and every ZeRO stage, recomputed
    dict(nproc=4, cp=4), dict(nproc=4, cp=4, cp_layout="contiguous"), dict(nproc=2, cp=2, grad_accum=2),
    dict(nproc=4, cp=2, zero=1), dict(nproc=4, cp=2, zero=2), dict(nproc=4, cp=2, zero=3),
    dict(nproc=2, cp=2, recompute="full"),
]


def _train_each(cfgs: list[RunConfig]) -> list[list[dict]]:
    """Train each config in turn on these ranks: one launch for many runs (spawning ranks and importing torch
    costs more than 4 tiny steps). Each run builds its own Trainer, mesh and process groups, as a launch would."""
    return [train_rank(cfg)["history"] for cfg in cfgs]


@pytest.fixture(scope="module")
def strategy_histories() -> Callable[[int], list[dict]]:
    """Rank 0's per-step metrics of ``STRATEGIES[i]``; every strategy with the same nproc trains in one launch,
    started when the first of them is asked for (so no single test waits for all of them)."""
    done: dict[int, list[dict]] = {}

    def history(i: int) -> list[dict]:
        if i not in done:
            nproc = STRATEGIES[i]["nproc"]
            same = [j for j, flags in enumerate(STRATEGIES) if flags["nproc"] == nproc]
            cfgs = [RunConfig(steps=4, batch_size=8, seq_len=32, **STRATEGIES[j]) for j in same]
            done.update(zip(same, launch(_train_each, nproc, cfgs, timeout=240)[0], strict=True))
        return done[i]
    return history


@pytest.mark.parametrize("i", range(len(STRATEGIES)),
                         ids=["-".join(f"{k}{v}" for k, v in f.items()) for f in STRATEGIES])
def test_every_strategy_matches_single_process_loss(i: int, strategy_histories: Callable, baseline: dict) -> None:
    """Losses, and the gradient norm each step clips by (clip=1.0 binds: the norms are ~2-3), as one process."""
    history = strategy_histories(i)
    torch.testing.assert_close(torch.tensor([m["loss"] for m in history]), torch.tensor(baseline["losses"]),
                               rtol=LOSS_RTOL, atol=0)
    norms = [[h["grad_norm"] for h in run] for run in (history, baseline["history"])]
    assert min(norms[1]) > 1.0, "clipping should bind in this test"
    torch.testing.assert_close(torch.tensor(norms[0]), torch.tensor(norms[1]), rtol=LOSS_RTOL, atol=0)


def test_cli_subprocess_end_to_end(tmp_path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "run", "--nproc", "2", "--steps", "3",
                           "--batch-size", "4", "--seq-len", "32", "--out", str(out)],
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final_params_sha256" in proc.stdout and (out / "report.html").exists()
    assert "training on 2 rank(s)" in proc.stderr  # the progress bar


@pytest.mark.extended  # torchrun's agent and rendezvous: ~20 s; the extended lane runs it
def test_same_run_under_torchrun_matches_launch(tmp_path) -> None:
    """The cluster path (torchrun, env://) trains exactly what the notebook path trains (2 ranks: a + b is
    commutative in fp32, so the runs agree bit for bit)."""
    import os

    flags = ["run", "--steps", "3", "--batch-size", "4", "--seq-len", "32", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cli = [sys.executable, "-m", "workbench.cli"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                "workbench.cli"]
    shas = []
    for prefix, extra, out in ((cli, ["--nproc", "2"], "launched"), (torchrun, [], "torchrun")):
        proc = subprocess.run([*prefix, *flags, *extra, "--out", str(tmp_path / out)], capture_output=True,
                              text=True, timeout=200, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        shas.append(json.loads((tmp_path / out / "summary.json").read_text())["final_params_sha256"])
    assert shas[0] == shas[1]


def test_memory_ledger_of_single_process_matches_tensors(baseline: dict) -> None:
    peak = baseline["memory_peak_bytes"][0]
    n = baseline["n_params"]
    assert peak["parameters"] == 4 * n and peak["gradients"] == 4 * n
    assert peak["optimizer_state"] == 8 * n  # AdamW: exp_avg + exp_avg_sq, fp32
    assert peak["activations"] > 0


def test_cli_calc_prints_per_rank_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calc", "--model", "llama-7B", "--dp", "8", "--zero", "3"]) == 0
    out = capsys.readouterr().out
    assert "16Ψ/N" in out and "total per rank" in out
    total = float(out.split("total per rank")[1].split()[0])
    assert total == pytest.approx(6_738_415_616 * 16 / 8 / 2**30, rel=1e-3)  # printed to 2 decimals of GiB
