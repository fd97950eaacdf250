"""Checkpoints you can inspect: list a run's checkpoints, verify that each one restores, export a full model.

What ``workbench ckpt ls|verify|export DIR`` does (``workbench/cli.py`` only parses the flags and prints):

* ``list_checkpoints(DIR)``: every ``step-*`` folder with its step, the layout its manifest records (world size,
  dp/tp/pp, ZeRO stage...), its size on disk and its status: *good* (manifest present, every shard matches its
  size and sha256), *incomplete* (the save did not finish: no manifest, or a shard missing) or *corrupt*
  (anything else), and which is the newest good one (the one ``--resume`` would pick).
* ``verify_checkpoint(path)``: a checkpoint that was written is not yet one that restores, so beyond the checksums
  every shard is loaded (on the CPU, ``weights_only``) and its model tensors are checked against the model the
  manifest's run config describes: every name known, every dtype equal, every shape the full one or a piece of it
  (a tensor-parallel slice, a flat ZeRO-3 shard), every tensor held by some rank.
* ``export_model(path, out, ...)``: the full, unsharded model state dict in one ``.pt`` file, gathered with the
  resharding code that a resume on another layout uses (``FULL_STATE`` beside the shards, see
  ``checkpoint.resume``), written by ``store.export_full_state_dict``.

Building a model from a run config and gathering a sharded checkpoint need the training floor, which imports this
one; so, as ``CheckpointManager`` is handed ``shard_like_params``, these functions are handed ``build_model`` and
``consolidate`` by the caller (``workbench ckpt`` passes the trainer's).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench.checkpoint.resume import FULL_STATE
from workbench.checkpoint.store import (
    MANIFEST,
    CheckpointError,
    export_full_state_dict,
    list_steps,
    load,
    read_manifest,
    shard_name,
    step_dir,
    verify,
)

GOOD, INCOMPLETE, CORRUPT = "good", "incomplete", "corrupt"

#: ``build_model(run_config)``: an unwrapped instance of the architecture the manifest's run config names, on the CPU.
BuildModel = Callable[[Mapping[str, Any]], torch.nn.Module]
#: ``consolidate(path)``: write ``FULL_STATE`` beside the checkpoint's shards (gathered on CPU ranks of its saved
#: layout); it may write nothing when that layout is one process that holds every tensor whole.
Consolidate = Callable[[Path], None]


@dataclass(frozen=True)
class CheckpointInfo:
    """One ``step-*`` folder as ``list_checkpoints`` found it."""

    step: int
    path: Path
    status: str  # GOOD, INCOMPLETE or CORRUPT
    problems: tuple[str, ...] = ()
    world_size: int | None = None
    layout: dict[str, Any] = field(default_factory=dict)  # the layout fields the manifest's run config records
    strategy: str | None = None  # the strategy's own one-line description (``Parallelized.describe``)
    bytes_on_disk: int = 0
    newest_good: bool = False


def checkpoint_root(directory: str | os.PathLike) -> Path:
    """``directory`` if it is a run's checkpoint directory (it holds ``step-NNNNNN`` folders); ``ValueError`` saying
    what it is instead (missing, a file, one checkpoint rather than the directory of them, empty, unrelated)."""
    root = Path(directory)
    hint = "pass a run's checkpoint directory (its --ckpt-dir), which holds step-NNNNNN/ folders"
    if not root.exists():
        raise ValueError(f"{str(root)!r} does not exist; {hint}")
    if not root.is_dir():
        raise ValueError(f"{str(root)!r} is a file, not a directory; {hint}")
    if list_steps(root):
        return root
    if (root / MANIFEST).is_file() or (root / shard_name(0)).is_file():
        raise ValueError(f"{str(root)!r} is one checkpoint, not a directory of them; pass its parent "
                         f"{str(root.parent)!r}")
    names = sorted(p.name for p in root.iterdir())
    seen = "it is empty" if not names else f"it holds {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}"
    raise ValueError(f"{str(root)!r} holds no checkpoint ({seen}); {hint}")


def _status(problems: list[str]) -> str:
    """A save that did not finish leaves no manifest or a missing shard; any other problem is damage after it."""
    if not problems:
        return GOOD
    unfinished = all(f"{MANIFEST} is missing" in p or p.endswith(" is missing") for p in problems)
    return INCOMPLETE if unfinished else CORRUPT


def _layout(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The layout fields worth showing: the mesh and ZeRO stage always, the others only where they are in use."""
    shown = {k: run_config[k] for k in ("nproc", "dp", "tp", "pp", "cp", "zero") if k in run_config}
    for key in ("sp", "offload", "zero3_replicate"):
        if run_config.get(key):
            shown[key] = run_config[key]
    if (run_config.get("grad_accum") or 1) > 1:
        shown["grad_accum"] = run_config["grad_accum"]
    if (run_config.get("pp") or 1) > 1:  # the schedule means nothing without a pipeline
        shown.update({k: run_config[k] for k in ("schedule", "microbatches", "virtual_stages") if k in run_config})
    return shown


