"""Tokenizer ids <-> model ids for evaluation (``data/tokenizer.py``: ``make_codec``)."""

from __future__ import annotations

import pytest

from sparsebalance.data.tokenizer import make_codec


class _Chars:
    """A toy tokenizer: one id per character (ord), end of document = 1000."""

    eos_token_id = 1000

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


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
