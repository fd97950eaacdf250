"""``workbench ckpt ls|verify|export DIR`` (issue 23 item 5): checkpoints you can inspect.

One real run (2 ranks, ZeRO-3, checkpoints after steps 1 and 3, its own ``--export``) is shared by the module; each
test that damages a checkpoint works on a copy. The export is compared with the run's own export exactly: both
gather the same ZeRO-3 shards by concatenation, no arithmetic, so no instruction set can change a bit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from workbench.checkpoint import inspect as ckpt_inspect
from workbench.checkpoint import load, read_manifest, save, step_dir, write_atomic, write_manifest
from workbench.checkpoint.resume import FULL_STATE
from workbench.cli import main, run_training
from workbench.models import GPTConfig, build_gpt
from workbench.training.config import RunConfig

pytestmark = pytest.mark.timeout(120)  # two launches of 2 ranks each (the run, the export's gather)

SMALL = dict(batch_size=8, seq_len=32)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder: ``ckpt/`` (step-000001, step-000003 of dp=2 ZeRO-3) and ``run-export.pt`` (the run's own)."""
    root = tmp_path_factory.mktemp("ckpt-cli")
    run_training(RunConfig(steps=4, nproc=2, zero=3, ckpt_dir=str(root / "ckpt"), ckpt_every=2,
                           export=str(root / "run-export.pt"), **SMALL), progress=False)
    return root


@pytest.fixture
def copy(run: Path, tmp_path: Path) -> Path:
    """A copy of the run's checkpoint directory to damage."""
    return Path(shutil.copytree(run / "ckpt", tmp_path / "ckpt"))


def _tiny() -> torch.nn.Module:
    return build_gpt(GPTConfig.preset("tiny", seq_len=SMALL["seq_len"]), device="cpu")


def _flip_bytes(file: Path) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    file.write_bytes(bytes(data))


# -- ls --------------------------------------------------------------------------------------------------------------

def test_ls_lists_step_layout_size_and_status(run: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["ckpt", "ls", str(run / "ckpt")]) == 0
    out = capsys.readouterr().out
    rows = {int(line.split()[0]): line for line in out.splitlines()[1:] if line.split()[0].isdigit()}
    assert sorted(rows) == [1, 3]
    for row in rows.values():
        assert " good " in row and "nproc=2" in row and "dp=2" in row and "zero=3" in row and "(ZeRO-3)" in row
    assert "newest good" in rows[3] and "newest good" not in rows[1]
    infos = ckpt_inspect.list_checkpoints(run / "ckpt")
    folder = step_dir(run / "ckpt", 1)
    assert infos[0].world_size == 2 and infos[0].layout["zero"] == 3
    assert infos[0].bytes_on_disk == sum(p.stat().st_size for p in folder.iterdir())


