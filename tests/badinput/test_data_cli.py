"""Data given to ``sparsebalance prepare`` and ``train``: a tokenizer folder without a tokenizer,
a parquet or Arrow file that is not one, and a token store given where raw data is read are
refused in one line naming the folder or file (and what is wrong with it), and no store or run
folder is written."""

from __future__ import annotations

import pytest

from tests.badinput.conftest import assert_refused, cli, snapshot, write_json
from tests.train.harness import write_dataset


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A token store of a few documents, as ``prepare`` writes it (the default tokenizer)."""
    from sparsebalance.cli import main

    tmp = tmp_path_factory.mktemp("store")
    (tmp / "docs.jsonl").write_text('{"text": "one two three four"}\n{"text": "five six"}\n')
    assert main(["prepare", str(tmp / "docs.jsonl"), "--out", str(tmp / "store"),
                 "--no-progress", "--json"]) == 0  # fmt: skip
    return tmp / "store"


def _empty_tokenizer(tmp, store):
    (tmp / "tok").mkdir()
    return ["--tokenizer", tmp / "tok"], [f"--tokenizer {tmp / 'tok'}", "no tokenizer files",
                                          "tokenizer.json"]  # fmt: skip


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
    code, err = cli(capsys, "prepare", _input(case, tmp_path, store), "--out", out,
                    "--no-progress", *extra)  # fmt: skip
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
    code, err = cli(capsys, "train", "--data", _input(case, tmp_path, store), "--device", "cpu",
                    "--nproc", "1", "--block-size", "32", "--capacity", "512", "--global-batch",
                    "2", "--steps", "1", "--out", run, *extra)  # fmt: skip
    assert_refused(code, err, "train", *culprits)
    assert not run.exists()
