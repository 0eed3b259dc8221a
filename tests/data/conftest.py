"""Shared fixtures: the default tokenizer (loaded once) and small input files."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os

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


class FullDisk:
    """What the store writes goes to files sharing ``free`` bytes; the write that does not fit
    raises ``OSError(ENOSPC)``, as on a full disk (a buffered file's ``close`` then fails too)."""

    def __init__(self, free: int) -> None:
        self.free = free

    def install(self, monkeypatch) -> FullDisk:
        """Every file the store module opens for writing (through its module-level ``open``)."""
        monkeypatch.setattr("sparsebalance.data.store.open", self.open, raising=False)
        return self

    def open(self, file, mode="r", *args, **kwargs):
        if "w" not in mode:
            return builtins.open(file, mode, *args, **kwargs)
        disk = self

        class Raw(io.FileIO):
            def write(self, b):
                n = memoryview(b).nbytes
                if n > disk.free:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                disk.free -= n
                return super().write(b)

        return io.BufferedWriter(Raw(file, "wb"))
