"""Finding a checkpoint and loading trained weights for evaluation (``train/checkpoint.py``,
``train/weights.py``)."""

from __future__ import annotations

import json

import pytest
import torch

from sparsebalance.train.checkpoint import CHECKSUMS, latest_checkpoint, resolve_checkpoint, sha256
from sparsebalance.train.weights import load_trained_model, read_vocab_map
from sparsebalance.versions import CHECKPOINT


def _checkpoint(run, step, files=("model.pt", "state.pt"), latest=True):
    ckpt = run / "checkpoints" / f"step-{step:06d}"
    ckpt.mkdir(parents=True)
    for name in files:
        (ckpt / name).write_bytes(b"")
    if "state.pt" in files:  # a trainer checkpoint of the current format, verifiable
        (ckpt / "meta.json").write_text(json.dumps({"schema_version": CHECKPOINT.version}))
        sums = {n: sha256(ckpt / n) for n in (*files, "meta.json")}
        (ckpt / CHECKSUMS).write_text(json.dumps(sums))
    if latest:
        (run / "checkpoints" / "latest").write_text(ckpt.name + "\n")
    return ckpt


def test_latest_and_resolve(tmp_path):
    run = tmp_path / "run"
    assert latest_checkpoint(run) is None and resolve_checkpoint(run) is None
    _checkpoint(run, 2)
    ckpt = _checkpoint(run, 4, files=("model.pt",))  # weights only: no trainer state
    # resuming needs state.pt: the newest checkpoint that has it
    assert latest_checkpoint(run) == run / "checkpoints" / "step-000002"
    assert latest_checkpoint(run, needs="model.pt") == ckpt
    assert resolve_checkpoint(run) == ckpt  # a run folder -> its latest checkpoint
    assert resolve_checkpoint(ckpt) == ckpt  # a checkpoint folder -> itself
    (run / "checkpoints" / "latest").write_text("step-000009\n")  # points at nothing
    assert resolve_checkpoint(run) == ckpt  # falls back to the newest intact checkpoint


def test_load_trained_model_from_a_run_folder(tmp_path):
    from sparsebalance.models.hf import build_model

    trained = build_model("tiny", seed=3)
    run = tmp_path / "run"
    ckpt = _checkpoint(run, 1, files=("model.pt",))  # weights only: what evaluation reads
    torch.save(trained.state_dict(), ckpt / "model.pt")
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "model": "tiny"}))
    (run / "vocab_map.json").write_text(json.dumps({"151643": 1, "7": 2}))
    model, vmap = load_trained_model(str(run))
    for (name, a), b in zip(model.state_dict().items(), trained.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert vmap == {151643: 1, 7: 2}
    (ckpt / "meta.json").write_text(json.dumps({"step": 1}))  # base model not recorded
    with pytest.raises(ValueError, match="--base"):
        load_trained_model(str(run))
    _, vmap = load_trained_model(str(ckpt), base="tiny", vocab_map=None)
    assert vmap == {151643: 1, 7: 2}  # found in the run folder two levels up


def test_a_hugging_face_folder_brings_its_own_vocab_map(tmp_path):
    """A compact-vocabulary model saved as a Hugging Face folder (config + safetensors +
    vocab_map.json, what accuracy_pretrain.py writes): evaluating it without its map would feed
    tokenizer ids to a 768-id embedding."""
    from sparsebalance.models.hf import build_model

    folder = tmp_path / "hf"
    build_model("tiny", seed=3).save_pretrained(folder, safe_serialization=True)
    assert load_trained_model(str(folder))[1] is None  # no map: none
    (folder / "vocab_map.json").write_text(json.dumps({"151643": 1}))
    assert load_trained_model(str(folder))[1] == {151643: 1}
    other = tmp_path / "other.json"
    other.write_text('{"9": 2}')
    assert load_trained_model(str(folder), vocab_map=str(other))[1] == {9: 2}  # --vocab-map wins


def test_read_vocab_map(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="--vocab-map"):
        read_vocab_map(str(bad), [])
    good = tmp_path / "good.json"
    good.write_text('{"5": 1}')
    assert read_vocab_map(None, [tmp_path / "missing.json", good]) == {5: 1}
    assert read_vocab_map(None, [tmp_path / "missing.json"]) is None
