"""Data: tokenizer, documents (user files or the built-in synthetic tasks), packing, and the
length files of ``plan`` / ``simulate``."""

from .dataset import TokenizedCorpus, load_corpus
from .lengths import read_lengths
from .packing import PackedBatch, pack
from .tokenizer import load_tokenizer

__all__ = [
    "PackedBatch",
    "TokenizedCorpus",
    "load_corpus",
    "load_tokenizer",
    "pack",
    "read_lengths",
]
