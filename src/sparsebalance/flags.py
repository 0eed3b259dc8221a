"""One config mechanism: command-line flags, TOML keys and ``--help`` text generated from a
config dataclass's fields and the docstring under each field (torchtitan style).

Conventions (``TrainConfig``, ``DSTConfig``, ``SimConfig``):

- a field ``global_batch`` is the flag ``--global-batch`` and the TOML key ``global_batch``;
- a field holding another config dataclass is a section: ``dst.gamma_min`` is the flag
  ``--dst.gamma-min`` and the key ``gamma_min`` of the TOML table ``[dst]``;
- a docstring that starts with ``[--flag]`` (or ``[--a / --b]``) names documented aliases, the
  short flags earlier versions used (``--gamma0`` = ``--dst.gamma0``); they stay accepted;
- every flag defaults to "unset": a value comes from the dataclass default < the TOML file <
  the command line; the defaults are written once, in the dataclass.

Types: ``bool`` (``--x`` / ``--no-x``), ``int``, ``float``, ``str``, ``X | None``, and tuples
(``tuple[int, ...]``, ``tuple[float, float]``: comma lists such as ``8,64,512``). Fields of other
types are not flags (a command builds them from its own options).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import json
import re
import sys
import types
import typing
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

_ALIAS = re.compile(r"^\[(--[\w.-]+(?:\s*/\s*--[\w.-]+)*)\]\s*")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (whitespace collapsed)."""
    tree = ast.parse(inspect.getsource(cls))
    docs = {}
    for node, nxt in itertools.pairwise(tree.body[0].body):
        is_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and is_doc and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@dataclasses.dataclass(frozen=True)
class Option:
    """One generated flag."""

    path: tuple[str, ...]
    """Field names from the root config: ``("dst", "gamma_min")``."""
    flag: str
    """``--dst.gamma-min``."""
    aliases: tuple[str, ...]
    kind: Any
    """The field's resolved type."""
    default: Any
    help: str

    @property
    def dest(self) -> str:
        return ".".join(self.path)


def options(cls: type, prefix: tuple[str, ...] = ()) -> list[Option]:
    """Every flag of config dataclass ``cls`` (sections recursively), in field order."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out: list[Option] = []
    for f in dataclasses.fields(cls):
        kind, path = hints[f.name], (*prefix, f.name)
        if dataclasses.is_dataclass(kind):
            out.extend(options(kind, path))
            continue
        if _converter(kind) is None:
            continue
        doc = docs.get(f.name, "")
        aliases: tuple[str, ...] = ()
        match = _ALIAS.match(doc)
        if match:
            aliases = tuple(a.strip() for a in match.group(1).split("/"))
            doc = doc[match.end() :]
        flag = "--" + ".".join(p.replace("_", "-") for p in path)
        aliases = tuple(a for a in aliases if a != flag)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(Option(path, flag, aliases, kind, default, doc))
    return out


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: tuple[str, ...] = (),
    title: str = "",
    skip: Collection[str] = (),
    exclusive: Sequence[Sequence[str]] = (),
) -> dict[str, Any]:
    """Add one flag per field of ``cls`` (and its sections) to ``parser``; all default to unset.

    Args:
        skip: dests (``"lengths.lengths"``) the caller parses itself.
        exclusive: groups of dests that may not be given together (argparse's mutually
            exclusive groups).

    Returns:
        dest -> its mutually exclusive group, for a caller that adds its own flag to one.
    """
    group = parser.add_argument_group(title) if title else parser
    groups = {}
    for names in exclusive:
        shared = parser.add_mutually_exclusive_group()
        groups.update(dict.fromkeys(names, shared))
    for opt in options(cls, prefix):
        if opt.dest in skip:
            continue
        target = groups.get(opt.dest, group)
        shown = opt.default
        if isinstance(shown, tuple):  # as it is typed: a comma list
            shown = ",".join(str(x) for x in shown)
        text = f"{opt.help} (default: {shown})".replace("``", "").strip().replace("%", "%%")
        names = [opt.flag, *opt.aliases]
        if _base(opt.kind) is bool:
            target.add_argument(*names, dest=opt.dest, action=argparse.BooleanOptionalAction,
                                default=None, help=text)  # fmt: skip
        else:
            target.add_argument(*names, dest=opt.dest, type=_converter(opt.kind), default=None,
                                help=text, metavar=opt.path[-1].upper())  # fmt: skip
    return groups


def values_from_args(args: argparse.Namespace, cls: type, prefix: tuple[str, ...] = ()) -> dict:
    """The flags that were given, as a nested dict (``{"dst": {"gamma_min": 0.6}}``)."""
    out: dict = {}
    for opt in options(cls, prefix):
        value = getattr(args, opt.dest, None)
        if value is not None:
            node = out
            for key in opt.path[len(prefix) : -1]:
                node = node.setdefault(key, {})
            node[opt.path[-1]] = value
    return out


def load_file(path: str, flag: str = "--config") -> dict:
    """A TOML (or JSON, by extension) config file as a nested dict; errors name ``flag``."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        text = Path(path).read_text()
        return json.loads(text) if path.endswith(".json") else tomllib.loads(text)
    except (OSError, ValueError) as err:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{flag} {path}: {err}") from None


def merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``, sections merged key by key."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def build(cls: type, values: dict, where: str = "config") -> Any:
    """``cls(**values)`` with sections built recursively (their unset fields keep defaults);
    unknown keys raise ``ValueError`` naming the section."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: {sorted(names)})")
    kwargs = {}
    for key, value in values.items():
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ValueError(f"{where}: {key} must be a table of {kind.__name__} fields")
            kwargs[key] = build(kind, value, f"{where} [{key}]")
        elif isinstance(value, list):  # TOML / JSON arrays -> the tuples the configs hold
            kwargs[key] = tuple(value)
        else:
            kwargs[key] = value
    return cls(**kwargs)


def _base(kind: Any) -> Any:
    """``X`` for ``X | None``."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        rest = [a for a in typing.get_args(kind) if a is not type(None)]
        return rest[0] if len(rest) == 1 else None
    return kind


def _converter(kind: Any):
    """The argparse ``type=`` for a field type, or ``None`` when it is not a flag."""
    base = _base(kind)
    if base in (bool, int, float, str):
        return base
    if base is None and set(typing.get_args(kind)) - {type(None)} == {int, str}:
        return _int_or_str
    if typing.get_origin(base) is tuple:
        args = typing.get_args(base)
        item = args[0]
        if item not in (int, float, str) or (len(args) > 1 and args[1] is not Ellipsis
                                              and any(a is not item for a in args)):  # fmt: skip
            return None
        size = None if len(args) == 2 and args[1] is Ellipsis else len(args)
        return _comma_list(item, size)
    return None


def _int_or_str(text: str) -> int | str:
    """An ``int | str`` field: a number when it parses as one (``--capacity 4096``), else the
    word (``--capacity auto``); the config's validation names what is allowed."""
    try:
        return int(text.replace("_", ""))
    except ValueError:
        return text


def _comma_list(item: type, size: int | None):
    def parse(text: str) -> tuple:
        try:
            out = tuple(item(x.strip().replace("_", "") if item is not str else x.strip())
                        for x in text.split(",") if x.strip())  # fmt: skip
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma list of {item.__name__}, got {text!r}"
            ) from None
        if size is not None and len(out) != size:
            raise argparse.ArgumentTypeError(
                f"expected {size} comma-separated values, got {text!r}"
            )
        return out

    parse.__name__ = f"{item.__name__} list"
    return parse
