"""Every command the README and docs/ show parses with the parser the command really builds
(parse only: nothing runs, nothing is written): ``sparsebalance ...``, ``python -m
sparsebalance ...``, ``python -m sparsebalance.train.convert ...``, ``torchrun ... -m
sparsebalance.train ...``, ``bash scripts/demo.sh ...`` (flags go to ``train --demo``) and
``python benchmarks/NAME.py ...``, in fenced shell blocks and in inline code. ``...`` stands for
more flags and is dropped. Inline spans are parsed when they hold a flag (``sparsebalance
prepare`` alone names a command); those holding ``[ ] | < > { }`` are usage syntax, not
commands. A block is exempted by ``<!-- docs-test: skip (reason) -->``."""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import re
import shlex
import sys

import pytest

from tests.docs.pages import ROOT, blocks, doc_files, inline_code, rel

sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gen_reference

SHELL_LANGS = {"bash", "sh", "shell", "console"}
PYTHONS = {"python", "python3", ".venv/bin/python"}
KEYWORDS = {"do", "then", "else", "time", "exec", "nohup"}
USAGE_SYNTAX = set("[]|<>{}")


def shell_commands(code: str) -> list[list[str]]:
    """The simple commands of a shell snippet: continuation lines joined, comments dropped,
    split at ``; && || |``, leading ``VAR=value`` and keywords (``do``, ``time``...) removed."""
    out: list[list[str]] = []
    for line in code.replace("\\\n", " ").split("\n"):
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lex.whitespace_split = True
        cmd: list[str] = []
        for token in lex:
            if set(token) <= set(";&|()"):
                out.append(cmd)
                cmd = []
            else:
                cmd.append(token)
        out.append(cmd)
    cleaned = []
    for cmd in out:
        while cmd and (cmd[0] in KEYWORDS or re.match(r"^[A-Za-z_]\w*=", cmd[0])):
            cmd = cmd[1:]
        if cmd:
            cleaned.append(cmd)
    return cleaned


def classify(cmd: list[str]) -> tuple[str, list[str]] | None:
    """``(parser kind, argv)`` of a command this test checks, else ``None``."""
    args = [a for a in cmd if a != "..."]
    head = args[0]
    if head == "sparsebalance":
        return "cli", args[1:]
    if head == "srun" and "python" in args:
        return classify(args[args.index("python") :])
    if head == "torchrun" and "-m" in args:
        i = args.index("-m")
        return ("train", args[i + 2 :]) if args[i + 1] == "sparsebalance.train" else None
    if head == "bash" and len(args) > 1 and args[1] == "scripts/demo.sh":
        return "cli", ["train", "--demo", *args[2:]]
    if head in PYTHONS and len(args) > 1:
        if args[1] == "-m" and len(args) > 2:
            module = {
                "sparsebalance": "cli",
                "sparsebalance.train": "train",
                "sparsebalance.train.convert": "convert",
            }.get(args[2])
            return (module, args[3:]) if module else None
        m = re.fullmatch(r"benchmarks/(\w+)\.py", args[1])
        if m:
            return f"bench:{m[1]}", args[2:]
    return None


@functools.cache
def cli_parser():
    from sparsebalance import cli

    return cli.build_parser()


def parse_error(kind: str, argv: list[str]) -> str | None:
    """``None`` when ``argv`` parses, else argparse's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if kind == "cli":
                cli_parser().parse_args(argv)
            elif kind == "train":
                gen_reference.train_module_parser().parse_args(argv)
            elif kind == "convert":
                from sparsebalance.train import convert

                gen_reference.capture_parser(lambda: convert.main(argv), argv)
            else:
                module = importlib.import_module(kind.removeprefix("bench:"))
                gen_reference.capture_parser(module.main, argv)
    except SystemExit as stop:
        lines = err.getvalue().strip().split("\n")
        return lines[-1] if stop.code else None
    return None


def documented_commands(path) -> list[tuple[str, str, list[str]]]:
    """``(where, kind, argv)`` of every command on a page that this test checks."""
    text = path.read_text()
    found = []
    for block in blocks(path):
        if block.lang in SHELL_LANGS and block.skip is None:
            for cmd in shell_commands(block.code):
                kind = classify(cmd)
                if kind:
                    found.append((block.where, *kind))
    for line, code in inline_code(text):
        if USAGE_SYNTAX & set(code):
            continue
        try:
            cmd = shlex.split(code)
        except ValueError:
            continue
        kind = classify(cmd) if cmd else None
        if kind and any(a.startswith("-") for a in kind[1]):  # a command, not its name
            found.append((f"{rel(path)}:{line}", *kind))
    return found


ALL = {rel(p): documented_commands(p) for p in doc_files()}


@pytest.mark.parametrize("page", sorted(ALL))
def test_documented_commands_parse(page):
    bad = [
        f"{where}: {' '.join([kind, *argv])}\n    {error}"
        for where, kind, argv in ALL[page]
        if (error := parse_error(kind, argv))
    ]
    assert not bad, "commands in the docs that their parser refuses:\n" + "\n".join(bad)


def test_the_docs_show_commands_of_every_kind():
    kinds = {kind.split(":")[0] for found in ALL.values() for _, kind, _ in found}
    assert {"cli", "bench", "train", "convert"} <= kinds
    assert sum(len(found) for found in ALL.values()) >= 40


def test_the_checker_refuses_what_the_parsers_refuse():
    assert parse_error("cli", ["train", "--no-such-flag"])
    assert parse_error("cli", ["simulate", "--world-size", "eight"])
    assert parse_error("cli", ["plan", "--strategy"])  # flag without its value
    assert parse_error("train", ["--nproc", "2"])  # a launcher flag; torchrun's ranks refuse it
    assert parse_error("convert", [])
    assert parse_error("bench:table1", ["--mode", "nonsense"])
    assert parse_error("cli", ["train", "--demo", "--steps", "2"]) is None
    assert parse_error("bench:table1", ["--mode", "simulated"]) is None


def test_shell_snippets_are_split_into_commands():
    code = "# setup\nFOO=1 sparsebalance plan --lengths L \\\n    --world-size 8  # eight\n"
    code += "for a in 1 2; do sparsebalance report runs/x; done\n"
    code += "true && python benchmarks/table1.py ...\n"
    cmds = [classify(c) for c in shell_commands(code)]
    assert ("cli", ["plan", "--lengths", "L", "--world-size", "8"]) in cmds
    assert ("cli", ["report", "runs/x"]) in cmds
    assert ("bench:table1", []) in cmds
    assert classify(["torchrun", "--nnodes", "2", "-m", "sparsebalance.train", "--steps", "3"]) == (
        "train",
        ["--steps", "3"],
    )
