"""Tokenizer ids <-> model ids for evaluation (``data/tokenizer.py``: ``make_codec``)."""

from __future__ import annotations

import pytest

from sparsebalance.data.tokenizer import make_codec


class _Chars:
    """A toy tokenizer: one id per character (ord), end of document = 1000."""

    eos_token_id = 1000

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 1000))


def test_compact_vocabulary_round_trip_and_unknown():
    vmap = {ord("a"): 1, ord("b"): 2, 1000: 3}
    encode, decode, eos = make_codec(_Chars(), vmap, vocab_size=4)
    assert encode("abz") == [1, 2, 0]  # z is not in the map: unknown id 0
    assert decode([1, 2, 0, 2]) == "abb"  # id 0 has no tokenizer id: dropped
    assert eos == 3


def test_without_a_map_the_model_must_cover_the_tokenizer():
    encode, decode, eos = make_codec(_Chars(), None, vocab_size=1001)
    assert encode("ab") == [97, 98] and decode([97]) == "a" and eos == 1000
    with pytest.raises(ValueError, match="--vocab-map"):
        make_codec(_Chars(), None, vocab_size=1000)


def test_decode_skips_special_tokens_like_longbench():
    # LongBench's pred.py decodes answers with skip_special_tokens=True
    from sparsebalance.data import load_tokenizer

    tok = load_tokenizer()
    ids = [*tok.encode("B"), tok.eos_token_id]
    _, decode, _ = make_codec(tok, None, vocab_size=200_000)
    assert decode(ids) == "B" and "<|" in tok.decode(ids)
    _, decode_toy, _ = make_codec(_Chars(), {ord("a"): 1, 1000: 2}, vocab_size=3)
    assert decode_toy([1, 2, 1]) == "aa"
