"""Retrieval tasks: passkey, multi-key needle-in-a-haystack (RULER-style), key-value lookup.

Each builder takes a seeded ``numpy`` generator, draws its content (keys and values of the
requested split only), and fits the prompt to ``length`` tokens with :func:`fit_length`.

- ``passkey``: one 5-digit pass key hidden in RULER's noise haystack (Mohtashami & Jaggi, 2023).
- ``niah``: :data:`NIAH_NUM_NEEDLES` needles "The special magic number for KEY is: VALUE." with
  distinct two-word keys and 7-digit values; one is queried, the others are distractors at random
  depths (RULER's ``niah_multikey_1``, with the noise haystack).
- ``niah1``: single-needle NIAH: the same needle sentence, no distractors (RULER's
  ``niah_single_2`` with the noise haystack).
- ``kv``: a JSON object of three-word keys and 6-digit values (no noise text: the pairs are the
  haystack); the queried pair sits at ``depth`` (Liu et al., "Lost in the Middle", with short keys
  instead of UUIDs to keep the vocabulary small).
"""

from __future__ import annotations

import numpy as np

from .example import Encode, TaskExample, finish_example, haystack
from .vocab import draw_distinct, draw_key, draw_number

NIAH_NUM_NEEDLES = 4
"""Needles per ``niah`` prompt: one queried plus three distractors."""

PASSKEY_PREFIX = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
NIAH_PREFIX = "Some special magic numbers are hidden in the text below. Memorize them.\n\n"
KV_PREFIX = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n{"


def make_passkey(rng: np.random.Generator, length: int, encode: Encode, split: str, depth: float) -> TaskExample:
    """A passkey example whose prompt is ``length`` tokens (see module docstring)."""
    key = draw_number(rng, 5, split)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    question = "\n\nWhat is the pass key? The pass key is"

    def render(n: int) -> str:
        return PASSKEY_PREFIX + haystack(n, [(depth, needle)]) + question

    return finish_example("passkey", render, length, encode, f" {key}", depth, split)


def make_niah(
    rng: np.random.Generator,
    length: int,
    encode: Encode,
    split: str,
    depth: float,
    num_needles: int = NIAH_NUM_NEEDLES,
    task: str = "niah",
) -> TaskExample:
    """A multi-key needle example: the queried needle at ``depth``, ``num_needles - 1``
    distractors elsewhere."""
    keys = draw_distinct(lambda: draw_key(rng, 2, split), num_needles, set())
    values = draw_distinct(lambda: draw_number(rng, 7, split), num_needles, set())
    depths = [depth, *(float(d) for d in rng.uniform(0.0, 1.0, num_needles - 1))]
    needles = [(d, f"The special magic number for {k} is: {v}.") for d, k, v in zip(depths, keys, values, strict=True)]
    needles.sort(key=lambda item: item[0])
    question = f"\n\nWhat is the special magic number for {keys[0]}? The special magic number for {keys[0]} is:"

    def render(n: int) -> str:
        return NIAH_PREFIX + haystack(n, needles) + question

    return finish_example(task, render, length, encode, f" {values[0]}", depth, split)


def make_niah_single(rng: np.random.Generator, length: int, encode: Encode, split: str, depth: float) -> TaskExample:
    """A single-needle example (``niah1``): one needle at ``depth``, no distractors."""
    return make_niah(rng, length, encode, split, depth, num_needles=1, task="niah1")


def make_kv(rng: np.random.Generator, length: int, encode: Encode, split: str, depth: float) -> TaskExample:
    """A key-value retrieval example: ``n`` other pairs, the queried pair at ``depth``."""
    taken: set[str] = set()
    key = draw_distinct(lambda: draw_key(rng, 3, split), 1, taken)[0]
    value = draw_number(rng, 6, split)
    others: list[str] = []  # grown on demand; depends only on rng order, never on the search

    def pairs(n: int) -> list[str]:
        while len(others) < n:
            k = draw_distinct(lambda: draw_key(rng, 3, split), 1, taken)[0]
            others.append(f'"{k}": "{draw_number(rng, 6, split)}"')
        return others[:n]

    target = f'"{key}": "{value}"'
    question = f'}}\n\nKey: "{key}"\nThe value associated with the specified key is:'

    def render(n: int) -> str:
        items = pairs(n)
        at = round(depth * n)
        return KV_PREFIX + ", ".join([*items[:at], target, *items[at:]]) + question

    return finish_example("kv", render, length, encode, f" {value}", depth, split)
