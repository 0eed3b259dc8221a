"""The store format: writer -> reader round trip, atomic rename, damaged stores refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparsebalance.data.store import StoreWriter, TokenStore, is_store, token_dtype

TOK = {"name": "fake", "identity": "fake@1", "vocab_size": 1000}


def _write(path, docs, sources, **kw):
    with StoreWriter(path, TOK, **kw) as w:
        w.add_many(docs, sources)
        return w.close()


def test_round_trip_views_lengths_sources_counts(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, n) for n in (5, 1, 97, 200, 3)]
    sources = ["a", "b", "a", "c", "b"]
    path = _write(tmp_path / "s", docs[:2], sources[:2])
    path = tmp_path / "s"
    with StoreWriter(tmp_path / "t", TOK) as w:  # two appends == one
        w.add_many(docs[:2], sources[:2])
        w.add_many(docs[2:], sources[2:])
        w.close()
    st = TokenStore(tmp_path / "t")
    assert st.dtype == np.uint16 and len(st) == 5 and st.num_tokens == sum(map(len, docs))
    np.testing.assert_array_equal(st.lengths(), [len(d) for d in docs])
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(st.doc(i), d)
        assert st.source(i) == sources[i]
    assert isinstance(st.tokens, np.memmap)
    expect = np.bincount(np.concatenate(docs), minlength=1000)
    np.testing.assert_array_equal(st.token_counts(), expect)
    (tmp_path / "t" / "token_counts.npy").unlink()  # recomputed from the map when absent
    np.testing.assert_array_equal(st.token_counts(chunk=7), expect)
    m = st.manifest
    assert [s["name"] for s in m["sources"]] == ["a", "b", "c"]
    assert [s["documents"] for s in m["sources"]] == [2, 2, 1]
    assert sum(m["length_histogram"]["counts"]) == 5
    assert TokenStore(path).content_hash != st.content_hash  # different documents


def test_dtype_from_vocabulary():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    with pytest.raises(ValueError, match="vocab_size"):
        token_dtype(0)


def test_same_content_same_hash(tmp_path):
    docs = [np.arange(10), np.arange(3)]
    a = TokenStore(_write(tmp_path / "a", docs, ["x", "y"]))
    b = TokenStore(_write(tmp_path / "b", docs, ["x", "y"]))
    assert a.content_hash == b.content_hash


def test_out_of_range_token_refused(tmp_path):
    with pytest.raises(ValueError, match="out of range"), StoreWriter(tmp_path / "s", TOK) as w:
        w.add_many([np.array([1, 1000])], ["a"])
    assert not (tmp_path / "s").exists()
    assert not list(tmp_path.iterdir())  # the temporary folder is gone too


def test_interrupted_write_leaves_nothing_loadable(tmp_path):
    with pytest.raises(KeyboardInterrupt), StoreWriter(tmp_path / "s", TOK) as w:
        w.add_many([np.arange(50)], ["a"])
        raise KeyboardInterrupt
    assert not is_store(tmp_path / "s") and not (tmp_path / "s").exists()
    # a killed process leaves its temporary folder (no manifest): it does not load either
    w = StoreWriter(tmp_path / "s", TOK)
    w.add_many([np.arange(50)], ["a"])
    with pytest.raises(ValueError, match="not a token store"):
        TokenStore(w.tmp)
    assert not (tmp_path / "s").exists()
    w.abort()


def test_existing_store_needs_overwrite(tmp_path):
    _write(tmp_path / "s", [np.arange(4)], ["a"])
    with pytest.raises(ValueError, match="--overwrite"):
        StoreWriter(tmp_path / "s", TOK)
    _write(tmp_path / "s", [np.arange(9)], ["a"], overwrite=True)
    assert TokenStore(tmp_path / "s").num_tokens == 9
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a token store"):
        StoreWriter(tmp_path / "plain", TOK, overwrite=True)


def test_damaged_or_foreign_store_refused(tmp_path):
    path = _write(tmp_path / "s", [np.arange(8)], ["a"])
    with open(path / "tokens.bin", "r+b") as f:
        f.truncate(6)
    with pytest.raises(ValueError, match="damaged"):
        TokenStore(path)
    m = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**m, "version": 999}))
    with pytest.raises(ValueError, match=r"version 999 .*newer.*upgrade SparseBalance, or prepare"):
        TokenStore(path)
    (path / "manifest.json").write_text(json.dumps({**m, "version": 0}))
    with pytest.raises(ValueError, match=r"version 0 .*older.*prepare it again"):
        TokenStore(path)


def test_empty_store_refused(tmp_path):
    with pytest.raises(ValueError, match="empty"), StoreWriter(tmp_path / "s", TOK) as w:
        w.close()
    assert not (tmp_path / "s").exists()


def test_plan_reads_lengths_from_a_store(tmp_path):
    from sparsebalance.data import read_lengths

    path = _write(tmp_path / "s", [np.arange(7), np.arange(3), np.arange(12)], ["a", "b", "a"])
    samples, dens = read_lengths(str(path))
    assert [(s.id, s.num_tokens, s.source) for s in samples] == [
        (0, 7, "a"),
        (1, 3, "b"),
        (2, 12, "a"),
    ]
    assert dens is None


def test_killed_writers_temporary_folder_is_swept(tmp_path):
    import os
    import socket
    import subprocess
    import sys
    import time

    from sparsebalance.data.store import STALE_ELSEWHERE_SECONDS

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs here
    here = socket.gethostname()

    def folder(name, age=0.0):
        d = tmp_path / name
        d.mkdir()
        (d / "tokens.bin").write_bytes(b"x" * 10)
        old = time.time() - age
        for p in (d / "tokens.bin", d):
            os.utime(p, (old, old))
        return d

    dead = folder(f".s.tmp-{here}-{gone.pid}-abcd1234")
    alive = folder(f".s.tmp-{here}-{os.getpid()}-00000000")  # a live writer's folder is kept
    # another host's writer: its pid means nothing here (it may be alive over there)
    remote = folder(f".s.tmp-node-17-{gone.pid}-11111111")
    remote_old = folder(f".s.tmp-node-17-{gone.pid}-22222222", STALE_ELSEWHERE_SECONDS + 60)
    legacy = folder(f".s.tmp-{gone.pid}-33333333")  # no host in the name: judged by age too
    w = StoreWriter(tmp_path / "s", TOK)
    assert sorted(w.swept) == sorted([dead, remote_old])
    assert alive.exists() and remote.exists() and legacy.exists()
    assert here in w.tmp.name and str(os.getpid()) in w.tmp.name
    w.abort()