def _bytes_on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def describe_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """One checkpoint's step, status (checksums, not a load: see ``verify_checkpoint``), layout and size."""
    folder = Path(path)
    problems = verify(folder)
    try:
        manifest = read_manifest(folder)
    except CheckpointError:
        manifest = {}
    meta = manifest.get("meta") if isinstance(manifest.get("meta"), dict) else {}
    run_config = meta.get("run_config") if isinstance(meta.get("run_config"), dict) else {}
    return CheckpointInfo(step=int(folder.name.split("-")[-1]), path=folder, status=_status(problems),
                          problems=tuple(problems), world_size=manifest.get("world_size"),
                          layout=_layout(run_config), strategy=meta.get("strategy"),
                          bytes_on_disk=_bytes_on_disk(folder))


def list_checkpoints(directory: str | os.PathLike) -> list[CheckpointInfo]:
    """Every checkpoint under ``directory``, oldest first, the newest good one marked; ``ValueError`` for a
    directory that is not a run's checkpoint directory (``checkpoint_root``)."""
    root = checkpoint_root(directory)
    infos = [describe_checkpoint(step_dir(root, s)) for s in list_steps(root)]
    good = [i for i, info in enumerate(infos) if info.status == GOOD]
    if good:
        newest = infos[good[-1]]
        infos[good[-1]] = CheckpointInfo(**{**newest.__dict__, "newest_good": True})
    return infos


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_listing(infos: list[CheckpointInfo]) -> str:
    """``list_checkpoints``'s result as a table, each problem under its row, and which checkpoint a resume picks."""
    lines = [f"{'step':>8}  {'status':<11} {'size':>10}  {'world':>5}  layout"]
    for info in infos:
        layout = " ".join(f"{k}={v}" for k, v in info.layout.items()) or "-"
        strategy = f"  ({info.strategy})" if info.strategy else ""
        mark = "  <- newest good" if info.newest_good else ""
        lines.append(f"{info.step:>8}  {info.status:<11} {_size(info.bytes_on_disk):>10}  "
                     f"{info.world_size if info.world_size is not None else '?':>5}  {layout}{strategy}{mark}")
        lines += [f"{'':>10}{info.path.name}: {p}" for p in info.problems]
    newest = next((i for i in infos if i.newest_good), None)
    lines.append(f"newest good: {newest.path}" if newest else "no good checkpoint: a --resume would find nothing")
    return "\n".join(lines)


def select(directory: str | os.PathLike, step: int | None = None) -> Path:
    """The ``step-*`` folder of ``step`` (``ValueError`` naming the steps there are), or the newest good one."""
    root = checkpoint_root(directory)
    steps = list_steps(root)
    if step is None:
        good = [s for s in steps if not verify(step_dir(root, s))]
        if not good:
            raise CheckpointError(f"{root} holds no good checkpoint (steps {steps} all fail verification; "
                                  f"`workbench ckpt ls {root}` says why)")
        return step_dir(root, good[-1])
    if isinstance(step, bool) or not isinstance(step, int) or step not in steps:
        raise ValueError(f"step {step!r} has no checkpoint in {root}; it holds steps {steps}")
    return step_dir(root, step)


# -- verify: the checksums, then a real load ------------------------------------------------------------------------

