"""The token store: tokenized documents prepared once and memory-mapped on read.

A store is a folder::

    manifest.json      format, version, dtype, counts, tokenizer identity, sources, length
                       histogram, content hashes, what prepare skipped (written last)
    tokens.bin         every document's tokens back to back, uint16 or uint32 (by vocabulary size)
    offsets.bin        int64 (num_documents + 1,): document i is tokens[offsets[i]:offsets[i+1]]
    sources.bin        int32 (num_documents,): index into the manifest's ``sources`` list
    token_counts.npy   int64 (vocab_size,): occurrences of every token id (compact vocabularies)

:class:`StoreWriter` writes under a temporary name beside the destination and renames it into
place only once everything (the manifest last) is on disk, so an interrupted write leaves nothing
that :func:`open_store` accepts. :class:`TokenStore` maps the files read-only: opening a store of
any size reads only the manifest and the offsets; tokens are paged in when a document is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import time
from pathlib import Path

import numpy as np

from ..versions import STORE

FORMAT = "sparsebalance-token-store"
VERSION = STORE.version  # bump it in sparsebalance/versions.py
MANIFEST = "manifest.json"
HIST_EDGES = [0, *(2**k for k in range(4, 22)), 2**62]  # 0, 16, 32, ..., 2M tokens, beyond


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocabulary <= 65,536), else uint32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def is_store(path: str | Path) -> bool:
    """Whether ``path`` is a complete store folder (it has a store manifest)."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


STALE_ELSEWHERE_SECONDS = 24 * 3600
"""A temporary folder of another host (or of a name without one) is removed only when nothing in
it changed for this long: its writer's pid cannot be checked from here (a shared cache)."""


def _temporary_name(path: Path) -> str:
    """``.NAME.tmp-HOST-PID-RANDOM``: the writer's host and pid, so a sweep on another host of a
    shared cache can tell it is not its own."""
    return f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by someone else
        return False
    return False


def sweep_stale_temporaries(path: str | Path) -> list[Path]:
    """Remove temporary folders beside ``path`` left by a writer that was killed (SIGKILL, power
    loss: no ``__exit__`` ran).

    A folder written on this host is removed when its writer's pid is gone; one written on
    another host (a cache shared over NFS) or named without a host (an earlier version) when none
    of its files changed for :data:`STALE_ELSEWHERE_SECONDS`, since a pid of another host means
    nothing here. A live writer's folder is kept. Returns the removed folders."""
    path = Path(path)
    removed = []
    here = socket.gethostname()
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
        parts = tmp.name[len(f".{path.name}.tmp-") :].rsplit("-", 2)
        if not tmp.is_dir() or not parts[-2].isdigit():
            continue
        host = parts[0] if len(parts) == 3 else None
        if host == here:
            stale = _pid_gone(int(parts[-2]))
        else:
            newest = max((f.stat().st_mtime for f in tmp.rglob("*")), default=0.0)
            stale = time.time() - max(newest, tmp.stat().st_mtime) > STALE_ELSEWHERE_SECONDS
        if stale:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    return removed


