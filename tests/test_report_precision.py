"""report.html for mixed precision and devices: fp16's loss-scale panel (log axis) with the skipped steps marked
on it and on the loss curve, from a real fp16 run with a planted overflow, absent from real fp32 and bf16 runs'
reports; and the CUDA allocator's figures with the GPU's utilisation beside the ledger (synthetic traces here,
the recording itself on a GPU)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from workbench import launch, trace
from workbench.cli import summarize, write_outputs
from workbench.trace import DeviceMemory, Trace
from workbench.train import RunConfig, Trainer, params_sha256
from workbench.viz.report import (
    SKIPPED_NAME,
    loss_curve,
    loss_scale_curve,
    loss_scale_trace,
    memory_section,
    read_embedded_json,
    write_report,
)

pytestmark = pytest.mark.timeout(300)

SMALL = dict(nproc=1, model="tiny", steps=5, batch_size=8, seq_len=32)
PLANTED_STEP = 2  # fp16: an inf planted in one gradient after the sync of this step
PANEL_TITLE = "fp16 loss scale per step (log axis), skipped steps marked"


def _train(cfg: RunConfig, plant_at: int | None) -> tuple[dict, Trace]:
    """Train ``cfg`` on this rank under a tracer of its own; with ``plant_at``, an inf lands in a gradient of
    that step (what an fp16 overflow leaves). Returns what ``train_rank`` would for rank 0, and the trace."""
    tracer = trace.Tracer(rank=0, world_size=1)
    with trace.tracing(tracer):
        trainer = Trainer(cfg)
        s = trainer.strategy
        sync = s.finish_grad_sync

        def finish_and_plant() -> None:
            sync()
            if trainer.step_index == plant_at:
                grad = next(p.grad for p in s.model.parameters() if p.grad is not None)
                grad.view(-1)[0] = math.inf

        s.finish_grad_sync = finish_and_plant
        history = [trainer.step() for _ in range(cfg.steps)]
        full = s.full_parameters()
    rank0 = {"history": history, "strategy": s.describe, "n_params": trainer.n_params,
             "final_params_sha256": params_sha256(full), "placement": None}
    return rank0, tracer.trace


def _train_all(cfgs: dict[str, RunConfig]) -> dict[str, tuple[dict, Trace]]:
    return {name: _train(cfg, PLANTED_STEP if cfg.precision == "fp16" else None) for name, cfg in cfgs.items()}


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Real fp16 (overflow planted), fp32 and bf16 runs on one rank (one launch), written as ``workbench run``
    writes them (``cli.summarize`` + ``cli.write_outputs``)."""
    root = tmp_path_factory.mktemp("report_precision")
    cfgs = {p: RunConfig(precision=p, **SMALL) for p in ("fp16", "fp32", "bf16")}
    runs = launch(_train_all, 1, cfgs, timeout=240)[0]
    out = {}
    for name, (rank0, tr) in runs.items():
        summary = summarize(cfgs[name], rank0, [tr])
        write_outputs(root / name, summary, [tr])
        out[name] = {"summary": summary, "trace": tr, "page": (root / name / "report.html").read_text(),
                     "dir": root / name}
    return out


def test_fp16_report_has_the_loss_scale_panel_and_marks_the_skipped_step(reports: dict[str, dict]) -> None:
    run = reports["fp16"]
    history = run["summary"]["history"]
    # the run really overflowed once: that step was skipped and the scale backed off after it
    assert [m["skipped"] for m in history] == [i == PLANTED_STEP for i in range(SMALL["steps"])]
    scales = [m["loss_scale"] for m in history]
    assert scales[PLANTED_STEP + 1] == scales[PLANTED_STEP] / 2
    page = run["page"]
    assert PANEL_TITLE in page
    assert '"type":"log"' in page  # the panel's y axis (no other figure of the report is logarithmic)
    # marked twice: on the loss curve and on the loss-scale panel
    assert page.count(f'"name":"{SKIPPED_NAME}"') == 2
    assert f"1 of {SMALL['steps']} steps skipped (step {PLANTED_STEP})" in page
    data = read_embedded_json(page)["loss_scale"]
    assert data == {"shown": True, "steps": list(range(SMALL["steps"])), "loss_scale": scales,
                    "skipped_steps": [PLANTED_STEP]}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_no_loss_scale_panel_without_loss_scaling(reports: dict[str, dict], precision: str) -> None:
    run = reports[precision]
    assert all(m["loss_scale"] == 1.0 and not m["skipped"] for m in run["summary"]["history"])
    page = run["page"]
    assert PANEL_TITLE not in page
    assert '"type":"log"' not in page
    assert SKIPPED_NAME not in page
    assert "dynamic loss scaling" not in page
    assert read_embedded_json(page)["loss_scale"]["shown"] is False


def test_report_rebuilt_from_summary_json_keeps_the_panel(reports: dict[str, dict], tmp_path: Path) -> None:
    """``workbench report`` rebuilds the page from summary.json, where a skipped step's NaN grad norm is null."""
    from workbench.viz.compare import load_run

    run = load_run(reports["fp16"]["dir"])
    summary, traces = run.summary, run.traces
    assert any(m["grad_norm"] is None for m in summary["history"])
    page = write_report(tmp_path / "report.html", summary, traces).read_text()
    assert PANEL_TITLE in page and page.count(f'"name":"{SKIPPED_NAME}"') == 2


