"""Documents for training: token stores (``--data STORE``), raw inputs prepared once into a store
in the cache, weighted mixtures of both, or the built-in synthetic long-context tasks (also kept
as a cached store); a compact vocabulary for small models whose embedding is smaller than the
tokenizer's vocabulary.

:func:`resolve_data` turns ``--data`` into store folders (preparing raw inputs into the cache,
keyed by the inputs' content hash and the tokenizer, never by path or mtime); run it on one rank.
:func:`open_corpus` maps them read-only on every rank. Documents have global ids: component by
component, in ``--data`` order.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..files import CACHE_ENV, cache_folder, unwritable
from .mixture import parse_mixture
from .prepare import PrepareConfig, describe_inputs, prepare, store_key, tokenizer_info
from .store import (
    VERSION,
    StoreBusy,
    StoreExists,
    StoreWriter,
    TokenStore,
    is_store,
    read_manifest,
    wait_for_writer,
)

CACHE_DIR: Path | None = None
"""Where raw ``--data`` is prepared into stores; None: ``$SPARSEBALANCE_CACHE/tokens``, else
``~/.cache/sparsebalance/tokens`` (:func:`~sparsebalance.files.cache_folder`, read at each call)."""
BUILTIN_LEN = (128, 4096)
"""Length range of the built-in synthetic documents when --min-len / --max-len are not given."""


@dataclass(frozen=True)
class DataSource:
    """One component of ``--data``: where its store is and its mixture weight."""

    name: str
    """As given to --data (a store, raw inputs, or ``builtin``)."""
    store: str
    """The store folder (for raw inputs: the prepared store in the cache)."""
    weight: float
    """Share of the documents drawn from this component (the weights sum to 1)."""


def _builtin_store(tokenizer, num, seed, min_len, max_len, cache_dir: Path, default: bool) -> Path:
    from ..tasks import synthetic_mix

    info = tokenizer_info(tokenizer)
    key = store_key([], info["identity"], f"builtin:{num}:{seed}:{min_len}:{max_len}", 2)
    out = cache_dir / "stores" / f"builtin-{key}"
    if is_store(out):
        return out
    _check_cache(cache_dir, None, default)

    def write() -> None:
        examples = synthetic_mix(num, tokenizer.encode, seed, min_len=min_len, max_len=max_len)
        docs = [np.asarray(tokenizer.encode(e.prompt + e.answer), np.int64) for e in examples]
        keep = [i for i, d in enumerate(docs) if len(d) >= 2]
        with StoreWriter(out, info) as w:
            w.add_many([docs[i] for i in keep], [examples[i].task for i in keep])
            w.close({"builtin": {"num": num, "seed": seed, "min_len": min_len, "max_len": max_len}})

    _prepare_once(out, write)
    return out


def _token_cache(cache_dir: Path | None) -> tuple[Path, bool]:
    """The token cache folder, and whether it is the default one (``$SPARSEBALANCE_CACHE``)."""
    given = cache_dir or CACHE_DIR
    return (Path(given), False) if given else (cache_folder("tokens"), True)


def _check_cache(cache_dir: Path, name: str | None, default: bool) -> None:
    """Before anything is tokenised into the cache: refused in one line naming the folder and
    how to point it elsewhere when it cannot be written (a read-only home)."""
    why = unwritable(cache_dir)
    if why is None:
        return
    data = f"--data {name}" if name else "the built-in documents (no --data)"
    hint = f"set {CACHE_ENV} to a writable folder" if default else "pass a writable cache_dir"
    if name:
        hint += f", or prepare it yourself (sparsebalance prepare {name} --out STORE) and pass "
        hint += "--data STORE"
    raise ValueError(f"{data}: the token cache {cache_dir} cannot be written ({why}): {hint}")


def _say(message: str) -> None:
    print(f"sparsebalance: {message}", file=sys.stderr, flush=True)


def _prepare_once(path: Path, write: Callable[[], object]) -> None:
    """``write()`` the cache's store at ``path`` unless another process does: then wait for it
    (one line first) and use its store. Never replaces a store in the cache: a reader may be
    mapping it."""
    try:
        write()
        return
    except StoreBusy as busy:
        _say(f"{busy.holder} is preparing the same data into {path}: waiting for it")
        wait_for_writer(path)
    except StoreExists:  # another process finished it between our look and our start
        pass
    if not is_store(path):  # the other writer failed or was killed: prepare it here
        write()


def _check_bad_records(name: str, path: Path, on_bad_record: str) -> None:
    """A cached store made with ``--on-bad-record skip`` that skipped records is not what a run
    asking for ``error`` would get: refused with the first bad record, as preparing would."""
    if on_bad_record != "error":
        return
    skipped = read_manifest(path).get("bad_records") or {}
    for reason, info in skipped.items():
        where = (info.get("first") or [name])[0]
        raise ValueError(
            f"{where}: {reason}; pass --on-bad-record skip to skip such records (they are "
            f"counted): the cached store {path} of --data {name} skipped "
            f"{sum(i['count'] for i in skipped.values())} bad records"
        )


def resolve_data(
    data: str | None,
    tokenizer,
    text_field: str = "text",
    num_builtin: int = 256,
    seed: int = 0,
    min_len: int | None = None,
    max_len: int | None = None,
    cache_dir: Path | None = None,
    on_bad_record: str = "error",
    progress: bool = False,
) -> list[DataSource]:
    """``--data`` -> store folders with weights (raw inputs prepared into the cache once)."""
    identity = tokenizer.identity  # no vocabulary load for stores
    if data is None:
        lo, hi = min_len or BUILTIN_LEN[0], max_len or BUILTIN_LEN[1]
        path = _builtin_store(tokenizer, num_builtin, seed, lo, hi, *_token_cache(cache_dir))
        return [DataSource("builtin", str(path), 1.0)]
    out = []
    for name, weight in parse_mixture(data):
        if is_store(name):  # its files are checked where they are opened (open_corpus)
            theirs = (read_manifest(name).get("tokenizer") or {}).get("identity")
            if theirs is not None and theirs != identity:  # None: damaged, said when opened
                raise ValueError(
                    f"--data {name}: the store was prepared with tokenizer "
                    f"{theirs}, this run uses {identity} (--tokenizer)"
                )
            out.append(DataSource(name, name, weight))
            continue
        inputs = describe_inputs([name], "--data")
        key = store_key(inputs, identity, text_field, 2)
        folder, default = _token_cache(cache_dir)
        path = folder / "stores" / key
        if not is_store(path):
            _check_cache(folder, name, default)
            cfg = PrepareConfig(
                [name],
                str(path),
                text_field=text_field,
                on_bad_record=on_bad_record,
                progress=progress,
            )
            _prepare_once(path, lambda cfg=cfg, inputs=inputs: prepare(cfg, tokenizer, inputs))
        _check_bad_records(name, path, on_bad_record)
        out.append(DataSource(name, str(path), weight))
    return out


class _DocView:
    """``corpus.docs[i]``: document ``i``'s tokens (mapped through the compact vocabulary)."""

    def __init__(self, corpus: TokenizedCorpus) -> None:
        self.corpus = corpus

    def __len__(self) -> int:
        return len(self.corpus)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.corpus.doc(int(i))

    def __iter__(self):
        return (self.corpus.doc(i) for i in range(len(self.corpus)))


