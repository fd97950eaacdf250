"""Context parallelism as a user runs it: ``workbench run --cp`` (the equivalence with one process is in
tests/test_train_cli.py's strategy matrix), its traffic and memory beside theory in the report, ``workbench calc
--cp``, and the bad input refused before any rank starts.

Bytes are counts: the report's measured bytes per (axis, op) must equal theory's exactly (tolerance 0), the K/V
ring on the cp axis and the gradients (or ZeRO-3's gathers and reduce-scatters) over dp x cp on the dp row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.cli import main, run_training
from workbench.theory.context import ring_kv_bytes
from workbench.train import RunConfig
from workbench.viz.report import read_embedded_json

pytestmark = pytest.mark.timeout(300)

SMALL = dict(steps=2, batch_size=8, seq_len=32)


@pytest.fixture(scope="module")
def cp_zero3_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dp=2 x cp=2 with ZeRO-3: the ring on cp, the shards over all four ranks."""
    out = tmp_path_factory.mktemp("cp") / "run"
    run_training(RunConfig(nproc=4, cp=2, zero=3, **SMALL), out=out, progress=False)
    return out


def test_the_report_puts_the_ring_and_the_sharded_gradients_beside_theory(cp_zero3_run: Path) -> None:
    data = read_embedded_json((cp_zero3_run / "report.html").read_text())
    comm = data["comm_vs_theory"]
    assert comm["available"], comm["why"]
    rows = {(r["step"], r["axis"], r["op"]): r for r in comm["rows"]}
    # tiny GPT: 2 layers, 2 heads of 32 channels; one rank's micro-batch is 8 / dp = 4 sequences of 32 tokens
    ring = ring_kv_bytes(batch=4, heads=2, seq_len=32, head_dim=32, cp=2)
    per_step = 2 * (ring["forward_messages"] + ring["backward_kv_messages"]) * ring["kv_message"] \
        + 2 * ring["backward_grad_messages"] * ring["grad_message"]
    for step in (0, 1):
        for op in ("send", "recv"):
            row = rows[(step, "cp", op)]
            assert row["measured_bytes"] == row["theory_bytes"] == per_step
        for op in ("all_gather", "reduce_scatter"):  # ZeRO-3 over dp x cp = 4 ranks
            row = rows[(step, "dp", op)]
            assert row["measured_bytes"] == row["theory_bytes"] > 0
    memory = data["memory_vs_theory"]
    states = [r for r in memory["rows"] if r["category"] in ("parameters", "gradients", "optimizer_state")]
    assert states and all(r["measured_bytes"] == r["theory_bytes"] for r in states)  # sharded over 4, not 2


def test_the_summary_names_the_strategy_and_the_fused_group(cp_zero3_run: Path) -> None:
    summary = json.loads((cp_zero3_run / "summary.json").read_text())
    assert summary["strategy"].startswith("CP=2 (zigzag ring attention) + ZeRO-3")
    assert summary["mesh"]["cp"] == 2
    assert {"ranks": [0, 1, 2, 3], "axis": "dp_cp"} in summary["comm_groups"]


def test_calc_prices_a_long_context(capsys: pytest.CaptureFixture[str]) -> None:
    """A 128k context of a 70B model on 64 GPUs: without cp its activations cannot fit, with cp = 64 they do."""
    common = ["calc", "--model", "llama-70B", "--nproc", "64", "--seq-len", "131072", "--zero", "3",
              "--recompute", "full"]
    main([*common, "--batch-size", "64"])
    alone = capsys.readouterr().out
    main([*common, "--cp", "64", "--batch-size", "1"])
    split = capsys.readouterr().out
    assert "fits in 80 GiB: NO" in alone and "fits in 80 GiB: yes" in split
    assert "dp 1 x cp 64 (zigzag)" in split
    assert [line.split()[0] for line in split.splitlines() if "GB sent per rank" in line] == ["dp", "cp"]


def test_the_ring_carries_only_the_kv_heads_of_grouped_query_attention() -> None:
    """llama-70B has 64 query heads and 8 K/V heads (GQA): the ring moves 8 heads' K and V, 1/8 of the naive count."""
    from workbench.theory.parallelism import Layout, layout_comm

    comm = layout_comm("llama-70B", Layout(cp=64), "bf16-mixed", micro_batch=1, seq_len=131072)["cp"]
    ring = ring_kv_bytes(batch=1, heads=8, seq_len=131072, head_dim=128, cp=64, bytes_per_value=2)
    assert comm["tensor_bytes"] == 80 * ring["total"]  # 80 layers, one micro-batch, nothing recomputed


@pytest.mark.parametrize("flags, message", [
    (dict(nproc=3, cp=3, seq_len=32), "not divisible into 2*cp=6 chunks"),
    (dict(nproc=2, cp=2, seq_len=33, cp_layout="contiguous"), "not divisible into cp=2 chunks"),
    (dict(nproc=2, cp=2, cp_layout="striped"), "unknown context-parallel layout 'striped'"),
    (dict(nproc=4, cp=2, tp=2), "context parallelism (cp=2) composes with"),
    (dict(nproc=4, cp=2, pp=2), "context parallelism (cp=2) composes with"),
    (dict(nproc=2, cp=2, recompute="selective"), "ring attention already keeps only q, k, v"),
    (dict(nproc=2, cp=2, val_every=1), "val_every=1 with cp=2"),
    (dict(nproc=4, cp=3), "dp x tp x pp x cp"),
])
def test_bad_context_parallel_input_is_refused_before_ranks_start(flags: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        RunConfig(**{"batch_size": 8, **flags})
    assert message in str(info.value)
