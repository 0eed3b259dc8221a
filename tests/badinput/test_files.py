"""Damaged files given to ``sparsebalance train``: a latency profile that is garbage, not JSON,
of an unknown schema or with NaN / negative seconds, and a token store whose offsets are not
monotone, are refused in one line naming the file before anything is launched, and nothing is
left in ``--out``."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from tests.badinput.conftest import assert_refused, cli, write_profile
from tests.train.harness import write_dataset


def _run(tmp, *extra) -> list:
    return [
        "train",
        "--data",
        write_dataset(tmp),
        "--block-size",
        "32",
        "--device",
        "cpu",
        "--nproc",
        "1",
        "--steps",
        "2",
        "--global-batch",
        "4",
        "--capacity",
        "512",
        "--out",
        tmp / "run",
        *extra,
    ]


def _bytes(content: bytes):
    def write(tmp):
        path = tmp / "profile.json"
        path.write_bytes(content)
        return path

    return write


def _edited(edit):
    return lambda tmp: write_profile(tmp, edit=edit)


def _set(path: str, value):
    """An edit setting ``data[a][b]...`` (``path``: ``"a.b.0"``) to ``value``."""

    def edit(data):
        *parents, last = path.split(".")
        for key in parents:
            data = data[int(key)] if key.isdigit() else data[key]
        data[int(last) if last.isdigit() else last] = value

    return edit


# how the profile is damaged -> the culprits (besides the file's name)
PROFILES = [
    pytest.param(_bytes(b"\x00\xff\x13garbage"), ["not valid JSON"], id="garbage"),
    pytest.param(_bytes(b'{"schema": "sparsebalance.profile/2", '), ["not valid JSON"], id="bad-json"),
    pytest.param(_bytes(b"[1, 2, 3]"), ["not a SparseBalance profile"], id="a-list"),
    pytest.param(_edited(_set("schema", "sparsebalance.profile/99")), ["schema version 99"], id="schema-99"),
    pytest.param(_edited(_set("attention.seconds.0.0", math.nan)), ["attention.seconds"], id="nan-seconds"),
    pytest.param(_edited(_set("head.seconds.1", -1.0)), ["head.seconds", ">= 0"], id="negative-seconds"),
    pytest.param(_edited(_set("optimizer_seconds", math.nan)), ["optimizer_seconds"], id="nan-optimizer-seconds"),
    pytest.param(_edited(lambda d: d.pop("layer_other")), ["damaged", "layer_other"], id="missing-table"),
]


@pytest.mark.parametrize(("damage", "culprits"), PROFILES)
def test_a_damaged_profile_is_refused_before_launch(tmp_path, capsys, damage, culprits):
    path = damage(tmp_path)
    code, err = cli(capsys, *_run(tmp_path, "--profile", path))
    assert_refused(code, err, "train", str(path), *culprits)
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A token store of the harness's dataset (the default tokenizer), as ``prepare`` writes it."""
    from sparsebalance.cli import main

    tmp = tmp_path_factory.mktemp("store")
    assert main(["prepare", str(write_dataset(tmp)), "--out", str(tmp / "store"), "--no-progress", "--json"]) == 0
    return tmp / "store"


def _swap(offsets):
    offsets[2], offsets[3] = offsets[3], offsets[2]


def _huge(offsets):
    offsets[3] = 2**40  # one document of "a TiB" in the middle


def _shifted(offsets):
    offsets[0] = 1


# damage to offsets.bin -> the culprits
OFFSETS = [
    pytest.param(_swap, ["offsets decrease at document 2"], id="not-monotone"),
    pytest.param(_huge, ["offsets decrease at document 3"], id="huge-offset"),
    pytest.param(_shifted, ["offsets run from 1"], id="not-from-zero"),
]


@pytest.mark.parametrize(("damage", "culprits"), OFFSETS)
def test_a_store_with_damaged_offsets_is_refused_when_opened(store, tmp_path, capsys, damage, culprits):
    damaged = tmp_path / "store"
    shutil.copytree(store, damaged)
    offsets = np.fromfile(damaged / "offsets.bin", np.int64)
    damage(offsets)
    offsets.tofile(damaged / "offsets.bin")
    argv = _run(tmp_path)
    argv[argv.index("--data") + 1] = damaged
    code, err = cli(capsys, *argv)
    assert_refused(code, err, "train", str(damaged / "offsets.bin"), "damaged", *culprits)
    assert not (tmp_path / "run").exists()
