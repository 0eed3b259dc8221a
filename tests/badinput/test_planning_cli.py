"""``sparsebalance plan``, ``simulate`` and ``ring-balance``: an output that cannot be written, a
config file of the wrong type and sizes the machine cannot hold are refused in one line before
anything is planned, simulated or built."""

from __future__ import annotations

import pytest

from tests.badinput.conftest import assert_refused, cli, gpt2_model, snapshot, write_profile


def _lengths(tmp):
    path = tmp / "lengths.txt"
    path.write_text("".join(f"{100 + 37 * i}\n" for i in range(16)))
    return ["plan", "--lengths", path, "--world-size", "2", "--capacity", "2048"]


def _config(tmp, text):
    path = tmp / "sim.toml"
    path.write_text(text)
    return ["simulate", "--capacity", "4096", "--config", path]


def _folder(tmp):
    (tmp / "out").mkdir()
    return tmp / "out"


# (command line made by the case, command, culprits)
CASES = [
    pytest.param(
        lambda tmp: [*_lengths(tmp), "--save", _folder(tmp)],
        "plan",
        ["--save", "is a folder"],
        id="plan-save-is-a-folder",
    ),
    pytest.param(
        lambda tmp: [*_lengths(tmp), "--save", tmp / "keep.txt" / "plan.json"],
        "plan",
        ["--save", "is not a folder"],
        id="plan-save-under-a-file",
    ),
    pytest.param(
        lambda tmp: _config(tmp, "steps = 2.5\n"),
        "simulate",
        ["sim.toml: steps must be an integer"],
        id="simulate-steps-float",
    ),
    pytest.param(
        lambda tmp: _config(tmp, "[dst]\nlayer_feedback = 1\n"),
        "simulate",
        ["[dst] layer_feedback must be true or false"],
        id="simulate-dst-bool-int",
    ),
    pytest.param(
        lambda tmp: ["simulate", "--capacity", "4096", "--plot", tmp / "keep.txt"],
        "simulate",
        ["--plot", "is not a folder"],
        id="simulate-plot-is-a-file",
    ),
    pytest.param(
        lambda tmp: ["simulate", "--capacity", "4096", "--model", gpt2_model(tmp)],
        "simulate",
        ["--model", "model type 'gpt2' is not supported"],
        id="simulate-gpt2-model",
    ),
    pytest.param(
        lambda tmp: ["simulate", "--capacity", "4096", "--profile", write_profile(tmp), "--model", "qwen2.5-0.5b"],
        "simulate",
        ["--profile", "profile.json was made for another model than --model qwen2.5-0.5b", "num_layers 4 vs 24"],
        id="simulate-profile-of-another-model",
    ),
    pytest.param(
        lambda tmp: ["ring-balance", "--seq-len", "100000000"],
        "ring-balance",
        ["--seq-len", "GiB of memory"],
        id="ring-balance-seq-len",
    ),
    pytest.param(
        lambda tmp: ["ring-balance", "--block-size", "0"],
        "ring-balance",
        ["--block-size must be a positive integer, got 0"],
        id="ring-balance-block-size-zero",
    ),
    pytest.param(
        lambda tmp: ["ring-balance", "--heads", "0"],
        "ring-balance",
        ["--heads must be >= 1"],
        id="ring-balance-heads-zero",
    ),
]


@pytest.mark.parametrize(("make", "command", "culprits"), CASES)
def test_bad_input_is_refused_before_the_work(tmp_path, capsys, small_machine, make, command, culprits):
    (tmp_path / "keep.txt").write_text("an earlier file\n")
    argv = make(tmp_path)
    before = snapshot(tmp_path)
    code, err = cli(capsys, *argv)
    assert_refused(code, err, command, *culprits)
    assert snapshot(tmp_path) == before  # nothing written, nothing replaced
