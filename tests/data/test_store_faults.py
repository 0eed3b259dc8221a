"""Token stores under faults (issue 45): concurrent writers of one store, a full disk, damaged
contents (found when opened, when a shard is first read, or by ``prepare --verify``), and a
cached store reused under another ``--on-bad-record``."""

from __future__ import annotations

import errno
import json
import os
import threading

import numpy as np
import pytest

from sparsebalance.data import store as store_mod
from sparsebalance.data.dataset import load_corpus, resolve_data
from sparsebalance.data.store import (
    DiskFull,
    StoreBusy,
    StoreDamaged,
    StoreExists,
    StoreWriter,
    TokenStore,
    verify_store,
)

from .conftest import TEXTS, FullDisk, write_jsonl

TOK = {"name": "fake", "identity": "fake@1", "vocab_size": 1000}


class Tokenizer:
    name = identity = TOK["identity"]
    vocab_size = TOK["vocab_size"]


def _docs(seed: int, n: int = 6, length: int = 50) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, length) for _ in range(n)]


def _write(path, docs, **kw):
    with StoreWriter(path, TOK, **kw) as w:
        w.add_many(docs, ["a"] * len(docs))
        return w.close()


def _leftovers(folder) -> list[str]:
    """Temporary folders and locks a writer left beside its stores."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# -- concurrent writers -------------------------------------------------------------------------


def test_a_second_writer_of_a_store_is_refused_while_the_first_writes(tmp_path):
    first = StoreWriter(tmp_path / "s", TOK)
    first.add_many(_docs(0), ["a"] * 6)
    for overwrite in (False, True):  # --overwrite does not make two writers possible either
        with pytest.raises(StoreBusy, match=f"{tmp_path / 's'}: another prepare is writing"):
            StoreWriter(tmp_path / "s", TOK, overwrite=overwrite)
    first.close()
    np.testing.assert_array_equal(TokenStore(tmp_path / "s").doc(5), _docs(0)[5])
    with pytest.raises(StoreExists, match="--overwrite"):
        StoreWriter(tmp_path / "s", TOK)
    _write(tmp_path / "s", _docs(1), overwrite=True)  # the documented replace, once alone
    np.testing.assert_array_equal(TokenStore(tmp_path / "s").doc(5), _docs(1)[5])
    assert _leftovers(tmp_path) == []


def test_a_writer_that_finishes_second_never_replaces_the_first(tmp_path, monkeypatch):
    """On a filesystem without locks both writers start; the rename still cannot replace the
    store the first one finished: the second fails naming it, and nothing of the first is lost."""

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr("fcntl.flock", no_locks)
    a, b = StoreWriter(tmp_path / "s", TOK), StoreWriter(tmp_path / "s", TOK)
    a.add_many(_docs(0), ["a"] * 6)
    b.add_many(_docs(1), ["b"] * 6)
    a.close()
    with pytest.raises(StoreExists, match=f"--out {tmp_path / 's'}: another writer finished"):
        b.close()
    st = TokenStore(tmp_path / "s")
    assert [st.source(i) for i in range(6)] == ["a"] * 6
    np.testing.assert_array_equal(st.doc(0), _docs(0)[0])
    assert _leftovers(tmp_path) == []


def test_a_killed_writer_leaves_no_lock(tmp_path):
    """The lock is the kernel's (flock): a writer that dies without cleaning up releases it."""
    import subprocess
    import sys

    code = (
        "import os, sys; from sparsebalance.data.store import StoreWriter; "
        f"w = StoreWriter({str(tmp_path / 's')!r}, {TOK!r}); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert (tmp_path / ".s.lock").exists()  # left behind, but nobody holds it
    _write(tmp_path / "s", _docs(0))
    assert TokenStore(tmp_path / "s").num_tokens == 300 and _leftovers(tmp_path) == []


def test_the_cache_waits_for_a_writer_of_the_same_store(tmp_path, tokenizer, monkeypatch):
    """Two runs preparing the same raw input into the cache: the second waits for the first and
    uses its store (it neither fails nor prepares it again)."""
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    cache = tmp_path / "cache"
    (done,) = resolve_data(str(src), tokenizer, cache_dir=cache)
    ready = store_mod.TokenStore(done.store)
    held = cache / "stores" / "held"
    inode = os.stat(done.store).st_ino
    os.rename(done.store, held)  # the store the other run is about to finish
    other = StoreWriter(done.store, {**ready.tokenizer})  # the other run, writing
    said, result = [], {}
    monkeypatch.setattr("sparsebalance.data.dataset._say", said.append)
    waiter = threading.Thread(
        target=lambda: result.update(r=resolve_data(str(src), tokenizer, cache_dir=cache)),
        daemon=True,
    )
    waiter.start()
    try:
        while not said and waiter.is_alive():  # until it says it waits (or has failed)
            waiter.join(0.01)
        (line,) = said
        assert line.startswith(f"pid {os.getpid()} on ")
        assert line.endswith(f"is preparing the same data into {done.store}: waiting for it")
        os.rename(held, done.store)  # the other run finishes: its store is in place,
    finally:
        other.abort()  # then its lock goes
    waiter.join(10)  # a bound only against a hang: it returns as soon as the lock is free
    assert not waiter.is_alive() and result["r"][0].store == done.store
    assert os.stat(done.store).st_ino == inode  # its store, not prepared again


# -- a full disk --------------------------------------------------------------------------------


TOKENS_BYTES = 10 * 3 * 2000 * 2  # what the writer below appends: 10 x 3 documents, uint16


@pytest.mark.parametrize(
    ("free", "appended"),
    [
        pytest.param(50_000, 4, id="while-appending-tokens"),
        pytest.param(TOKENS_BYTES + 31 * 8 + 30 * 4 + 10, 10, id="at-close-token-counts"),
    ],
)
def test_a_full_disk_is_one_line_and_leaves_the_previous_store(tmp_path, monkeypatch, free, appended):
    before = TokenStore(_write(tmp_path / "s", _docs(0))).content_hash
    FullDisk(free).install(monkeypatch)
    done = []
    with pytest.raises(DiskFull) as err, StoreWriter(tmp_path / "s", TOK, overwrite=True) as w:
        for i in range(10):
            w.add_many(_docs(i, n=3, length=2000), ["a"] * 3)  # 12,000 bytes: past the buffer
            done.append(i)
        w.close()
    assert len(done) == appended  # the disk filled where the case says
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{tmp_path / 's'}: the disk is full")
    assert "the existing store is intact" in text
    assert _leftovers(tmp_path) == []  # no .s.tmp-*, no lock
    assert TokenStore(tmp_path / "s").content_hash == before
    assert verify_store(tmp_path / "s")[0] == []


def test_a_full_disk_with_no_store_before_leaves_nothing(tmp_path, monkeypatch):
    FullDisk(100).install(monkeypatch)
    with pytest.raises(DiskFull, match="the partial store was removed; free space"):
        _write(tmp_path / "s", _docs(0, n=20))
    assert list(tmp_path.iterdir()) == []


# -- damaged contents ---------------------------------------------------------------------------


@pytest.fixture
def small_shards(monkeypatch):
    """Shards of 64 bytes (32 uint16 tokens): a store of a few documents has several."""
    monkeypatch.setattr(store_mod, "SHARD_BYTES", 64)


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path, small_shards):
    """The issue's 8 bytes of 0xFF: refused when the launcher opens the store (every id read),
    when a rank reads the document (its shard's checksum), and at any open of a store written
    before checksums (nothing else would catch it)."""
    path = _write(tmp_path / "s", _docs(0))
    with open(path / "tokens.bin", "r+b") as f:
        f.seek(2 * 120)
        f.write(b"\xff" * 8)
    problem = (
        f"{path / 'tokens.bin'}: token id 65535 (token 120, document 2) is outside the "
        "vocabulary of 1,000 the store was prepared with: the store is damaged"
    )
    with pytest.raises(StoreDamaged) as err:
        load_corpus(str(path), Tokenizer())  # what `sparsebalance train` checks before launch
    assert str(err.value) == problem
    st = TokenStore(path)  # a rank: the documents it reads
    np.testing.assert_array_equal(st.doc(0), _docs(0)[0])
    with pytest.raises(StoreDamaged, match=r"bytes 192\.\.256 \(shard 3, read for document 2\)"):
        st.doc(2)
    m = json.loads((path / "manifest.json").read_text())
    del m["checksums"]
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreDamaged) as err:
        TokenStore(path)
    assert str(err.value) == problem


