"""Data: tokenizer, documents (user files or the built-in synthetic tasks), packing."""

from .dataset import TokenizedCorpus, load_corpus
from .packing import PackedBatch, pack
from .tokenizer import load_tokenizer

__all__ = ["PackedBatch", "TokenizedCorpus", "load_corpus", "load_tokenizer", "pack"]
