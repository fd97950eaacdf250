"""``workbench run``'s flags and ``RunConfig`` cannot drift: every field has a flag, the flags' defaults are the
config's, and the parsed namespace becomes a config field by field (no hand copy in cli.py)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from workbench.cli import NOT_FLAGS, _config_from_args, build_parser
from workbench.train import RunConfig


def _parsed(*flags: str) -> RunConfig:
    return _config_from_args(build_parser().parse_args(["run", *flags]))


def test_every_run_config_field_has_a_run_flag() -> None:
    run = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "run")[1]
    dests = {a.dest for a in run._actions}
    missing = [f.name for f in fields(RunConfig) if f.name not in dests and f.name not in NOT_FLAGS]
    assert not missing, f"RunConfig fields without a `workbench run` flag: {missing}"


def test_the_flags_defaults_are_run_configs_defaults() -> None:
    assert _parsed().to_dict() == RunConfig().to_dict()


@pytest.mark.parametrize("flags, field, value", [
    (["--weight-decay", "0.05"], "weight_decay", 0.05),
    (["--min-lr-ratio", "0.2"], "min_lr_ratio", 0.2),
    (["--trace-steps", "2"], "trace_steps", 2),
    (["--clip", "0"], "clip", None),             # 0 disables clipping
    (["--backend", "auto"], "backend", None),    # auto follows the device
    (["--zero3-replicate", "*norm", "--zero", "3", "--nproc", "2"], "zero3_replicate", ["*norm"]),
])
def test_a_flag_lands_in_its_field(flags: list[str], field: str, value: object) -> None:
    assert getattr(_parsed(*flags), field) == value


def test_calc_prints_without_importing_widgets_or_plotly() -> None:
    """``workbench calc`` is arithmetic (``theory.calculator``): it must start without ipywidgets and plotly."""
    import subprocess
    import sys

    code = ("import sys; from workbench.cli import main; main(['calc', '--model', 'llama-7B']); "
            "heavy = [m for m in ('plotly', 'ipywidgets') if m in sys.modules]; "
            "assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "llama-7B" in proc.stdout


# --- precision names: one table (theory.precisions) for run, calc, the trainer and the theory ------------------


def _precision_action(command: str, flag: str = "--precision"):
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return next(a for a in sub.choices[command]._actions if flag in a.option_strings)


def test_run_and_calc_take_the_same_precision_names_as_the_trainer_and_the_theory() -> None:
    from workbench.parallel.precision import PRECISIONS as TRAINER_PRECISIONS
    from workbench.theory.memory import PRECISIONS as THEORY_PRECISIONS
    from workbench.theory.precisions import ACCEPTED_PRECISIONS, PRECISION_NAMES

    run, calc = _precision_action("run"), _precision_action("calc")
    assert tuple(run.choices) == tuple(calc.choices) == PRECISION_NAMES == tuple(TRAINER_PRECISIONS)
    assert run.type is calc.type
    assert THEORY_PRECISIONS == set(ACCEPTED_PRECISIONS)
    assert tuple(_precision_action("run", "--reduce-dtype").choices) == PRECISION_NAMES


@pytest.mark.parametrize("given", ["fp32", "bf16", "fp16", "bf16-mixed", "fp16-mixed"])
def test_every_accepted_precision_parses_to_one_name_in_run_calc_and_run_config(given: str) -> None:
    from workbench.theory.precisions import canonical_precision

    want = canonical_precision(given)
    assert _parsed("--precision", given).precision == want
    assert build_parser().parse_args(["calc", "--precision", given]).precision == want
    assert RunConfig(precision=given).precision == want


def test_an_unknown_precision_is_refused_by_both_commands_naming_the_valid_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("run", "calc"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--precision", "fp8"])
        assert "invalid choice: 'fp8' (choose from 'fp32', 'bf16', 'fp16')" in capsys.readouterr().err