class _SourceView:
    def __init__(self, corpus: TokenizedCorpus) -> None:
        self.corpus = corpus

    def __len__(self) -> int:
        return len(self.corpus)

    def __getitem__(self, i: int) -> str:
        c, j = self.corpus.locate(int(i))
        return self.corpus.stores[c].source(j)


class TokenizedCorpus:
    """Stores mapped read-only under global document ids, with the read-time length filter.

    ``docs[i]`` / ``sources[i]``: tokens and source of document ``i``; ``lengths()``: int64
    ``(N,)`` from the offsets (no token read); ``pools()``: per component, the local indices
    that pass ``min_len <= length <= max_len``; ``filtered``: what the filter removed.
    ``scan_ids``: see :class:`~.store.TokenStore` (the launcher scans, its ranks need not).
    """

    def __init__(
        self,
        sources: list[DataSource],
        min_len: int | None = None,
        max_len: int | None = None,
        scan_ids: bool | None = None,
    ) -> None:
        if not sources:
            raise ValueError("--data: no data source")
        self.data_sources = list(sources)
        self.stores = [TokenStore(s.store, scan_ids) for s in sources]
        ids = {s.tokenizer["identity"] for s in self.stores}
        if len(ids) > 1:
            raise ValueError(f"--data: stores prepared with different tokenizers ({sorted(ids)})")
        sizes = [len(s) for s in self.stores]
        self.bases = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._lengths = np.concatenate([s.lengths() for s in self.stores])
        self.docs = _DocView(self)
        self.sources = _SourceView(self)
        self.vocab_map: dict[int, int] | None = None
        self._lut: np.ndarray | None = None
        self.meta: dict = {"stores": [s.store for s in sources]}
        self.min_len, self.max_len = min_len, max_len
        self._pools, self.filtered = [], {}
        for src, store in zip(sources, self.stores, strict=True):
            n = store.lengths()
            short = n < (min_len or 0)
            long = n > max_len if max_len is not None else np.zeros(len(n), bool)
            self._pools.append(np.nonzero(~(short | long))[0])
            self.filtered[src.name] = {
                "shorter than --min-len": int(short.sum()),
                "longer than --max-len": int(long.sum()),
            }

    def __len__(self) -> int:
        return int(self.bases[-1])

    def lengths(self) -> np.ndarray:
        return self._lengths

    def locate(self, i: int) -> tuple[int, int]:
        """Global id -> (component, local index)."""
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} out of range [0, {len(self)})")
        c = int(np.searchsorted(self.bases, i, side="right")) - 1
        return c, i - int(self.bases[c])

    def global_id(self, component: int, local: int) -> int:
        return int(self.bases[component]) + int(local)

    def doc(self, i: int) -> np.ndarray:
        c, j = self.locate(i)
        d = self.stores[c].doc(j)
        return d if self._lut is None else self._lut[d]

    def pools(self) -> list[np.ndarray]:
        return self._pools

    @property
    def weights(self) -> list[float]:
        return [s.weight for s in self.data_sources]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.data_sources]

    def token_counts(self) -> np.ndarray:
        """int64 ``(vocab_size,)`` summed over the stores (from their manifests' count files)."""
        return sum(s.token_counts() for s in self.stores)

    def max_token_id(self) -> int:
        return int(np.nonzero(self.token_counts())[0].max())

    def identity(self) -> dict:
        """What a checkpoint records about its data: resume refuses when this differs."""
        return {
            "format_version": VERSION,
            "tokenizer": self.stores[0].tokenizer["identity"],
            "components": [
                {"name": src.name, "content_hash": st.content_hash, "weight": round(src.weight, 9)}
                for src, st in zip(self.data_sources, self.stores, strict=True)
            ],
            "min_len": self.min_len,
            "max_len": self.max_len,
        }


