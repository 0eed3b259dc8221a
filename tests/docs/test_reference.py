"""docs/reference.md is what scripts/gen_reference.py writes from today's argument parsers: a flag
added, renamed or re-described without regenerating the page fails here."""

from __future__ import annotations

import argparse
import difflib
import sys

import pytest

from tests.docs.pages import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gen_reference


def test_the_committed_reference_is_up_to_date():
    committed = (ROOT / "docs" / "reference.md").read_text()
    fresh = gen_reference.render()
    diff = list(difflib.unified_diff(committed.split("\n"), fresh.split("\n"), lineterm="", n=0))
    assert not diff, "docs/reference.md is out of date: run python scripts/gen_reference.py\n" + "\n".join(diff[:40])


def test_the_reference_covers_every_command_and_flag():
    text = (ROOT / "docs" / "reference.md").read_text()
    for name, parser in gen_reference.cli_parsers().items():
        assert f"## `sparsebalance {name}`" in text
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in ("-h", "--help") or f"`{flag}" in text, (name, flag)
    assert "## `python -m sparsebalance.train.convert`" in text


def test_a_flag_without_help_is_refused():
    parser = argparse.ArgumentParser(prog="sparsebalance demo-command")
    parser.add_argument("--documented", help="has a help text")
    parser.add_argument("--silent")
    with pytest.raises(SystemExit, match="--silent has no help text"):
        gen_reference.flag_rows(parser)


def test_capture_parser_stops_before_the_work():
    ran = []

    def main(argv=None):
        p = argparse.ArgumentParser()
        p.add_argument("--steps", type=int)
        args = p.parse_args(argv)
        ran.append(args)

    parser, ns = gen_reference.capture_parser(main, ["--steps", "3"])
    assert ns.steps == 3 and not ran and parser.parse_args([]).steps is None
    with pytest.raises(SystemExit):
        gen_reference.capture_parser(main, ["--steps", "three"])
