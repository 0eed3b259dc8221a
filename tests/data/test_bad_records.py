"""Bad records: each class stops the run naming file and line, or is skipped and counted."""

from __future__ import annotations

import json

import pytest

from sparsebalance.data.prepare import PrepareConfig, prepare
from sparsebalance.data.readers import REASONS, BadRecords
from sparsebalance.data.store import TokenStore

GOOD = json.dumps({"text": "a perfectly good record"}).encode()
BAD = {
    "invalid JSON": b'{"text": "unterminated',
    "invalid UTF-8": b'{"text": "caf\xe9"}',
    "not a JSON object": b'["text", "in a list"]',
    "missing text field": b'{"content": "wrong field"}',
    "text is not a string": b'{"text": {"nested": "dict"}}',
}
SURROGATE = b'{"text": "lone \\ud800 surrogate"}'


def _file(tmp_path, bad_lines):
    lines = [GOOD, *bad_lines, GOOD]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _prepare(tmp_path, path, policy, tokenizer):
    cfg = PrepareConfig([str(path)], str(tmp_path / "s"), on_bad_record=policy, progress=False)
    return prepare(cfg, tokenizer)


@pytest.mark.parametrize("reason", list(BAD))
def test_error_names_file_line_and_reason(tmp_path, tokenizer, reason):
    path = _file(tmp_path, [BAD[reason]])
    with pytest.raises(ValueError) as err:
        _prepare(tmp_path, path, "error", tokenizer)
    assert f"{path}:2: {reason}" in str(err.value)
    assert "--on-bad-record skip" in str(err.value)
    assert not (tmp_path / "s").exists()


def test_skip_counts_every_reason_with_first_lines(tmp_path, tokenizer):
    lines = [BAD[r] for r in BAD] * 3 + [SURROGATE]  # too-large records: test_record_bounds.py
    path = _file(tmp_path, lines)
    m = _prepare(tmp_path, path, "skip", tokenizer)
    bad = m["bad_records"]
    assert set(bad) == set(BAD) == set(REASONS) - {"record too large"}
    assert bad["invalid JSON"] == {"count": 3, "first": [f"{path}:2", f"{path}:7", f"{path}:12"]}
    assert bad["invalid UTF-8"]["count"] == 4  # 3 byte-level + 1 surrogate escape
    assert bad["invalid UTF-8"]["first"][-1] == f"{path}:17"
    st = TokenStore(tmp_path / "s")
    assert len(st) == 2  # the two good records, and no str(dict) of the nested one
    assert all("nested" not in tokenizer.decode(st.doc(i).tolist()) for i in range(len(st)))


def test_first_locations_capped():
    bad = BadRecords("skip", keep=2)
    for i in range(5):
        bad.report("invalid JSON", f"f:{i}")
    assert bad.summary() == {"invalid JSON": {"count": 5, "first": ["f:0", "f:1"]}}
    assert "5 invalid JSON (first: f:0, f:1)" in bad.describe()
    with pytest.raises(ValueError, match="--on-bad-record must be"):
        BadRecords("ignore")


def test_parquet_null_and_non_string(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": ["good one", None, "good two"]}), path)
    with pytest.raises(ValueError, match=r"p.parquet row 2: text is not a string \('text' is a NoneType"):
        _prepare(tmp_path, path, "error", tokenizer)
    m = _prepare(tmp_path, path, "skip", tokenizer)
    assert m["bad_records"] == {"text is not a string": {"count": 1, "first": [f"{path} row 2"]}}
    assert m["num_documents"] == 2


def test_txt_invalid_utf8_line(tmp_path, tokenizer):
    path = tmp_path / "t.txt"
    path.write_bytes(b"line one\nline two \xff\n")
    with pytest.raises(ValueError, match=r"t.txt:2: invalid UTF-8"):
        _prepare(tmp_path, path, "error", tokenizer)
