"""Issue 55: ``--help``, a mistyped flag and a value of the wrong type or choice are answered
before torch is imported (it took 8-13 s on a loaded machine: the command's module, and torch with
it, was imported to build its parser). The parser is built from ``cli_spec.json``
(:mod:`sparsebalance.cli_spec`); these tests keep that file equal to the real parsers and check
that the answers are the real parser's, word for word. Asserted on the modules loaded, not timed."""

from __future__ import annotations

import json

import pytest

from sparsebalance import cli, cli_spec, cli_spec_write
from tests.cli.test_startup import HEAVY, loaded_after

REGENERATE = (
    "the kept flags differ from the real parsers: run `python -m sparsebalance.cli_spec_write` and commit cli_spec.json"
)


def test_the_kept_flags_are_the_real_parsers():
    kept = json.loads(cli_spec.SPEC.read_text())
    made = json.loads(json.dumps(cli_spec_write.generate()))  # tuples as JSON keeps them
    assert sorted(kept) == sorted(cli.COMMANDS), REGENERATE
    for name in cli.COMMANDS:
        assert kept[name] == made[name], f"{name}: {REGENERATE}"


def _answer(capsys, argv: list[str], fast: bool) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``argv`` parsed by the fast parser or the real one."""
    command = argv[0]
    parser = cli.build_parser([], {command: cli_spec.load(command)}) if fast else cli.build_parser([command])
    with pytest.raises(SystemExit) as stop:
        parser.parse_args(argv)
    out = capsys.readouterr()
    return stop.value.code, out.out, out.err


@pytest.mark.parametrize("columns", ["80", "132"])
@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_the_fast_help_is_the_real_help(command, columns, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", columns)
    assert cli_spec.load(command) is not None, f"{command}: {REGENERATE}"
    assert _answer(capsys, [command, "--help"], fast=True) == _answer(capsys, [command, "--help"], fast=False)


REFUSED = [
    ["train", "--stesp", "3"],
    ["train", "--strategy", "sabb"],
    ["train", "--steps", "x"],
    ["train", "--dst.mode", "up"],
    ["simulate", "--steps", "2.5"],
    ["simulate", "--micro-batches", "2", "--capacity", "8"],  # mutually exclusive
    ["plan", "--world-sizes", "8"],
    ["report"],  # the run folder missing
    ["eval", "--attn", "sparce"],
    ["profile", "--analytic", "h100", "--bogus"],
]


@pytest.mark.parametrize("argv", REFUSED, ids=" ".join)
def test_a_refusal_is_the_real_parsers_word_for_word(argv, capsys):
    fast = _answer(capsys, argv, fast=True)
    assert fast[0] == 2 and fast[2].splitlines()[-1].startswith(f"sparsebalance {argv[0]}: error: ")
    assert fast == _answer(capsys, argv, fast=False)


def test_an_invalid_choice_names_the_closest_one(capsys):
    _, _, err = _answer(capsys, ["train", "--strategy", "sabb"], fast=True)
    assert err.splitlines()[-1] == (
        "sparsebalance train: error: argument --strategy: invalid choice 'sabb'; did you mean sab? "
        "(one of auto, sequential, sorted, lbb, tokens, flops, sab, sab-cp)"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--help"],
        ["simulate", "--help"],
        ["train", "--stesp", "3"],
        ["train", "--strategy", "sabb"],
        ["simulate", "--steps", "x"],
        ["bench-e2e", "--help"],
    ],
    ids=" ".join,
)
def test_answered_without_importing_torch_or_the_command(argv):
    loaded = loaded_after(argv)
    assert not {m for m in HEAVY if m in loaded}, argv
    assert not any(m.startswith("sparsebalance.commands.") for m in loaded)


def test_a_stale_spec_is_not_trusted(tmp_path, monkeypatch, capsys):
    spec = json.loads(cli_spec.SPEC.read_text())
    spec["train"]["actions"] = [a for a in spec["train"]["actions"] if a["dest"] != "steps"]
    spec["train"]["digest"] = "0" * 16  # made from other files than today's
    stale = tmp_path / "cli_spec.json"
    stale.write_text(json.dumps(spec))
    monkeypatch.setattr(cli_spec, "SPEC", stale)
    assert cli_spec.load("train") is None and cli_spec.load("simulate") is not None
    _, _, err = _answer(capsys, ["train", "--stesp", "3"], fast=False)  # what main falls back to
    assert "did you mean --steps?" in err
