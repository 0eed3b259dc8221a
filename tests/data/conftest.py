"""Shared fixtures: the default tokenizer (loaded once) and small input files."""

from __future__ import annotations

import json

import pytest

from sparsebalance.data import load_tokenizer

TEXTS = [
    "The passkey is 4821. Remember it.",
    "Alice keeps the red key in the blue box under the old oak table.",
    "Ünïcödé text: naïve café, 東京, emoji 🙂 and <|endoftext|> inside.",
    "one two three four five six seven eight nine ten " * 20,
    "a short one",
    "x",  # one token: too short to store (needs a next-token label)
]


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path
