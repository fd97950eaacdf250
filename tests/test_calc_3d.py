"""`workbench calc` takes `workbench run`'s strategy flags and prints theory.parallelism's memory, bubble, traffic."""

from __future__ import annotations

import argparse
import re

import pytest

from workbench.cli import build_parser, main
from workbench.theory.parallelism import Layout, Link, analyze_layout
from workbench.train import RunConfig

STRATEGY_FLAGS = ("--nproc", "--dp", "--tp", "--sp", "--pp", "--schedule", "--microbatches", "--virtual-stages",
                  "--zero", "--offload", "--batch-size", "--seq-len")
EXAMPLE = ["calc", "--model", "llama-70B", "--nproc", "64", "--tp", "8", "--pp", "4", "--zero", "1",
           "--schedule", "1f1b", "--microbatches", "16"]


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings}


def test_run_and_calc_share_the_strategy_flags() -> None:
    run, calc = _actions(_subparser("run")), _actions(_subparser("calc"))
    for flag in STRATEGY_FLAGS:
        a, b = run[flag], calc[flag]
        assert (type(a), a.dest, a.type, a.choices, a.help) == (type(b), b.dest, b.type, b.choices, b.help), flag
        if flag != "--batch-size":  # calc has no default batch: activations are then left out
            assert a.default == b.default, flag
    assert run["--batch-size"].default == 16 and calc["--batch-size"].default is None


def test_calc_resolves_dp_and_microbatches_as_run_does(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = RunConfig(nproc=8, tp=2, pp=2)
    assert main(["calc", "--model", "llama-7B", "--nproc", "8", "--tp", "2", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert f"nproc=8 = dp {cfg.dp} x tp 2 x pp 2" in out
    assert f"pp=2, {cfg.microbatches} micro-batch(es)" in out


# `calc` prints GiB and ms with 2 decimals, so abs=0.01 below is that printing's rounding; theory is Python
# float arithmetic, no tensor sums, so no instruction set changes it.
def _number(out: str, label: str) -> float:
    return float(re.search(rf"{label}\s+([\d.]+)", out).group(1))


def test_the_example_prints_memory_fit_bubble_and_traffic(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(EXAMPLE) == 0
    out = capsys.readouterr().out
    layout = Layout(dp=2, tp=8, pp=4, zero_stage=1, microbatches=16)
    theory = analyze_layout("llama-70B", layout)
    for category, nbytes in theory["memory"]["per_rank"].items():
        assert _number(out, category) == pytest.approx(nbytes / 2**30, abs=0.01)
    assert _number(out, "total per rank") == pytest.approx(theory["memory"]["total"] / 2**30, abs=0.01)
    assert "fits in 80 GiB: yes" in out
    assert f"bubble {theory['bubble']:.1%}" in out and "[4, 3, 2, 1]" in out
    for axis in ("dp", "tp", "pp"):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"{axis} "))
        ms = float(line.split(" ms")[0].split()[-1])
        assert ms == pytest.approx(theory["comm"][axis]["time_s"] * 1e3, abs=0.01), line
    assert "activations not counted" in out


def test_batch_size_counts_activations_of_the_worst_stage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*EXAMPLE, "--batch-size", "64", "--sp"]) == 0
    out = capsys.readouterr().out
    layout = Layout(dp=2, tp=8, pp=4, sp=True, zero_stage=1, microbatches=16)
    theory = analyze_layout("llama-70B", layout, micro_batch=2)  # 64 sequences / (dp 2 x 16 micro-batches)
    assert theory["memory"]["worst"] == 0  # rank 0 holds 4 micro-batches of activations
    assert "micro-batch: 2 sequence(s) per rank" in out
    assert _number(out, "activations") == pytest.approx(theory["memory"]["per_rank"]["activations"] / 2**30, abs=0.01)
    assert "activations not counted" not in out


def test_links_override_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*EXAMPLE, "--tp-link", "100,2"]) == 0
    out = capsys.readouterr().out
    theory = analyze_layout("llama-70B", Layout(dp=2, tp=8, pp=4, zero_stage=1, microbatches=16),
                            links={"tp": Link(alpha=2e-6, bandwidth=100e9)})
    line = next(x for x in out.splitlines() if x.strip().startswith("tp "))
    assert "100 GB/s, 2 µs" in line
    assert float(line.split(" ms")[0].split()[-1]) == pytest.approx(theory["comm"]["tp"]["time_s"] * 1e3, abs=0.01)


def test_plain_data_parallel_calc_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calc", "--model", "llama-7B", "--dp", "8", "--zero", "3"]) == 0
    out = capsys.readouterr().out
    assert "16Ψ/N" in out and "bubble 0.0%" in out and "tp     1 rank   no traffic" in out
    assert _number(out, "total per rank") == pytest.approx(6_738_415_616 * 16 / 8 / 2**30, abs=0.01)


@pytest.mark.parametrize("flags, message", [
    (["--tp", "3"], "tp=3 must divide the model's n_head=32"),
    (["--pp", "33"], "33 pipeline stages but the model has only 32 layers"),
    (["--nproc", "16", "--dp", "2", "--tp", "2"], "dp x tp x pp = 2 x 2 x 1 = 4 but nproc=16"),
    (["--nproc", "0"], "nproc must be a positive int, got 0"),
    (["--sp"], "sp (sequence parallelism) needs tp > 1"),
    (["--pp", "4", "--microbatches", "2"], "needs at least as many micro-batches as stages"),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatches", "3"], "multiple of pp=2"),
    (["--schedule", "2f2b"], "invalid choice: '2f2b'"),
    (["--dp", "2", "--pp", "2", "--batch-size", "6"], "batch_size=6 must divide into dp x microbatches = 2 x 4"),
    (["--seq-len", "0"], "seq_len must be a positive int"),
    (["--model", "gpt-5"], "unknown model 'gpt-5'"),
    (["--dp-link", "fast"], "expected BANDWIDTH_GBPS,LATENCY_US"),
    (["--zero", "4"], "invalid choice: 4"),
])
def test_bad_layout_is_one_line_exit_2(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["calc", "--model", "llama-7B", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # the usage, then one line: the error
    assert "error:" in last and message in last, err
    assert "Traceback" not in err and err.count("error:") == 1


@pytest.mark.parametrize("memory_layout", ["classic", "amp"])
def test_calc_prices_and_names_the_memory_layout(memory_layout: str, capsys: pytest.CaptureFixture[str]) -> None:
    """ZeRO-1 in bf16: the classic layout keeps 2 + 2 bytes a parameter replicated, the trainer's amp 4 + 4."""
    from workbench.theory.memory import model_state_bytes

    assert main(["calc", "--model", "llama-7B", "--nproc", "8", "--zero", "1", "--precision", "bf16",
                 "--memory-layout", memory_layout]) == 0
    out = capsys.readouterr().out
    assert f"bf16 ({memory_layout} layout)" in out and f"note: memory layout {memory_layout!r}" in out
    n = 6_738_415_616
    for category, nbytes in model_state_bytes(n, 8, 1, "bf16", memory_layout=memory_layout).items():
        assert _number(out, category) == pytest.approx(nbytes / 2**30, abs=0.01)  # printed with 2 decimals
