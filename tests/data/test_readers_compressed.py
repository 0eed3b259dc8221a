"""Issue 45 (weak): a truncated or damaged ``.jsonl.gz`` / ``.jsonl.zst`` is one line naming the
file and saying what is wrong with it, before any of it is tokenised, whatever
``--on-bad-record`` says (it was an unnamed ``EOFError`` for gzip, and for zstd an "invalid JSON"
record at the cut, which ``skip`` dropped without a word about the missing rest)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from sparsebalance.cli import main
from sparsebalance.data.prepare import PrepareConfig, prepare
from sparsebalance.data.readers import BadRecords, check_compressed, read_records

DATA = "".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(300)).encode()


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data)


def _zstd(data: bytes) -> bytes:
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdCompressor().compress(data)


def _write(tmp_path, name: str, blob: bytes):
    path = tmp_path / name
    path.write_bytes(blob)
    return path


# name -> how its bytes are made -> what the one line says
DAMAGED = [
    pytest.param("in.jsonl.gz", lambda: _gzip(DATA)[:-700], "truncated: the gzip stream ends", id="gzip-truncated"),
    pytest.param(
        "in.jsonl.gz",
        lambda: _gzip(DATA)[:-8] + b"\0" * 8,
        "not a readable gzip file (BadGzipFile: CRC check failed",
        id="gzip-crc",
    ),
    pytest.param("in.jsonl.zst", lambda: _zstd(DATA)[:-300], "truncated: the zstd stream ends", id="zstd-truncated"),
]


class _Counting:
    """A tokenizer that counts the texts it was asked to encode."""

    def __init__(self, tokenizer):
        self.inner, self.texts = tokenizer, 0
        self.name, self.vocab_size = tokenizer.name, tokenizer.vocab_size
        self.identity, self.eos_token_id = tokenizer.identity, tokenizer.eos_token_id

    def encode(self, text):
        self.texts += 1
        return self.inner.encode(text)

    def encode_batch(self, texts):
        return [np.asarray(self.encode(t), np.int64) for t in texts]


@pytest.mark.parametrize("policy", ["error", "skip"])
@pytest.mark.parametrize("name, make, says", DAMAGED)
def test_a_damaged_compressed_input_is_one_line_before_tokenising(tmp_path, tokenizer, name, make, says, policy):
    path = _write(tmp_path, name, make())
    counting = _Counting(tokenizer)
    cfg = PrepareConfig([str(path)], str(tmp_path / "store"), on_bad_record=policy, progress=False)
    with pytest.raises(ValueError) as err:
        prepare(cfg, counting)
    line = str(err.value)
    assert line.startswith(f"{path}: {says}"), line
    assert "\n" not in line
    assert counting.texts == 0  # refused before a single record was tokenised
    assert not (tmp_path / "store").exists()


def test_prepare_names_the_truncated_file_in_one_line(tmp_path, capsys):
    path = _write(tmp_path, "docs.jsonl.gz", _gzip(DATA)[:-700])
    code = main(["prepare", str(path), "--out", str(tmp_path / "store"), "--no-progress"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert lines == [
        f"sparsebalance prepare: error: {path}: truncated: the gzip stream ends before its end "
        "marker (the file is incomplete: copy or download it again)"
    ]


@pytest.mark.parametrize("compress", [_gzip, _zstd], ids=["gzip", "zstd"])
def test_intact_compressed_inputs_read_whole(tmp_path, compress):
    suffix = ".jsonl.gz" if compress is _gzip else ".jsonl.zst"
    one = _write(tmp_path, "one" + suffix, compress(DATA))
    two = _write(tmp_path, "two" + suffix, compress(DATA) + compress(DATA))  # two members
    empty = _write(tmp_path, "empty" + suffix, b"")
    for path, records in ((one, 300), (two, 600), (empty, 0)):
        check_compressed(path)
        assert sum(1 for _ in read_records(path, "text", BadRecords())) == records
