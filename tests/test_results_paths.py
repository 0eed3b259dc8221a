"""Results files name the command that made them, not the machine's folders (issue 54)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from sparsebalance.results import command_line, portable_path, write_results


def test_absolute_paths_leave_the_command_line(tmp_path):
    cwd = tmp_path / "repo"
    home, tmp = str(Path.home()), tempfile.gettempdir()
    argv = [
        str(cwd / "benchmarks" / "x.py"),
        "--out",
        str(cwd / "benchmarks" / "results"),
        f"--root={tmp}/pipeline-memory",
        "--model",
        f"{home}/models/qwen",
        "--data",
        "/srv/cluster7/corpus.jsonl",
        "--tokens",
        "1024,2048",
        "--files",
        f"{cwd}/a.jsonl,/srv/b.jsonl",
    ]
    line = command_line(argv, cwd)
    assert line == (
        "python benchmarks/x.py --out benchmarks/results '--root=$TMPDIR/pipeline-memory' "
        "--model '~/models/qwen' --data '<abs>/corpus.jsonl' --tokens 1024,2048 "
        "--files 'a.jsonl,<abs>/b.jsonl'"
    )
    for root in (str(cwd), home, tmp, "/srv"):
        assert root not in line


def test_relative_arguments_are_kept(tmp_path):
    assert portable_path("benchmarks/results", tmp_path) == "benchmarks/results"
    assert portable_path("--steps=4", tmp_path) == "--steps=4"
    assert portable_path(str(tmp_path), tmp_path) == "."


def test_a_results_file_holds_no_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", [str(tmp_path / "bench.py"), "--out", str(tmp_path / "results")])
    md, js = write_results(tmp_path / "results", "paths", torch.device("cpu"), "| a |\n|---|\n| 1 |", {})
    assert json.loads(js.read_text())["command"] == "python bench.py --out results"
    assert str(tmp_path) not in md.read_text()
