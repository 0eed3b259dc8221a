"""Data given to ``sparsebalance prepare`` and ``train``: a tokenizer folder without a tokenizer,
a parquet or Arrow file that is not one, and a token store given where raw data is read are
refused in one line naming the folder or file (and what is wrong with it), and no store or run
folder is written."""

from __future__ import annotations

import pytest

from tests.badinput.conftest import ExpensiveStageReached, assert_refused, cli, snapshot, write_json
from tests.train.harness import write_dataset


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A token store of a few documents, as ``prepare`` writes it (the default tokenizer)."""
    from sparsebalance.cli import main

    tmp = tmp_path_factory.mktemp("store")
    (tmp / "docs.jsonl").write_text('{"text": "one two three four"}\n{"text": "five six"}\n')
    assert main(["prepare", str(tmp / "docs.jsonl"), "--out", str(tmp / "store"), "--no-progress", "--json"]) == 0
    return tmp / "store"


def _empty_tokenizer(tmp, store):
    (tmp / "tok").mkdir()
    return ["--tokenizer", tmp / "tok"], [f"--tokenizer {tmp / 'tok'}", "no tokenizer files", "tokenizer.json"]


def _garbage_tokenizer(tmp, store):
    (tmp / "tok").mkdir()
    (tmp / "tok" / "tokenizer.json").write_text("not json")
    write_json(tmp / "tok" / "tokenizer_config.json", {})
    return ["--tokenizer", tmp / "tok"], [f"--tokenizer {tmp / 'tok'}", "could not load"]


def _garbage(name: str, what: str):
    def make(tmp, store):
        path = tmp / name
        path.write_bytes(b"\x00\xffnot a table at all\x13" * 4)
        return [], [f"{path}: not a readable {what} file"]

    make.input = name
    return make


def _truncated_parquet(tmp, store):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp / "docs.parquet"
    pq.write_table(pa.table({"text": ["some words here " * 40] * 400}), path, row_group_size=100)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3] + data[-4096:])  # row groups gone, footer kept
    return [], [f"{path}: not a readable parquet file"]


_truncated_parquet.input = "docs.parquet"


def _store_as_input(tmp, store):
    return [], ["INPUT", f"{store}: a token store, already prepared", f"--data {store}"]


_store_as_input.input = "STORE"


def _folder_holding_a_store(tmp, store):
    import shutil

    shutil.copytree(store, tmp / "raw" / "store")
    (tmp / "raw" / "more.jsonl").write_text('{"text": "seven eight nine"}\n')
    inner = tmp / "raw" / "store"
    return [], [f"INPUT {tmp / 'raw'}: {inner} is a token store", f"--data {inner}"]


_folder_holding_a_store.input = "raw"


def _store_manifest(tmp, store):
    return [], [f"{store} is a token store", f"--data {store}"]


_store_manifest.input = "STORE/manifest.json"

# a case: (tmp, store) -> (extra flags, culprits); its ``input`` (default a good jsonl file)
CASES = [
    pytest.param(_empty_tokenizer, id="empty-tokenizer-folder"),
    pytest.param(_garbage_tokenizer, id="tokenizer-json-garbage"),
    pytest.param(_garbage("docs.parquet", "parquet"), id="garbage-parquet"),
    pytest.param(_truncated_parquet, id="truncated-parquet"),
    pytest.param(_garbage("docs.arrow", "Arrow"), id="garbage-arrow"),
    pytest.param(_store_as_input, id="store-as-input"),
    pytest.param(_folder_holding_a_store, id="folder-holding-a-store"),
    pytest.param(_store_manifest, id="store-manifest-as-input"),
]


def _input(case, tmp, store):
    name = getattr(case, "input", None)
    if name is None:
        return write_dataset(tmp)
    return str(store) + name[len("STORE") :] if name.startswith("STORE") else tmp / name


@pytest.mark.parametrize("case", CASES)
def test_prepare_refuses_in_one_line_naming_the_file(tmp_path, capsys, store, case):
    extra, culprits = case(tmp_path, store)
    before = snapshot(store)
    out = tmp_path / "out"
    code, err = cli(capsys, "prepare", _input(case, tmp_path, store), "--out", out, "--no-progress", *extra)
    assert_refused(code, err, "prepare", *culprits)
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))  # no store, no leftovers
    assert snapshot(store) == before


# what train reads: the same refusals, before anything is launched
TRAIN_CASES = [
    pytest.param(_empty_tokenizer, id="empty-tokenizer-folder"),
    pytest.param(_garbage("docs.parquet", "parquet"), id="garbage-parquet"),
    pytest.param(_folder_holding_a_store, id="folder-holding-a-store"),
]


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_train_refuses_before_launch(tmp_path, capsys, store, case, monkeypatch):
    monkeypatch.setattr("sparsebalance.data.dataset.CACHE_DIR", tmp_path / "cache")
    extra, culprits = case(tmp_path, store)
    culprits = [c.replace("INPUT ", "--data ") for c in culprits]
    run = tmp_path / "run"
    code, err = cli(
        capsys,
        "train",
        "--data",
        _input(case, tmp_path, store),
        "--device",
        "cpu",
        "--nproc",
        "1",
        "--block-size",
        "32",
        "--capacity",
        "512",
        "--global-batch",
        "2",
        "--steps",
        "1",
        "--out",
        run,
        *extra,
    )
    assert_refused(code, err, "train", *culprits)
    assert not run.exists()


# -- token stores under faults (issue 45) -------------------------------------------------------

TRAIN = [
    "--device",
    "cpu",
    "--nproc",
    "1",
    "--block-size",
    "32",
    "--capacity",
    "512",
    "--global-batch",
    "2",
    "--steps",
    "1",
]


def _no_tokenizing(monkeypatch):
    """Reading the inputs (then tokenizing them) is the expensive stage of prepare."""

    def trip(*args, **kwargs):
        raise ExpensiveStageReached("the inputs were read before the refusal")

    monkeypatch.setattr("sparsebalance.data.prepare.read_records", trip)


def _leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_prepare_into_a_store_another_prepare_writes(tmp_path, capsys, store, monkeypatch):
    """The second of two prepares into one store fails at its start, naming the store; the
    first finishes with its documents."""
    from sparsebalance.data.store import StoreWriter, TokenStore

    out = tmp_path / "out"
    first = StoreWriter(out, TokenStore(store).tokenizer)
    first.add_many([TokenStore(store).doc(0)], ["first"])
    _no_tokenizing(monkeypatch)
    code, err = cli(capsys, "prepare", write_dataset(tmp_path), "--out", out, "--no-progress")
    assert_refused(code, err, "prepare", f"{out}: another prepare is writing this token store")
    first.close()
    assert TokenStore(out).source(0) == "first" and _leftovers(tmp_path) == []


def test_prepare_that_finishes_second_keeps_the_first(tmp_path, capsys, store, monkeypatch):
    """Without locks (a filesystem without flock) both prepares run; the one finishing second
    fails naming the store, and the store holds the first one's documents."""
    import errno
    import os

    from sparsebalance.data import prepare as prepare_mod
    from sparsebalance.data.store import StoreWriter, TokenStore

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr("fcntl.flock", no_locks)
    out, real = tmp_path / "out", prepare_mod.read_records

    def other_prepare_finishes_meanwhile(*args, **kwargs):
        with StoreWriter(out, TokenStore(store).tokenizer) as other:
            other.add_many([TokenStore(store).doc(0)], ["first"])
            other.close()
        yield from real(*args, **kwargs)

    monkeypatch.setattr(prepare_mod, "read_records", other_prepare_finishes_meanwhile)
    code, err = cli(capsys, "prepare", write_dataset(tmp_path), "--out", out, "--no-progress")
    assert_refused(code, err, "prepare", f"--out {out}: another writer finished this store first")
    assert TokenStore(out).source(0) == "first" and len(TokenStore(out)) == 1
    assert _leftovers(tmp_path) == []


