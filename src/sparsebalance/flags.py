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

Every value is type-checked, wherever it comes from (:func:`check_values` for a config file's or
the command line's values, naming the key and its source; :func:`check_fields` in a config's
``__post_init__`` for the Python API): an ``int`` field takes an integer (not ``true``, not
``2.7``), a ``float`` a finite number (not ``nan``, not ``"1e-3"``), a ``bool`` ``true`` or
``false``, a ``str`` a string, a section a table. Nothing is coerced: a wrong type is
:class:`ConfigTypeError`, one line.

Messages name a field as its user wrote it (:func:`name`): ``--lr`` on the command line (the
``sparsebalance`` commands run inside :func:`command_line`), ``TrainConfig.lr (--lr)`` from the
Python API.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import contextvars
import dataclasses
import inspect
import itertools
import json
import math
import numbers
import re
import sys
import types
import typing
from collections.abc import Collection, Mapping, Sequence
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
        default = f.default
        if default is dataclasses.MISSING:  # a factory's, or none (a required field)
            no_factory = f.default_factory is dataclasses.MISSING
            default = None if no_factory else f.default_factory()
        out.append(Option(path, flag, aliases, kind, default, doc))
    return out


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: tuple[str, ...] = (),
    title: str = "",
    skip: Collection[str] = (),
    exclusive: Sequence[Sequence[str]] = (),
    choices: Mapping[str, Sequence[str]] | None = None,
    sections: Sequence[tuple[str, Sequence[str]]] = (),
) -> dict[str, Any]:
    """Add one flag per field of ``cls`` (and its sections) to ``parser``; all default to unset.

    Args:
        skip: dests (``"lengths.lengths"``) the caller parses itself.
        exclusive: groups of dests that may not be given together (argparse's mutually
            exclusive groups).
        choices: dest -> the values a flag takes (``--help`` shows them; argparse refuses others
            before the command's modules are imported).
        sections: ``(title, dests)`` argument groups for ``--help``, in order; a dest that is a
            config section (``"dst"``) takes all of its flags. Other flags go under ``title``.

    Returns:
        dest -> its mutually exclusive group, for a caller that adds its own flag to one.
    """
    choices = choices or {}
    group = parser.add_argument_group(title) if title else parser
    titled = [(parser.add_argument_group(t), tuple(dests)) for t, dests in sections]

    def home(dest: str):
        for target, dests in titled:
            if any(dest == d or dest.startswith(f"{d}.") for d in dests):
                return target
        return group

    groups = {}
    for names in exclusive:
        shared = home(names[0]).add_mutually_exclusive_group()
        groups.update(dict.fromkeys(names, shared))
    for opt in options(cls, prefix):
        if opt.dest in skip:
            continue
        target = groups.get(opt.dest) or home(opt.dest)
        text = help_text(opt).replace("%", "%%")  # argparse %-formats help
        names = [opt.flag, *opt.aliases]
        if _base(opt.kind) is bool:
            target.add_argument(*names, dest=opt.dest, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            allowed = choices.get(opt.dest)
            target.add_argument(
                *names,
                dest=opt.dest,
                type=_converter(opt.kind),
                default=None,
                help=text,
                choices=allowed,
                metavar=None if allowed else opt.path[-1].upper(),  # the choices: {a,b,c}
            )
    return groups


_ROLE = re.compile(r":[a-z]+:`(~?)\.?([^`]+)`")
_DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)


def plain_text(text: str) -> str:
    """``text`` without reST / markdown markup, as a terminal shows it: ````x````, ```x``` and
    ``:role:`x``` become ``x`` (``:role:`~a.b``` becomes ``b``, as Sphinx shows it)."""
    text = _ROLE.sub(lambda m: m[2].rsplit(".", 1)[-1] if m[1] else m[2], text)
    return re.sub(r"``?([^`]+?)``?", r"\1", text)


