"""The complete run report and ``workbench report``: memory per category and bytes per collective measured (from
the traces) beside theory, the configuration (what applies to the layout, the rest folded), checkpoint saves and
restarts on the loss curve, offline pages under 3 MB (plotly.js inlined once, compressed), runs compared side by
side, and a bad run directory as one line (exit 2) before anything is written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from workbench.cli import main, run_training
from workbench.theory.comm import dp_step_collectives
from workbench.theory.memory import model_state_bytes
from workbench.train import RunConfig
from workbench.viz.compare import load_run
from workbench.viz.report import (
    PLOTLY_ELEMENT_ID,
    applicable_settings,
    read_embedded_json,
    read_figures,
    read_plotly_js,
    write_report,
)

pytestmark = pytest.mark.timeout(300)

THREE_MB = 3_000_000
PLOTLY_JS_BANNER = "* plotly.js v"


def _offline_with_plotly_once(page: str) -> bool:
    """plotly.js is in the page once (compressed: ``report.plotly_js_payload``) and nothing is fetched."""
    return (page.count(f"id='{PLOTLY_ELEMENT_ID}'") == 1 and PLOTLY_JS_BANNER in read_plotly_js(page)[:300]
            and not re.search(r"<script[^>]*\ssrc=", page))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny 2-rank runs: bucketed DDP saving checkpoints every 2 steps, and ZeRO-3."""
    root = tmp_path_factory.mktemp("report_full")
    small = dict(nproc=2, steps=4, batch_size=8, seq_len=32)
    run_training(RunConfig(**small, ckpt_dir=str(root / "ckpt"), ckpt_every=2), out=root / "ddp", progress=False)
    run_training(RunConfig(**small, zero=3), out=root / "zero3", progress=False)
    return {"ddp": root / "ddp", "zero3": root / "zero3"}


def _load(run: Path) -> tuple[dict, list[dict], str]:
    return (json.loads((run / "summary.json").read_text()), json.loads((run / "traces.json").read_text()),
            (run / "report.html").read_text())


def _measured_by_axis_op(traces: list[dict], summary: dict, step: int, tags: set[str]) -> dict[tuple, int]:
    """From traces.json, independently of the report: the busiest rank's bytes per (axis, op) in ``step``."""
    axis_of = {tuple(sorted(g["ranks"])): g["axis"] for g in summary["comm_groups"]}
    best: dict[tuple, int] = {}
    for t in traces:
        per: dict[tuple, int] = {}
        for c in t["comms"]:
            if c["step"] == step and c["tag"] in tags:
                key = (axis_of[tuple(sorted(c["group"]))], c["op"])
                per[key] = per.get(key, 0) + c["nbytes"]
        for key, nbytes in per.items():
            best[key] = max(best.get(key, 0), nbytes)
    return best


@pytest.mark.parametrize("name, zero", [("ddp", 0), ("zero3", 3)])
def test_memory_beside_theory_holds_the_ledger_peaks(runs: dict[str, Path], name: str, zero: int) -> None:
    summary, traces, page = _load(runs[name])
    assert "memory per rank by category: measured (ledger peaks) beside theory" in page
    memory = read_embedded_json(page)["memory_vs_theory"]
    assert memory["available"], memory["why"]
    rows = {(r["rank"], r["category"]): r for r in memory["rows"]}
    theory = model_state_bytes(summary["n_params"], 2, zero, "fp32", "adamw")
    for t in traces:
        for category, peak in t["memory"]["peak"].items():
            row = rows[(t["rank"], category)]
            assert row["measured_bytes"] == peak  # the ledger's peak, as traces.json has it
            assert f"<td>{peak / 2**20:.3f}</td>" in page  # and in the table's text
        for category in ("parameters", "gradients", "optimizer_state"):
            # the tiny GPT's parameter count is even, so ZeRO's shards need no padding: exact
            assert rows[(t["rank"], category)]["theory_bytes"] == theory[category] == t["memory"]["peak"][category]
        activations = rows[(t["rank"], "activations")]
        assert activations["theory_bytes"] > 0
        assert activations["difference_bytes"] == activations["measured_bytes"] - activations["theory_bytes"]
    if zero == 3:  # ZeRO-3's gathered units are measured but not modelled, and the page says so
        assert rows[(0, "gathered_params")]["theory_bytes"] is None
        assert rows[(0, "gathered_params")]["measured_bytes"] > 0
        assert "Not modelled by theory: comm_buffers, gathered_params" in page


