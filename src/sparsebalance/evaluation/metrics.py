"""Answer metrics: exact match for the synthetic tasks, and LongBench v1's per-dataset metrics.

The LongBench metrics reproduce the official ``metrics.py`` / ``eval.py`` (THUDM/LongBench)
behaviour, quirks included, so scores are comparable with published tables:

- ``qa_f1``: token F1 after SQuAD normalisation (lower case, no punctuation, no articles).
- ``qa_f1_zh``: F1 over jieba words, each stripped of Chinese and ASCII punctuation.
- ``rouge`` / ``rouge_zh``: ROUGE-L F from the ``rouge`` package (the one LongBench uses); the
  Chinese variant segments with jieba first. An empty prediction (``rouge`` raises) scores 0.
- ``classification``: share of credit among the class names found in the prediction; a found name
  that is a strict substring of the gold class is dropped (official loop semantics kept).
- ``retrieval`` / ``retrieval_zh``: fraction of numbers in the prediction that equal the gold
  paragraph id (``Paragraph N`` / ``段落N``); ``count``: same with the gold count.
- ``code_sim``: first prediction line without a backtick, ``#`` or ``//``, compared with
  ``fuzz.ratio`` / 100. rapidfuzz's ratio is the normalised Indel similarity that fuzzywuzzy
  computes with python-Levenshtein; it is rounded to an integer percentage like fuzzywuzzy's,
  with fuzzywuzzy's rules for equal (100) and empty (0) strings.

Each metric takes ``(prediction, ground_truth, all_classes=None)`` and returns a float in [0, 1];
:func:`score_dataset` takes the max over gold answers and averages over examples (x100, 2 dp).
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

Metric = Callable[..., float]

# full-width look-alikes are the point of this list (official normalize_zh_answer set)
_CN_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛"  # noqa: RUF001
    "〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."  # noqa: RUF001
)
_EN_PUNCT = set(string.punctuation)
_ALL_PUNCT = set(string.punctuation + _CN_PUNCTUATION)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop ASCII punctuation, articles, extra whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """Lower case, drop Chinese and ASCII punctuation and all whitespace."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ALL_PUNCT).split())


def exact_match(prediction: str, ground_truth: str, **_) -> float:
    """1.0 when the stripped strings are equal (the synthetic tasks' metric)."""
    return float(prediction.strip() == ground_truth.strip())


def token_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """F1 of the multiset overlap of two token lists (0 when either is empty)."""
    same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, ground_truth: str, **_) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _jieba_words(text: str) -> list[str]:
    import jieba

    jieba.setLogLevel(logging.WARNING)  # its dictionary-loading messages go to stderr
    return list(jieba.cut(text, cut_all=False))


def qa_f1_zh(prediction: str, ground_truth: str, **_) -> float:
    def words(text: str) -> list[str]:
        return [w for w in (normalize_zh_answer(t) for t in _jieba_words(text)) if w]

    return token_f1(words(prediction), words(ground_truth))


def rouge_l(prediction: str, ground_truth: str, **_) -> float:
    from rouge import Rouge

    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except (ValueError, RecursionError):  # empty hypothesis/reference; very long inputs
        return 0.0
    return float(scores["rouge-l"]["f"])


def rouge_l_zh(prediction: str, ground_truth: str, **_) -> float:
    return rouge_l(" ".join(_jieba_words(prediction)), " ".join(_jieba_words(ground_truth)))


def classification(prediction: str, ground_truth: str, all_classes=None, **_) -> float:
    if not all_classes:
        raise ValueError("classification needs the record's all_classes list")
    found = [name for name in all_classes if name in prediction]
    # the official loop removes from the list it iterates over, so the element right after a
    # removed one is never checked; reproduced on purpose for score parity
    i = 0
    while i < len(found):
        name = found[i]
        if name in ground_truth and name != ground_truth:
            found.remove(name)
        i += 1
    return 1.0 / len(found) if ground_truth in found else 0.0


