"""A mixture of experts and expert parallelism through ``workbench run`` (issue 21 part 2, the wiring): flags,
composition, the trainer's routing metrics, summary.json, the report's section and ``workbench calc``'s rows.

* ``--nproc 4 --moe-experts 8 --moe-top-k 2 --moe-capacity-factor none --ep 4`` trains to the losses of
  ``--nproc 1`` with the same MoE flags; so do ``--ep 2`` on 4 ranks (EP x DP: two copies of each expert shard),
  ``--ep 2 --zero 1``, and MoE without EP on 2 ranks under DDP and ZeRO-1/2/3 (every rank holds every expert);
* with a capacity factor, every layer call's drops on a rank are the capacity rule's on its own tokens, and
  summary.json carries the per-step load per expert and dropped fraction; the report has the MoE section with rank
  0's all-to-all bytes measured = ``theory.expert``'s for the routing counted (exact: integers);
* bad input is refused before any rank starts, naming the value and what is valid; calc prints a Mixtral-shaped
  model's EP rows.

Tolerance (fp32, batch 8, seq_len 32, 4 AdamW steps, clip 1.0 on): ``RTOL`` = 1e-5 relative on every step's loss.
EP moves rows between ranks without arithmetic; what differs from one process is the order of sums (GEMMs over
other row counts, the gradients' all-reduce, the ranks' loss average, the clip norm's shares summed over the ep
group), a few eps per step, which Adam's normalised update can grow over steps (an update is ~lr whatever the
gradient's size). Measured here (x86 CPU): worst relative loss difference over 4 steps 9.6e-8 (ep 4), 1.9e-7
(ep 2, and ep 2 + ZeRO-1), 1.8e-7 (no EP, ZeRO-0..3 alike); RTOL leaves about 50x headroom.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from workbench import launch
from workbench.cli import main
from workbench.run import run_training
from workbench.theory.expert import all_to_all_bytes, dropped_assignments, expert_capacity
from workbench.training.config import RunConfig
from workbench.training.trainer import Trainer

pytestmark = [pytest.mark.timeout(240)]

MOE = dict(moe_experts=8, moe_top_k=2, moe_capacity_factor=None, steps=4, batch_size=8, seq_len=32, warmup=1,
           trace_steps=2)
RTOL = 1e-5


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def one() -> list[float]:
    return run_training(RunConfig(nproc=1, **MOE), progress=False)["losses"]


@pytest.fixture(scope="module")
def ep4(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ep4")
    summary = run_training(RunConfig(nproc=4, ep=4, **MOE), out=out, progress=False)
    return {"summary": summary, "out": out}


def _losses(configs: list[dict]) -> list[list[float]]:
    """Each config trained in turn on this launch's ranks (one launch for several runs: spawning is the slow part)."""
    out = []
    for kw in configs:
        trainer = Trainer(RunConfig(nproc=torch.distributed.get_world_size(), **{**MOE, **kw}))
        out.append([trainer.step()["loss"] for _ in range(MOE["steps"])])
    return out


def test_ep4_trains_to_the_losses_of_one_process(ep4, one):
    got = ep4["summary"]["losses"]
    assert _rel(got, one) <= RTOL, (got, one)
    assert ep4["summary"]["strategy"].startswith("EP=4 x DP=4")


def test_ep_times_dp_and_zero1_train_to_the_losses_of_one_process(one):
    ep2, ep2_zero1 = launch(_losses, 4, [dict(ep=2), dict(ep=2, zero=1)], device="cpu", timeout=120)[0]
    assert _rel(ep2, one) <= RTOL, (ep2, one)
    assert _rel(ep2_zero1, one) <= RTOL, (ep2_zero1, one)


def test_moe_without_ep_composes_with_ddp_and_every_zero_stage(one):
    runs = launch(_losses, 2, [dict(zero=z) for z in range(4)], device="cpu", timeout=120)[0]
    for zero, losses in enumerate(runs):
        assert _rel(losses, one) <= RTOL, (zero, losses, one)


def test_summary_and_report_carry_the_load_and_the_all_to_all_beside_theory(ep4):
    summary = json.loads((ep4["out"] / "summary.json").read_text())
    moe = summary["moe"]
    assert moe["experts"] == 8 and moe["ep"] == 4 and moe["ranks_counted"] == 4
    tokens = MOE["batch_size"] * MOE["seq_len"] * MOE["moe_top_k"] * 2  # assignments per step: 2 layers (tiny)
    for step in moe["per_step"]:
        assert len(step["tokens_per_expert"]) == 8 and sum(step["tokens_per_expert"]) == tokens
        assert step["dropped"] == 0 and step["dropped_fraction"] == 0.0
    a2a = moe["all_to_all"]
    assert [r["step"] for r in a2a] == [2, 3]
    for row in a2a:
        assert row["measured_bytes"] == row["theory_exact_bytes"] > 0
    groups = {g["axis"] for g in summary["comm_groups"]}
    assert "ep" in groups or "dp" in groups
    page = (ep4["out"] / "report.html").read_text()
    assert "mixture of experts: 8 experts, top-2" in page and "comm log beside theory.expert" in page


