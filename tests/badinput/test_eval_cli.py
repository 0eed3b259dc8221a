"""``sparsebalance eval``: a damaged checkpoint is never evaluated, an output that cannot be
written and lengths the model cannot take are refused before the evaluation runs (one line,
exit 2), and an existing ``--out`` file is left as it was."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sparsebalance.train.checkpoint import CHECKSUMS, save_checkpoint
from tests.badinput.conftest import assert_refused, cli, snapshot

VOCAB_MAP = {151643: 1}
"""The tiny model's 4,096 ids: the end of document maps to 1, every other token id to 0."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run folder with one intact checkpoint of the tiny model (what the trainer writes)."""
    from sparsebalance.models.hf import build_model

    run = tmp_path_factory.mktemp("trained") / "run"
    model = build_model("tiny", seed=1)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    state = {"step": 1, "config": {"model": "tiny"}, "vocab_map": VOCAB_MAP}  # compact vocab
    save_checkpoint(run, 1, model, opt, sched, state, [], True)
    return run


def _flip(ckpt):
    data = bytearray((ckpt / "model.pt").read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])  # 16 flipped bytes
    (ckpt / "model.pt").write_bytes(bytes(data))


def _truncate(ckpt):
    (ckpt / "model.pt").write_bytes((ckpt / "model.pt").read_bytes()[:4096])


def _truncate_unverifiable(ckpt):  # weights without checksums (a checkpoint of format 1)
    _truncate(ckpt)
    (ckpt / CHECKSUMS).unlink()
    (ckpt / "meta.json").write_text(json.dumps({"model": "tiny"}))


def _drop_checksums(ckpt):
    (ckpt / CHECKSUMS).unlink()


# damage to the checkpoint, which --model names (the checkpoint or its run) -> the culprits
DAMAGED = [
    pytest.param(_flip, "checkpoint", ["model.pt: corrupt"], id="flipped-bytes"),
    pytest.param(_truncate, "checkpoint", ["model.pt: corrupt"], id="truncated"),
    pytest.param(
        _truncate_unverifiable,
        "checkpoint",
        ["model.pt: unreadable"],
        id="truncated-without-checksums",
    ),
    pytest.param(_drop_checksums, "checkpoint", ["checksums.json: missing"], id="no-checksums"),
    pytest.param(_flip, "run", ["no intact checkpoint", "model.pt: corrupt"], id="run-folder"),
]


@pytest.mark.parametrize(("damage", "named", "culprits"), DAMAGED)
def test_a_damaged_checkpoint_is_never_evaluated(trained, tmp_path, capsys, damage, named, culprits):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    ckpt = run / "checkpoints" / "step-000001"
    damage(ckpt)
    model = ckpt if named == "checkpoint" else run
    code, err = cli(
        capsys,
        "eval",
        "--model",
        model,
        "--task",
        "passkey",
        "--lengths",
        "512",
        "--num-examples",
        "1",
        "--device",
        "cpu",
    )
    assert_refused(code, err, "eval", *culprits)


def _existing_file(tmp):
    out = tmp / "results"
    out.write_text("earlier results\n")
    return ["--out", out], ["--out", "is not a folder"]


# arguments (made by the case) -> the culprits; each is refused before the evaluation
ARGUMENTS = [
    pytest.param(_existing_file, id="out-is-a-file"),
    pytest.param(
        lambda tmp: (["--lengths", "100000"], ["--lengths 100000", "8,192"]),
        id="lengths-past-the-context",
    ),
    pytest.param(lambda tmp: (["--backend", "nope"], ["--backend nope"]), id="backend"),
    pytest.param(lambda tmp: (["--pack-tokens", "0"], ["--pack-tokens"]), id="pack-tokens"),
]


@pytest.mark.parametrize("make", ARGUMENTS)
def test_bad_arguments_are_refused_before_the_evaluation(tmp_path, capsys, make):
    argv, culprits = make(tmp_path)
    vocab = tmp_path / "vocab_map.json"
    vocab.write_text(json.dumps(VOCAB_MAP))
    before = snapshot(tmp_path)
    code, err = cli(
        capsys,
        "eval",
        "--model",
        "tiny",
        "--task",
        "passkey",
        "--lengths",
        "512",
        "--num-examples",
        "1",
        "--device",
        "cpu",
        "--vocab-map",
        vocab,
        *argv,
    )
    assert_refused(code, err, "eval", *culprits)
    assert snapshot(tmp_path) == before  # an existing --out file is left as it was


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_a_gpu_says_so(capsys):
    code, err = cli(capsys, "eval", "--model", "tiny", "--task", "passkey", "--device", "cuda")
    assert_refused(code, err, "eval", "--device cuda", "no CUDA device")
