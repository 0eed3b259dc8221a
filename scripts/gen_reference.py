"""Write docs/reference.md: every command and flag of ``sparsebalance`` (and of the module entry
points ``python -m sparsebalance.train.convert`` and ``python -m sparsebalance.train``) with its
help text, read from the argument parsers the commands really build. Commands whose flags are
written by hand and those generated from config dataclasses (``sparsebalance/flags.py``) are
covered alike.

    python scripts/gen_reference.py            # rewrite docs/reference.md
    python scripts/gen_reference.py --check    # exit 1 when docs/reference.md is out of date

``tests/docs/test_reference.py`` regenerates the page in memory and fails when the committed file
differs, so a flag added, renamed or re-described without running this script fails the tests.
A flag without a help text is refused here: the reference would have nothing to say about it.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "reference.md"
CONVERT_HELP = "convert checkpoints of format 1 to the current weights-only format, in place"


class ParserBuilt(Exception):
    """Raised by :func:`capture_parser` in place of a command's work, once it has parsed."""

    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace):
        super().__init__(parser.prog)
        self.parser = parser
        self.namespace = namespace


@contextlib.contextmanager
def _stop_after_parsing(argv: Sequence[str]) -> Iterator[None]:
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise ParserBuilt(self, original(self, list(argv), namespace))

    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def capture_parser(main: Callable, argv: Sequence[str] = ()) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser a script's ``main`` builds, and ``argv`` parsed by it, without running the
    script: ``main`` is stopped at its first ``parse_args`` call (whatever arguments it passes,
    ``argv`` is parsed). A parse error exits as argparse does (``SystemExit(2)``)."""
    with _stop_after_parsing(argv):
        try:
            main()
        except ParserBuilt as built:
            return built.parser, built.namespace
    raise RuntimeError(f"{main.__module__}.main returned without parsing arguments")


def cli_parsers() -> dict[str, argparse.ArgumentParser]:
    """``sparsebalance``'s subcommand parsers, in the command table's order."""
    from sparsebalance import cli

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def convert_parser() -> argparse.ArgumentParser:
    from sparsebalance.train import convert

    return capture_parser(lambda: convert.main(["RUN_DIR"]), ["RUN_DIR"])[0]


def train_module_parser() -> argparse.ArgumentParser:
    """What ``python -m sparsebalance.train`` (torchrun's entry point) parses; its ``main`` is
    not called (it installs signal handlers), the parser is built the same way."""
    from sparsebalance.train.config_io import add_train_arguments

    parser = argparse.ArgumentParser(prog="python -m sparsebalance.train")
    add_train_arguments(parser)
    return parser


def markdown_text(doc: str) -> str:
    """A reST-flavoured docstring as markdown: ``x`` and :role:`x` become `x`."""
    text = inspect.cleandoc(doc)
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]


def flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = ["| flag | what it does |", "| --- | --- |"]
    for action in _options(parser):
        if not action.help:
            name = action.option_strings[0] if action.option_strings else action.dest
            raise SystemExit(f"gen_reference: {parser.prog} {name} has no help text: write one")
        invocation = formatter._format_action_invocation(action)
        names = ", ".join(f"`{part}`" for part in invocation.split(", "))
        rows.append(f"| {_cell(names)} | {_cell(formatter._expand_help(action))} |")
    return rows


def synopsis(parser: argparse.ArgumentParser) -> str:
    formatter = parser._get_formatter()
    positionals = [formatter._format_args(a, a.dest.upper()) for a in _options(parser) if not a.option_strings]
    return " ".join([parser.prog, *positionals, "[flags]"])


def section(title: str, parser: argparse.ArgumentParser, doc: str) -> list[str]:
    return [
        f"## `{title}`",
        "",
        markdown_text(doc),
        "",
        f"Synopsis: `{synopsis(parser)}`",
        "",
        *flag_rows(parser),
        "",
    ]


def slug(title: str) -> str:
    """GitHub's anchor for a heading (lower case, punctuation but ``-`` and ``_`` dropped)."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def render() -> str:
    """The whole page (a pure function of the parsers and their help texts)."""
    from sparsebalance import cli
    from sparsebalance.train import convert

    commands = cli_parsers()
    conv = convert_parser()
    entries = [(f"sparsebalance {name}", text) for name, (_, text) in cli.COMMANDS.items()]
    entries.append(("python -m sparsebalance.train.convert", CONVERT_HELP))
    train_flags = {s for a in _options(commands["train"]) for s in a.option_strings}
    module_flags = {s for a in _options(train_module_parser()) for s in a.option_strings}
    launcher_only = sorted(train_flags - module_flags)
    lines = [
        "# Command reference",
        "",
        "<!-- Generated by scripts/gen_reference.py from the argument parsers: do not edit. -->",
        "Generated from the argument parsers the commands build, by "
        "`python scripts/gen_reference.py` (do not edit this page by hand: "
        "`tests/docs/test_reference.py` fails when it differs from what the script writes). "
        "`python -m sparsebalance COMMAND` is the same as `sparsebalance COMMAND`. A command "
        "prints a human-readable table; with `--json` it prints only JSON to stdout. Bad "
        "flags or values are one line on stderr and exit code 2.",
        "",
        "| command | what it does |",
        "| --- | --- |",
        *(f"| [`{t}`](#{slug(t)}) | {_cell(h)} |" for t, h in entries),
        "",
    ]
    for name, parser in commands.items():
        lines += section(f"sparsebalance {name}", parser, parser.description or "")
    lines += section("python -m sparsebalance.train.convert", conv, convert.__doc__ or "")
    lines += [
        "## `python -m sparsebalance.train`",
        "",
        "What `torchrun ... -m sparsebalance.train` runs on every rank (and `srun python -m "
        "sparsebalance.train` under SLURM): the flags of `sparsebalance train` without its "
        "launcher's own, which are: " + ", ".join(f"`{f}`" for f in launcher_only) + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write docs/reference.md from the parsers")
    p.add_argument("--check", action="store_true", help="exit 1 if docs/reference.md differs")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print("docs/reference.md is out of date: run python scripts/gen_reference.py")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