def test_changed_tokens_are_found_when_their_shard_is_first_read(tmp_path, small_shards):
    path = _write(tmp_path / "s", _docs(0))  # 300 tokens, 600 bytes: 10 shards
    tokens = np.fromfile(path / "tokens.bin", np.uint16)
    tokens[160:164] = 7  # 4 tokens of document 3 changed to a valid id (bytes 320..328)
    tokens.tofile(path / "tokens.bin")
    st = TokenStore(path)  # the cheap checks pass: sizes, offsets, ids in range
    np.testing.assert_array_equal(st.doc(0), _docs(0)[0])  # an intact shard reads
    with pytest.raises(StoreDamaged, match=r"bytes 320\.\.384 \(shard 5, read for document 3\)"):
        st.doc(3)
    with pytest.raises(StoreDamaged, match="prepare --verify"):
        st.doc(3)  # it stays refused


def test_offsets_and_sources_are_checked_against_their_checksums(tmp_path):
    path = _write(tmp_path / "s", _docs(0))
    offsets = np.fromfile(path / "offsets.bin", np.int64)
    offsets[2] += 1  # still from 0 to the end, never decreasing: only the checksum tells
    offsets.tofile(path / "offsets.bin")
    with pytest.raises(StoreDamaged, match=r"offsets\.bin: differs from its checksum"):
        TokenStore(path)
    path = _write(tmp_path / "t", _docs(0))
    (path / "token_counts.npy").write_bytes((path / "token_counts.npy").read_bytes()[:-8] + b"\x01" * 8)
    with pytest.raises(StoreDamaged, match=r"token_counts\.npy: differs from its checksum"):
        TokenStore(path).token_counts()


