"""``sparsebalance profile``: an output that cannot be written, sizes the machine cannot hold, a
profile of another run given to ``--validate`` and a model the op cannot run are refused in one
line before anything is timed; ``--analytic`` honours ``--block-size``."""

from __future__ import annotations

import json

import pytest

from tests.badinput.conftest import (
    assert_refused,
    cli,
    gpt2_model,
    sliding_window_model,
    snapshot,
    write_profile,
)


def _folder(tmp):
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("an earlier file\n")
    return tmp / "out"


# arguments (made by the case from its folder) -> the culprits
CASES = [
    pytest.param(
        lambda tmp: (["--model", "tiny", "--out", _folder(tmp)], ["--out", "is a folder"]), id="out-is-a-folder"
    ),
    pytest.param(
        lambda tmp: (["--analytic", "h100", "--out", _folder(tmp)], ["--out", "is a folder"]),
        id="analytic-out-is-a-folder",
    ),
    pytest.param(lambda tmp: (["--max-len", "0"], ["--max-len must be in"]), id="max-len-zero"),
    pytest.param(lambda tmp: (["--budget", "nan"], ["--budget must be > 0"]), id="budget-nan"),
    pytest.param(lambda tmp: (["--model", "qwen2.5-3b"], ["--max-len", "GiB of memory"]), id="model-too-large"),
    pytest.param(lambda tmp: (["--model", sliding_window_model(tmp)], ["sliding-window"]), id="sliding-window-model"),
    pytest.param(lambda tmp: (["--model", gpt2_model(tmp)], ["model type 'gpt2' is not supported"]), id="gpt2-model"),
    pytest.param(
        lambda tmp: (["--analytic", "h100", "--block-size", "0"], ["--block-size"]), id="analytic-block-size-zero"
    ),
    pytest.param(
        lambda tmp: (
            ["--validate", write_profile(tmp, "q.json", "qwen2.5-0.5b"), "--block-size", "32"],
            ["--validate", "num_layers 24 vs 4"],
        ),
        id="validate-another-model",
    ),
    pytest.param(
        lambda tmp: (
            ["--validate", write_profile(tmp), "--block-size", "32", "--results-dir", tmp / "keep.txt"],
            ["--results-dir"],
        ),
        id="validate-results-dir-is-a-file",
    ),
    pytest.param(
        lambda tmp: (
            ["--validate", write_profile(tmp), "--block-size", "32", "--max-tokens", "100000"],
            ["--max-tokens", "GiB of memory"],
        ),
        id="validate-too-many-tokens",
    ),
]


@pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")
@pytest.mark.parametrize("make", CASES)
def test_bad_input_is_refused_before_anything_is_timed(tmp_path, capsys, small_machine, make):
    (tmp_path / "keep.txt").write_text("an earlier file\n")
    argv, culprits = make(tmp_path)
    before = snapshot(tmp_path)
    code, err = cli(capsys, "profile", "--device", "cpu", *argv)
    assert_refused(code, err, "profile", *culprits)
    assert snapshot(tmp_path) == before  # nothing written, nothing replaced


@pytest.mark.parametrize("block", [64, 256])
def test_analytic_honours_the_block_size(tmp_path, capsys, block):
    out = tmp_path / "h100.json"
    code, _ = cli(capsys, "profile", "--analytic", "h100", "--block-size", block, "--out", out)
    data = json.loads(out.read_text())
    assert code == 0 and data["fingerprint"]["block_size"] == block
    lengths = data["attention"]["lengths"]
    # whole blocks, and below one block the powers of two from 1 (short documents, fillers)
    assert all(n % block == 0 for n in lengths if n >= block)
    assert [n for n in lengths if n < block] == [2**i for i in range(block.bit_length() - 1)]