def _number_share(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, ground_truth: str, **_) -> float:
    return _number_share(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh(prediction: str, ground_truth: str, **_) -> float:
    return _number_share(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def count(prediction: str, ground_truth: str, **_) -> float:
    return _number_share(prediction, str(ground_truth))


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` (python-Levenshtein flavour) via rapidfuzz: 0..100 int."""
    from rapidfuzz import fuzz

    if a == b:
        return 100
    if not a or not b:
        return 0
    return round(fuzz.ratio(a, b))


def code_sim(prediction: str, ground_truth: str, **_) -> float:
    line = next(
        (ln for ln in prediction.lstrip("\n").split("\n") if not any(m in ln for m in "`#")
         and "//" not in ln),
        "",
    )  # fmt: skip
    return fuzz_ratio(line, ground_truth) / 100


METRICS: dict[str, Metric] = {
    "exact_match": exact_match,
    "qa_f1": qa_f1,
    "qa_f1_zh": qa_f1_zh,
    "rouge": rouge_l,
    "rouge_zh": rouge_l_zh,
    "classification": classification,
    "retrieval": retrieval,
    "retrieval_zh": retrieval_zh,
    "count": count,
    "code_sim": code_sim,
}
"""Metric name -> function."""

DATASET_METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1",
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "multifieldqa_zh": "qa_f1_zh",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "musique": "qa_f1",
    "dureader": "rouge_zh",
    "gov_report": "rouge",
    "qmsum": "rouge",
    "multi_news": "rouge",
    "vcsum": "rouge_zh",
    "trec": "classification",
    "triviaqa": "qa_f1",
    "samsum": "rouge",
    "lsht": "classification",
    "passage_retrieval_en": "retrieval",
    "passage_count": "count",
    "passage_retrieval_zh": "retrieval_zh",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
}
"""LongBench v1 dataset -> metric name (``_e`` suffixed LongBench-E names map the same)."""

FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
"""Few-shot datasets whose prediction is cut at its first line before scoring (official)."""


def dataset_metric(dataset: str) -> str:
    """The metric name of a LongBench dataset (``hotpotqa_e`` -> ``qa_f1``)."""
    name = dataset[:-2] if dataset.endswith("_e") else dataset
    if name not in DATASET_METRIC:
        raise ValueError(f"unknown LongBench dataset {dataset!r}: known {sorted(DATASET_METRIC)}")
    return DATASET_METRIC[name]


def score_example(dataset: str, prediction: str, answers: Sequence[str], all_classes=None) -> float:
    """Best score over the gold ``answers`` (0..1), with the official first-line cut."""
    if not answers:
        raise ValueError(f"{dataset}: an example has no gold answers")
    name = dataset[:-2] if dataset.endswith("_e") else dataset
    if name in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = METRICS[dataset_metric(dataset)]
    return max(metric(prediction, gold, all_classes=all_classes) for gold in answers)


def score_dataset(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes=None,
) -> float:
    """Official LongBench score: mean of :func:`score_example` x 100, rounded to 2 decimals."""
    if len(predictions) != len(answers) or not predictions:
        raise ValueError(
            f"{dataset}: {len(predictions)} predictions for {len(answers)} answer lists"
        )
    total = sum(
        score_example(dataset, p, a, all_classes) for p, a in zip(predictions, answers, strict=True)
    )
    return round(100 * total / len(predictions), 2)


def score_by_length(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    lengths: Sequence[int],
    all_classes=None,
) -> dict[str, float]:
    """LongBench-E style: mean score x100 per ``length`` bucket ``0-4k``, ``4-8k``, ``8k+``
    (buckets with no example are left out)."""
    buckets: dict[str, list[float]] = {"0-4k": [], "4-8k": [], "8k+": []}
    for p, a, n in zip(predictions, answers, lengths, strict=True):
        key = "0-4k" if n < 4000 else "4-8k" if n < 8000 else "8k+"
        buckets[key].append(score_example(dataset, p, a, all_classes))
    return {k: round(100 * sum(v) / len(v), 2) for k, v in buckets.items() if v}
