"""The resume rules: which run fields a resume must keep, which it may change, and where it resumes from.

A resume on the same layout reloads each rank's own shard (``Trainer`` does, through ``store.load``). A resume on
another layout is resharded (``workbench.checkpoint.reshard``): the checkpoint is gathered into full tensors on its
saved layout once (``FULL_STATE`` beside its shards), then sharded the new way by every rank of the new layout.
The rules read a run's config through ``ResumableConfig``, the three things they need of it, so this module does
not import the training floor that imports it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol

from workbench.checkpoint.store import CheckpointError, latest_good, read_manifest
from workbench.models import PRESETS, GPTConfig


class ResumableConfig(Protocol):
    """What the resume rules read of a run's config (``workbench.training.config.RunConfig`` is one)."""

    ckpt_dir: str | None
    steps: int

    def to_dict(self) -> dict[str, Any]: ...


#: RunConfig fields a resume must share with the checkpoint: they fix the tensors' shapes, which shard each rank
#: holds (same-layout resume only) or the data order. Others (steps, lr, warmup, clip, timeout...) may change.
RESUME_MUST_MATCH = ("model", "seq_len", "batch_size", "seed", "data", "val_every", "val_fraction")
#: RunConfig fields a resume may change: the layout. The checkpoint is then resharded (``checkpoint.reshard``):
#: gathered into full tensors on the saved layout once (``full-state.pt`` beside its shards), then sharded the new
#: way by every rank of the new one.
LAYOUT_FIELDS = ("nproc", "dp", "tp", "pp", "sp", "cp", "zero", "zero3_replicate", "offload", "schedule",
                 "microbatches", "virtual_stages", "grad_accum")
FULL_STATE = "full-state.pt"


def checkpoint_config(cfg: ResumableConfig) -> dict[str, Any]:
    """The run config as it goes into a checkpoint's manifest (JSON: ``extra`` may hold anything, so it is left out)."""
    return {k: v for k, v in cfg.to_dict().items() if k != "extra"}


def find_resume_point(cfg: ResumableConfig, finished_ok: bool = False) -> Path:
    """The newest good checkpoint in ``cfg.ckpt_dir``, checked against ``cfg``; ``ValueError`` saying why not.

    Newer checkpoints that fail verification are skipped with a warning (``checkpoint.latest_good``).
    ``finished_ok``: a checkpoint of the last step is fine (a restart after the final save has nothing left to do);
    a ``--resume`` asking for no more steps than were done is an error."""
    try:
        path = latest_good(cfg.ckpt_dir)
    except CheckpointError as e:
        raise ValueError(f"cannot resume: {e}") from e
    manifest = read_manifest(path)
    check_resumable(cfg, manifest.get("meta", {}).get("run_config"), path)
    step = manifest["step"]
    if step + 1 >= cfg.steps and not finished_ok:
        raise ValueError(f"cannot resume from {path}: it holds the state after step {step} ({step + 1} steps done) "
                         f"and steps={cfg.steps} leaves nothing to train; pass --steps > {step + 1}")
    return path


def check_resumable(cfg: ResumableConfig, saved: dict[str, Any] | None, path: str | Path) -> None:
    """``ValueError`` naming every field of ``RESUME_MUST_MATCH`` in which the checkpoint's config differs."""
    if not isinstance(saved, dict):
        raise ValueError(f"cannot resume from {path}: its manifest holds no run_config (not saved by the trainer)")
    mine = checkpoint_config(cfg)
    differ = [f"{k}={saved.get(k)!r} (this run: {mine[k]!r})" for k in RESUME_MUST_MATCH
              if effective(saved, k, cfg) != effective(mine, k, cfg)]
    if differ:
        raise ValueError(f"cannot resume from {path}: it was saved with {', '.join(differ)}; a resume must keep the "
                         f"model and the data order (fields {', '.join(RESUME_MUST_MATCH)}; the layout may change: "
                         f"{', '.join(LAYOUT_FIELDS)}); rerun with the saved values or start a fresh --ckpt-dir")


def layout_changes(cfg: ResumableConfig, saved: dict[str, Any]) -> list[str]:
    """The layout fields in which ``cfg`` differs from a checkpoint's run config (empty: same layout)."""
    mine = checkpoint_config(cfg)
    return [f"{k}: {effective(saved, k, cfg)!r} -> {mine[k]!r}" for k in LAYOUT_FIELDS
            if effective(saved, k, cfg) != effective(mine, k, cfg)]




def effective(config: dict[str, Any], key: str, run: ResumableConfig) -> Any:
    """``config[key]`` as the run sees it. ``seq_len=None`` means the preset's: compare what the model gets, not how
    it was spelt. A field the config lacks (a checkpoint saved before the field existed) has the field's default
    in ``run``'s config class."""
    if key == "seq_len" and config.get(key) is None and config.get("model") in PRESETS:
        return GPTConfig.preset(config["model"]).seq_len
    if key not in config:
        f = next(f for f in dataclasses.fields(run) if f.name == key)  # type: ignore[arg-type]
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return config[key]