def shown_default(value: Any) -> str:
    """A default as it is typed on the command line: ``off`` / ``on``, a comma list."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return ",".join(shown_default(x) for x in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def help_text(opt: Option) -> str:
    """A flag's help, from its field's docstring: plain text in the command line's style (a
    fragment, no closing full stop) ending with its default once, ``(default: X)``. A docstring
    that says what an unset field means keeps its own words; a field whose default is None and
    whose docstring says nothing of it states none."""
    text = plain_text(opt.help).strip().removesuffix(".")
    first = text.split(" ", 1)[0]
    if first == "A" or first[1:].islower():  # "Optimizer steps" -> "optimizer steps"; "LM" kept
        text = text[:1].lower() + text[1:]
    if _DEFAULT.search(text) or opt.default is None:
        return text
    return f"{text} (default: {shown_default(opt.default)})"


def values_from_args(args: argparse.Namespace, cls: type, prefix: tuple[str, ...] = ()) -> dict:
    """The flags that were given, as a nested dict (``{"dst": {"gamma_min": 0.6}}``)."""
    out: dict = {}
    for opt in options(cls, prefix):
        value = vars(args).get(opt.dest)  # a flag this parser did not define: not given
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
        text = Path(path).read_text(encoding="utf-8-sig")  # a UTF-8 BOM (some editors write one) is not text
        values = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
    except (OSError, ValueError) as err:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{flag} {path}: {err}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{flag} {path}: expected a table of keys, got a {type(values).__name__}")
    return values


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


class ConfigTypeError(TypeError, ValueError):
    """A config value of the wrong type. A ``TypeError`` for the Python API, and a
    ``ValueError`` too, so the command line reports it in one line like every user error."""


def type_problem(kind: Any, value: Any) -> str | None:
    """What a value of a field typed ``kind`` must be (``"an integer"``), or None when ``value``
    is one. Booleans are not integers, integers are numbers, numbers must be finite; a field of
    a type that is not a flag or a section accepts anything (its owner checks it)."""
    base = _base(kind)
    if base is None and set(typing.get_args(kind)) - {type(None)} == {int, str}:
        want, ok = "an integer or a word", isinstance(value, str) or _is_int(value)
    elif base is bool:
        want, ok = "true or false", isinstance(value, bool) or _numpy(value, "bool_")
    elif base is int:
        want, ok = "an integer", _is_int(value)
    elif base is float:
        want, ok = "a finite number", _is_number(value) and math.isfinite(value)
    elif base is str:
        want, ok = "a string", isinstance(value, str)
    elif typing.get_origin(base) is tuple:
        want = _tuple_want(base)
        ok = want is None or _tuple_fits(base, value)
    elif dataclasses.is_dataclass(base):
        want, ok = f"a {base.__name__}", isinstance(value, base)
    else:
        return None
    if value is None and _optional(kind):
        return None
    return None if ok else want


def _tuple_want(kind: Any) -> str | None:
    args = typing.get_args(kind)
    what = {int: "integers", float: "finite numbers", str: "strings"}.get(args[0])
    if what is None:
        return None
    size = None if len(args) == 2 and args[1] is Ellipsis else len(args)
    return f"a list of {size} {what}" if size else f"a list of {what}"


def _tuple_fits(kind: Any, value: Any) -> bool:
    args = typing.get_args(kind)
    size = None if len(args) == 2 and args[1] is Ellipsis else len(args)
    if not isinstance(value, (tuple, list)) and not _numpy(value, "ndarray"):
        return False
    if _numpy(value, "ndarray") and value.ndim != 1:
        return False
    if size is not None and len(value) != size:
        return False
    return all(type_problem(args[0], x) is None for x in value)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not _is_bool(value)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool) or _numpy(value, "bool_")


def _numpy(value: Any, kind: str) -> bool:
    """Whether ``value`` is a ``numpy.<kind>``. Asked of the loaded module, not by importing it:
    a numpy value cannot exist before numpy is imported, and the command line's ``--help``
    stays fast without it."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, getattr(np, kind))


def _optional(kind: Any) -> bool:
    return type(None) in typing.get_args(kind)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_values(cls: type, values: dict, where: str, prefix: tuple[str, ...] = ()) -> None:
    """Raise :class:`ConfigTypeError` for the first value of the nested dict ``values`` (a
    config file's keys, or the flags given) whose type does not fit its field of ``cls``.
    ``where``: the source, ``"flags"`` (the message names the flag: ``--steps``) or e.g.
    ``"--config run.toml"`` (it names the key: ``--config run.toml: [dst] gamma0``). Unknown keys
    are left to :func:`build`."""
    hints = _hints(cls)
    for key, value in values.items():
        if key not in hints:
            continue
        path, kind = (*prefix, key), hints[key]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ConfigTypeError(
                    f"{_name(path, where)} must be a table of {kind.__name__} fields, got {_shown(value)}"
                )
            check_values(kind, value, where, path)
            continue
        problem = type_problem(kind, value)
        if problem is not None:
            raise ConfigTypeError(f"{_name(path, where)} must be {problem}, got {_shown(value)}")


