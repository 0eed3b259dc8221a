"""Writes ``cli_spec.json`` (:mod:`.cli_spec`) from every command's real parser:
``python -m sparsebalance.cli_spec_write`` after changing a command's flags (a test says so). It
imports every command, and so sits above the command line; :mod:`.cli_spec` only reads."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import flags
from .cli import COMMANDS, _subcommands, build_parser
from .cli_spec import PACKAGE, SPEC, describe, digest


def _made_from(module: str, build) -> list[str]:
    """The package files a command's flags come from: where ``add_argument`` was called and the
    modules of the config dataclasses whose fields became flags (``build`` makes the parser)."""
    files: set[str] = set()
    add, options = argparse._ActionsContainer.add_argument, flags.options

    def recorded_add(self, *args, **kwargs):
        files.add(sys._getframe(1).f_code.co_filename)
        return add(self, *args, **kwargs)

    def recorded_options(cls, prefix=()):
        files.add(sys.modules[cls.__module__].__file__)
        return options(cls, prefix)

    argparse._ActionsContainer.add_argument, flags.options = recorded_add, recorded_options
    try:
        build()
    finally:
        argparse._ActionsContainer.add_argument, flags.options = add, options
    files.add(sys.modules[f"sparsebalance.commands.{module}"].__file__)
    inside = [Path(f).resolve() for f in files]
    return sorted(str(f.relative_to(PACKAGE.resolve())) for f in inside if PACKAGE.resolve() in f.parents)


def generate() -> dict:
    """Every command's spec from its real parser (imports every command)."""
    out = {}
    for name, (module, _) in COMMANDS.items():
        holder: dict = {}
        files = _made_from(module, lambda n=name, h=holder: h.update(parser=build_parser([n])))
        parser = _subcommands(holder["parser"]).choices[name]
        out[name] = {"files": files, "digest": digest(files), **describe(parser)}
    return out


def main() -> int:
    SPEC.write_text(json.dumps(generate(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SPEC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
