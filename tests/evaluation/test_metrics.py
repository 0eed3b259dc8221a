"""LongBench metrics on the fixture (hand-computed scores) and their edge cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparsebalance.evaluation import read_jsonl, score_by_length, score_dataset
from sparsebalance.evaluation.metrics import (
    classification,
    code_sim,
    dataset_metric,
    fuzz_ratio,
    qa_f1,
    qa_f1_zh,
    rouge_l,
    score_example,
)

FIXTURES = Path(__file__).parent.parent / "fixtures" / "longbench"

# Hand-computed, per example (the fixture's "pred" field is the model output to score):
EXPECTED = {
    # "The city of Paris." -> [city, of, paris]; vs "paris": P 1/3 R 1 -> 0.5; vs "paris france":
    # P 1/3 R 1/2 -> 0.4; best gold 0.5. Empty prediction 0. Exact "1961" 1.  -> 50.0
    "hotpotqa": ([0.5, 0.0, 1.0], 50.0),
    # jieba: 中国/的/首都/是/北京 vs 北京: P 1/5 R 1 -> 1/3; exact 北京 -> 1.   -> 66.67
    "multifieldqa_zh": ([1.0, 1 / 3], 66.67),
    # "a quick brown fox" vs "the quick red fox jumps": LCS quick,fox = 2; P 2/4 R 2/5
    # -> F 2PR/(P+R) = 0.4444; empty prediction -> 0 (rouge raises, scored 0).   -> 22.22
    "gov_report": ([4 / 9, 0.0], 22.22),
    # jieba: 北京/是/首都 vs 北京/是/中国/的/首都: LCS 3, P 1 R 3/5 -> 0.75         -> 75.0
    "dureader": ([0.75], 75.0),
    # "Human being" found with "Human" (substring of the gold: dropped) -> 1; first line
    # "Location or Number" -> 1/2; empty -> 0.                                   -> 50.0
    "trec": ([1.0, 0.5, 0.0], 50.0),
    # numbers [3] -> 1; [3, 12] -> 1/2; none -> 0                                -> 50.0
    "passage_retrieval_en": ([1.0, 0.5, 0.0], 50.0),
    # [5] -> 1; [2] -> 0                                                           -> 50.0
    "passage_retrieval_zh": ([1.0, 0.0], 50.0),
    # "4" -> 1; [4, 5] -> 1/2                                                      -> 75.0
    "passage_count": ([1.0, 0.5], 75.0),
    # first line equal -> 100; "# add them" skipped, "return a+b" vs "return a + b":
    # Indel distance 2 over 22 chars -> 90.9 -> 91 -> 0.91                         -> 95.5
    "lcc": ([1.0, 0.91], 95.5),
}


def load(name):
    path = FIXTURES / f"{name}.jsonl"
    preds = [json.loads(line)["pred"] for line in path.read_text(encoding="utf-8").splitlines()]
    return read_jsonl(path), preds


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_scores_match_hand_computed(name):
    records, preds = load(name)
    per_example, total = EXPECTED[name]
    got = [score_example(r.dataset, p, r.answers, r.all_classes) for r, p in zip(records, preds, strict=True)]
    assert got == pytest.approx(per_example, abs=1e-6)
    answers = [r.answers for r in records]
    assert score_dataset(name, preds, answers, records[0].all_classes) == total


def test_every_metric_family_has_a_fixture():
    families = {dataset_metric(name) for name in EXPECTED}
    assert families == {
        "qa_f1",
        "qa_f1_zh",
        "rouge",
        "rouge_zh",
        "classification",
        "retrieval",
        "retrieval_zh",
        "count",
        "code_sim",
    }


def test_qa_f1_normalization_and_edge_cases():
    assert qa_f1("The Eiffel Tower!", "eiffel tower") == 1.0
    assert qa_f1("", "eiffel tower") == 0.0
    assert qa_f1("a an the", "the") == 0.0  # nothing left after dropping articles
    assert qa_f1_zh("", "北京") == 0.0
    assert qa_f1_zh("北京。", "北京") == 1.0  # Chinese punctuation is dropped


def test_rouge_on_empty_and_identical():
    assert rouge_l("", "") == 0.0
    assert rouge_l("same words here", "same words here") == pytest.approx(1.0)


def test_classification_requires_classes_and_splits_credit():
    assert classification("Entity or Location", "Location", all_classes=["Entity", "Location"]) == 0.5
    assert classification("nothing", "Location", all_classes=["Entity", "Location"]) == 0.0
    with pytest.raises(ValueError, match="all_classes"):
        classification("Location", "Location", all_classes=None)


def test_fuzz_ratio_rules_and_code_line_choice():
    assert fuzz_ratio("", "") == 100 and fuzz_ratio("", "x") == 0
    assert fuzz_ratio("abcd", "abce") == 75  # Indel distance 2 over 8 chars
    assert code_sim("```python\n// c\nx = 1", "x = 1") == 1.0  # fenced and comment lines skipped
    assert code_sim("# only comments", "x = 1") == 0.0


def test_first_line_cut_only_for_few_shot_datasets():
    assert score_example("triviaqa", "\nParis\nLondon", ["Paris"]) == 1.0
    assert score_example("hotpotqa", "Paris\nLondon", ["Paris"]) == pytest.approx(2 / 3)


def test_longbench_e_names_and_length_buckets():
    assert dataset_metric("hotpotqa_e") == "qa_f1"
    buckets = score_by_length("hotpotqa_e", ["x", "y", "y"], [["x"], ["x"], ["y"]], [100, 5000, 9000])
    assert buckets == {"0-4k": 100.0, "4-8k": 0.0, "8k+": 100.0}
    with pytest.raises(ValueError, match="unknown LongBench dataset"):
        dataset_metric("squad")
    with pytest.raises(ValueError, match="predictions for"):
        score_dataset("hotpotqa", ["a"], [])
