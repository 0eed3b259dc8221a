"""``--help`` is plain text: a description's examples one per line, no reST / markdown markup, and
every flag's default said once, as ``(default: X)``."""

from __future__ import annotations

import re

import pytest

from sparsebalance import cli

PARSER = cli.build_parser()
COMMANDS = cli._subcommands(PARSER).choices


def flag_help(command: str, flag: str) -> str:
    """The help text ``sparsebalance COMMAND --help`` shows for ``flag``, on one line."""
    parser = COMMANDS[command]
    action = next(a for a in parser._actions if flag in a.option_strings)
    return " ".join(parser._get_formatter()._expand_help(action).split())


def help_of(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        cli.main([command, "--help"])
    assert stop.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_help_has_no_markup_and_each_default_once(command):
    parser = COMMANDS[command]
    text = parser.format_help()
    for markup in ("``", "`", ":mod:", ":class:", ":func:"):
        assert markup not in text, (command, markup)
    assert "(default: None)" not in text
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help:
            said = formatter._expand_help(action)
            # one statement of the default, in one style: "(default 128). (default: None)" was two
            assert len(re.findall(r"\(default\b", said)) <= 1, (
                command,
                action.option_strings,
                said,
            )
            assert not re.search(r"\(default [^:]", said), (command, action.option_strings, said)


@pytest.mark.parametrize(
    ("command", "flag", "help_text"),
    [
        ("train", "--steps", "optimizer steps (default: 20)"),
        ("train", "--micro-batches", "micro-batches per rank (exclusive with --capacity)"),
        ("train", "--resume", "continue from the latest checkpoint in --out (default: off)"),
        ("bench-attn", "--heads", "query heads Hq (default: 14)"),
        (
            "eval",
            "--lengths",
            "e.g. 1k,2k,4k (longbench: max prompt tokens) (default: 1024,2048,4096)",
        ),
        (
            "train",
            "--stop-grace",
            "killed (torchrun alone would kill them after 30 s) (default: 900)",
        ),
    ],
)
def test_a_flag_states_its_default_once_at_the_end(command, flag, help_text):
    assert flag_help(command, flag).endswith(help_text)


def test_min_len_says_its_default_once():
    """The issue's example: ``(default 128). (default: None)``."""
    said = flag_help("train", "--min-len")
    assert said.endswith("generated from this length (default: 128)")
    assert said.count("default") == 1


def test_profile_help_shows_its_examples_one_per_line(capsys):
    text = help_of("profile", capsys)
    lines = text.splitlines()
    start = lines.index("examples:")
    examples = lines[start + 1 : start + 5]
    assert all(line.startswith("    sparsebalance profile --") for line in examples), examples
    assert "    sparsebalance profile --analytic h100 --model qwen2.5-0.5b --out h100.json" in examples
    assert lines[start + 5] == ""  # the prose follows as its own paragraph
    assert "``" not in text and ":mod:" not in text


def test_a_description_is_rewrapped_without_cutting_a_flag(capsys):
    text = help_of("profile", capsys)
    assert not any(line.rstrip().endswith("--memory-") for line in text.splitlines())
    assert "sparsebalance.latency.form" in text  # :mod:`sparsebalance.latency.form`, plain


def test_the_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert stop.value.code == 0
    for name, (_, help_text) in cli.COMMANDS.items():
        assert name in text and " ".join(help_text.split()[:3]) in " ".join(text.split())
    assert "--version" in text