def test_capacity_drops_are_the_capacity_rules_per_rank_and_call(tmp_path):
    cfg = RunConfig(nproc=2, ep=2, **{**MOE, "moe_capacity_factor": 1.0})
    summary = run_training(cfg, out=tmp_path, progress=False)
    tokens = MOE["batch_size"] // 2 * MOE["seq_len"]  # one rank's tokens per layer call
    capacity = expert_capacity(tokens, 8, 2, 1.0)
    dropped_rank0 = 0
    for m in summary["history"]:
        for call in m["moe_calls"]:
            assert call["tokens"] == tokens and call["capacity"] == capacity
            assert sum(call["chosen"]) - sum(call["kept"]) == dropped_assignments(call["chosen"], capacity)
            assert call["kept"] == [min(c, capacity) for c in call["chosen"]]
        dropped_rank0 += m["moe_dropped"]
        assert m["moe_dropped_fraction"] == m["moe_dropped"] / sum(m["moe_tokens_per_expert"])
    per_step = summary["moe"]["per_step"]
    assert dropped_rank0 > 0 and sum(s["dropped"] for s in per_step) >= dropped_rank0
    assert all(0 < s["dropped_fraction"] < 1 for s in per_step if s["dropped"])
    assert math.isfinite(summary["losses"][-1])


@pytest.mark.parametrize("flags, message", [
    (["--moe-experts", "8", "--ep", "3", "--nproc", "3"], "ep=3 does not divide experts=8"),
    (["--moe-experts", "6", "--ep", "3", "--nproc", "2"], "does not divide the 2 data-parallel ranks"),
    (["--moe-experts", "4", "--moe-top-k", "5"], "moe top_k must be an int in [1, experts=4]"),
    (["--moe-experts", "4", "--moe-capacity-factor", "0"], "moe capacity_factor must be a finite number > 0"),
    (["--moe-experts", "4", "--moe-capacity-factor", "-1"], "got -1.0"),
    (["--moe-experts", "4", "--tp", "2", "--nproc", "2"], "a mixture of experts (moe_experts=4) composes with"),
    (["--moe-experts", "4", "--ep", "2", "--nproc", "2", "--zero", "2"], "expert parallelism (ep=2) composes with"),
    (["--ep", "2", "--nproc", "2"], "it needs moe_experts > 0"),
    (["--moe-top-k", "1"], "needs --moe-experts E > 0"),
    (["--moe-capacity-factor", "lots"], "expected a number > 0"),
])
def test_bad_moe_input_is_refused_before_spawning(flags, message, capsys, monkeypatch):
    monkeypatch.setattr("workbench.cli.run_training", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as info:
        main(["run", "--no-progress", *flags])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_calc_prints_ep_rows_for_a_mixtral_shaped_model(capsys):
    main(["calc", "--model", "mixtral-8x7B", "--nproc", "64", "--ep", "8", "--zero", "1", "--batch-size", "64",
          "--moe-capacity-factor", "1.25"])
    out = capsys.readouterr().out
    assert "8 experts of 176.2M parameters per layer" in out and "top-2, ep=8 over dp=64" in out
    assert "experts per rank 1 of 8, 8 copies of each shard" in out
    assert "capacity 1280 assignments per layer call" in out  # ceil(1.25 x 4096 x 2 / 8)
    assert "all-to-all" in out and "GB over 32 layers" in out
    with pytest.raises(SystemExit):
        main(["calc", "--model", "mixtral-8x7B", "--nproc", "64", "--ep", "3"])
    assert "ep=3 does not divide experts=8" in capsys.readouterr().err


def test_ep_in_bf16_sends_16_bit_rows_and_trains_as_one_bf16_process(tmp_path):
    """Under bf16 autocast the rows travel in bf16 (half the fp32 bytes: measured = theory to the byte with 2-byte
    values) and ep = 2 trains to the losses of one bf16 process. Tolerance 2e-3 relative: each side rounds the same
    rows' matmuls to bf16 (eps 2^-8) but may block them differently, and a loss averages those roundings over 256
    tokens (measured 1e-4 on x86, default ISA); the smallest step-to-step change of these losses is 7x larger."""
    bf16 = {**MOE, "precision": "bf16"}
    one = run_training(RunConfig(nproc=1, **bf16), progress=False)["losses"]
    summary = run_training(RunConfig(nproc=2, ep=2, **bf16), out=tmp_path, progress=False)
    assert _rel(summary["losses"], one) <= 2e-3, (summary["losses"], one)
    assert min(abs(a - b) / b for a, b in zip(one[1:], one, strict=False)) > 1e-2  # the bound is meaningful
    for row in summary["moe"]["all_to_all"]:
        assert row["measured_bytes"] == row["theory_exact_bytes"] > 0
    cfg = RunConfig(nproc=2, ep=2, **bf16).gpt_config()
    even16 = cfg.n_layer * all_to_all_bytes(MOE["batch_size"] // 2 * MOE["seq_len"], cfg.d_model, 2, 8, 2,
                                            bytes_per_value=2)["total"]
    assert all(row["theory_even_bytes"] == even16 for row in summary["moe"]["all_to_all"])
