"""Documents to tokens: user data (jsonl / parquet / text / a local HF ``datasets`` folder) or the
built-in synthetic long-context tasks; tokenized once and cached; a compact vocabulary for small
models whose embedding is smaller than the tokenizer's vocabulary."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CACHE_DIR = Path.home() / ".cache" / "sparsebalance" / "tokens"


@dataclass
class TokenizedCorpus:
    """Tokenized documents and their source keys (task / domain)."""

    docs: list[np.ndarray]
    sources: list[str]
    vocab_map: dict[int, int] | None = None
    """Tokenizer id -> model id when the model's vocabulary is compact; unknown ids map to 0."""
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.docs)

    def lengths(self) -> np.ndarray:
        return np.array([len(d) for d in self.docs])


def _read_texts(path: Path, text_field: str) -> tuple[list[str], list[str]]:
    """Texts (and sources) from a jsonl / json / parquet / txt file or a directory of them."""
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            try:
                import datasets
            except ImportError:
                raise ValueError(
                    f"--data {path}: a saved HF dataset needs `pip install datasets`"
                ) from None
            ds = datasets.load_from_disk(str(path))
            ds = ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
            if text_field not in ds.column_names:
                raise ValueError(
                    f"--data {path}: no field {text_field!r} (fields: {ds.column_names})"
                )
            return list(ds[text_field]), [str(path.name)] * len(ds)
        files = sorted(
            p for p in path.rglob("*") if p.suffix in (".jsonl", ".json", ".parquet", ".txt")
        )
        if not files:
            raise ValueError(f"--data {path}: no .jsonl/.json/.parquet/.txt files in the directory")
        texts, sources = [], []
        for f in files:
            t, s = _read_texts(f, text_field)
            texts += t
            sources += s
        return texts, sources
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file or directory")
    if path.suffix == ".txt":
        return [path.read_text()], [path.stem]
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"--data {path}: parquet needs `pip install pyarrow`") from None
        table = pq.read_table(path)
        if text_field not in table.column_names:
            raise ValueError(
                f"--data {path}: no field {text_field!r} (fields: {table.column_names})"
            )
        return [str(x) for x in table.column(text_field).to_pylist()], [path.stem] * table.num_rows
    records = []
    lines = path.read_text().splitlines() if path.suffix == ".jsonl" else None
    if lines is None:
        data = json.loads(path.read_text())
        records = data if isinstance(data, list) else [data]
    else:
        for i, line in enumerate(lines, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"--data {path}:{i}: invalid JSON ({err})") from None
    texts, sources = [], []
    for i, r in enumerate(records):
        if text_field not in r:
            raise ValueError(
                f"--data {path}: record {i} has no field {text_field!r} (--text-field)"
            )
        texts.append(str(r[text_field]))
        sources.append(str(r.get("source", r.get("task", path.stem))))
    return texts, sources


def _cache_key(*parts) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_corpus(
    data: str | None,
    tokenizer,
    text_field: str = "text",
    num_builtin: int = 256,
    seed: int = 0,
    min_len: int = 128,
    max_len: int = 8192,
    cache_dir: Path | None = None,
) -> TokenizedCorpus:
    """Tokenize ``data`` (or the built-in synthetic task mix when ``data`` is None), cached."""
    cache_dir = Path(cache_dir or CACHE_DIR)
    if data is None:
        from ..tasks import synthetic_mix

        key = _cache_key("builtin", num_builtin, seed, min_len, max_len, tokenizer.name)
        texts = sources = None
    else:
        path = Path(data)
        stat = path.stat() if path.exists() else None
        key = _cache_key(str(path.resolve()), stat and stat.st_mtime_ns, text_field, tokenizer.name)
    cached = cache_dir / f"{key}.npz"
    if cached.is_file():
        with np.load(cached, allow_pickle=False) as z:
            flat, offsets, sources = z["flat"], z["offsets"], list(z["sources"])
        docs = [flat[a:b] for a, b in itertools.pairwise(offsets)]
        return TokenizedCorpus(docs, [str(s) for s in sources], meta={"cache": str(cached)})
    if data is None:
        examples = synthetic_mix(
            num_builtin, tokenizer.encode, seed, min_len=min_len, max_len=max_len
        )
        texts = [e.prompt + e.answer for e in examples]
        sources = [e.task for e in examples]
    else:
        texts, sources = _read_texts(Path(data), text_field)
    docs = [np.asarray(tokenizer.encode(t), dtype=np.int32) for t in texts]
    keep = [i for i, d in enumerate(docs) if len(d) >= 2]
    if not keep:
        raise ValueError(f"--data {data}: the dataset is empty (no document with >= 2 tokens)")
    docs, sources = [docs[i] for i in keep], [sources[i] for i in keep]
    cache_dir.mkdir(parents=True, exist_ok=True)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    tmp = cache_dir / f"{key}.tmp.npz"
    np.savez(tmp, flat=np.concatenate(docs), offsets=offsets, sources=np.array(sources))
    tmp.replace(cached)
    return TokenizedCorpus(docs, sources, meta={"cache": str(cached)})


def compact_vocabulary(corpus: TokenizedCorpus, vocab_size: int) -> dict[int, int]:
    """Map the ``vocab_size - 1`` most frequent tokenizer ids to 1..vocab_size-1 (0 = unknown),
    for small models whose embedding is smaller than the tokenizer's vocabulary."""
    ids, counts = np.unique(np.concatenate(corpus.docs), return_counts=True)
    order = np.lexsort((ids, -counts))[: vocab_size - 1]
    return {int(ids[i]): rank + 1 for rank, i in enumerate(order)}


def apply_vocabulary(corpus: TokenizedCorpus, vocab_map: dict[int, int]) -> TokenizedCorpus:
    lut_size = max(max(vocab_map), int(max(d.max() for d in corpus.docs))) + 1
    lut = np.zeros(lut_size, dtype=np.int32)
    for k, v in vocab_map.items():
        lut[k] = v
    docs = [lut[d] for d in corpus.docs]
    unknown = sum(int((d == 0).sum()) for d in docs)
    return TokenizedCorpus(
        docs, corpus.sources, vocab_map, {**corpus.meta, "unknown_tokens": unknown}
    )