def test_verify_names_every_problem(tmp_path, small_shards):
    path = _write(tmp_path / "s", _docs(0))
    assert verify_store(path)[0] == []
    tokens = np.fromfile(path / "tokens.bin", np.uint16)
    tokens[[5, 200]] = [7, 9999]  # a valid id in shard 0, an id out of range in shard 6
    tokens.tofile(path / "tokens.bin")
    problems, _ = verify_store(path)
    assert problems[0] == (
        f"{path / 'tokens.bin'}: token id 9999 (token 200, document 4) is outside the "
        "vocabulary of 1,000 the store was prepared with: the store is damaged"
    )
    assert problems[1:3] == [
        f"{path / 'tokens.bin'}: bytes 0..64 (shard 0, document 0) differ from their checksum: the store is damaged",
        f"{path / 'tokens.bin'}: bytes 384..448 (shard 6, documents 3..4) differ from their "
        "checksum: the store is damaged",
    ]
    assert "content hash" in problems[3] and len(problems) == 4


def test_verify_a_store_written_before_checksums(tmp_path):
    path = _write(tmp_path / "s", _docs(0))
    m = json.loads((path / "manifest.json").read_text())
    del m["checksums"]
    (path / "manifest.json").write_text(json.dumps(m))
    assert verify_store(path)[0] == []
    tokens = np.fromfile(path / "tokens.bin", np.uint16)
    tokens[10] = (tokens[10] + 1) % 1000
    tokens.tofile(path / "tokens.bin")
    TokenStore(path).doc(0)  # no shard checksums to check when read
    (problem,) = verify_store(path)[0]
    assert problem.startswith(f"{path / 'manifest.json'}: content hash {m['content_hash']}")


def test_cli_verify(tmp_path, capsys, small_shards):
    from sparsebalance.cli import main

    path = _write(tmp_path / "s", _docs(0))
    assert main(["prepare", "--verify", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: intact: 6 documents, 300 tokens")
    tokens = np.fromfile(path / "tokens.bin", np.uint16)
    tokens[160:164] = 7
    tokens.tofile(path / "tokens.bin")
    assert main(["prepare", "--verify", str(path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("sparsebalance prepare: damaged: ") for line in err)
    assert "bytes 320..384 (shard 5, document 3)" in err[0] and "content hash" in err[1]
    assert main(["prepare", "--verify", str(path), "--out", str(tmp_path / "x")]) == 2
    assert "give no INPUT and no --out" in capsys.readouterr().err
    assert main(["prepare", "--verify", str(tmp_path)]) == 2
    assert "is not a token store" in capsys.readouterr().err


# -- the cache and --on-bad-record --------------------------------------------------------------


def test_a_cached_store_that_skipped_records_is_not_reused_by_error(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": TEXTS[0]}, "{not json", {"text": TEXTS[1]}])
    cache = tmp_path / "cache"
    (made,) = resolve_data(str(src), tokenizer, cache_dir=cache, on_bad_record="skip")
    assert len(TokenStore(made.store)) == 2
    with pytest.raises(ValueError) as err:
        resolve_data(str(src), tokenizer, cache_dir=cache, on_bad_record="error")
    assert str(err.value).startswith(f"{src}:2: invalid JSON; pass --on-bad-record skip")
    assert made.store in str(err.value) and "\n" not in str(err.value)
    (again,) = resolve_data(str(src), tokenizer, cache_dir=cache, on_bad_record="skip")
    assert again.store == made.store