class StoreWriter:
    """Appends documents to a new store; :meth:`close` renames it into place atomically.

    Use as a context manager: an exception inside the block removes the temporary folder.
    """

    def __init__(
        self, path: str | Path, tokenizer: dict, *, overwrite: bool = False, count_tokens=True
    ) -> None:
        """``tokenizer``: at least ``identity`` and ``vocab_size`` (recorded in the manifest)."""
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise ValueError(f"--out {self.path} already exists (pass --overwrite to replace it)")
        if self.path.exists() and not is_store(self.path):
            raise ValueError(f"--out {self.path} exists and is not a token store: not replacing it")
        self.tokenizer = dict(tokenizer)
        self.vocab_size = int(tokenizer["vocab_size"])
        self.dtype = token_dtype(self.vocab_size)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.swept = sweep_stale_temporaries(self.path)
        self.tmp = self.path.parent / _temporary_name(self.path)
        self.tmp.mkdir()
        self._tokens = open(self.tmp / "tokens.bin", "wb")  # noqa: SIM115 (closed in close/abort)
        self._offsets = open(self.tmp / "offsets.bin", "wb")  # noqa: SIM115
        self._sources = open(self.tmp / "sources.bin", "wb")  # noqa: SIM115
        self._hash = {k: hashlib.blake2b(digest_size=16) for k in ("tokens", "offsets", "sources")}
        self._write("offsets", np.zeros(1, np.int64))
        self.num_documents = 0
        self.num_tokens = 0
        self.source_names: list[str] = []
        self._source_ids: dict[str, int] = {}
        self._per_source: list[list[int]] = []  # [documents, tokens] per source
        self.hist = np.zeros(len(HIST_EDGES) - 1, np.int64)
        self.counts = np.zeros(self.vocab_size, np.int64) if count_tokens else None
        self.started = time.perf_counter()

    def _write(self, name: str, arr: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(arr)).cast("B")
        {"tokens": self._tokens, "offsets": self._offsets, "sources": self._sources}[name].write(
            data
        )
        self._hash[name].update(data)

    def source_id(self, name: str) -> int:
        if name not in self._source_ids:
            self._source_ids[name] = len(self.source_names)
            self.source_names.append(name)
            self._per_source.append([0, 0])
        return self._source_ids[name]

    def add_many(self, docs: list[np.ndarray], sources: list[str]) -> None:
        """Append documents (each a 1-D array of token ids < vocab_size) with their source names."""
        if len(docs) != len(sources):
            raise ValueError(f"{len(docs)} documents but {len(sources)} sources")
        if not docs:
            return
        lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
        flat = np.concatenate(docs)
        if flat.size and (int(flat.max()) >= self.vocab_size or int(flat.min()) < 0):
            raise ValueError(
                f"token id out of range [0, {self.vocab_size}): got {int(flat.min())}.."
                f"{int(flat.max())} (wrong vocab_size for this tokenizer?)"
            )
        src = np.fromiter((self.source_id(s) for s in sources), np.int32, len(sources))
        self._write("tokens", flat.astype(self.dtype, copy=False))
        self._write("offsets", self.num_tokens + np.cumsum(lengths))
        self._write("sources", src)
        if self.counts is not None and flat.size:
            self.counts += np.bincount(flat, minlength=self.vocab_size)
        self.hist += np.histogram(lengths, HIST_EDGES)[0]
        for s, n in zip(src.tolist(), lengths.tolist(), strict=True):
            self._per_source[s][0] += 1
            self._per_source[s][1] += n
        self.num_documents += len(docs)
        self.num_tokens += int(lengths.sum())

    def close(self, extra: dict | None = None) -> Path:
        """Finish: flush, write the manifest (with ``extra`` keys), rename into place."""
        if self.num_documents == 0:
            self.abort()
            raise ValueError("the dataset is empty: no document to store")
        for f in (self._tokens, self._offsets, self._sources):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        if self.counts is not None:
            np.save(self.tmp / "token_counts.npy", self.counts)
        content = hashlib.blake2b(digest_size=16)
        for k in ("tokens", "offsets", "sources"):
            content.update(self._hash[k].digest())
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype.name,
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "tokenizer": self.tokenizer,
            "content_hash": content.hexdigest(),
            "sources": [
                {"name": n, "documents": d, "tokens": t}
                for n, (d, t) in zip(self.source_names, self._per_source, strict=True)
            ],
            "length_histogram": {"edges": HIST_EDGES, "counts": self.hist.tolist()},
            "seconds": round(time.perf_counter() - self.started, 3),
            **(extra or {}),
        }
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        old = None
        if self.path.exists():  # --overwrite: move the old store aside, then swap
            old = self.path.parent / f".{self.path.name}.old-{secrets.token_hex(4)}"
            os.replace(self.path, old)
        os.replace(self.tmp, self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.path

    def abort(self) -> None:
        for f in (self._tokens, self._offsets, self._sources):
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self.tmp.exists():
            self.abort()


def check_offsets(path: Path, offsets: np.ndarray, num_tokens: int) -> None:
    """``offsets.bin`` must start at 0, never decrease and end at the token count: anything
    else is a damaged store, refused when it is opened (one pass over the offsets, which opening
    reads anyway), never read as documents of negative or impossible lengths."""
    where = path / "offsets.bin"
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or last != num_tokens:
        raise ValueError(
            f"{where}: offsets run from {first} to {last}, not 0 to the manifest's {num_tokens} "
            "tokens: the store is damaged"
        )
    steps = np.diff(np.asarray(offsets))
    if steps.size and int(steps.min()) < 0:
        at = int(np.argmax(steps < 0))
        raise ValueError(
            f"{where}: offsets decrease at document {at} ({int(offsets[at])} -> "
            f"{int(offsets[at + 1])}): the store is damaged"
        )


class TokenStore:
    """A store mapped read-only. ``doc(i)`` is a view into the token file (no copy)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        mpath = self.path / MANIFEST
        if not mpath.is_file():
            raise ValueError(
                f"{self.path} is not a token store (no {MANIFEST}; an interrupted "
                "`sparsebalance prepare` leaves none)"
            )
        try:
            m = json.loads(mpath.read_text())
        except ValueError as err:
            raise ValueError(f"{mpath}: unreadable manifest ({err})") from None
        if m.get("format") != FORMAT:
            raise ValueError(f"{mpath}: not a {FORMAT} manifest")
        STORE.check(m.get("version"), str(self.path))
        self.manifest = m
        try:
            n, t = int(m["num_documents"]), int(m["num_tokens"])
            self.dtype = np.dtype(m["dtype"])
            if n < 1 or t < 0 or self.dtype not in (np.uint16, np.uint32):
                raise ValueError(f"{n} documents, {t} tokens of {self.dtype}")
            names = [s["name"] for s in m["sources"]]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{mpath}: damaged manifest ({err}): the store is damaged") from None
        for name, size in (
            ("tokens.bin", t * self.dtype.itemsize),
            ("offsets.bin", (n + 1) * 8),
            ("sources.bin", n * 4),
        ):
            f = self.path / name
            if not f.is_file() or f.stat().st_size != size:
                got = f.stat().st_size if f.is_file() else "missing"
                raise ValueError(f"{f}: expected {size} bytes, found {got}: the store is damaged")
        self.tokens = np.memmap(self.path / "tokens.bin", self.dtype, "r", shape=(t,))
        self.offsets = np.memmap(self.path / "offsets.bin", np.int64, "r", shape=(n + 1,))
        self.source_index = np.memmap(self.path / "sources.bin", np.int32, "r", shape=(n,))
        self.source_names = names
        check_offsets(self.path, self.offsets, t)
        if n and not 0 <= int(self.source_index.min()) <= int(self.source_index.max()) < len(
            self.source_names
        ):
            raise ValueError(
                f"{self.path / 'sources.bin'}: source indices outside the manifest's "
                f"{len(self.source_names)} sources: the store is damaged"
            )

    def __len__(self) -> int:
        return int(self.manifest["num_documents"])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def content_hash(self) -> str:
        return str(self.manifest["content_hash"])

    @property
    def tokenizer(self) -> dict:
        return dict(self.manifest["tokenizer"])

    def lengths(self) -> np.ndarray:
        """int64 ``(num_documents,)`` from the offsets alone (no token is read)."""
        return np.diff(np.asarray(self.offsets))

    def doc(self, i: int) -> np.ndarray:
        """Tokens of document ``i``: ``(L_i,)`` of the store's dtype, a view of the mapped file."""
        return self.tokens[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def source(self, i: int) -> str:
        return self.source_names[int(self.source_index[i])]

    def token_counts(self, chunk: int = 1 << 26) -> np.ndarray:
        """int64 ``(vocab_size,)``: ``token_counts.npy``, else a chunked bincount of the map."""
        f = self.path / "token_counts.npy"
        if f.is_file():
            return np.load(f)
        vocab = int(self.manifest["tokenizer"]["vocab_size"])
        counts = np.zeros(vocab, np.int64)
        for a in range(0, self.num_tokens, chunk):
            counts += np.bincount(self.tokens[a : a + chunk], minlength=vocab)
        return counts


def open_store(path: str | Path) -> TokenStore:
    return TokenStore(path)
