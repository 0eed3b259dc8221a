"""The token store: tokenized documents prepared once and memory-mapped on read.

A store is a folder::

    manifest.json      format, version, dtype, counts, tokenizer identity, sources, length
                       histogram, content hashes and checksums, what prepare skipped (written last)
    tokens.bin         every document's tokens back to back, uint16 or uint32 (by vocabulary size)
    offsets.bin        int64 (num_documents + 1,): document i is tokens[offsets[i]:offsets[i+1]]
    sources.bin        int32 (num_documents,): index into the manifest's ``sources`` list
    token_counts.npy   int64 (vocab_size,): occurrences of every token id (compact vocabularies)

Writing. :class:`StoreWriter` writes under a temporary name beside the destination and renames it
into place only once everything (the manifest last) is on disk, so an interrupted write leaves
nothing that :func:`open_store` accepts. One writer at a time: it holds ``.NAME.lock`` beside the
store (``flock``, which the kernel releases when the writer dies, so a killed writer leaves no
stale lock), and without ``overwrite`` the rename never replaces a store that appeared meanwhile.
A full disk is one line (:class:`DiskFull`); the temporary folder is removed, a previous store
stays intact.

Reading. :class:`TokenStore` maps the files read-only and checks on every open what costs in
proportion to the documents: the manifest, file sizes, offsets (from 0 to the token count, never
decreasing), source indices and the CRC-32 of ``offsets.bin`` and ``sources.bin`` (2-4 ms for 1B
tokens in 300K documents). Every 4 MiB shard of ``tokens.bin`` has a CRC-32 in the manifest,
checked the first time a document in it is read: a shard that matches holds the ids prepare
wrote. The launcher also reads every token id once before it starts the ranks (``scan_ids``: 4
MiB chunks into one buffer, 0.04 s per 100M tokens from the page cache, 0.2 s from disk), so a
store with an id outside the vocabulary is refused before any work; hashing every shard at each
open instead would cost every rank 0.17 s per 100M tokens with CRC-32, 0.6 s with BLAKE2b.
:func:`verify_store` (``sparsebalance prepare --verify``) checks everything, the content hash
included. Checksums detect damage, not tampering.

The checks themselves live in :mod:`.integrity`, the writer's lock and temporary folders in
:mod:`.store_lock`; the names other modules use are importable from here.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import secrets
import shutil
import time
import zlib
from pathlib import Path
from typing import NoReturn

import numpy as np

from ..versions import STORE
from .integrity import (
    FORMAT,
    MANIFEST,
    StoreDamaged,
    _bad_id_problem,
    _crc_problem,
    _first_bad_id,
    _layout,
    _shard_checksums,
    _size_problems,
    _sources_problem,
    check_offsets,
    read_manifest,
)
from .integrity import verify_store as verify_store  # re-exported
from .store_lock import STALE_ELSEWHERE_SECONDS as STALE_ELSEWHERE_SECONDS  # re-exported
from .store_lock import StoreBusy as StoreBusy  # re-exported
from .store_lock import (
    _fsync_dir,
    _release_lock,
    _take_lock,
    _temporary_name,
    sweep_stale_temporaries,
)
from .store_lock import wait_for_writer as wait_for_writer  # re-exported

VERSION = STORE.version  # bump it in sparsebalance/versions.py
HIST_EDGES = [0, *(2**k for k in range(4, 22)), 2**62]  # 0, 16, 32, ..., 2M tokens, beyond
SHARD_BYTES = 4 << 20
"""``tokens.bin`` is checksummed per shard of this many bytes (the manifest records the size)."""
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class StoreExists(ValueError):
    """The store exists and the writer was not asked to replace it."""


class DiskFull(ValueError):
    """The disk filled while writing a store (its partial output is removed)."""


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


class StoreWriter:
    """Appends documents to a new store; :meth:`close` renames it into place atomically.

    Use as a context manager: an exception inside the block removes the temporary folder. A
    second writer of the same store raises :class:`StoreBusy` when it starts; without
    ``overwrite``, :class:`StoreExists` when the store exists (also when it appeared while this
    writer ran). A full disk raises :class:`DiskFull` with nothing of this writer left behind.
    """

    def __init__(self, path: str | Path, tokenizer: dict, *, overwrite: bool = False, count_tokens=True) -> None:
        """``tokenizer``: at least ``identity`` and ``vocab_size`` (recorded in the manifest)."""
        self.path = Path(path)
        self.overwrite = overwrite
        self._lock: int | None = None
        self._refuse_existing()
        self.tokenizer = dict(tokenizer)
        self.vocab_size = int(tokenizer["vocab_size"])
        self.dtype = token_dtype(self.vocab_size)
        self._files: list = []
        self.tmp: Path | None = None
        self.swept: list[Path] = []
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = _take_lock(self.path)
            self._refuse_existing()  # a writer that finished just before this one started
            self.swept = sweep_stale_temporaries(self.path)
            self.tmp = self.path.parent / _temporary_name(self.path)
            self.tmp.mkdir()
            names = ("tokens", "offsets", "sources")
            for name in names:  # closed in close / abort
                self._files.append(open(self.tmp / f"{name}.bin", "wb"))  # noqa: SIM115
            self._tokens, self._offsets, self._sources = self._files
            self._hash = {k: hashlib.blake2b(digest_size=16) for k in names}
            self._crc = {"offsets": 0, "sources": 0}
            self._shards: list[int] = []  # CRC-32 of each full shard of tokens.bin
            self._shard_crc, self._shard_fill, self._shard_bytes = 0, 0, SHARD_BYTES
            self._write("offsets", np.zeros(1, np.int64))
        except BaseException as err:
            self._fail(err)
        self.num_documents = 0
        self.num_tokens = 0
        self.source_names: list[str] = []
        self._source_ids: dict[str, int] = {}
        self._per_source: list[list[int]] = []  # [documents, tokens] per source
        self.hist = np.zeros(len(HIST_EDGES) - 1, np.int64)
        self.counts = np.zeros(self.vocab_size, np.int64) if count_tokens else None
        self.started = time.perf_counter()

    def _refuse_existing(self) -> None:
        if self.path.exists() and not is_store(self.path):
            raise ValueError(f"--out {self.path} exists and is not a token store: not replacing it")
        if self.path.exists() and not self.overwrite:
            raise StoreExists(f"--out {self.path} already exists (pass --overwrite to replace it)")

    def _fail(self, err: BaseException) -> NoReturn:
        """Remove everything this writer made, then raise (a full disk as one line)."""
        self.abort()
        if isinstance(err, OSError) and err.errno in NO_SPACE:
            where = self.path.parent
            while not where.exists() and where != where.parent:
                where = where.parent
            try:
                free = f", {shutil.disk_usage(where).free / 2**20:,.1f} MiB free in {where}"
            except OSError:
                free = ""
            kept = "; the existing store is intact" if is_store(self.path) else ""
            raise DiskFull(
                f"{self.path}: the disk is full (no space left on the device{free}): the partial "
                f"store was removed{kept}; free space and run it again"
            ) from None
        raise err

    def _write(self, name: str, arr: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(arr)).cast("B")
        {"tokens": self._tokens, "offsets": self._offsets, "sources": self._sources}[name].write(data)
        self._hash[name].update(data)
        if name != "tokens":
            self._crc[name] = zlib.crc32(data, self._crc[name])
            return
        pos = 0
        while pos < len(data):  # CRC-32 per shard of tokens.bin, whatever the write sizes
            take = min(len(data) - pos, self._shard_bytes - self._shard_fill)
            self._shard_crc = zlib.crc32(data[pos : pos + take], self._shard_crc)
            self._shard_fill += take
            pos += take
            if self._shard_fill == self._shard_bytes:
                self._shards.append(self._shard_crc)
                self._shard_crc, self._shard_fill = 0, 0

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
        try:
            self._write("tokens", flat.astype(self.dtype, copy=False))
            self._write("offsets", self.num_tokens + np.cumsum(lengths))
            self._write("sources", src)
        except OSError as err:
            self._fail(err)
        if self.counts is not None and flat.size:
            self.counts += np.bincount(flat, minlength=self.vocab_size)
        self.hist += np.histogram(lengths, HIST_EDGES)[0]
        for s, n in zip(src.tolist(), lengths.tolist(), strict=True):
            self._per_source[s][0] += 1
            self._per_source[s][1] += n
        self.num_documents += len(docs)
        self.num_tokens += int(lengths.sum())

    def _put(self, name: str, data: bytes) -> None:
        with open(self.tmp / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def close(self, extra: dict | None = None) -> Path:
        """Finish: flush, write the manifest (with ``extra`` keys), rename into place."""
        if self.num_documents == 0:
            self.abort()
            raise ValueError("the dataset is empty: no document to store")
        try:
            for f in self._files:
                f.flush()
                os.fsync(f.fileno())
                f.close()
            manifest = self._manifest(extra)
            self._put(MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
            _fsync_dir(self.tmp)
        except BaseException as err:
            self._fail(err)
        return self._install()

    def _manifest(self, extra: dict | None) -> dict:
        checksums: dict = {}
        if self.counts is not None:
            buf = io.BytesIO()
            np.save(buf, self.counts)
            self._put("token_counts.npy", buf.getvalue())
            checksums["token_counts.npy"] = {"crc32": zlib.crc32(buf.getvalue())}
        shards = self._shards + ([self._shard_crc] if self._shard_fill else [])
        checksums["tokens.bin"] = {
            "blake2b": self._hash["tokens"].hexdigest(),
            "shard_bytes": self._shard_bytes,
            "shard_crc32": b"".join(c.to_bytes(4, "big") for c in shards).hex(),
        }
        for k in ("offsets", "sources"):
            checksums[f"{k}.bin"] = {"blake2b": self._hash[k].hexdigest(), "crc32": self._crc[k]}
        content = hashlib.blake2b(digest_size=16)
        for k in ("tokens", "offsets", "sources"):
            content.update(self._hash[k].digest())
        return {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype.name,
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "tokenizer": self.tokenizer,
            "content_hash": content.hexdigest(),
            "checksums": checksums,
            "sources": [
                {"name": n, "documents": d, "tokens": t}
                for n, (d, t) in zip(self.source_names, self._per_source, strict=True)
            ],
            "length_histogram": {"edges": HIST_EDGES, "counts": self.hist.tolist()},
            "seconds": round(time.perf_counter() - self.started, 3),
            **(extra or {}),
        }

    def _install(self) -> Path:
        """Rename the finished folder into place. Without ``overwrite`` the rename itself refuses
        a store that appeared meanwhile (a folder is never renamed onto a non-empty one)."""
        old = None
        finished = StoreExists(
            f"--out {self.path}: another writer finished this store first; it is kept (pass --overwrite to replace it)"
        )
        try:
            if self.path.exists() and not self.overwrite:
                raise finished
            self._refuse_existing()
            if self.path.exists():  # --overwrite: move the old store aside, then swap
                old = self.path.parent / f".{self.path.name}.old-{secrets.token_hex(4)}"
                os.replace(self.path, old)
            try:
                os.rename(self.tmp, self.path)
            except OSError as err:
                if old is not None:
                    os.replace(old, self.path)
                if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise finished from None
                raise
        except BaseException as err:
            self._fail(err)
        self.tmp = None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        with contextlib.suppress(OSError):  # the rename's durability: the store is in place
            _fsync_dir(self.path.parent)
        _release_lock(self.path, self._lock)
        self._lock = None
        return self.path

    def abort(self) -> None:
        """Remove the temporary folder and release the store (safe to call again; a file whose
        buffer cannot be flushed, on a full disk, is closed all the same)."""
        for f in self._files:
            with contextlib.suppress(OSError):
                f.close()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        _release_lock(self.path, self._lock)
        self._lock = None

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def __del__(self) -> None:  # dropped unfinished: at least let the next writer start
        if self._lock is not None:
            _release_lock(self.path, self._lock)


class TokenStore:
    """A store mapped read-only. ``doc(i)`` is a view into the token file (no copy).

    Opening checks sizes, offsets, sources and their checksums (cost proportional to the
    documents); ``doc(i)`` checks the CRC-32 of each shard of ``tokens.bin`` it reads the first
    time (a shard that matches holds the ids prepare wrote, all in the vocabulary). ``scan_ids``:
    also read every token at open to refuse an id outside the vocabulary before any work (the
    launcher does, once); None: only for a store without shard checksums (written before them).
    Damage raises :class:`StoreDamaged` (a ``ValueError``) naming the file.
    """

    def __init__(self, path: str | Path, scan_ids: bool | None = None) -> None:
        self.path = Path(path)
        m = read_manifest(self.path)
        self.manifest = m
        n, t, self.dtype, names, vocab = _layout(self.path, m)
        problems = _size_problems(self.path, n, t, self.dtype)
        if problems:
            raise StoreDamaged(next(iter(problems.values())))
        self.tokens = np.memmap(self.path / "tokens.bin", self.dtype, "r", shape=(t,))
        self.offsets = np.memmap(self.path / "offsets.bin", np.int64, "r", shape=(n + 1,))
        self.source_index = np.memmap(self.path / "sources.bin", np.int32, "r", shape=(n,))
        self.source_names = names
        check_offsets(self.path, self.offsets, t)
        for problem in (
            _sources_problem(self.path, self.source_index, len(names)),
            _crc_problem(self.path, "offsets.bin", self.offsets, m),
            _crc_problem(self.path, "sources.bin", self.source_index, m),
        ):
            if problem is not None:
                raise StoreDamaged(problem)
        self._shards = _shard_checksums(m)
        if scan_ids or (scan_ids is None and self._shards is None):
            bad = _first_bad_id(self.path, t, self.dtype, vocab)
            if bad is not None:
                raise StoreDamaged(_bad_id_problem(self.path, bad, self.offsets, vocab))
        if self._shards is not None:
            self._checked = np.zeros(len(self._shards[1]), bool)

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
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        if self._shards is not None and b > a:
            self._check_shards(i, a, b)
        return self.tokens[a:b]

    def _check_shards(self, i: int, a: int, b: int) -> None:
        """CRC-32 of every shard holding tokens ``[a, b)`` not checked yet (once per shard)."""
        size = self._shards[0]
        first, last = a * self.dtype.itemsize // size, (b * self.dtype.itemsize - 1) // size
        if self._checked[first : last + 1].all():
            return
        with open(self.path / "tokens.bin", "rb", buffering=0) as f:  # not through the map:
            for k in range(first, last + 1):  # a shard's pages do not stay resident
                if not self._checked[k]:
                    self._check_shard(f.fileno(), i, k)

    def _check_shard(self, fd: int, i: int, k: int) -> None:
        size, crcs = self._shards
        if zlib.crc32(os.pread(fd, size, k * size)) != int(crcs[k]):
            lo, hi = k * size, min((k + 1) * size, self.num_tokens * self.dtype.itemsize)
            raise StoreDamaged(
                f"{self.path / 'tokens.bin'}: bytes {lo:,}..{hi:,} (shard {k}, read for "
                f"document {i}) differ from their checksum: the store is damaged (changed "
                f"since it was prepared); list every damaged part with sparsebalance prepare "
                f"--verify {self.path}"
            )
        self._checked[k] = True

    def source(self, i: int) -> str:
        return self.source_names[int(self.source_index[i])]

    def token_counts(self, chunk: int = 1 << 26) -> np.ndarray:
        """int64 ``(vocab_size,)``: ``token_counts.npy``, else a chunked bincount of the map."""
        f = self.path / "token_counts.npy"
        if f.is_file():
            data = f.read_bytes()
            want = self.manifest.get("checksums", {}).get("token_counts.npy", {}).get("crc32")
            if want is not None and zlib.crc32(data) != want:
                raise StoreDamaged(f"{f}: differs from its checksum in the manifest: the store is damaged")
            return np.load(io.BytesIO(data))
        vocab = int(self.manifest["tokenizer"]["vocab_size"])
        counts = np.zeros(vocab, np.int64)
        for a in range(0, self.num_tokens, chunk):
            counts += np.bincount(self.tokens[a : a + chunk], minlength=vocab)
        return counts


def open_store(path: str | Path) -> TokenStore:
    return TokenStore(path)