@pytest.mark.parametrize("name, zero", [("ddp", 0), ("zero3", 3)])
def test_comm_beside_theory_per_traced_step(runs: dict[str, Path], name: str, zero: int) -> None:
    summary, traces, page = _load(runs[name])
    assert "communication per traced step by mesh axis and collective: measured beside theory" in page
    comm = read_embedded_json(page)["comm_vs_theory"]
    assert comm["available"], comm["why"]
    expected_theory: dict[str, float] = {}
    for op, size in dp_step_collectives(summary["n_params"], 4, zero):
        expected_theory[op] = expected_theory.get(op, 0.0) + size
    steps = sorted({c["step"] for t in traces for c in t["comms"] if c["step"] is not None})
    assert steps == [0, 1, 2, 3]
    for step in steps:
        measured = _measured_by_axis_op(traces, summary, step, {"grad", "param"})
        rows = {(r["axis"], r["op"]): r for r in comm["rows"] if r["step"] == step}
        assert set(rows) == {("dp", op) for op in expected_theory}
        for (axis, op), row in rows.items():
            assert row["measured_bytes"] == measured[(axis, op)]
            assert row["theory_bytes"] == expected_theory[op]
            assert row["measured_bytes"] == row["theory_bytes"]  # this GPT's dp traffic is the textbook count
    unmodelled = {u["tag"] for u in comm["unmodelled"]}
    assert "metrics" in unmodelled  # the loss all-reduce of every step: a scalar theory leaves out
    assert "grad" not in unmodelled and "param" not in unmodelled


def test_report_has_configuration_checkpoints_and_plotly_once(runs: dict[str, Path]) -> None:
    summary, _, page = _load(runs["ddp"])
    assert "<h2>configuration</h2>" in page
    assert "<td>batch_size</td><td>8</td>" in page and "<td>seq_len</td><td>32</td>" in page
    assert read_embedded_json(page)["config"] == json.loads(json.dumps(summary["config"]))
    written = summary["checkpoint"]["written_steps"]
    assert written == [1, 3]
    assert "checkpoint saved" in page and f"checkpoints saved after step(s) {', '.join(map(str, written))}" in page
    assert "dashed lines on the loss curve" not in page  # no restarts listed: none drawn
    assert _offline_with_plotly_once(page)


@pytest.mark.parametrize("where", [{"at_step": 2}, {"last_step_done": 2, "rank": 1}])
def test_restarts_are_drawn_when_the_summary_lists_them(runs: dict[str, Path], tmp_path: Path, where: dict) -> None:
    summary, traces, _ = _load(runs["ddp"])
    summary["restarts"] = [{"attempt": 1, **where, "reason": "rank 1 died (injected)"}]
    page = write_report(tmp_path / "report.html", summary, traces).read_text()
    assert "restart 1 at step 2" in page and "rank 1 died (injected)" in page
    assert "<h3>restarts (dashed lines on the loss curve)</h3>" in page


def test_compare_page_holds_both_runs(runs: dict[str, Path], tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(runs["ddp"]), str(runs["zero3"])]) == 0
    page_path = tmp_path / "report-compare.html"  # the default: in the current directory
    assert str(page_path.name) in capsys.readouterr().out
    page = page_path.read_text()
    data = read_embedded_json(page, "workbench-compare-data")
    assert [r["strategy"] for r in data["runs"]] == ["bucketed DDP", "ZeRO-3"]
    for name, entry in zip(("ddp", "zero3"), data["runs"], strict=True):
        summary, traces, _ = _load(runs[name])
        assert entry["run"] in page and entry["losses"] == summary["losses"]
        assert entry["median tokens/s"] == summary["tokens_per_s"]
        assert entry["peak_memory_bytes"]["optimizer_state"] == max(t["memory"]["peak"]["optimizer_state"]
                                                                    for t in traces)
        steps = {c["step"] for t in traces for c in t["comms"] if c["step"] is not None}
        all_gather = max(sum(c["nbytes"] for c in t["comms"] if c["step"] is not None and c["op"] == "all_gather")
                         for t in traces) / len(steps)
        assert entry["bytes_per_collective"].get("all_gather", 0.0) == all_gather
    assert data["runs"][1]["bytes_per_collective"]["all_gather"] > 0  # ZeRO-3 gathers, DDP does not
    assert {"setting": "zero", data["runs"][0]["run"]: 0, data["runs"][1]["run"]: 3} in data["differences"]
    assert _offline_with_plotly_once(page) and len(page.encode()) < THREE_MB


#: The panels of a plain data-parallel report, by figure title (plotly JSON) and by section heading.
DDP_FIGURES = ["global-batch loss per step", None, "per-rank timeline of the last traced steps (bucketed DDP)",
               "bytes per collective and axis in step 49", "peak memory per rank: measured (ledger) vs theory"]
