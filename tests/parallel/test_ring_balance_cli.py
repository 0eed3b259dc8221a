"""``sparsebalance ring-balance``: table, JSON, and errors that name the flag."""

from __future__ import annotations

import json

import pytest

from sparsebalance.cli import main


def test_table_and_json(capsys):
    argv = ["ring-balance", "--seq-len", "2k", "--world", "4", "--density", "1,0.2", "--docs", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| 1.000 | zigzag |" in out and "striped" in out and "not timed" in out
    assert main([*argv, "--json", "--layout", "zigzag,striped", "--inner-size", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["layout"] for r in rows] == ["zigzag", "striped"] * 2
    assert all(r["ring"] >= r["rank"] - 1e-12 and len(r["rank_work"]) == 4 for r in rows)


@pytest.mark.parametrize(
    "extra,flag",
    [
        (["--layout", "spiral"], "--layout"),
        (["--density", "1.5"], "--density"),
        (["--inner-size", "3"], "--inner-size"),
        (["--pattern", "dots"], "--pattern"),
    ],
)
def test_bad_flags_are_named(capsys, extra, flag):
    assert main(["ring-balance", "--seq-len", "512", "--world", "4", *extra]) == 2
    assert flag in capsys.readouterr().err