def open_corpus(
    sources: list[DataSource],
    min_len: int | None = None,
    max_len: int | None = None,
    scan_ids: bool | None = None,
) -> TokenizedCorpus:
    """Map the stores on this rank (each opened with its cheap checks; see :class:`TokenStore`)."""
    return TokenizedCorpus(sources, min_len, max_len, scan_ids)


def load_corpus(
    data: str | None,
    tokenizer,
    text_field: str = "text",
    num_builtin: int = 256,
    seed: int = 0,
    min_len: int | None = None,
    max_len: int | None = None,
    cache_dir: Path | None = None,
    on_bad_record: str = "error",
    progress: bool = False,
) -> TokenizedCorpus:
    """:func:`resolve_data` then :func:`open_corpus` in one process (the launcher's check before
    it starts any rank: every token id is read, so a damaged store is refused before launch)."""
    sources = resolve_data(
        data, tokenizer, text_field, num_builtin, seed, min_len, max_len, cache_dir, on_bad_record, progress
    )
    return open_corpus(sources, min_len, max_len, scan_ids=True)


def compact_vocabulary(corpus: TokenizedCorpus, vocab_size: int) -> dict[int, int]:
    """Map the ``vocab_size - 1`` most frequent tokenizer ids (ties: smaller id first) to
    1..vocab_size-1 (0 = unknown), for small models whose embedding is smaller than the
    tokenizer's vocabulary. Counts come from the stores' manifests: no token is read."""
    counts = corpus.token_counts()
    ids = np.nonzero(counts)[0]
    order = np.lexsort((ids, -counts[ids]))[: vocab_size - 1]
    return {int(ids[i]): rank + 1 for rank, i in enumerate(order)}


def apply_vocabulary(corpus: TokenizedCorpus, vocab_map: dict[int, int]) -> TokenizedCorpus:
    """Map every document through ``vocab_map`` when read (in place; returns ``corpus``)."""
    counts = corpus.token_counts()
    lut = np.zeros(max(len(counts), max(vocab_map) + 1), dtype=np.int64)
    keys = np.fromiter(vocab_map.keys(), np.int64, len(vocab_map))
    lut[keys] = np.fromiter(vocab_map.values(), np.int64, len(vocab_map))
    corpus._lut, corpus.vocab_map = lut, vocab_map
    known = counts[keys[keys < len(counts)]].sum()
    corpus.meta["unknown_tokens"] = int(counts.sum() - known)
    return corpus
