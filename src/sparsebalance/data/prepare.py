"""Prepare: input files -> a token store, streamed and tokenized in parallel.

The main thread reads and parses records (:mod:`.readers`) into chunks of about ``chunk_bytes``
of text; ``workers`` threads tokenize chunks with the tokenizer's batch encoder (tiktoken and HF
``tokenizers`` release the GIL while encoding, so threads run in parallel without copying text to
other processes); finished chunks are appended in input order to a :class:`~.store.StoreWriter`.
At most ``2 * workers`` chunks are in flight, so memory does not grow with the input size.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .readers import (
    MAX_RECORD_BYTES,
    BadRecords,
    file_digest,
    input_files,
    read_records,
    source_stem,
)
from .store import VERSION, StoreWriter
from .tokenizer import Tokenizer

TOKENIZE_BYTES_PER_S = 10e6
"""Input bytes one tokenizer thread gets through per second, roughly, for the line said before a
long tokenization (28 MB/s measured with the Qwen tokenizer on plain English words on a 2-core
CPU; real text, other tokenizers and compressed inputs are slower per input byte)."""
SAY_AFTER_S = 5.0
"""A tokenization expected to take longer than this is announced in one line first."""


@dataclass
class PrepareConfig:
    inputs: list[str]
    """Input files or folders (jsonl, jsonl.gz, jsonl.zst, json, parquet, txt, HF dataset)."""
    out: str
    """The store folder to write (written under a temporary name, renamed when complete)."""
    text_field: str = "text"
    """Field holding the text in jsonl / json / parquet / Arrow records."""
    workers: int = field(default_factory=lambda: max(1, os.cpu_count() or 1))
    """Tokenizer threads."""
    on_bad_record: str = "error"
    """error: stop at the first bad record, naming file and line; skip: skip and count them."""
    min_tokens: int = 2
    """Documents with fewer tokens are not stored (counted in the manifest): a document needs
    two tokens to have one next-token label."""
    overwrite: bool = False
    """Replace an existing store at --out."""
    chunk_bytes: int = 1 << 20
    """Text per tokenizer task (bytes)."""
    max_record_bytes: int = MAX_RECORD_BYTES
    """A record longer than this (bytes after decompression) is a bad record ("record too
    large"): memory stays bounded whatever the input holds."""
    progress: bool = True
    """Show a progress bar (documents/s, MB/s) on stderr."""

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("prepare needs at least one INPUT")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.min_tokens < 1:
            raise ValueError(f"--min-tokens must be >= 1, got {self.min_tokens}")
        if self.chunk_bytes < 1:
            raise ValueError(f"--chunk-bytes must be >= 1, got {self.chunk_bytes}")
        BadRecords(self.on_bad_record, max_record_bytes=self.max_record_bytes)  # validates both


def describe_inputs(paths: list[str | Path], flag: str = "INPUT") -> list[dict]:
    """Each input's path, source stem, size and sha256 (the content the store is made from)."""
    out = []
    for f in input_files(paths, flag):
        size = sum(p.stat().st_size for p in f.rglob("*") if p.is_file()) if f.is_dir() else None
        out.append(
            {
                "path": str(f),
                "stem": source_stem(f),
                "bytes": size if size is not None else f.stat().st_size,
                "sha256": file_digest(f),
            }
        )
    return out


def store_key(inputs: list[dict], tokenizer_identity: str, text_field: str, min_tokens: int) -> str:
    """What a store's content depends on (input bytes, not paths or mtimes): the cache key."""
    parts = [[i["stem"], i["sha256"]] for i in inputs]
    blob = json.dumps([VERSION, tokenizer_identity, text_field, min_tokens, parts])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def tokenizer_info(tokenizer: Tokenizer) -> dict:
    return {
        "name": tokenizer.name,
        "identity": tokenizer.identity,
        "vocab_size": int(tokenizer.vocab_size),
        "eos_token_id": tokenizer.eos_token_id,
    }


def prepare(cfg: PrepareConfig, tokenizer: Tokenizer, inputs: list[dict] | None = None) -> dict:
    """Write the store; return its manifest (+ ``elapsed`` seconds). ``inputs``: precomputed
    :func:`describe_inputs` (the caller may already have hashed them for a cache key).

    The store is taken (:class:`StoreWriter`: refused when it exists without ``overwrite`` or
    another prepare writes it) after the inputs are found and before they are hashed or read."""
    files = input_files(cfg.inputs) if inputs is None else []
    bad = BadRecords(cfg.on_bad_record, max_record_bytes=cfg.max_record_bytes)
    encode = tokenizer.encode_batch
    info = tokenizer_info(tokenizer)
    with StoreWriter(cfg.out, info, overwrite=cfg.overwrite) as writer:
        inputs = inputs if inputs is not None else describe_inputs(files)
        total_bytes = sum(i["bytes"] for i in inputs)
        _announce(cfg, inputs, total_bytes)
        t0 = time.perf_counter()
        bar = _Progress(total_bytes, cfg.progress)
        text_chars, short = _tokenize(cfg, inputs, encode, writer, bad, bar)
        elapsed = time.perf_counter() - t0
        extra = {
            "inputs": inputs,
            "inputs_hash": store_key(inputs, info["identity"], cfg.text_field, cfg.min_tokens),
            "prepare": {
                "text_field": cfg.text_field,
                "min_tokens": cfg.min_tokens,
                "on_bad_record": cfg.on_bad_record,
                "max_record_bytes": cfg.max_record_bytes,
                "workers": cfg.workers,
                "input_bytes": total_bytes,
                "text_chars": text_chars,
                "elapsed_s": round(elapsed, 3),
            },
            "bad_records": bad.summary(),
            "skipped_short": short,
        }
        if writer.num_documents == 0:
            raise ValueError(
                f"{', '.join(cfg.inputs)}: no document with >= {cfg.min_tokens} tokens "
                f"({short['documents']} too short, {bad.total} bad records)"
            )
        path = writer.close(extra)
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    swept = [str(t) for t in writer.swept]
    return {**manifest, "elapsed": elapsed, "swept": swept}


def _announce(cfg: PrepareConfig, inputs: list[dict], total_bytes: int) -> None:
    """Say on stderr, once and before the wait, what is tokenized and roughly how long it takes,
    when that is over :data:`SAY_AFTER_S` (the bar, if any, follows)."""
    threads = min(cfg.workers, os.cpu_count() or 1)
    expected = total_bytes / (TOKENIZE_BYTES_PER_S * threads)
    if expected > SAY_AFTER_S:
        names = ", ".join(Path(i["path"]).name for i in inputs[:3])
        names += f" and {len(inputs) - 3} more" if len(inputs) > 3 else ""
        print(
            f"sparsebalance: tokenizing {total_bytes / 1e6:,.0f} MB of input ({names}) "
            f"into {cfg.out} with {threads} thread{'s' if threads > 1 else ''}: roughly "
            f"{_minutes(expected)} (at ~{TOKENIZE_BYTES_PER_S / 1e6:.0f} MB/s per "
            "thread)",
            file=sys.stderr,
            flush=True,
        )


def _tokenize(
    cfg: PrepareConfig, inputs: list[dict], encode, writer: StoreWriter, bad: BadRecords, bar: _Progress
) -> tuple[int, dict]:
    """Read the inputs' records, tokenize chunks of ``cfg.chunk_bytes`` on ``cfg.workers``
    threads (at most 2 x workers chunks queued) and write the documents of >= ``min_tokens``
    in input order; returns (text characters read, the short documents skipped)."""
    short = {"documents": 0, "tokens": 0}
    text_chars = 0

    def flush(job) -> None:
        future, sources = job
        docs = future.result()
        keep = [i for i, d in enumerate(docs) if len(d) >= cfg.min_tokens]
        dropped = [len(d) for d in docs if len(d) < cfg.min_tokens]
        short["documents"] += len(dropped)
        short["tokens"] += sum(dropped)
        writer.add_many([docs[i] for i in keep], [sources[i] for i in keep])
        bar.docs(len(docs))

    pending: deque = deque()
    with ThreadPoolExecutor(cfg.workers) as pool:
        try:
            texts, sources, size = [], [], 0
            for item in inputs:
                for text, source in read_records(Path(item["path"]), cfg.text_field, bad, bar.bytes):
                    texts.append(text)
                    sources.append(source)
                    size += len(text)
                    if size >= cfg.chunk_bytes:
                        pending.append((pool.submit(encode, texts), sources))
                        text_chars += size
                        texts, sources, size = [], [], 0
                        while len(pending) > 2 * cfg.workers:
                            flush(pending.popleft())
            if texts:
                pending.append((pool.submit(encode, texts), sources))
                text_chars += size
            while pending:
                flush(pending.popleft())
        finally:
            for future, _ in pending:  # interrupted: drop queued work before the pool joins
                future.cancel()
            bar.close()
    return text_chars, short


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


class _Progress:
    """tqdm over input bytes (MB/s) with documents/s in the postfix; silent when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        self.num_docs, self.t0 = 0, time.perf_counter()
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", mininterval=0.5)

    def bytes(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def docs(self, n: int) -> None:
        self.num_docs += n
        if self.bar is not None:
            rate = self.num_docs / max(1e-9, time.perf_counter() - self.t0)
            self.bar.set_postfix_str(f"{self.num_docs} docs, {rate:,.0f} docs/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
