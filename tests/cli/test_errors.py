"""What the command line says on a mistake: an unknown command or flag names the closest one, in
one line after the usage of the command typed (not the top-level usage); ``--version``."""

from __future__ import annotations

from importlib import metadata

import pytest

from sparsebalance.cli import main


def refused(capsys, *argv: str) -> list[str]:
    """``sparsebalance ARGV``, refused by its parser: the lines it printed on stderr."""
    with pytest.raises(SystemExit) as stop:
        main(list(argv))
    captured = capsys.readouterr()
    assert stop.value.code == 2, captured
    assert captured.out == ""
    return captured.err.strip().splitlines()


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"sparsebalance {metadata.version('sparsebalance')} (torch {metadata.version('torch')})"


def test_an_unknown_flag_names_the_closest_one_under_the_commands_usage(capsys):
    usage, error = refused(capsys, "train", "--stesp", "5")
    assert usage.startswith("usage: sparsebalance train ")
    assert error == "sparsebalance train: error: unknown flag --stesp; did you mean --steps?"


def test_an_unknown_flag_with_a_value_after_equals(capsys):
    argv = ["plan", "--lengths", "x", "--world-size", "2", "--micro-batches", "1", "--sead=3"]
    lines = refused(capsys, *argv)
    assert lines[-1] == "sparsebalance plan: error: unknown flag --sead; did you mean --seed?"


def test_several_unknown_flags_are_named_together(capsys):
    lines = refused(capsys, "train", "--stesp", "5", "--lrr", "1e-3", "--zzzzzz")
    assert lines[-1] == (
        "sparsebalance train: error: unknown flags --stesp (did you mean --steps?), "
        "--lrr (did you mean --lr?), --zzzzzz"
    )


def test_an_unknown_command_names_the_closest_one(capsys):
    usage, error = refused(capsys, "trian", "--steps", "5")
    assert usage.startswith("usage: sparsebalance ")
    assert error == "sparsebalance: error: unknown command trian; did you mean train?"


def test_a_stray_argument_is_named(capsys):
    lines = refused(capsys, "report", "runs/a", "runs/b")
    assert lines[0].startswith("usage: sparsebalance report ")
    assert lines[-1] == "sparsebalance report: error: unexpected argument 'runs/b'"


def test_a_bad_value_shows_the_commands_usage(capsys):
    usage, error = refused(capsys, "train", "--steps", "five")
    assert usage.startswith("usage: sparsebalance train ")
    assert error.startswith("sparsebalance train: error: argument --steps: invalid int value")
