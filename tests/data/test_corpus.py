"""``--data`` resolution: stores, raw inputs prepared once into the cache, mixtures, the length
filter and the compact vocabulary built from the stores' token counts."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.data.dataset import (
    apply_vocabulary,
    compact_vocabulary,
    load_corpus,
    open_corpus,
    resolve_data,
)
from sparsebalance.data.prepare import PrepareConfig, prepare
from sparsebalance.data.store import TokenStore

from .conftest import TEXTS, write_jsonl


def test_raw_input_prepared_once_keyed_by_content(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    cache = tmp_path / "cache"
    (first,) = resolve_data(str(src), tokenizer, cache_dir=cache)
    stamp = (TokenStore(first.store).path / "manifest.json").stat().st_mtime_ns
    src.touch()  # a new mtime, same content: same store, not prepared again
    (again,) = resolve_data(str(src), tokenizer, cache_dir=cache)
    assert again.store == first.store
    assert (TokenStore(again.store).path / "manifest.json").stat().st_mtime_ns == stamp
    write_jsonl(src, [{"text": t} for t in TEXTS[:3]])
    (changed,) = resolve_data(str(src), tokenizer, cache_dir=cache)
    assert changed.store != first.store and len(TokenStore(changed.store)) == 3


def test_store_and_mixture_global_ids(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS[:2]])
    store = tmp_path / "b-store"
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in TEXTS[2:5]])
    prepare(PrepareConfig([str(b)], str(store), progress=False), tokenizer)
    corpus = load_corpus(f"{a}:3,{store}:1", tokenizer, cache_dir=tmp_path / "cache")
    assert len(corpus) == 5 and corpus.weights == [0.75, 0.25]
    want = [tokenizer.encode(t) for t in TEXTS[:5]]
    assert [corpus.docs[i].tolist() for i in range(5)] == want
    np.testing.assert_array_equal(corpus.lengths(), [len(w) for w in want])
    assert [corpus.sources[i] for i in range(5)] == ["a", "a", "b", "b", "b"]
    assert corpus.locate(3) == (1, 1) and corpus.global_id(1, 1) == 3
    ident = corpus.identity()
    assert [c["weight"] for c in ident["components"]] == [0.75, 0.25]
    assert ident["components"][1]["content_hash"] == TokenStore(store).content_hash


def test_store_from_another_tokenizer_refused(tmp_path, tokenizer):
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in TEXTS])
    prepare(PrepareConfig([str(b)], str(tmp_path / "s"), progress=False), tokenizer)

    class Other:
        name = identity = "other-tokenizer"
        vocab_size = 10

    with pytest.raises(ValueError, match=r"prepared with tokenizer .* this run uses other"):
        resolve_data(str(tmp_path / "s"), Other())


def test_length_filter_counted(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    lengths = [len(tokenizer.encode(t)) for t in TEXTS[:5]]
    corpus = load_corpus(str(src), tokenizer, min_len=5, max_len=30, cache_dir=tmp_path / "c")
    keep = [i for i, n in enumerate(lengths) if 5 <= n <= 30]
    assert corpus.pools()[0].tolist() == keep
    counts = corpus.filtered[str(src)]
    assert counts["shorter than --min-len"] == sum(n < 5 for n in lengths)
    assert counts["longer than --max-len"] == sum(n > 30 for n in lengths)
    assert counts["shorter than --min-len"] > 0 and counts["longer than --max-len"] > 0


def test_compact_vocabulary_from_counts_matches_the_tokens(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    corpus = load_corpus(str(src), tokenizer, cache_dir=tmp_path / "c")
    raw = [corpus.docs[i].copy() for i in range(len(corpus))]
    ids, counts = np.unique(np.concatenate(raw), return_counts=True)  # the old definition
    order = np.lexsort((ids, -counts))[:15]
    want = {int(ids[i]): r + 1 for r, i in enumerate(order)}
    vmap = compact_vocabulary(corpus, 16)
    assert vmap == want
    apply_vocabulary(corpus, vmap)
    for d, r in zip((corpus.docs[i] for i in range(len(corpus))), raw, strict=True):
        assert d.tolist() == [vmap.get(int(t), 0) for t in r]
    assert corpus.meta["unknown_tokens"] == sum(int((corpus.docs[i] == 0).sum()) for i in range(len(corpus)))


def test_builtin_data_is_a_cached_store(tmp_path, tokenizer):
    (src,) = resolve_data(None, tokenizer, num_builtin=8, cache_dir=tmp_path)
    corpus = open_corpus([src])
    assert len(corpus) == 8 and src.name == "builtin"
    assert set(corpus.sources[i] for i in range(8)) <= {"passkey", "niah", "kv"}
    assert resolve_data(None, tokenizer, num_builtin=8, cache_dir=tmp_path)[0].store == src.store
