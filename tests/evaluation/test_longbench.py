"""LongBench reader, templates, middle truncation, and the evaluate loop with a fake generator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparsebalance.evaluation import (
    DATASET_METRIC,
    MAX_NEW_TOKENS,
    build_prompt,
    evaluate_longbench,
    load_templates,
    read_dir,
    read_jsonl,
    truncate_middle,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "longbench"


def test_reader_fields():
    rec = read_jsonl(FIXTURES / "trec.jsonl")[1]
    assert rec.id == "tr-2" and rec.dataset == "trec" and rec.language == "en"
    assert rec.answers == ["Location"] and rec.length == 6
    assert rec.all_classes == ["Location", "Human being", "Human", "Number"]
    assert read_jsonl(FIXTURES / "passage_count.jsonl")[0].answers == ["4"]  # int -> str
    assert len(read_dir(FIXTURES)) == 20


def test_reader_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "hotpotqa.jsonl"
    bad.write_text('{"context": "x", "answers": ["a"]}\n{"context": "y"}\n')
    with pytest.raises(ValueError, match=r"hotpotqa.jsonl:2"):
        read_jsonl(bad)
    ok = tmp_path / "qasper.jsonl"
    ok.write_text('{"context": "x", "answers": "a"}\n')
    assert read_jsonl(ok)[0].dataset == "qasper"  # from the file name


def test_templates_cover_every_dataset_and_keep_answer_formats():
    templates = load_templates()
    assert set(templates) == set(DATASET_METRIC) == set(MAX_NEW_TOKENS)
    assert all("{context}" in t for t in templates.values())
    assert '"Paragraph 1"' in templates["passage_retrieval_en"]
    assert '"段落1"' in templates["passage_retrieval_zh"]
    assert templates["lcc"].endswith("Next line of code:\n")


def test_build_prompt_keeps_braces_in_context():
    rec = read_jsonl(FIXTURES / "lcc.jsonl")[0]
    rec = rec.__class__(**{**rec.__dict__, "context": "d = {'a': {input}}\n"})
    prompt = build_prompt(rec, {"lcc": "Code:\n{context}Next:"})
    assert prompt == "Code:\nd = {'a': {input}}\nNext:"


def test_truncate_middle():
    ids = list(range(10))
    assert truncate_middle(ids, 10) == (ids, False)
    assert truncate_middle(ids, 4) == ([0, 1, 8, 9], True)
    assert truncate_middle(ids, 5) == ([0, 1, 8, 9], True)  # official: 2 * (max // 2)
    with pytest.raises(ValueError, match="max_length"):
        truncate_middle(ids, 1)


def test_evaluate_loop_scores_generated_text_and_counts_truncation():
    records = read_jsonl(FIXTURES / "hotpotqa.jsonl")
    preds = {
        json.loads(x)["_id"]: json.loads(x)["pred"] for x in (FIXTURES / "hotpotqa.jsonl").read_text().splitlines()
    }
    encode = lambda s: [ord(c) for c in s]  # noqa: E731 (a character "tokenizer")
    decode = lambda ids: "".join(map(chr, ids))  # noqa: E731
    seen = []

    def generate(ids, max_new):
        seen.append((len(ids), max_new))
        text = decode(ids)
        rec = next(r for r in records if r.input in text)
        return encode(preds[rec.id])

    result = evaluate_longbench(records, generate, encode, decode, max_length=4000)
    assert result.scores == {"hotpotqa": 50.0} and result.num_truncated == 0
    assert all(m == 32 for _, m in seen)
    short = evaluate_longbench(records, lambda ids, m: [], encode, decode, max_length=100)
    assert short.num_truncated == 3
    assert short.scores == {"hotpotqa": 0.0}