def test_the_figures_themselves() -> None:
    history = [{"step": s, "loss": 5.0 - s, "loss_scale": 2.0 ** 16 if s < 2 else 2.0 ** 15, "skipped": s == 1}
               for s in range(4)]
    scaler = loss_scale_trace(history)
    assert scaler["shown"] and scaler["skipped_steps"] == [1]
    panel = loss_scale_curve(scaler)
    assert panel.layout.yaxis.type == "log"
    marks = [t for t in panel.data if t.name == SKIPPED_NAME]
    assert len(marks) == 1 and list(marks[0].x) == [1] and list(marks[0].y) == [2.0 ** 16]
    curve = loss_curve(history, skipped_steps=scaler["skipped_steps"])
    marks = [t for t in curve.data if t.name == SKIPPED_NAME]
    assert len(marks) == 1 and list(marks[0].x) == [1] and list(marks[0].y) == [4.0]
    # a NaN loss on the skipped step still gets a mark, at the lowest finite loss
    nan_loss = [{**m, "loss": math.nan} if m["step"] == 1 else m for m in history]
    marks = [t for t in loss_curve(nan_loss, skipped_steps=[1]).data if t.name == SKIPPED_NAME]
    assert list(marks[0].y) == [2.0]
    # fp32/bf16 metrics (scale 1, nothing skipped): no panel, unless the config says fp16
    plain = [{**m, "loss_scale": 1.0, "skipped": False} for m in history]
    assert not loss_scale_trace(plain)["shown"] and not loss_scale_trace(plain, "bf16")["shown"]
    assert loss_scale_trace(plain, "fp16")["shown"]
    assert not loss_scale_trace([{"step": 0, "loss": 1.0}])["shown"], "a summary from before the scaler existed"


# --- device memory and utilisation beside the ledger ---------------------------------------------------------


def _device_memory(utilization: float | None) -> DeviceMemory:
    return DeviceMemory(device="cuda:0", allocated=300 * 2**20, peak_allocated=420 * 2**20, reserved=512 * 2**20,
                        ledger_total=256 * 2**20, ledger_peak=400 * 2**20, utilization=utilization,
                        cublas_workspaces=32 * 2**20, batch=2**20)


def test_report_shows_device_memory_and_utilisation_beside_the_ledger(reports: dict[str, dict],
                                                                      tmp_path: Path) -> None:
    run = reports["fp32"]
    assert run["trace"].device_memory is None and "allocator now" not in run["page"]  # CPU: no allocator to ask
    on_gpu = replace(run["trace"], device_memory=_device_memory(37.0))
    page = write_report(tmp_path / "report.html", run["summary"], [on_gpu.to_dict()]).read_text()
    assert "measured on CUDA: ledger beside the allocator" in page
    for column, value in [("allocator now (MiB)", 300.0), ("allocator - ledger now (MiB)", 44.0),
                          ("allocator peak (MiB)", 420.0), ("allocator reserved (MiB)", 512.0),
                          ("GPU utilisation (%)", 37.0), ("of which cuBLAS workspaces (MiB)", 32.0),
                          ("of which the batch (MiB)", 1.0), ("unexplained (MiB)", 11.0)]:
        assert f"<th>{column}</th>" in page
        assert f"<td>{value:.3f}</td>" in page
    assert "<td>cuda:0</td>" in page
    assert "torch.cuda.utilization at the same moment" in page
    assert "workspaces (scratch memory for matmuls" in page


def test_a_trace_from_before_the_named_categories_loads_with_them_unknown() -> None:
    old = Trace(rank=0, world_size=1, device_memory=_device_memory(5.0)).to_dict()
    for key in ("cublas_workspaces", "batch"):
        old["device_memory"].pop(key)
    dm = Trace.from_dict(old).device_memory
    assert dm.cublas_workspaces is None and dm.batch == 0
    assert dm.unexplained == 44 * 2**20  # then all of allocator - ledger is unexplained
    html = "".join(memory_section([Trace(rank=0, world_size=1, device_memory=dm)]))
    assert "<th>of which cuBLAS workspaces (MiB)</th>" in html and "<td>unknown</td>" in html


def test_unknown_utilisation_is_said_not_hidden() -> None:
    dm = _device_memory(None)
    html = "".join(memory_section([Trace(rank=0, world_size=1, device_memory=dm)]))
    assert "<th>GPU utilisation (%)</th>" in html and "<td>unknown</td>" in html
    assert "GPU utilisation unknown: torch.cuda.utilization needs the pynvml" in html
    # traces.json written before utilisation was recorded still loads
    old = Trace(rank=0, world_size=1, device_memory=dm).to_dict()
    old["device_memory"].pop("utilization")
    assert Trace.from_dict(old).device_memory.utilization is None
    assert Trace.from_dict(Trace(rank=0, world_size=1, device_memory=_device_memory(5.0)).to_dict()
                           ).device_memory.utilization == 5.0


def test_device_utilization_records_none_when_it_cannot_be_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def broken(device: object = None) -> int:
        calls.append(device)
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    monkeypatch.setattr(trace._Utilization, "unavailable", False)
    monkeypatch.setattr(torch.cuda, "utilization", broken)
    assert trace.device_utilization("cuda:0") is None
    assert trace.device_utilization("cuda:0") is None
    assert len(calls) == 1, "a failure is remembered: not asked again every step"
    monkeypatch.setattr(trace._Utilization, "unavailable", False)
    monkeypatch.setattr(torch.cuda, "utilization", lambda device=None: 63)
    assert trace.device_utilization("cuda:0") == 63.0


def test_nothing_recorded_for_a_cpu_device() -> None:
    with trace.tracing() as tracer:
        trace.record_device_memory(torch.device("cpu"))
    assert tracer.trace.device_memory is None


# The recording itself on a GPU: tests/test_gpu.py (the GPU lane runs that file).
