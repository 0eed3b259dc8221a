"""Parity with the official LongBench v1 scorer (``metrics.py``, ``eval.py``, ``pred.py``): the
per-sample differential fixture, LongBench-E buckets, both ``code_sim`` backends, the reader's
line splitting, middle truncation, and degenerate inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sparsebalance.evaluation import (
    CODE_SIM_BACKENDS,
    evaluate_longbench,
    read_jsonl,
    score_by_length,
    truncate_prompt,
)
from sparsebalance.evaluation.metrics import classification, fuzz_ratio, score_example

FIXTURES = Path(__file__).parent.parent / "fixtures" / "longbench"
CASES = json.loads((FIXTURES / "official_cases.json").read_text(encoding="utf-8"))["cases"]


@pytest.mark.parametrize("backend", CODE_SIM_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[f"{c['dataset']}-{i}" for i, c in enumerate(CASES)])
def test_official_per_sample_scores(case, backend):
    expected = case["score"][backend] if isinstance(case["score"], dict) else case["score"]
    got = score_example(case["dataset"], case["pred"], case["answers"], case["all_classes"], code_sim_backend=backend)
    assert got == pytest.approx(expected, abs=1e-9), case["why"]


def test_default_code_sim_backend_is_the_official_requirements_one():
    case = next(c for c in CASES if isinstance(c["score"], dict))
    assert CODE_SIM_BACKENDS[0] == "difflib"
    assert score_example("lcc", case["pred"], case["answers"]) == case["score"]["difflib"]
    with pytest.raises(ValueError, match="--code-sim-backend"):
        fuzz_ratio("a", "b", "levenshtein")


def test_longbench_e_buckets_use_numpy_mean_and_nan_for_empty():
    # passage_count scores 0, .8, .25, .6, .5, .4, .8, .8: mean 0.51875. np.mean gives
    # 51.875000000000014 -> 51.88 (official); sum / len gives 51.87499999999999 -> 51.87.
    preds = ["none", "4 4 4 4 5", "4 5 5 5", "4 4 4 5 5", "4 5", "4 4 5 5 5", "4 4 4 4 5", "4 4 4 4 5"]
    got = score_by_length("passage_count_e", preds, [["4"]] * 8, [100] * 8)
    assert got["0-4k"] == 51.88
    assert math.isnan(got["4-8k"]) and math.isnan(got["8k+"])  # official: np.mean([]) = nan
    assert list(got) == ["0-4k", "4-8k", "8k+"]


def test_reader_splits_records_on_newline_only(tmp_path):
    text = "line\u2028separator\u2029paragraph\x85next\x0bvt\x1cfs"
    path = tmp_path / "hotpotqa.jsonl"
    rows = [
        {"context": text, "input": "q\u2028", "answers": ["a\u2029"], "_id": "x"},
        {"context": "second", "answers": ["b"], "_id": "y"},
    ]
    path.write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    recs = read_jsonl(path)
    assert [r.id for r in recs] == ["x", "y"]
    assert recs[0].context == text and recs[0].input == "q\u2028"
    assert recs[0].answers == ["a\u2029"]


class _MergingTokenizer:
    """Greedy longest match over single characters and the pair ``"ab"``: a join that puts
    ``a`` before ``b`` tokenizes differently from the two halves' ids."""

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                out.append(1000)
                i += 2
            else:
                out.append(ord(text[i]))
                i += 1
        return out

    def decode(self, ids) -> str:
        return "".join("ab" if i == 1000 else chr(i) for i in ids)


def test_middle_truncation_text_is_official_tokens_is_slicing():
    tok = _MergingTokenizer()
    prompt = "xya" + "-" * 20 + "bzw"  # 26 tokens; keep 3 + 3
    ids_text, cut = truncate_prompt(prompt, 6, tok.encode, tok.decode)  # default: text
    assert cut and ids_text == tok.encode("xyabzw") == [ord("x"), ord("y"), 1000, ord("z"), ord("w")]
    ids_tok, cut = truncate_prompt(prompt, 6, tok.encode, tok.decode, mode="tokens")
    assert cut and ids_tok == [ord(c) for c in "xyabzw"]  # 6 ids, "a" and "b" apart
    assert truncate_prompt("short", 6, tok.encode, tok.decode) == (tok.encode("short"), False)
    with pytest.raises(ValueError, match="--truncation"):
        truncate_prompt(prompt, 6, tok.encode, tok.decode, mode="middle")


def test_evaluate_uses_text_truncation_and_counts_degenerate_records(tmp_path):
    tok = _MergingTokenizer()
    path = tmp_path / "hotpotqa.jsonl"
    rows = [
        {"context": "a" + "-" * 50 + "b", "input": "", "answers": [], "_id": "1"},
        {"context": "ctx", "input": "", "answers": ["yes"], "_id": "2"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    seen = []

    def generate(ids, max_new):
        seen.append(ids)
        return tok.encode("yes")

    res = evaluate_longbench(
        read_jsonl(path), generate, tok.encode, tok.decode, max_length=2, templates={"hotpotqa": "{context}"}
    )
    assert seen[0] == [1000] and res.num_truncated == 2  # "a" + "b" joined, re-tokenized
    assert res.scores == {"hotpotqa": 50.0}  # the record without answers scores 0, officially
    assert res.num_without_answers == 1 and res.to_dict()["num_without_answers"] == 1
    with pytest.raises(ValueError, match="--code-sim-backend"):
        evaluate_longbench([], generate, tok.encode, tok.decode, 8, code_sim_backend="x")


def test_classification_degenerate_classes():
    assert classification("Location", "Location", all_classes=[]) == 0.0
    with pytest.raises(ValueError, match="all_classes"):
        classification("Location", "Location", all_classes=None)


def test_eval_flags_default_to_official_behaviour(capsys):
    from sparsebalance.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["eval", "--model", "tiny", "--task", "longbench", "--data", "x"])
    assert (args.truncation, args.code_sim_backend) == ("text", "difflib")
    with pytest.raises(SystemExit) as err:
        parser.parse_args(["eval", "--model", "tiny", "--task", "longbench", "--truncation", "mid"])
    assert err.value.code == 2 and "--truncation" in capsys.readouterr().err


@pytest.mark.slow  # ~10-60 s on a 2-core CPU: builds the tiny model and generates
def test_eval_cli_passes_longbench_options(tmp_path, capsys):
    from sparsebalance.cli import main

    vmap = tmp_path / "vmap.json"  # the tiny model has 4,096 embeddings: a compact map
    vmap.write_text(json.dumps({**{str(i): i for i in range(1, 4000)}, "151643": 4000}))
    argv = [
        "eval",
        "--model",
        "tiny",
        "--task",
        "longbench",
        "--data",
        str(FIXTURES / "hotpotqa.jsonl"),
        "--lengths",
        "48",
        "--block-size",
        "16",
        "--device",
        "cpu",
        "--vocab-map",
        str(vmap),
        "--truncation",
        "tokens",
        "--code-sim-backend",
        "rapidfuzz",
        "--json",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["truncation"] == "tokens" and result["code_sim_backend"] == "rapidfuzz"
    per = result["longbench"]["48"]
    assert per["num_examples"] == {"hotpotqa": 3} and per["num_truncated"] == 3
