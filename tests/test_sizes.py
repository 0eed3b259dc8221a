"""Unbounded inputs are refused before anything large is allocated: one line, rc 2, naming the
flag (lengths beyond int32 token offsets; plans and simulations that cannot fit in memory)."""

from __future__ import annotations

import pytest

import sparsebalance.sizes as sizes
from sparsebalance.cli import main

pytestmark = pytest.mark.timeout(120)  # a regression would allocate for minutes, then crash


@pytest.fixture
def lengths(tmp_path):
    def write(*values):
        path = tmp_path / "lengths.txt"
        path.write_text("\n".join(map(str, values)) + "\n")
        return str(path)

    return write


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    return err


def test_a_length_beyond_int32_is_refused_by_plan_and_simulate(lengths, capsys):
    path = lengths(10**12, 4096)
    for argv in (
        ["plan", "--lengths", path, "--world-size", "2", "--micro-batches", "2"],
        ["simulate", "--lengths", path, "--world-size", "2", "--micro-batches", "2", "--steps", "1"],
    ):
        assert main(argv) == 2
        assert "entry 0" in (err := _err(capsys)) and "2,147,483,647" in err
    assert main(["simulate", "--max-len", str(2**31), "--world-size", "2", "--steps", "1"]) == 2
    assert "--max-len" in _err(capsys)


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("plan", ["--world-size", str(10**12), "--micro-batches", "2"]),
        ("plan", ["--world-size", "2", "--micro-batches", str(10**12)]),
        ("simulate", ["--world-size", str(10**12), "--micro-batches", "2", "--steps", "1"]),
        (
            "simulate",
            [
                "--world-size",
                "8",
                "--micro-batches",
                "2",
                "--steps",
                "1",
                "--samples-per-rank",
                str(10**12),
            ],
        ),
    ],
    ids=["plan-R", "plan-M", "simulate-R", "simulate-samples"],
)
def test_sizes_beyond_memory_are_refused(command, flags, lengths, capsys):
    argv = [command, *flags] + (["--lengths", lengths(4096, 100)] if command == "plan" else [])
    assert main(argv) == 2
    err = _err(capsys)
    assert "would need about" in err and "available" in err and "--world-size" in err


def test_the_check_follows_the_memory_available(monkeypatch, lengths, capsys):
    argv = [
        "plan",
        "--lengths",
        lengths(4096, 100),
        "--world-size",
        str(10**6),
        "--micro-batches",
        "2",
        "--strategy",
        "sequential",
    ]
    monkeypatch.setattr(sizes, "available_memory", lambda: 300 * 2**20)
    assert main(argv) == 2
    assert "300.0 MiB" not in (err := _err(capsys)) and "0.3 GiB available" in err
    # split chunks count as items: one 2^31 - 1 token document at C = 64 is 33.5M items
    argv = ["plan", "--lengths", lengths(2**31 - 1), "--world-size", "2", "--capacity", "64"]
    monkeypatch.setattr(sizes, "available_memory", lambda: 16 * 2**30)
    assert main(argv) == 2
    assert "33,554,432 items" in _err(capsys)


def test_plan_bytes_grows_with_every_size():
    base = sizes.plan_bytes(10, 10, 2)
    assert sizes.plan_bytes(11, 10, 2) > base
    assert sizes.plan_bytes(10, 11, 2) > base
    assert sizes.plan_bytes(10, 10, 3) > base
    assert sizes.available_memory() > 0
