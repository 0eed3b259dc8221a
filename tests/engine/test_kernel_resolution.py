"""Issue 43, item 2: one block-size resolution. Every command's ``--block-size`` defaults to None
(the device's block), is declared once (:func:`~sparsebalance.engine.kernel.add_block_size_argument`,
or generated from a config field) and resolved by :func:`~sparsebalance.ops.flex_config.resolve_block_size`
(through :func:`~sparsebalance.engine.resolve_kernel` where a kernel runs); nothing below takes a
block size it did not get from there (no numeric ``block_size`` default anywhere in the package)."""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

import pytest
import torch

import sparsebalance
from sparsebalance.cli import build_parser, main
from sparsebalance.engine import resolve_block_size, resolve_kernel
from sparsebalance.simulate import SimConfig
from sparsebalance.train import TrainConfig

ROOT = Path(sparsebalance.__file__).parent
WITH_BLOCK_SIZE = {"bench-attn", "bench-e2e", "eval", "memory", "profile", "ring-balance", "simulate", "train"}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _block_size_action(parser: argparse.ArgumentParser) -> argparse.Action | None:
    found = [a for a in parser._actions if "--block-size" in a.option_strings]
    return found[0] if found else None


def test_every_command_with_a_block_size_defaults_to_the_devices():
    having = {name for name, p in _subparsers().items() if _block_size_action(p) is not None}
    assert having == WITH_BLOCK_SIZE  # a new command with a block size joins this test
    for name in sorted(having):
        action = _block_size_action(_subparsers()[name])
        assert action.default is None, f"{name} --block-size defaults to {action.default!r}, not the device's"
        assert action.type is int, name


def test_the_device_default_is_resolved_in_one_function():
    assert resolve_block_size("cpu") == resolve_kernel("cpu").block_size == 64
    assert resolve_block_size("cuda") == 128  # decided from the device alone: no GPU needed
    assert resolve_kernel("cpu", 32).block_size == 32
    with pytest.raises(ValueError, match="--block-size 64 cannot compile"):
        resolve_block_size("cuda", 64, "flex")
    assert resolve_block_size("cuda", 64, backend=None) == 64  # an estimate: nothing compiles
    with pytest.raises(ValueError, match="--block-size must be a positive integer, got 0"):
        resolve_kernel("cpu", 0)


def test_the_gqa_mode_is_resolved_with_the_kernel():
    from sparsebalance.commands import bench_attn
    from sparsebalance.ops.flex_config import flex_settings

    assert resolve_kernel("cpu").gqa == flex_settings(64, "cpu").gqa == "expand"  # what a flex call defaults to
    assert resolve_kernel("cpu", gqa="native").gqa == "native"
    with pytest.raises(ValueError, match="--gqa must be one of expand, native, got 'both'"):
        resolve_kernel("cpu", gqa="both")
    parser = argparse.ArgumentParser()
    bench_attn.add_arguments(parser)
    assert bench_attn.prepare_args(parser.parse_args(["--device", "cpu"])).gqa == resolve_kernel("cpu").gqa


def test_commands_resolve_an_unset_block_size_to_the_devices(tmp_path, capsys):
    cpu = resolve_kernel("cpu").block_size
    assert TrainConfig(out=str(tmp_path / "run")).block_size == cpu
    assert SimConfig(micro_batches=1).block_size == resolve_block_size("cuda")  # a simulated GPU
    assert main(["memory", "--device", "cpu", "--memory-budget", "8GiB", "--devices", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["block_size"] == cpu
    assert main(["memory", "--analytic", "h100", "--devices", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["block_size"] == resolve_block_size("cuda")
    local = "cuda" if torch.cuda.is_available() else "cpu"
    assert main(["ring-balance", "--seq-len", "2048", "--world", "2", "--density", "0.5", "--layout", "striped"]) == 0
    assert f"B={resolve_block_size(local)} " in capsys.readouterr().out


def _declarations(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, what)`` of every numeric default of a parameter or dataclass field ``block_size``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = a.posonlyargs + a.args
            with_default = positional[len(positional) - len(a.defaults) :]
            pairs = list(zip(with_default, a.defaults, strict=True)) + list(
                zip(a.kwonlyargs, a.kw_defaults, strict=True)
            )
            name = node.name if not isinstance(node, ast.Lambda) else "lambda"
            out += [(node.lineno, f"{name}(block_size={ast.unparse(d)})") for arg, d in pairs if _numeric(arg.arg, d)]
        elif isinstance(node, ast.ClassDef):
            fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
            out += [
                (s.lineno, f"{node.name}.block_size = {ast.unparse(s.value)}")
                for s in fields
                if _numeric(s.target.id, s.value)
            ]
    return out


def _numeric(name: str, default: ast.expr | None) -> bool:
    return name == "block_size" and isinstance(default, ast.Constant) and type(default.value) in (int, float)


def test_the_scan_sees_every_kind_of_default():
    code = (
        "def f(a, block_size=64): ...\n"
        "def g(a, *, block_size=128): ...\n"
        "class C:\n    block_size: int = 64\n"
        "def ok(a, block_size=None, *, b=1): ...\n"
        "def ok2(block_size): ...\n"
    )
    assert [line for line, _ in _declarations(ast.parse(code))] == [1, 2, 4]


def test_no_numeric_block_size_default_in_the_package():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        found += [
            f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in _declarations(ast.parse(path.read_text()))
        ]
    assert not found, "block_size defaults below the kernel resolution:\n" + "\n".join(found)


def test_the_block_size_flag_and_the_device_default_have_one_home():
    """``--block-size`` is declared by :func:`add_block_size_argument` only (or generated from a
    config field), and the per-device table is read by :func:`resolve_block_size` only."""
    declared, defaulted = [], []
    for path in sorted(ROOT.rglob("*.py")):
        text, rel = path.read_text(), str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                declared += [rel for a in node.args if isinstance(a, ast.Constant) and a.value == "--block-size"]
        if "default_block_size(" in text:
            defaulted.append(rel)
    assert declared == ["engine/kernel.py"]
    assert defaulted == ["ops/flex_config.py"]
