"""Perplexity on held-out text, per context length.

The text (one string per document) is tokenized, concatenated with an end-of-document id between
documents, and cut into non-overlapping windows of each requested length; every window is an
independent document (its first token is not predicted). ``ppl = exp(mean NLL)`` over all
predicted tokens of the windows of that length. A remainder shorter than the window is dropped
(counted in ``dropped_tokens``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from .runner import ModelRunner


def read_texts(path: str | Path, text_field: str = "text") -> list[str]:
    """Documents of a ``.txt`` file (the whole file), a ``.jsonl`` (``text_field`` per line) or a
    directory of those."""
    path = Path(path)
    if path.is_dir():
        files = sorted([*path.glob("*.txt"), *path.glob("*.jsonl")])
        if not files:
            raise ValueError(f"--data {path}: no .txt or .jsonl files")
        return [t for f in files for t in read_texts(f, text_field)]
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"--data {path}: cannot read ({err.strerror})") from None
    if path.suffix != ".jsonl":
        return [raw]
    texts = []
    for i, line in enumerate(raw.splitlines(), 1):
        if line.strip():
            try:
                texts.append(str(json.loads(line)[text_field]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--data {path}:{i}: no {text_field!r} field") from None
    return texts


def perplexity(
    runner: ModelRunner,
    texts: Sequence[str],
    encode: Callable[[str], list[int]],
    lengths: Sequence[int],
    eod_id: int | None = None,
    max_windows: int | None = None,
    pack_tokens: int = 16384,
    progress: Callable[[int], None] | None = None,
) -> dict[str, dict]:
    """``{str(length): {"ppl", "nll", "tokens", "windows", "dropped_tokens"}}`` per length."""
    stream: list[int] = []
    for text in texts:
        stream += encode(text)
        if eod_id is not None:
            stream.append(eod_id)
    out = {}
    for n in lengths:
        if n < 2:
            raise ValueError(f"--lengths: perplexity windows need >= 2 tokens, got {n}")
        num = len(stream) // n
        if max_windows is not None:
            num = min(num, max_windows)
        if num == 0:
            raise ValueError(f"--data: {len(stream)} tokens of held-out text, less than one {n}")
        windows = [stream[k * n : (k + 1) * n] for k in range(num)]
        total, count = 0.0, 0
        per_pack = max(1, pack_tokens // n)
        for a in range(0, num, per_pack):
            for nll in runner.token_nll(windows[a : a + per_pack]):
                total += float(nll.sum())
                count += len(nll)
            if progress is not None:
                progress(len(windows[a : a + per_pack]))
        out[str(n)] = {
            "ppl": math.exp(total / count),
            "nll": total / count,
            "tokens": count,
            "windows": num,
            "dropped_tokens": len(stream) - num * n,
        }
    return out
