"""Multi-query associative recall (``mqar``), after Zoology (Arora et al., 2023), in text.

Zoology's MQAR is the standard probe of whether a small model can recall: a block of key-value
pairs, then several keys queried again; a 2-layer attention model solves it at 512+ tokens. Here
the keys are single :data:`~.vocab.WORDS` (1-3 Qwen2 tokens) and the values 3-digit numbers, so the
task lives in the same compact vocabulary as the others:

    ... The grass is green. apple 417, river 902, ..., candle 385. The sky is blue. ...
    Recall: river 902, candle 385, apple 417, tiger

The :data:`MQAR_NUM_PAIRS` pairs sit together at ``depth`` in RULER's noise haystack; the
:data:`MQAR_NUM_QUERIES` queries (distinct keys, random order) come at the end. The scored answer
is the *last* query's value (`` 512``); the earlier queries' values are part of the prompt, so a
trainer's language-model loss learns every query while exact match scores one per example.
"""

from __future__ import annotations

import numpy as np

from .example import Encode, TaskExample, finish_example, haystack
from .vocab import WORDS, draw_distinct, draw_number, split_of

MQAR_NUM_PAIRS = 8
"""Key-value pairs in the block."""
MQAR_NUM_QUERIES = 4
"""Keys queried at the end (the last one is the scored answer)."""


def _draw_word(rng: np.random.Generator, split: str) -> str:
    while True:
        word = WORDS[int(rng.integers(len(WORDS)))]
        if split_of(word) == split:
            return word


def make_mqar(rng: np.random.Generator, length: int, encode: Encode, split: str, depth: float) -> TaskExample:
    """An MQAR example whose prompt is ``length`` tokens (see module docstring)."""
    keys = draw_distinct(lambda: _draw_word(rng, split), MQAR_NUM_PAIRS, set())
    values = [draw_number(rng, 3, split) for _ in keys]
    block = ", ".join(f"{k} {v}" for k, v in zip(keys, values, strict=True)) + "."
    asked = [int(i) for i in rng.choice(MQAR_NUM_PAIRS, size=MQAR_NUM_QUERIES, replace=False)]
    queries = ", ".join(f"{keys[i]} {values[i]}" for i in asked[:-1])
    question = f"\n\nRecall: {queries}, {keys[asked[-1]]}"

    def render(n: int) -> str:
        return haystack(n, [(depth, block)]) + question

    return finish_example("mqar", render, length, encode, f" {values[asked[-1]]}", depth, split)
