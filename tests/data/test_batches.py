"""BatchSource: global ids and per-component counts, exact resume, refusal on other data."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.data.batches import BatchSource
from sparsebalance.data.dataset import DataSource, open_corpus
from sparsebalance.data.store import StoreWriter

TOK = {"name": "fake", "identity": "fake@1", "vocab_size": 500}


def _store(path, num_docs, seed, tok=TOK):
    if path.exists():  # the same arguments made it: the same content
        return str(path)
    rng = np.random.default_rng(seed)
    with StoreWriter(path, tok) as w:
        w.add_many([rng.integers(0, 500, rng.integers(2, 60)) for _ in range(num_docs)], [f"src{seed}"] * num_docs)
        w.close()
    return str(path)


def _corpus(tmp_path, weights=(0.7, 0.3), sizes=(40, 30), seeds=(1, 2), **kw):
    srcs = [
        DataSource(f"c{i}", _store(tmp_path / f"s{i}-{s}-{n}", n, s), w)
        for i, (w, n, s) in enumerate(zip(weights, sizes, seeds, strict=True))
    ]
    return open_corpus(srcs, **kw)


def test_samples_have_global_ids_lengths_and_counts(tmp_path):
    corpus = _corpus(tmp_path)
    src = BatchSource(corpus, seed=0, global_batch=8)
    batch = src.next_batch()
    assert len(batch) == 8 and len({s.id for s in batch}) == 8
    for s in batch:
        assert s.num_tokens == len(corpus.docs[s.id]) and s.source == corpus.sources[s.id]
    comps = [corpus.locate(s.id)[0] for s in batch]
    assert src.metrics()["documents"] == {"c0": comps.count(0), "c1": comps.count(1)}
    assert sum(src.metrics()["drawn"].values()) == 8


def test_resume_continues_exactly(tmp_path):
    corpus = _corpus(tmp_path)
    full = BatchSource(corpus, 3, 8)
    want = [[s.id for s in full.next_batch()] for _ in range(20)]
    first = BatchSource(corpus, 3, 8)
    for _ in range(7):
        first.next_batch()
    again = BatchSource(corpus, 3, 8)
    again.load_state_dict(first.state_dict())
    assert [[s.id for s in again.next_batch()] for _ in range(13)] == want[7:]


def test_length_filter_applies_to_sampling(tmp_path):
    corpus = _corpus(tmp_path, min_len=20, max_len=40)
    src = BatchSource(corpus, 0, 4)
    lengths = [s.num_tokens for _ in range(30) for s in src.next_batch()]
    assert min(lengths) >= 20 and max(lengths) <= 40
    assert sum(corpus.filtered["c0"].values()) > 0


@pytest.mark.parametrize(
    "change,message",
    [
        ({"seeds": (1, 5)}, "--data c1: content changed"),
        ({"weights": (0.5, 0.5)}, "mixture weight 0.3 -> 0.5"),
        ({"min_len": 3}, "--min-len: checkpoint None, now 3"),
    ],
)
def test_resume_refuses_other_data(tmp_path, change, message):
    state = BatchSource(_corpus(tmp_path), 0, 8).state_dict()
    kw = {k: change[k] for k in ("seeds", "weights") if k in change}
    other = _corpus(tmp_path, **kw, min_len=change.get("min_len"))
    with pytest.raises(ValueError, match="--resume: the checkpoint was trained on other data") as e:
        BatchSource(other, 0, 8).load_state_dict(state)
    assert message in str(e.value)


def test_resume_refuses_another_tokenizer(tmp_path):
    state = BatchSource(_corpus(tmp_path), 0, 8).state_dict()
    tok2 = {**TOK, "identity": "fake@2"}
    srcs = [
        DataSource("c0", _store(tmp_path / "t0", 40, 1, tok2), 0.7),
        DataSource("c1", _store(tmp_path / "t1", 30, 2, tok2), 0.3),
    ]
    with pytest.raises(ValueError, match="tokenizer: checkpoint fake@1, now fake@2"):
        BatchSource(open_corpus(srcs), 0, 8).load_state_dict(state)
