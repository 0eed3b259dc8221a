"""The ``sparsebalance`` command line: one explicit ``command -> (module, help)`` table.

Each command module exposes ``add_arguments(parser)`` and ``main(args) -> int``. Commands appear
here only once they work; there are no placeholders. A command's module is imported only when
that command runs (or shows its help): ``sparsebalance --help`` and ``--version`` load neither
torch nor numpy.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Iterable, Sequence
from typing import NoReturn

from . import cli_spec
from .flags import command_line, plain_text, shown_default

# command -> (module under sparsebalance.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench-attn": ("bench_attn", "time block-sparse attention vs density and vs dense SDPA"),
    "eval": ("eval", "accuracy under an attention setting: synthetic tasks, perplexity, LongBench"),
    "prepare": ("prepare", "tokenize inputs once into a memory-mapped token store (--data STORE)"),
    "memory": ("memory", "longest trainable micro-batch / document from the memory model"),
    "plan": ("plan", "pack a global batch into ranks x micro-batches (sparsity-aware batching)"),
    "profile": ("profile", "measure, validate or build the latency profile of a model"),
    "ring-balance": ("ring_balance", "per-rank / per-ring-step work imbalance of CP placements"),
    "train": ("train", "distributed training with SAB + DST (launches torchrun); --demo compares"),
    "report": ("report", "markdown + PNG report of training runs"),
    "bench-e2e": ("bench_e2e", "measured baseline / SAB / DST / SAB+DST ablation with prediction"),
    "simulate": ("simulate", "predict baseline / SAB / DST / SAB+DST over many virtual ranks"),
}


class HelpFormatter(argparse.HelpFormatter):
    """Plain-text help. A description is re-wrapped paragraph by paragraph, its indented blocks
    kept line by line as examples; reST markup (````x````, ``:mod:`x```) is dropped; a flag that
    takes a value and has a default says it once, ``(default: X)``, unless its help already says
    what the default is."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = re.split(r"\n\s*\n", plain_text(inspect.cleandoc(text)))
        out = []
        for par in paragraphs:
            lines = par.splitlines()
            if all(line[:1].isspace() for line in lines):  # command lines: as written
                out.append(f"{indent}examples:\n" + "\n".join(indent + line for line in lines))
            else:
                lines = self._split_lines(par, width - len(indent))
                out.append("\n".join(indent + line for line in lines))
        return "\n\n".join(out)

    def _split_lines(self, text: str, width: int) -> list[str]:
        # whole words: --memory-tokens is never cut at its hyphen
        text = " ".join(text.split())
        return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)

    def _format_usage(self, usage, actions, groups, prefix) -> str:
        text = super()._format_usage(usage, actions, groups, prefix)
        if usage is not None or text.count("\n") <= 5:
            return text
        # dozens of flags: the synopsis; --help lists them below, in groups
        words = [
            self._format_args(a, self._get_default_metavar_for_positional(a)) for a in actions if not a.option_strings
        ]
        return f"{prefix or 'usage: '}{' '.join([self._prog, *words, '[flags]'])}\n\n"

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        # "--dst.mode, --dst-mode {off,down,bidirectional}": the value once, not once per alias
        value = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{', '.join(action.option_strings)} {value}"

    def _get_help_string(self, action: argparse.Action) -> str:
        text = plain_text(action.help or "")
        default = action.default
        said = re.search(r"\bdefault\b", text, re.IGNORECASE)
        if said or action.nargs == 0 or default is None or default is argparse.SUPPRESS:
            return text
        return f"{text} (default: {shown_default(default).replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """argparse with the errors a user can act on: an unknown command or flag names the closest
    one, and a command's error shows that command's usage (one line when its flags are many)."""

    def parse_args(self, args: Sequence[str] | None = None, namespace=None) -> argparse.Namespace:
        args = sys.argv[1:] if args is None else [str(a) for a in args]
        sub = _subcommands(self)
        if sub is not None:
            name = command_word(args)
            if name is not None and name not in sub.choices:
                self.error(f"unknown command {name}{_did_you_mean(name, sub.choices)}")
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            target = sub.choices[parsed.command] if sub is not None else self
            target.error(_unknown(extra, target))
        return parsed

    def error(self, message: str) -> NoReturn:
        message = _choice_hint(message)
        usage = self.format_usage()
        if usage.count("\n") > 3:  # dozens of flags: the synopsis, not all of them
            formatter = self._get_formatter()
            positionals = [a for a in self._actions if not a.option_strings]
            words = [formatter._format_args(a, a.dest.upper()) for a in positionals]
            usage = f"usage: {' '.join([self.prog, *words])} [flags] (--help lists them)\n"
        self._print_message(usage, sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


_INVALID_CHOICE = re.compile(r"^(argument \S+): invalid choice: '(.*)' \(choose from (.*)\)$", re.DOTALL)


def _choice_hint(message: str) -> str:
    """argparse's ``invalid choice`` message with the closest choice named, the choices plain:
    ``argument --strategy: invalid choice 'sabb'; did you mean sab? (one of auto, sequential, ...)``."""
    found = _INVALID_CHOICE.match(message)
    if found is None:
        return message
    flag, word, listed = found.groups()
    choices = [c.strip().strip("'") for c in listed.split(",")]
    return f"{flag}: invalid choice {word!r}{_did_you_mean(word, choices)} (one of {', '.join(choices)})"


def command_word(argv: Sequence[str]) -> str | None:
    """The command of a ``sparsebalance`` command line: its first word that is not a flag (no
    top-level flag takes a value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _closest(word: str, choices: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return close[0] if close else None


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = _closest(word, choices)
    return f"; did you mean {close}?" if close else ""


def _unknown(extra: list[str], parser: argparse.ArgumentParser) -> str:
    """The message for what ``parser`` did not recognise: each unknown flag with the closest
    known one, else the first stray argument."""
    flags = [a.split("=", 1)[0] for a in extra if a.startswith("-")]
    if not flags:
        return f"unexpected argument {extra[0]!r}"
    known = [s for a in parser._actions for s in a.option_strings]
    if len(flags) == 1:
        return f"unknown flag {flags[0]}{_did_you_mean(flags[0], known)}"
    named = []
    for flag in flags:
        close = _closest(flag, known)
        named.append(f"{flag} (did you mean {close}?)" if close else flag)
    return "unknown flags " + ", ".join(named)


def version() -> str:
    """``sparsebalance X (torch Y)``: the installed distributions' versions (torch not imported)."""
    from importlib import metadata  # ~50 ms to import: only for --version

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"sparsebalance {installed('sparsebalance')} (torch {installed('torch')})"


class _Version(argparse.Action):
    """``--version``: :func:`version`, looked up only when asked."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, 0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:
        print(version())
        parser.exit()


def build_parser(commands: Iterable[str] | None = None, specs: dict | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``commands``: the commands whose flags are added (their modules
    imported), default all of them. The others are listed with their one-line help only.
    ``specs``: command -> its flags as data (:mod:`.cli_spec`), added without importing it (a
    parser that answers ``--help`` and refuses, but has no command to run)."""
    specs = specs or {}
    load = set(COMMANDS if commands is None else commands)
    parser = Parser(
        prog="sparsebalance",
        description="Balanced data-parallel long-context training with dynamic sparse attention.",
        epilog="sparsebalance COMMAND --help lists a command's flags.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action=_Version, help="print the versions and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        if name in specs:
            spec = specs[name]
            p = sub.add_parser(
                name,
                help=help_text,
                description=spec["description"],
                epilog=spec["epilog"],
                formatter_class=HelpFormatter,
            )
            cli_spec.rebuild(p, spec)
            continue
        if name not in load:
            sub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
            continue
        mod = importlib.import_module(f"sparsebalance.commands.{module}")
        description = (mod.__doc__ or help_text).strip()
        p = sub.add_parser(name, help=help_text, description=description, formatter_class=HelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(func=mod.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    command = command_word(argv)
    spec = cli_spec.load(command) if command in COMMANDS else None
    if spec is not None:  # --help, a mistyped flag, a wrong type or choice: answered (and exits) here
        build_parser([], {command: spec}).parse_args(argv)
    args = build_parser([command] if command in COMMANDS else []).parse_args(argv)
    try:
        with command_line():  # messages name the flags typed, not the Python fields
            return args.func(args)
    except ValueError as err:  # user errors: one clear line, no traceback
        print(f"sparsebalance {args.command}: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # a run that failed (e.g. training stopped): say so plainly
        print(f"sparsebalance {args.command}: failed: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        if err.errno != errno.ENAMETOOLONG:
            raise
        name = str(err.filename or "")
        shown = name if len(name) <= 80 else f"{name[:40]}...{name[-30:]} ({len(name)} characters)"
        print(f"sparsebalance {args.command}: error: a path is too long for this file system: {shown}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
