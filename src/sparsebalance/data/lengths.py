"""Length files: a global batch described by its document lengths, for ``plan`` and ``simulate``.

Formats (``--lengths FILE``): one length per line (``#`` comments allowed); or JSON, either a list
of lengths or an object with a ``lengths`` list (optional ``densities`` and ``sources`` lists of
the same size); or a jsonl dataset, one object per line, whose ``text_field`` is counted with a
whitespace tokenizer (token = whitespace-separated word; the model's tokenizer comes with the
trainer), with optional ``density`` and ``source`` fields.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..sizes import check_document_length
from ..workload import Sample
from .store import TokenStore, is_store


def read_lengths(path: str, text_field: str = "text") -> tuple[list[Sample], np.ndarray | None]:
    """Samples (ids = position in the file) and their densities ``(N,)`` if the file has them.

    Raises ``ValueError`` naming ``--lengths`` for an unreadable, empty or malformed file. A
    token store (``sparsebalance prepare``) gives its lengths from the offsets (no token read).
    """
    if is_store(path):
        store = TokenStore(path)
        names = store.source_names
        src = np.asarray(store.source_index)
        return [Sample(i, int(n), names[s]) for i, (n, s) in enumerate(zip(store.lengths(), src, strict=True))], None
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"--lengths {path}: cannot read ({err.strerror})") from None
    lines = [ln.strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    if not lines:
        raise ValueError(f"--lengths {path}: the file is empty: nothing to plan")
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, list) or (isinstance(whole, dict) and "lengths" in whole):
        record = whole if isinstance(whole, dict) else {"lengths": whole}
        return _from_lists(path, record)
    if lines[0].startswith("{"):
        return _from_jsonl(path, lines, text_field)
    try:
        lengths = [int(ln) for ln in lines]
    except ValueError:
        raise ValueError(
            f"--lengths {path}: expected one integer length per line, JSON with a 'lengths' list, or a jsonl dataset"
        ) from None
    return _from_lists(path, {"lengths": lengths})


def _from_lists(path: str, record: dict) -> tuple[list[Sample], np.ndarray | None]:
    lengths = record["lengths"]
    if not lengths:
        raise ValueError(f"--lengths {path}: the 'lengths' list is empty: nothing to plan")
    sources = record.get("sources") or [""] * len(lengths)
    dens = record.get("densities")
    for name, values in (("sources", sources), ("densities", dens)):
        if values is not None and len(values) != len(lengths):
            raise ValueError(f"--lengths {path}: {len(values)} {name} for {len(lengths)} lengths")
    samples = []
    for i, (n, src) in enumerate(zip(lengths, sources, strict=True)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"--lengths {path}: entry {i} is {n!r}, lengths must be integers > 0")
        check_document_length(f"--lengths {path}: entry {i}", n)
        samples.append(Sample(i, n, str(src)))
    return samples, None if dens is None else np.asarray(dens, dtype=np.float64)


def _from_jsonl(path: str, lines: list[str], field: str) -> tuple[list[Sample], np.ndarray | None]:
    samples, dens = [], []
    for i, ln in enumerate(lines):
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError as err:
            raise ValueError(f"--lengths {path}: record {i + 1} is not JSON ({err.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get(field), str):
            raise ValueError(f"--lengths {path}: record {i + 1} has no string field {field!r}")
        num_tokens = len(rec[field].split())  # whitespace tokenizer
        if num_tokens == 0:
            raise ValueError(f"--lengths {path}: record {i + 1}: {field!r} holds no tokens")
        samples.append(Sample(i, num_tokens, str(rec.get("source", ""))))
        dens.append(rec.get("density"))
    if all(d is None for d in dens):
        return samples, None
    if any(d is None for d in dens):
        raise ValueError(f"--lengths {path}: 'density' is given for some records but not all")
    return samples, np.asarray(dens, dtype=np.float64)