def _name(path: tuple[str, ...], where: str) -> str:
    if where == "flags":
        return "--" + ".".join(p.replace("_", "-") for p in path)
    key = f"[{'.'.join(path[:-1])}] {path[-1]}" if len(path) > 1 else path[0]
    return f"{where}: {key}"


def check_fields(obj: Any) -> None:
    """Raise :class:`ConfigTypeError` naming ``Class.field`` for the first field of dataclass
    ``obj`` whose value does not fit its type (called first in a config's ``__post_init__``:
    what the Python API passed)."""
    cls = type(obj)
    for name, kind in _hints(cls).items():
        value = getattr(obj, name)
        problem = type_problem(kind, value)
        if problem is not None:
            flag = next((o.aliases[0] if o.aliases else o.flag for o in options(cls) if o.path == (name,)), None)
            shown = f"{cls.__name__}.{name}" + (f" ({flag})" if flag else "")
            raise ConfigTypeError(f"{shown} must be {problem}, got {_shown(value)}")


_COMMAND_LINE = contextvars.ContextVar("sparsebalance_command_line", default=False)


@contextlib.contextmanager
def command_line():
    """Inside it, :func:`name` names a field by its flag alone: the user typed flags (the
    ``sparsebalance`` commands and the training ranks they start run inside it)."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def name(config: Any, field: str) -> str:
    """How a message names ``field`` of config dataclass ``config`` (an instance or the class):
    its flag on the command line (``--lr``, :func:`command_line`), ``TrainConfig.lr (--lr)``
    from the Python API, where the user passed the field. A field that is not a flag is named
    ``TrainConfig.field`` either way."""
    cls = config if isinstance(config, type) else type(config)
    flag = next((o.aliases[0] if o.aliases else o.flag for o in options(cls) if o.path == (field,)), None)
    if flag is None:
        return f"{cls.__name__}.{field}"
    return flag if _COMMAND_LINE.get() else f"{cls.__name__}.{field} ({flag})"


def given(config: Any, field: str, value: Any) -> str:
    """A field with the value given, as the user wrote it: ``--backend nope`` on the command
    line, ``TrainConfig.backend='nope' (--backend)`` from the Python API (see :func:`name`)."""
    if _COMMAND_LINE.get():
        return f"{name(config, field)} {value}"
    flag = name(config, field)
    cls, _, flag = flag.partition(" ")
    return f"{cls}={value!r}" + (f" {flag}" if flag else "")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The resolved types of ``cls``'s fields (cached: configs are built often)."""
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _HINTS[cls]


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
        if item not in (int, float, str) or (
            len(args) > 1 and args[1] is not Ellipsis and any(a is not item for a in args)
        ):
            return None
        size = None if len(args) == 2 and args[1] is Ellipsis else len(args)
        return CommaList(item, size)
    return None


def _int_or_str(text: str) -> int | str:
    """An ``int | str`` field: a number when it parses as one (``--capacity 4096``), else the
    word (``--capacity auto``); the config's validation names what is allowed."""
    try:
        return int(text.replace("_", ""))
    except ValueError:
        return text


class CommaList:
    """The argparse ``type=`` of a tuple field: a comma list of ``item`` (``size`` of them, or any
    number when None)."""

    def __init__(self, item: type, size: int | None) -> None:
        self.item, self.size = item, size
        self.__name__ = f"{item.__name__} list"  # argparse names the type in its messages

    def __call__(self, text: str) -> tuple:
        item, size = self.item, self.size
        try:
            out = tuple(
                item(x.strip().replace("_", "") if item is not str else x.strip()) for x in text.split(",") if x.strip()
            )
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of {item.__name__}, got {text!r}") from None
        if size is not None and len(out) != size:
            raise argparse.ArgumentTypeError(f"expected {size} comma-separated values, got {text!r}")
        return out
