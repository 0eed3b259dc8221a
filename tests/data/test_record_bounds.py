"""Unbounded records cannot exhaust memory: a record over ``max_record_bytes`` (after
decompression) is a bad record, found while it streams by, never read whole or tokenized."""

from __future__ import annotations

import gzip
import json
import tracemalloc

import pytest

from sparsebalance.cli import main
from sparsebalance.data.prepare import PrepareConfig, prepare
from sparsebalance.data.readers import MAX_RECORD_BYTES, BadRecords, read_records

LIMIT = 64 * 1024
BIG = json.dumps({"text": "a" * (4 * LIMIT)}).encode()  # 4x the limit
GOOD = [json.dumps({"text": f"good record {i}"}).encode() for i in range(2)]


def _jsonl(path, lines, opener=open):
    with opener(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    return path


def _read(path, policy="skip", limit=LIMIT):
    bad = BadRecords(policy, max_record_bytes=limit)
    return [t for t, _ in read_records(path, "text", bad)], bad


def test_the_default_is_64_mib_after_decompression():
    assert MAX_RECORD_BYTES == 64 * 2**20
    assert PrepareConfig(["x"], "y").max_record_bytes == MAX_RECORD_BYTES
    with pytest.raises(ValueError, match="--max-record-bytes must be >= 1"):
        PrepareConfig(["x"], "y", max_record_bytes=0)


def test_an_oversized_jsonl_line_is_a_bad_record_and_reading_goes_on(tmp_path):
    path = _jsonl(tmp_path / "a.jsonl", [GOOD[0], BIG, GOOD[1]])
    texts, bad = _read(path)
    assert texts == ["good record 0", "good record 1"]
    assert bad.summary() == {"record too large": {"count": 1, "first": [f"{path}:2"]}}
    with pytest.raises(ValueError, match=r"a\.jsonl:2: record too large .*--max-record-bytes"):
        _read(path, "error")
    # a line of exactly the limit (plus its newline) is fine
    exact = json.dumps({"text": "b" * (LIMIT - 12)}).encode()
    assert len(exact) == LIMIT
    texts, bad = _read(_jsonl(tmp_path / "b.jsonl", [exact]))
    assert len(texts) == 1 and bad.total == 0


def test_a_gzip_bomb_is_skipped_in_bounded_memory(tmp_path):
    bomb = json.dumps({"text": "z" * (64 * LIMIT)}).encode()  # 4 MiB that gzips to ~4 KiB
    path = _jsonl(tmp_path / "bomb.jsonl.gz", [bomb, GOOD[0]], gzip.open)
    assert path.stat().st_size < LIMIT
    tracemalloc.start()
    try:
        texts, bad = _read(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert texts == ["good record 0"] and bad.counts == {"record too large": 1}
    assert peak < 16 * LIMIT  # never the 4 MiB line (the limit plus the reader's buffers)


@pytest.mark.parametrize("name", ["doc.txt", "list.json"])
def test_whole_file_formats_must_fit_the_bound(tmp_path, name):
    path = tmp_path / name
    if name.endswith(".txt"):
        path.write_text("w " * LIMIT)
    else:
        path.write_text(json.dumps([{"text": "w " * LIMIT}]))
    texts, bad = _read(path)
    assert texts == [] and bad.counts == {"record too large": 1}
    with pytest.raises(ValueError, match="record too large"):
        _read(path, "error")


def test_a_giant_parquet_cell(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": ["fine", "y" * (2 * LIMIT), "also fine"]}), path)
    texts, bad = _read(path)
    assert texts == ["fine", "also fine"]
    assert bad.first == {"record too large": [f"{path} row 2"]}


def test_prepare_counts_them_and_the_flag_sets_the_bound(tmp_path, tokenizer, capsys):
    path = _jsonl(tmp_path / "in.jsonl", [GOOD[0], BIG, GOOD[1]])
    cfg = PrepareConfig([str(path)], str(tmp_path / "s"), on_bad_record="skip", progress=False, max_record_bytes=LIMIT)
    m = prepare(cfg, tokenizer)
    assert m["num_documents"] == 2 and m["bad_records"]["record too large"]["count"] == 1
    assert m["prepare"]["max_record_bytes"] == LIMIT
    rc = main(["prepare", str(path), "--out", str(tmp_path / "t"), "--no-progress", "--max-record-bytes", "64KiB"])
    assert rc == 2 and "in.jsonl:2: record too large" in capsys.readouterr().err
    assert main(["prepare", str(path), "--out", str(tmp_path / "u"), "--max-record-bytes", "lots"]) == 2
    assert "--max-record-bytes must be a size" in capsys.readouterr().err