DDP_SECTIONS = ["<h2>communication in step 49 (from the log)</h2>", "measured beside theory</h2>",
                "<h2>per-rank step time: computing vs waiting</h2>", "<h2>memory per rank (the ledger",
                "<h2>memory per rank by category: measured (ledger peaks) beside theory</h2>",
                "<h2>configuration</h2>", "<details><summary>"]


@pytest.mark.extended  # 50 steps on 4 ranks (~25 s): the extended lane; the size rule is checked on the short run above
def test_report_of_a_50_step_4_rank_run_is_under_3_mb_with_every_panel(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_training(RunConfig(nproc=4, steps=50, batch_size=8, seq_len=32), out=out, progress=False)
    size = (out / "report.html").stat().st_size
    assert size <= THREE_MB, f"report.html is {size:,} bytes"
    page = (out / "report.html").read_text()
    assert _offline_with_plotly_once(page)
    figures = read_figures(page)
    titles = [(f["layout"].get("title") or {}).get("text") for f in figures]
    assert titles == DDP_FIGURES, titles
    assert len(figures[1]["data"]) == 4  # the metric curves: grad norm, learning rate, tokens/s, data wait
    assert figures[0]["data"][0]["x"] == list(range(50))
    assert all(section in page for section in DDP_SECTIONS)


def test_the_configuration_shows_what_applies_and_folds_the_rest(runs: dict[str, Path]) -> None:
    summary, _, page = _load(runs["ddp"])
    shown, folded = applicable_settings(summary["config"])
    assert set(shown) | set(folded) == set(summary["config"]) and not set(shown) & set(folded)
    # pure DDP: the pipeline's settings do not apply (RunConfig refuses them without pp > 1), checkpoints do
    for name in ("schedule", "microbatches", "virtual_stages", "moe_top_k", "cp_layout", "init_loss_scale"):
        assert name in folded and f"<td>{name}</td>" in page.split("<details>")[1]
        assert f"<td>{name}</td>" not in page.split("<h2>configuration</h2>")[1].split("<details>")[0]
    for name in ("nproc", "dp", "zero", "ckpt_dir", "ckpt_every", "ddp", "bucket_mb", "lr"):
        assert name in shown
    assert folded["schedule"] == "applies with a pipeline (pp > 1)" and folded["inject_fault"] == "off (not set)"
    pipeline = {**summary["config"], "pp": 2, "microbatches": 4, "ckpt_dir": None}
    shown, folded = applicable_settings(pipeline)
    assert {"schedule", "microbatches", "virtual_stages"} <= set(shown) and "ckpt_every" in folded


def test_tables_are_styled_and_figures_compact(runs: dict[str, Path]) -> None:
    _, _, page = _load(runs["ddp"])
    assert "<style>" in page and "table.wb th{" in page and "border=1" not in page
    assert page.count("<table class='wb'>") >= 5
    for figure in read_figures(page):  # floats rounded to 5 significant digits: a plot shows no more
        for trace in figure["data"]:
            for value in trace.get("y") or ():
                if isinstance(value, float):
                    assert float(f"{value:.5g}") == value


def _bad_dirs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    empty = tmp_path / "empty"
    empty.mkdir()
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "summary.json").write_text('{"config": ')
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "summary.json").write_text('{"strategy": "x"}')
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("not a run")
    return {"missing": (tmp_path / "no_such_run", "no such directory"),
            "empty": (empty, "has no summary.json"),
            "corrupt": (corrupt, "summary.json is not valid JSON"),
            "partial": (partial, "summary.json lacks config, history"),
            "file": (a_file, "is not a directory")}


@pytest.mark.parametrize("case", ["missing", "empty", "corrupt", "partial", "file"])
def test_bad_run_dir_is_one_line_exit_2_and_nothing_written(runs: dict[str, Path], tmp_path: Path, case: str,
                                                            capsys) -> None:
    path, message = _bad_dirs(tmp_path)[case]
    out = tmp_path / "page.html"
    assert main(["report", str(runs["ddp"]), str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and message in err, err
    assert "expected" in err and "Traceback" not in err
    assert not out.exists()


def test_a_run_without_traces_is_compared_without_its_bytes(runs: dict[str, Path], tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "summary.json").write_text((runs["ddp"] / "summary.json").read_text())
    run = load_run(bare)
    assert run.traces is None and "no traces.json" in run.notes[0]
    out = tmp_path / "cmp.html"
    assert main(["report", str(bare), str(runs["zero3"]), "--out", str(out)]) == 0
    data = read_embedded_json(out.read_text(), "workbench-compare-data")
    assert data["runs"][0]["bytes_per_collective"] is None and data["runs"][1]["bytes_per_collective"]