def test_ls_names_a_corrupt_and_an_incomplete_checkpoint(copy: Path, capsys: pytest.CaptureFixture) -> None:
    _flip_bytes(step_dir(copy, 3) / "rank-00001.pt")
    (step_dir(copy, 1) / "manifest.json").unlink()  # as a save killed before its commit leaves it
    assert main(["ckpt", "ls", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "corrupt" in out and "rank-00001.pt has a checksum mismatch" in out
    assert "incomplete" in out and "no good checkpoint" in out
    assert [i.status for i in ckpt_inspect.list_checkpoints(copy)] == ["incomplete", "corrupt"]


# -- verify ----------------------------------------------------------------------------------------------------------

def test_verify_loads_every_checkpoint(run: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["ckpt", "verify", str(run / "ckpt")]) == 0
    assert capsys.readouterr().out.count("OK ") == 2
    assert main(["ckpt", "verify", str(run / "ckpt"), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert "step-000001" in out and "step-000003" not in out


def test_verify_names_the_corrupt_checkpoint_and_file(copy: Path, capsys: pytest.CaptureFixture) -> None:
    _flip_bytes(step_dir(copy, 3) / "rank-00001.pt")
    assert main(["ckpt", "verify", str(copy)]) == 1
    captured = capsys.readouterr()
    assert "1 of 2 checkpoint(s) failed: step-000003" in captured.err
    assert "FAIL" in captured.out and "rank-00001.pt has a checksum mismatch" in captured.out
    assert main(["ckpt", "verify", str(copy), "--step", "1"]) == 0  # the older one still restores


def test_verify_loads_the_shards_not_only_their_checksums(copy: Path, capsys: pytest.CaptureFixture) -> None:
    """A shard whose checksum matches (its manifest rewritten) but which the model would not accept fails verify."""
    folder = step_dir(copy, 1)
    state = load(folder, 0)
    state["model"]["wpe.weight"] = torch.zeros(3, 3, 3, device="cpu")
    state["model"]["blocks.0.ln1.bias"] = state["model"]["blocks.0.ln1.bias"].to(torch.float64)
    write_atomic(folder / "rank-00000.pt", state)
    write_manifest(copy, 1, 2, read_manifest(folder)["meta"])
    assert main(["ckpt", "verify", str(copy), "--step", "1"]) == 1
    out = capsys.readouterr().out
    assert "rank-00000.pt: 'wpe.weight' has shape (3, 3, 3)" in out
    assert "rank-00000.pt: 'blocks.0.ln1.bias' is torch.float64, the model's is torch.float32" in out


# -- export ----------------------------------------------------------------------------------------------------------

def test_export_gathers_zero3_shards_into_the_full_model(run: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "model.pt"
    assert main(["ckpt", "export", str(run / "ckpt"), "--out", str(out)]) == 0  # the newest good: step 3, the last
    assert "step-000003" in capsys.readouterr().out
    exported = torch.load(out, map_location="cpu", weights_only=True)
    reference = torch.load(run / "run-export.pt", map_location="cpu", weights_only=True)
    assert list(exported) == list(reference)
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), name
    _tiny().load_state_dict(exported, strict=True)
    assert (step_dir(run / "ckpt", 3) / FULL_STATE).is_file()  # the gather is kept for a resharded resume


def test_export_of_a_one_process_checkpoint_needs_no_gather(tmp_path: Path) -> None:
    model = _tiny()
    with torch.no_grad():
        model.wte.weight.add_(1.0)
    save(tmp_path, 0, {"model": model.state_dict(), "step": 0},
         meta={"run_config": {"model": "tiny", "seq_len": SMALL["seq_len"], "nproc": 1}})
    gathers = []
    out = ckpt_inspect.export_model(step_dir(tmp_path, 0), tmp_path / "m.pt", lambda cfg: _tiny(), gathers.append)
    assert gathers == [step_dir(tmp_path, 0)]  # asked, and it wrote nothing: the one shard is whole
    exported = torch.load(out, map_location="cpu", weights_only=True)
    assert torch.equal(exported["wte.weight"], model.wte.weight.detach())


def test_export_refuses_a_corrupt_checkpoint(copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _flip_bytes(step_dir(copy, 3) / "rank-00001.pt")
    out = tmp_path / "model.pt"
    assert main(["ckpt", "export", str(copy), "--step", "3", "--out", str(out)]) == 1
    assert "step-000003: rank-00001.pt has a checksum mismatch" in capsys.readouterr().err
    assert not out.exists()


# -- bad input -------------------------------------------------------------------------------------------------------

def _foreign(kind: str, tmp_path: Path, run: Path) -> tuple[Path, str]:
    """A path that is not a run's checkpoint directory, and what the error must say about it."""
    if kind == "missing":
        return tmp_path / "nowhere", "does not exist"
    if kind == "empty":
        (tmp_path / "empty").mkdir()
        return tmp_path / "empty", "holds no checkpoint (it is empty)"
    if kind == "unrelated":
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "todo.txt").write_text("buy milk")
        return tmp_path / "notes", "holds no checkpoint (it holds todo.txt)"
    return step_dir(run / "ckpt", 1), "is one checkpoint, not a directory of them"


@pytest.mark.parametrize("kind", ["missing", "empty", "unrelated", "one-checkpoint"])
@pytest.mark.parametrize("verb", ["ls", "verify", "export"])
def test_a_foreign_directory_is_a_clear_error(verb: str, kind: str, run: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    path, says = _foreign(kind, tmp_path, run)
    extra = ["--out", str(tmp_path / "m.pt")] if verb == "export" else []
    assert main(["ckpt", verb, str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert f"workbench ckpt {verb}: error:" in err and str(path) in err and says in err
    assert not (tmp_path / "m.pt").exists()


def test_a_step_without_a_checkpoint_names_the_steps_there_are(run: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["ckpt", "verify", str(run / "ckpt"), "--step", "2"]) == 2
    err = capsys.readouterr().err
    assert "step 2 has no checkpoint" in err and "it holds steps [1, 3]" in err
    with pytest.raises(SystemExit) as exc:
        main(["ckpt", "verify", str(run / "ckpt"), "--step", "-1"])
    assert exc.value.code == 2
    assert "'-1' is not a step" in capsys.readouterr().err
