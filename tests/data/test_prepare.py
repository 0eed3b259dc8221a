"""``prepare``: every input format round-trips to the tokenizer's own ids; atomic; the CLI."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from sparsebalance.cli import main as cli
from sparsebalance.data.prepare import PrepareConfig, describe_inputs, prepare, store_key
from sparsebalance.data.store import TokenStore, is_store

from .conftest import TEXTS, write_jsonl


def _expected(tokenizer, texts):
    return [t for t in (tokenizer.encode(x) for x in texts) if len(t) >= 2]


def _docs(store):
    return [store.doc(i).tolist() for i in range(len(store))]


def _run(tmp_path, inputs, tokenizer, **kw):
    kw.setdefault("progress", False)
    cfg = PrepareConfig([str(p) for p in inputs], str(tmp_path / "store"), **kw)
    return prepare(cfg, tokenizer), TokenStore(tmp_path / "store")


@pytest.mark.parametrize("chunk_bytes,workers", [(1 << 20, 2), (10, 3)])
def test_round_trip_equals_direct_tokenization(tmp_path, tokenizer, chunk_bytes, workers):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t, "source": f"s{i % 2}"} for i, t in enumerate(TEXTS)])
    m, st = _run(tmp_path, [src], tokenizer, chunk_bytes=chunk_bytes, workers=workers)
    assert _docs(st) == _expected(tokenizer, TEXTS)  # order kept, "x" (1 token) skipped
    assert m["skipped_short"] == {"documents": 1, "tokens": 1}
    assert st.source(0) == "s0" and st.source(1) == "s1"
    assert m["tokenizer"]["identity"] == tokenizer.identity and st.dtype == np.uint32
    assert m["inputs"][0]["bytes"] == src.stat().st_size


def test_formats(tmp_path, tokenizer):
    """jsonl.gz, jsonl.zst, json, parquet, txt, a saved HF dataset folder: same documents."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    import zstandard

    texts = TEXTS[:4]
    recs = [{"text": t} for t in texts]
    write_jsonl(tmp_path / "g.jsonl.gz", recs, opener=gzip.open)
    raw = "".join(json.dumps(r) + "\n" for r in recs).encode()
    (tmp_path / "z.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "j.json").write_text(json.dumps(recs))
    table = pa.table({"text": texts})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=2)
    hf = tmp_path / "hf"
    hf.mkdir()
    with (
        pa.OSFile(str(hf / "data-00000-of-00001.arrow"), "wb") as f,
        pa.ipc.new_stream(f, table.schema) as w,
    ):
        w.write_table(table, max_chunksize=3)
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (tmp_path / "t.txt").write_text(texts[2])
    want = _expected(tokenizer, texts)
    for i, name in enumerate(["g.jsonl.gz", "z.jsonl.zst", "j.json", "p.parquet", "hf"]):
        out = tmp_path / f"o{i}"
        prepare(PrepareConfig([str(tmp_path / name)], str(out), progress=False), tokenizer)
        assert _docs(TokenStore(out)) == want, name
    prepare(PrepareConfig([str(tmp_path / "t.txt")], str(tmp_path / "ot"), progress=False), tokenizer)
    st = TokenStore(tmp_path / "ot")
    assert _docs(st) == [tokenizer.encode(texts[2])] and st.source(0) == "t"


def test_folder_of_inputs_sorted(tmp_path, tokenizer):
    d = tmp_path / "in"
    d.mkdir()
    write_jsonl(d / "b.jsonl", [{"text": TEXTS[1]}])
    write_jsonl(d / "a.jsonl", [{"text": TEXTS[0]}])
    (d / "notes.md").write_text("ignored: not an input format")
    _, st = _run(tmp_path, [d], tokenizer)
    assert _docs(st) == _expected(tokenizer, TEXTS[:2])
    assert st.source_names == ["a", "b"]


def test_content_hash_not_path_or_mtime(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "x" / "d.jsonl" if (tmp_path / "x").mkdir() is None else None, [{"text": "hello world"}])
    b = write_jsonl((tmp_path / "y").mkdir() or tmp_path / "y" / "d.jsonl", [{"text": "hello world"}])
    key = lambda p: store_key(describe_inputs([p]), tokenizer.identity, "text", 2)  # noqa: E731
    assert key(a) == key(b)
    write_jsonl(b, [{"text": "hello world!"}])
    assert key(a) != key(b)


def test_interrupted_prepare_leaves_nothing_loadable(tmp_path, tokenizer, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS * 50])
    import sparsebalance.data.prepare as mod

    real = mod.read_records

    def dying(*args, **kw):
        for i, rec in enumerate(real(*args, **kw)):
            if i == 120:
                raise KeyboardInterrupt  # Ctrl-C in the middle of the input
            yield rec

    monkeypatch.setattr(mod, "read_records", dying)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, [src], tokenizer, chunk_bytes=100)
    assert not is_store(tmp_path / "store") and not (tmp_path / "store").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]  # temporary folder removed


def test_cli_prepare_and_refusals(tmp_path, tokenizer, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    out = tmp_path / "s"
    assert cli(["prepare", str(src), "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "5 documents" in text and "skipped 1 documents with < 2 tokens" in text
    assert cli(["prepare", str(src), "--out", str(out), "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli(["prepare", str(src), "--out", str(out), "--overwrite", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_documents"] == 5
    assert cli(["prepare", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "t")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli(["prepare", str(src), "--out", str(tmp_path / "t"), "--workers", "0"]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err


def test_hf_tokenizer_batch_encode_round_trip_uint16(tmp_path):
    """A local HF tokenizer folder: the fast batch encoder gives ``encode``'s ids; small
    vocabulary -> uint16 tokens; the identity is the files' hash, not the folder's path."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from sparsebalance.data.tokenizer import HFTokenizer

    words = sorted({w for t in TEXTS for w in t.split()})
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    for d in ("t1", "t2"):
        (tmp_path / d).mkdir()
        tok.save(str(tmp_path / d / "tokenizer.json"))
        (tmp_path / d / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"})
        )
    hf = HFTokenizer(str(tmp_path / "t1"))
    assert hf.identity == HFTokenizer(str(tmp_path / "t2")).identity
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    _, st = _run(tmp_path, [src], hf, chunk_bytes=50)
    assert st.dtype == np.uint16
    assert _docs(st) == [hf.encode(t) for t in TEXTS if len(hf.encode(t)) >= 2]
