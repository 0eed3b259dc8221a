"""The small vocabulary the synthetic tasks are written in, and the train/eval partition.

Everything a task prompt contains comes from here: RULER's five noise sentences (the haystack),
a list of common English words (keys are hyphenated words) and decimal numbers (values; Qwen2's
tokenizer spells every digit as its own token). A model with a compact embedding table (the tiny
CPU model maps tokenizer ids onto 4096 ids) therefore sees only a few hundred distinct ids.

Splits are disjoint by construction: every key and value string is assigned to one split by a
CRC-32 hash (``crc32(s) % 5 == 0`` -> ``"eval"``, otherwise ``"train"``), and a generator draws
only strings of its own split, so no key or value of an evaluation example ever occurs in training.
"""

from __future__ import annotations

import zlib

import numpy as np

SPLITS: tuple[str, ...] = ("train", "eval")
"""The splits a generator accepts; keys and values never cross from one to the other."""

FILLER_SENTENCES: tuple[str, ...] = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
"""RULER's noise haystack, repeated in this order."""

_WORD_TEXT = """
    apple river stone cloud table window garden bread horse candle forest letter mountain
    silver basket bottle button castle circle copper cotton desert dragon engine feather
    finger flower galaxy hammer harbor island jacket kettle ladder lemon marble meadow
    mirror needle ocean orange paper pepper pillow planet pocket rabbit ribbon rocket saddle
    shadow shelter signal spider spring summer sunset tiger timber tomato tunnel valley
    velvet violin wagon walnut winter wizard yellow anchor arrow autumn badge banner barrel
    beacon blanket bridge bucket cabin camera canvas carpet cherry chimney clover comet
    compass coral crystal dolphin eagle ember falcon fossil fountain glacier hollow honey
    icicle jungle lantern lizard magnet maple melon mitten monkey nectar noodle oyster
    paddle parrot pebble pencil piano pirate quartz quill radar raven rudder salmon sandal
    scarf shovel sparrow statue strawberry thunder tractor trumpet turtle umbrella vessel
    walrus whistle willow zebra acorn bamboo beetle biscuit blossom boulder canyon cedar
    cobalt cricket daisy domino elbow fabric ferry gravel hazel helmet iris jasmine kayak
    kitten lagoon linen lotus mango mosaic nickel olive orchid panda pearl pine plum
    puzzle radish reef saffron satin sequoia slate sponge tulip velcro wafer yarn
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
"""Common words keys are built from (lower case, no duplicates)."""


def check_split(split: str) -> str:
    """Return ``split`` if it is one of :data:`SPLITS`, else raise ``ValueError``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split


def split_of(item: str) -> str:
    """The split a key or value string belongs to (a fixed hash partition, ~20% eval)."""
    return "eval" if zlib.crc32(item.encode("utf-8")) % 5 == 0 else "train"


def draw_number(rng: np.random.Generator, num_digits: int, split: str) -> str:
    """A ``num_digits``-digit decimal number (no leading zero) of ``split``."""
    low, high = 10 ** (num_digits - 1), 10**num_digits
    while True:
        value = str(int(rng.integers(low, high)))
        if split_of(value) == split:
            return value


def draw_key(rng: np.random.Generator, num_words: int, split: str) -> str:
    """A key of ``num_words`` distinct hyphen-joined :data:`WORDS` of ``split``."""
    while True:
        picks = rng.choice(len(WORDS), size=num_words, replace=False)
        key = "-".join(WORDS[int(i)] for i in picks)
        if split_of(key) == split:
            return key


def draw_distinct(draw, count: int, taken: set[str]) -> list[str]:
    """``count`` results of ``draw()`` not in ``taken`` and distinct (adds them to ``taken``)."""
    out: list[str] = []
    while len(out) < count:
        item = draw()
        if item not in taken:
            taken.add(item)
            out.append(item)
    return out
