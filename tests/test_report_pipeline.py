"""summary.json and report.html of a pipeline run: the mesh, the bubble measured beside theory, the timeline
labelled by micro-batch, per-stage activation memory; and the comm table naming each collective's mesh axis."""

from __future__ import annotations

import json

import pytest

from workbench.cli import comm_group_labels, run_training
from workbench.train import RunConfig
from workbench.viz.timeline import comm_table

pytestmark = pytest.mark.timeout(200)


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("pp_run")
    cfg = RunConfig(nproc=2, pp=2, schedule="1f1b", microbatches=4, steps=3, batch_size=8, seq_len=32)
    run_training(cfg, out=out, progress=False)
    return json.loads((out / "summary.json").read_text()), (out / "report.html").read_text()


def test_summary_records_mesh_and_pipeline(pipeline_run: tuple[dict, str]) -> None:
    summary, _ = pipeline_run
    assert summary["mesh"] == {"pp": 2, "dp": 1, "cp": 1, "tp": 1}
    pipe = summary["pipeline"]
    assert (pipe["schedule"], pipe["microbatches"], pipe["virtual_stages"]) == ("1f1b", 4, 1)
    assert pipe["bubble_theory"] == 0.2  # (p-1)/(m+p-1) = 1/5
    assert 0.0 <= pipe["bubble_measured"] <= 1.0
    peaks = pipe["peak_activation_bytes_per_rank"]
    assert len(peaks) == 2 and all(b > 0 for b in peaks)
    assert pipe["peak_activation_bytes_per_stage"] == peaks  # one stage per rank when v = 1


def test_report_shows_bubble_microbatches_and_stage_memory(pipeline_run: tuple[dict, str]) -> None:
    summary, report = pipeline_run
    pipe = summary["pipeline"]
    assert f"measured {pipe['bubble_measured']:.1%}" in report
    assert "theory 20.0%" in report
    assert "F mb0" in report and "B mb3" in report
    assert "peak activation memory per stage" in report
    assert "peak activations (MiB)" in report
    assert '"idle"' in report  # the idle gaps are drawn as their own bars


def test_group_labels_name_the_axes() -> None:
    labels = {tuple(g["ranks"]): g["axis"] for g in comm_group_labels({"pp": 2, "dp": 2, "cp": 1, "tp": 2})}
    assert labels[(0, 1)] == "tp" and labels[(0, 2)] == "dp" and labels[(0, 4)] == "pp"
    assert labels[tuple(range(8))] == "world"


def test_comm_table_labels_the_gradient_all_reduce_dp(tmp_path) -> None:
    summary = run_training(RunConfig(nproc=2, steps=2, batch_size=8, seq_len=32), out=tmp_path, progress=False)
    assert summary["mesh"] == {"pp": 1, "dp": 2, "cp": 1, "tp": 1}
    traces = json.loads((tmp_path / "traces.json").read_text())
    rows = comm_table(traces, group_labels=summary["comm_groups"])
    all_reduce = [r for r in rows if r["op"] == "all_reduce"]
    assert all_reduce and all(r["group"] == "dp" for r in all_reduce)
    assert "<td>dp</td>" in (tmp_path / "report.html").read_text()
