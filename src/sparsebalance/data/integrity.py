"""Integrity checks of a token store against its manifest, and the format constants they share
with the writer.

What :class:`~.store.TokenStore` checks at every open (the manifest, file sizes, offsets, source
indices, the CRC-32 of ``offsets.bin`` and ``sources.bin``, the optional scan of every token id)
and :func:`verify_store` (``sparsebalance prepare --verify``), which reads every byte: digests,
each shard of ``tokens.bin``, ``token_counts.npy`` and the content hash.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

import numpy as np

from ..versions import STORE

FORMAT = "sparsebalance-token-store"
MANIFEST = "manifest.json"
SCAN_BYTES = 4 << 20
"""Chunk of the token-id scan at open (read into one reused buffer: memory stays bounded)."""


class StoreDamaged(ValueError):
    """A store whose files do not match its manifest."""


def read_manifest(path: str | Path) -> dict:
    """The manifest of the store at ``path``, of this format and a version this build reads (one
    line otherwise: not a store, damaged, another version)."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise ValueError(
            f"{path} is not a token store (no {MANIFEST}; an interrupted `sparsebalance prepare` leaves none)"
        )
    try:
        m = json.loads(mpath.read_text())
    except (OSError, ValueError) as err:
        raise StoreDamaged(f"{mpath}: unreadable manifest ({err}): the store is damaged") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise StoreDamaged(f"{mpath}: not a {FORMAT} manifest")
    STORE.check(m.get("version"), str(path))
    return m


def _layout(path: Path, m: dict) -> tuple[int, int, np.dtype, list[str], int]:
    """(documents, tokens, dtype, source names, vocabulary size) from the manifest."""
    try:
        n, t = int(m["num_documents"]), int(m["num_tokens"])
        dtype = np.dtype(m["dtype"])
        if n < 1 or t < 0 or dtype not in (np.uint16, np.uint32):
            raise ValueError(f"{n} documents, {t} tokens of {dtype}")
        names = [s["name"] for s in m["sources"]]
        vocab = int(m["tokenizer"]["vocab_size"])
    except (KeyError, TypeError, ValueError) as err:
        raise StoreDamaged(f"{path / MANIFEST}: damaged manifest ({err}): the store is damaged") from None
    return n, t, dtype, names, vocab


def _size_problems(path: Path, n: int, t: int, dtype: np.dtype) -> dict[str, str]:
    """File name -> the line saying its size is not the manifest's (only files that differ)."""
    out = {}
    for name, size in (
        ("tokens.bin", t * dtype.itemsize),
        ("offsets.bin", (n + 1) * 8),
        ("sources.bin", n * 4),
    ):
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            got = f.stat().st_size if f.is_file() else "missing"
            out[name] = f"{f}: expected {size} bytes, found {got}: the store is damaged"
    return out


def _offsets_problem(path: Path, offsets: np.ndarray, num_tokens: int) -> str | None:
    where = path / "offsets.bin"
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or last != num_tokens:
        return (
            f"{where}: offsets run from {first} to {last}, not 0 to the manifest's {num_tokens} "
            "tokens: the store is damaged"
        )
    steps = np.diff(np.asarray(offsets))
    if steps.size and int(steps.min()) < 0:
        at = int(np.argmax(steps < 0))
        return (
            f"{where}: offsets decrease at document {at} ({int(offsets[at])} -> "
            f"{int(offsets[at + 1])}): the store is damaged"
        )
    return None


def check_offsets(path: Path, offsets: np.ndarray, num_tokens: int) -> None:
    """``offsets.bin`` must start at 0, never decrease and end at the token count: anything
    else is a damaged store, refused when it is opened (one pass over the offsets, which opening
    reads anyway), never read as documents of negative or impossible lengths."""
    problem = _offsets_problem(path, offsets, num_tokens)
    if problem is not None:
        raise StoreDamaged(problem)


