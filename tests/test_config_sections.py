"""RunConfig is flat for its users; lower floors receive sections of it (issue 19 item 4)."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from workbench.checkpoint.manager import CheckpointSettings
from workbench.parallel import ParallelConfig
from workbench.theory.composition import Combination
from workbench.training.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
NOT_SET_BY_A_RUN = {ParallelConfig: {"betas"}}  # AdamW's betas: the run keeps the section's default


@pytest.mark.parametrize("kind", [ParallelConfig, Combination, CheckpointSettings])
def test_a_section_takes_every_field_it_shares_with_the_run_by_name(kind: type) -> None:
    run = {f.name for f in dataclasses.fields(RunConfig)}
    missing = {f.name for f in dataclasses.fields(kind)} - run - NOT_SET_BY_A_RUN.get(kind, set())
    assert not missing, f"{kind.__name__} has fields RunConfig lacks: {missing} (rename one, or say why here)"
    cfg = RunConfig(nproc=2, zero=3, zero3_replicate=["*norm"], lr=1e-3, weight_decay=0.05, ddp="flat",
                    bucket_mb=None, precision="bf16", reduce_dtype="bf16", recompute="selective", grad_accum=2,
                    batch_size=8)
    section = cfg.section(kind)
    for f in dataclasses.fields(kind):
        if f.name in run:
            want = getattr(cfg, f.name)
            assert getattr(section, f.name) == (tuple(want) if isinstance(want, list) else want), f.name


def test_parallel_config_is_the_section_parallelize_receives() -> None:
    cfg = RunConfig(nproc=2, tp=2, sp=True, precision="fp16", init_loss_scale=8.0)
    # microbatches: RunConfig resolves its default (2 x pp, or 1 without a pipeline) before the section is taken
    assert cfg.parallel_config() == ParallelConfig(sp=True, precision="fp16", init_loss_scale=8.0, microbatches=1)
    assert cfg.combination() == Combination(tp=2, sp=True)


def test_no_floor_below_training_names_run_config() -> None:
    """theory, trace, dist, models, data and parallel see sections, never the whole run's config."""
    below = [p for p in (ROOT / "workbench").rglob("*.py")
             if p.relative_to(ROOT / "workbench").parts[0] in {"theory", "dist", "models", "parallel", "trace.py",
                                                               "data.py"}]
    assert len(below) > 30
    named = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in below for n in ast.walk(ast.parse(p.read_text()))
             if (isinstance(n, ast.Name) and n.id == "RunConfig")
             or (isinstance(n, ast.alias) and n.name == "RunConfig")
             or (isinstance(n, ast.Constant) and n.value == "RunConfig")]  # a string annotation
    assert not named, f"a floor below training uses RunConfig: {named}"
