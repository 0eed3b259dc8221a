"""``load_state``: the ablation reads a baseline's trainer state only through the checksums."""

from __future__ import annotations

import json

import pytest
import torch

from sparsebalance.train.checkpoint import CHECKSUMS, load_state, sha256
from sparsebalance.versions import CHECKPOINT


def _sums(folder):
    names = ("state.pt", "meta.json")
    (folder / CHECKSUMS).write_text(json.dumps({n: sha256(folder / n) for n in names}))


def test_load_state_verifies_the_checksum(tmp_path):
    torch.save({"step": 3}, tmp_path / "state.pt")
    (tmp_path / "meta.json").write_text(json.dumps({"schema_version": CHECKPOINT.version}))
    _sums(tmp_path)
    assert load_state(tmp_path) == {"step": 3}
    data = (tmp_path / "state.pt").read_bytes()
    (tmp_path / "state.pt").write_bytes(data[:-8] + bytes(8))  # same size, other bytes
    with pytest.raises(ValueError, match="corrupt"):
        load_state(tmp_path)
    (tmp_path / "state.pt").write_bytes(b"not a pickle")
    _sums(tmp_path)  # intact by its checksum, yet not a checkpoint file: unreadable is named
    with pytest.raises(ValueError, match="unreadable"):
        load_state(tmp_path)
    (tmp_path / CHECKSUMS).unlink()  # nothing to verify against: refused, not trusted
    with pytest.raises(ValueError, match=r"checksums\.json: missing"):
        load_state(tmp_path)


def test_an_old_format_checkpoint_is_refused_with_how_to_convert(tmp_path):
    torch.save({"step": 3}, tmp_path / "state.pt")
    (tmp_path / "meta.json").write_text(json.dumps({"step": 3}))  # no schema_version: format 1
    _sums(tmp_path)
    with pytest.raises(ValueError, match=r"schema version 1 .*sparsebalance\.train\.convert"):
        load_state(tmp_path)