def _sources_problem(path: Path, index: np.ndarray, num_sources: int) -> str | None:
    if len(index) and not 0 <= int(index.min()) <= int(index.max()) < num_sources:
        return (
            f"{path / 'sources.bin'}: source indices outside the manifest's {num_sources} sources: the store is damaged"
        )
    return None


def _crc_problem(path: Path, name: str, arr: np.ndarray, m: dict) -> str | None:
    """``name``'s CRC-32 against the manifest's (stores written before checksums: None)."""
    want = m.get("checksums", {}).get(name, {}).get("crc32")
    if want is None or zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B")) == want:
        return None
    return f"{path / name}: differs from its checksum in the manifest: the store is damaged"


def _first_bad_id(path: Path, t: int, dtype: np.dtype, vocab: int) -> tuple[int, int] | None:
    """(token index, id) of the first id >= ``vocab`` in ``tokens.bin``, else None. Reads the
    file in :data:`SCAN_BYTES` chunks into one buffer (not through the map: resident memory stays
    bounded); nothing to read when the dtype cannot hold an id out of range."""
    if vocab >= 2 ** (8 * dtype.itemsize):
        return None
    buf = np.empty(SCAN_BYTES // dtype.itemsize, dtype)
    raw = memoryview(buf).cast("B")
    pos = 0
    with open(path / "tokens.bin", "rb", buffering=0) as f:
        while pos < t:
            k = (f.readinto(raw) or 0) // dtype.itemsize
            if k == 0:
                break
            chunk = buf[:k]
            if int(chunk.max()) >= vocab:
                i = int(np.argmax(chunk >= vocab))
                return pos + i, int(chunk[i])
            pos += k
    return None


def _bad_id_problem(path: Path, at: tuple[int, int], offsets: np.ndarray, vocab: int) -> str:
    pos, value = at
    doc = int(np.searchsorted(offsets, pos, side="right")) - 1
    return (
        f"{path / 'tokens.bin'}: token id {value} (token {pos:,}, document {doc}) is outside "
        f"the vocabulary of {vocab:,} the store was prepared with: the store is damaged"
    )


def _shard_checksums(m: dict) -> tuple[int, np.ndarray] | None:
    """(shard bytes, CRC-32 per shard) of ``tokens.bin`` from the manifest, or None."""
    info = m.get("checksums", {}).get("tokens.bin")
    if not info:
        return None
    return int(info["shard_bytes"]), np.frombuffer(bytes.fromhex(info["shard_crc32"]), ">u4")


MAX_SHARD_LINES = 10
"""``verify_store`` names at most this many damaged shards, then counts the rest."""


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(SCAN_BYTES):
            h.update(chunk)
    return h.hexdigest()


def verify_store(path: str | Path) -> tuple[list[str], dict]:
    """Check every byte of the store at ``path`` against its manifest (``prepare --verify``).

    What opening checks (sizes, offsets, sources, the largest token id), then each file's
    BLAKE2b digest and checksums, each shard of ``tokens.bin`` (naming its bytes and documents),
    ``token_counts.npy`` and the content hash recomputed from the files (the only content check
    of a store written before checksums). One read of every file: about 0.9 s per 100M tokens.
    Returns (one line per problem, empty when intact; the manifest). Raises ``ValueError`` when
    ``path`` is not a store or of a version this build does not read."""
    path = Path(path)
    try:
        m = read_manifest(path)
        n, t, dtype, names, vocab = _layout(path, m)
    except StoreDamaged as err:
        return [str(err)], {}
    sizes = _size_problems(path, n, t, dtype)
    problems = list(sizes.values())
    sums = m.get("checksums", {})
    digests: dict[str, str] = {}
    offsets = None
    for name, dt, check in (
        ("offsets.bin", np.int64, lambda a: _offsets_problem(path, a, t)),
        ("sources.bin", np.int32, lambda a: _sources_problem(path, a, len(names))),
    ):
        if not (path / name).is_file():
            continue
        digests[name] = _file_digest(path / name)
        if name in sizes:
            continue
        arr = np.fromfile(path / name, dt)
        offsets = arr if name == "offsets.bin" else offsets
        found = [check(arr), _crc_problem(path, name, arr, m)]
        if found[1] is None and sums.get(name, {}).get("blake2b") not in (None, digests[name]):
            found[1] = f"{path / name}: differs from its digest in the manifest: the store is damaged"
        problems += [p for p in found if p is not None]
    if (path / "tokens.bin").is_file():
        digests["tokens.bin"], token_lines = _verify_tokens(path, m, dtype, vocab, offsets)
        problems += token_lines
    counts = path / "token_counts.npy"
    want = sums.get("token_counts.npy", {}).get("crc32")
    if counts.is_file() and want is not None and zlib.crc32(counts.read_bytes()) != want:
        problems.append(f"{counts}: differs from its checksum in the manifest: the store is damaged")
    if len(digests) == 3:
        content = hashlib.blake2b(digest_size=16)
        for name in ("tokens.bin", "offsets.bin", "sources.bin"):
            content.update(bytes.fromhex(digests[name]))
        if content.hexdigest() != m.get("content_hash"):
            problems.append(
                f"{path / MANIFEST}: content hash {m.get('content_hash')} recorded, the files "
                f"give {content.hexdigest()}: the store changed since it was prepared"
            )
    return problems, m


def _verify_tokens(
    path: Path, m: dict, dtype: np.dtype, vocab: int, offsets: np.ndarray | None
) -> tuple[str, list[str]]:
    """One pass over ``tokens.bin``: (its BLAKE2b digest, lines for ids out of range and damaged
    shards)."""
    shards = _shard_checksums(m)
    size = shards[0] if shards is not None else SCAN_BYTES
    h = hashlib.blake2b(digest_size=16)
    damaged: list[int] = []
    first_bad, num_bad, pos = None, 0, 0
    with open(path / "tokens.bin", "rb", buffering=0) as f:
        k = 0
        while chunk := f.read(size):
            h.update(chunk)
            if shards is not None and (k >= len(shards[1]) or zlib.crc32(chunk) != shards[1][k]):
                damaged.append(k)
            ids = np.frombuffer(chunk[: len(chunk) - len(chunk) % dtype.itemsize], dtype)
            out = ids >= vocab
            if out.any():
                num_bad += int(out.sum())
                if first_bad is None:
                    i = int(np.argmax(out))
                    first_bad = (pos + i, int(ids[i]))
            pos += len(ids)
            k += 1
    lines = []
    if first_bad is not None:
        where = (
            _bad_id_problem(path, first_bad, offsets, vocab)
            if offsets is not None
            else (
                f"{path / 'tokens.bin'}: token id {first_bad[1]} (token {first_bad[0]:,}) is "
                f"outside the vocabulary of {vocab:,}: the store is damaged"
            )
        )
        lines.append(where + (f" ({num_bad:,} such ids in all)" if num_bad > 1 else ""))
    for k in damaged[:MAX_SHARD_LINES]:
        lo, hi = k * size, min((k + 1) * size, pos * dtype.itemsize)
        docs = ""
        if offsets is not None:
            d0, d1 = (
                int(np.searchsorted(offsets, x // dtype.itemsize, side="right")) - 1 for x in (lo, max(lo, hi - 1))
            )
            docs = f", documents {d0}..{d1}" if d1 > d0 else f", document {d0}"
        lines.append(
            f"{path / 'tokens.bin'}: bytes {lo:,}..{hi:,} (shard {k}{docs}) differ from their "
            "checksum: the store is damaged"
        )
    if len(damaged) > MAX_SHARD_LINES:
        lines.append(f"{path / 'tokens.bin'}: and {len(damaged) - MAX_SHARD_LINES} more damaged shards")
    return h.hexdigest(), lines
