"""Every command's flags as data (``cli_spec.json`` beside this file), so that ``--help``, a
mistyped flag and a value of the wrong type or choice are answered without importing the command
(torch takes seconds to import; the answer takes ~0.1 s).

:func:`describe` turns a command's real parser into plain data; :func:`fast_parser` builds an
equivalent parser from it (the same :class:`~sparsebalance.cli.Parser`, help formatter, groups,
types and choices). The command line parses with it first and then, when it accepts, with the
real parser (whose answer counts). A value that only the command can check (a custom list type,
a range) is left to the real parser.

The data is trusted only while the files it was made from are unchanged (a digest of each
command's own files: where its flags were added and its config dataclasses); otherwise the real
parser answers, slower. ``python -m sparsebalance.cli_spec_write`` writes it again
(:mod:`.cli_spec_write`, above the command line: it builds the real parsers);
``tests/cli/test_fast_answers.py`` fails while it differs from them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

from . import flags

SPEC = Path(__file__).with_name("cli_spec.json")
PACKAGE = Path(__file__).parent
TYPES = {int: "int", float: "float", str: "str", flags._int_or_str: "int_or_str"}
"""Value types the fast parser converts itself; others (a command's own list parsers) it leaves
to the real parser ("deferred")."""
KINDS = {
    argparse._StoreAction: "store",
    argparse._StoreTrueAction: "store_true",
    argparse._StoreFalseAction: "store_false",
    argparse.BooleanOptionalAction: "bool",
    argparse._HelpAction: "help",
}


def _type(kind: Any) -> Any:
    if kind is None:
        return None
    if isinstance(kind, flags.CommaList):
        return ["list", kind.item.__name__, kind.size]
    return TYPES.get(kind, "deferred")


def _value(value: Any) -> Any:
    """A default or const as JSON holds it (tuples as lists)."""
    if isinstance(value, (tuple, list)):
        return [_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"cli_spec: a default of type {type(value).__name__} cannot be kept as data")


def describe(parser: argparse.ArgumentParser) -> dict:
    """A command's parser as plain data: its groups, mutually exclusive groups and actions."""
    groups = parser._action_groups
    mutex = parser._mutually_exclusive_groups
    actions = []
    for action in parser._actions:
        kind = KINDS.get(type(action))
        if kind is None:
            raise ValueError(f"cli_spec: {action.option_strings or action.dest}: {type(action).__name__} not kept")
        home = next(i for i, g in enumerate(groups) if action in g._group_actions)
        alone = next((i for i, m in enumerate(mutex) if action in m._group_actions), None)
        actions.append(
            {
                "strings": list(action.option_strings),
                "dest": action.dest,
                "kind": kind,
                "nargs": action.nargs,
                "const": _value(action.const),
                "default": _value(action.default),
                "type": _type(action.type),
                "choices": None if action.choices is None else [_value(c) for c in action.choices],
                "required": action.required,
                "help": action.help,
                "metavar": _value(action.metavar),
                "group": home,
                "mutex": alone,
            }
        )
    return {
        "description": parser.description,
        "epilog": parser.epilog,
        "groups": [{"title": g.title, "description": g.description} for g in groups],
        # a mutually exclusive group made on the parser itself (None) or in an argument group
        "mutex": [
            {"group": None if m._container is parser else groups.index(m._container), "required": m.required}
            for m in mutex
        ],
        "actions": actions,
    }


def _converter(kind: Any):
    if kind is None or kind == "deferred":
        return None  # the real parser converts (and refuses) it
    if isinstance(kind, list):
        return flags.CommaList({"int": int, "float": float, "str": str}[kind[1]], kind[2])
    return {v: k for k, v in TYPES.items()}[kind]


def rebuild(parser: argparse.ArgumentParser, spec: dict) -> None:
    """Add ``spec``'s groups and actions (:func:`describe`) to a fresh command parser."""
    groups = [parser._positionals, parser._optionals]
    for g in spec["groups"][2:]:
        groups.append(parser.add_argument_group(g["title"], g["description"]))
    mutex = [
        (parser if m["group"] is None else groups[m["group"]]).add_mutually_exclusive_group(required=m["required"])
        for m in spec["mutex"]
    ]
    for a in spec["actions"]:
        if a["kind"] == "help":
            continue  # every parser has its own -h
        target = mutex[a["mutex"]] if a["mutex"] is not None else groups[a["group"]]
        common = {"default": a["default"], "help": a["help"]}
        if not a["strings"]:  # a positional: its dest is its name
            target.add_argument(a["dest"], nargs=a["nargs"], metavar=a["metavar"], type=_converter(a["type"]), **common)
            continue
        common |= {"dest": a["dest"], "required": a["required"]}
        if a["kind"] == "bool":  # argparse adds the --no- forms again
            strings = [s for s in a["strings"] if not (s.startswith("--no-") and f"--{s[5:]}" in a["strings"])]
            target.add_argument(*strings, action=argparse.BooleanOptionalAction, **common)
        elif a["kind"] in ("store_true", "store_false"):
            target.add_argument(*a["strings"], action=a["kind"], **common)
        else:
            target.add_argument(
                *a["strings"],
                nargs=a["nargs"],
                const=a["const"],
                type=_converter(a["type"]),
                choices=a["choices"],
                metavar=tuple(a["metavar"]) if isinstance(a["metavar"], list) else a["metavar"],
                **common,
            )


def digest(files: list[str]) -> str:
    """16 hex digits of SHA-256 over the files' contents (package-relative paths, in order)."""
    h = hashlib.sha256()
    for name in files:
        path = PACKAGE / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"(missing)") + b"\0")
    return h.hexdigest()[:16]


def load(command: str) -> dict | None:
    """``command``'s kept spec, or None when there is none or its files changed since."""
    try:
        spec = json.loads(SPEC.read_text())[command]
    except (OSError, ValueError, KeyError):
        return None
    return spec if digest(spec["files"]) == spec["digest"] else None
