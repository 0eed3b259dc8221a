"""``load_state``: the ablation reads a baseline's trainer state only through the checksums."""

from __future__ import annotations

import json

import pytest
import torch

from sparsebalance.train.checkpoint import CHECKSUMS, load_state, sha256


def test_load_state_verifies_the_checksum(tmp_path):
    torch.save({"step": 3}, tmp_path / "state.pt")
    (tmp_path / CHECKSUMS).write_text(json.dumps({"state.pt": sha256(tmp_path / "state.pt")}))
    assert load_state(tmp_path) == {"step": 3}
    data = (tmp_path / "state.pt").read_bytes()
    (tmp_path / "state.pt").write_bytes(data[:-8] + bytes(8))  # same size, other bytes
    with pytest.raises(ValueError, match="corrupt"):
        load_state(tmp_path)
    (tmp_path / CHECKSUMS).unlink()  # an old checkpoint without checksums: unreadable is named
    (tmp_path / "state.pt").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="unreadable"):
        load_state(tmp_path)