def test_prepare_on_a_full_disk(tmp_path, capsys, store, monkeypatch):
    """One line naming the store and the full disk; the partial store removed, the existing
    one intact."""
    import shutil

    from tests.data.conftest import FullDisk

    out = tmp_path / "out"
    shutil.copytree(store, out)
    before = snapshot(out)
    FullDisk(20).install(monkeypatch)
    code, err = cli(capsys, "prepare", write_dataset(tmp_path), "--out", out, "--no-progress", "--overwrite")
    assert_refused(code, err, "prepare", f"{out}: the disk is full", "the existing store is intact")
    assert snapshot(out) == before and _leftovers(tmp_path) == []


def test_train_with_the_cache_on_a_full_disk(tmp_path, capsys, monkeypatch):
    """Raw --data prepared into the cache on a full HOME: one line, no partial store in the
    cache, no run folder."""
    from tests.data.conftest import FullDisk

    cache = tmp_path / "cache"
    monkeypatch.setattr("sparsebalance.data.dataset.CACHE_DIR", cache)
    FullDisk(100).install(monkeypatch)
    run = tmp_path / "run"
    code, err = cli(capsys, "train", "--data", write_dataset(tmp_path), *TRAIN, "--out", run)
    assert_refused(code, err, "train", f"{cache / 'stores'}/", "the disk is full")
    assert not run.exists() and list((cache / "stores").iterdir()) == []


def _damaged_ids(path):
    with open(path / "tokens.bin", "r+b") as f:  # 8 bytes of 0xFF: two ids of 4294967295
        f.seek(8)
        f.write(b"\xff" * 8)
    return ["tokens.bin: token id 4294967295 (token 2, document 0) is outside the vocabulary"]


def _changed_manifest(path):
    import json

    m = json.loads((path / "manifest.json").read_text())
    m["checksums"]["sources.bin"]["crc32"] ^= 1
    (path / "manifest.json").write_text(json.dumps(m))
    return ["sources.bin: differs from its checksum in the manifest"]


@pytest.mark.parametrize("damage", [_damaged_ids, _changed_manifest], ids=["ids", "checksum"])
def test_train_refuses_a_damaged_store_before_launch(tmp_path, capsys, store, damage):
    import shutil

    damaged = tmp_path / "store"
    shutil.copytree(store, damaged)
    culprits = damage(damaged)
    run = tmp_path / "run"
    code, err = cli(capsys, "train", "--data", damaged, *TRAIN, "--out", run)
    assert_refused(code, err, "train", str(damaged), "the store is damaged", *culprits)
    assert not run.exists()


def test_train_does_not_reuse_a_cached_store_that_skipped_records(tmp_path, capsys, monkeypatch):
    """A store made with --on-bad-record skip is not what --on-bad-record error (the default)
    asks for: refused with the first bad record, as preparing it would be."""
    cache = tmp_path / "cache"
    monkeypatch.setattr("sparsebalance.data.dataset.CACHE_DIR", cache)
    data = write_dataset(tmp_path)
    data.write_text(data.read_text() + "{not json\n")
    run = tmp_path / "run"
    from sparsebalance.data import load_tokenizer
    from sparsebalance.data.dataset import resolve_data

    resolve_data(str(data), load_tokenizer(), cache_dir=cache, on_bad_record="skip")
    code, err = cli(capsys, "train", "--data", data, *TRAIN, "--out", run)
    lines = len(data.read_text().splitlines())
    assert_refused(code, err, "train", f"{data}:{lines}: invalid JSON", "--on-bad-record skip")
    assert not run.exists()