def _expected_tensors(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def _piece_of(shape: tuple[int, ...], full: tuple[int, ...]) -> bool:
    """A rank may hold the whole tensor, a slice of it (tensor parallelism: no dim larger) or a flat shard (ZeRO-3:
    one dim, no more elements than the whole)."""
    if len(shape) == len(full) and all(a <= b for a, b in zip(shape, full, strict=True)):
        return True
    return len(shape) == 1 and shape[0] <= torch.Size(full).numel()


def _model_problems(file: str, model_state: Any, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                    seen: set[str]) -> list[str]:
    """What in one shard's model state the run config's model would not accept; the names seen go into ``seen``."""
    if not isinstance(model_state, Mapping):
        return [f"{file}: its 'model' is a {type(model_state).__name__}, not a state dict"]
    problems = []
    for name, tensor in model_state.items():
        if not isinstance(tensor, torch.Tensor):
            continue  # a plain value a strategy keeps beside its tensors: nothing to compare
        seen.add(name)
        if name not in expected:
            problems.append(f"{file}: tensor {name!r} is not in the model the manifest's run_config describes")
            continue
        shape, dtype = expected[name]
        if tensor.dtype != dtype:
            problems.append(f"{file}: {name!r} is {tensor.dtype}, the model's is {dtype}")
        elif not _piece_of(tuple(tensor.shape), shape):
            problems.append(f"{file}: {name!r} has shape {tuple(tensor.shape)}, which is neither the model's "
                            f"{shape} nor a piece of it")
    return problems


def _full_state_problems(folder: Path, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> list[str]:
    """``FULL_STATE`` (a resharded resume or an export gathered it) must hold every parameter whole."""
    try:
        full = torch.load(folder / FULL_STATE, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (any failure to read it is the finding: name the file and why)
        return [f"{FULL_STATE}: cannot load it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"]
    params = full.get("params") if isinstance(full, dict) else None
    if not isinstance(params, Mapping):
        return [f"{FULL_STATE}: holds no 'params' dict of full tensors"]
    return [f"{FULL_STATE}: {name!r} has shape {tuple(t.shape)}, the model's is {expected[name][0]}"
            for name, t in params.items() if name in expected and tuple(t.shape) != expected[name][0]]


def verify_checkpoint(path: str | os.PathLike, build_model: BuildModel | None = None) -> list[str]:
    """Problems with the checkpoint at ``path`` (a ``step-*`` folder); ``[]``: it verifies *and* restores.

    The store's checks first (manifest, sizes, sha256); then every rank's shard is loaded on the CPU with
    ``weights_only`` and must hold the manifest's step; with ``build_model`` and a run config in the manifest,
    every model tensor must fit that model (name, dtype, a shape that is the whole or a piece of it) and every one
    of the model's tensors must be held by some rank. Each problem names the file."""
    folder = Path(path)
    problems = verify(folder)
    if problems:
        return problems
    manifest = read_manifest(folder)
    run_config = (manifest.get("meta") or {}).get("run_config")
    expected = _expected_tensors(build_model(run_config)) if build_model and isinstance(run_config, dict) else None
    seen: set[str] = set()
    for rank in range(manifest["world_size"]):
        file = shard_name(rank)
        try:
            state = load(folder, rank, map_location="cpu", check=False)  # verify() above hashed every shard
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if not isinstance(state, dict):
            problems.append(f"{file}: holds a {type(state).__name__}, not a dict of training state")
            continue
        if "step" in state and state["step"] != manifest["step"]:
            problems.append(f"{file}: holds step {state['step']!r}, the manifest says {manifest['step']}")
        if expected is not None and "model" in state:
            problems += _model_problems(file, state["model"], expected, seen)
        del state  # one shard in memory at a time
    if expected is not None and seen:  # a checkpoint saved by the trainer: together the ranks hold the whole model
        missing = sorted(set(expected) - seen)
        if missing:
            problems.append(f"no rank holds {missing[:5]}{' ...' if len(missing) > 5 else ''} of the model")
        if (folder / FULL_STATE).is_file():
            problems += _full_state_problems(folder, expected)
    return problems


def verify_checkpoints(directory: str | os.PathLike, step: int | None = None,
                       build_model: BuildModel | None = None) -> dict[Path, list[str]]:
    """``verify_checkpoint`` on every checkpoint under ``directory`` (or on step ``step`` alone): folder -> problems.
    ``ValueError`` for a directory that holds no checkpoint or a step it does not hold."""
    root = checkpoint_root(directory)
    folders = [select(root, step)] if step is not None else [step_dir(root, s) for s in list_steps(root)]
    return {folder: verify_checkpoint(folder, build_model) for folder in folders}


# -- export: the full model in one file -------------------------------------------------------------------------------

def full_parameters(path: str | os.PathLike, consolidate: Consolidate) -> dict[str, torch.Tensor]:
    """The full parameters of the checkpoint at ``path`` by the unwrapped model's names, on the CPU: from
    ``FULL_STATE``, which ``consolidate`` gathers if it is not there yet; a one-process checkpoint that holds every
    tensor whole needs no gather (``consolidate`` writes nothing) and gives its own model state."""
    folder = Path(path)
    if problems := verify(folder):
        raise CheckpointError(f"cannot export {folder}: {'; '.join(problems)}")
    if not (folder / FULL_STATE).is_file():
        consolidate(folder)
    if (folder / FULL_STATE).is_file():
        return dict(torch.load(folder / FULL_STATE, map_location="cpu", weights_only=True)["params"])
    world_size = read_manifest(folder)["world_size"]
    if world_size != 1:
        raise CheckpointError(f"cannot export {folder}: it has {world_size} shards and no {FULL_STATE} was gathered")
    return dict(load(folder, 0, map_location="cpu")["model"])


def export_model(path: str | os.PathLike, out: str | os.PathLike, build_model: BuildModel,
                 consolidate: Consolidate) -> Path:
    """Write the checkpoint at ``path`` as one full model state dict at ``out`` (atomically): a file that
    ``torch.load(weights_only=True)`` reads and the model's ``load_state_dict`` accepts. Returns ``out``."""
    folder = Path(path)
    if Path(out).is_dir():
        raise ValueError(f"out {str(out)!r} is a directory; name the .pt file to write, e.g. "
                         f"{str(Path(out) / 'model.pt')!r}")
    run_config = (read_manifest(folder).get("meta") or {}).get("run_config")
    if not isinstance(run_config, dict):
        raise CheckpointError(f"cannot export {folder}: its manifest holds no run_config (not saved by the trainer), "
                              f"so the model it belongs to is unknown")
    return export_full_state_dict(build_model(run_config), full_parameters(folder, consolidate), out)
