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
  fuzzywuzzy's ``fuzz.ratio`` / 100, computed by one of two backends (:data:`CODE_SIM_BACKENDS`):
  ``difflib`` (default): ``round(100 * difflib.SequenceMatcher(None, a, b).ratio())``, what
  fuzzywuzzy computes when python-Levenshtein is absent, as with the official LongBench v1
  requirements; ``rapidfuzz``: the normalised Indel similarity, what fuzzywuzzy computes with
  python-Levenshtein installed (and thefuzz >= 0.20 always). The two differ on a minority of
  samples (difflib's matching blocks are greedy, not a longest common subsequence, and it treats
  characters frequent in strings of 200+ characters as junk). Both use fuzzywuzzy's rules for
  equal strings (100, even both empty) and one empty string (0), and round half to even.

Each metric takes ``(prediction, ground_truth, all_classes=None)`` and returns a float in [0, 1];
:func:`score_dataset` takes the max over gold answers, starting from 0 (an example without gold
answers scores 0, as officially), and averages over examples (x100, 2 dp).
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

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
    """Official: an empty class list finds nothing (0.0); a missing one (None) is an error."""
    if all_classes is None:
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


CODE_SIM_BACKENDS = ("difflib", "rapidfuzz")
"""``fuzz.ratio`` implementations for ``code_sim`` (see the module docstring); first = default."""


def fuzz_ratio(a: str, b: str, backend: str = "difflib") -> int:
    """fuzzywuzzy's ``fuzz.ratio``: an int in 0..100 (``backend``: one of
    :data:`CODE_SIM_BACKENDS`)."""
    if backend not in CODE_SIM_BACKENDS:
        raise ValueError(f"--code-sim-backend must be one of {', '.join(CODE_SIM_BACKENDS)}, got {backend!r}")
    if a == b:
        return 100
    if not a or not b:
        return 0
    if backend == "difflib":
        from difflib import SequenceMatcher

        return round(100 * SequenceMatcher(None, a, b).ratio())
    try:
        from rapidfuzz import fuzz
    except ImportError:
        raise ValueError("--code-sim-backend rapidfuzz needs `pip install rapidfuzz` (the eval extra)") from None
    return round(fuzz.ratio(a, b))


def code_sim(prediction: str, ground_truth: str, backend: str = "difflib", **_) -> float:
    line = next(
        (ln for ln in prediction.lstrip("\n").split("\n") if not any(m in ln for m in "`#") and "//" not in ln),
        "",
    )
    return fuzz_ratio(line, ground_truth, backend) / 100


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


def score_example(
    dataset: str,
    prediction: str,
    answers: Sequence[str],
    all_classes=None,
    code_sim_backend: str = "difflib",
) -> float:
    """Best score over the gold ``answers`` (0..1; 0 without answers, as officially), with the
    official first-line cut."""
    name = dataset[:-2] if dataset.endswith("_e") else dataset
    if name in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric_name = dataset_metric(dataset)
    metric = METRICS[metric_name]
    extra = {"backend": code_sim_backend} if metric_name == "code_sim" else {}
    return max([0.0, *(metric(prediction, gold, all_classes=all_classes, **extra) for gold in answers)])


def score_dataset(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes=None,
    code_sim_backend: str = "difflib",
) -> float:
    """Official LongBench score: mean of :func:`score_example` x 100, rounded to 2 decimals."""
    if len(predictions) != len(answers) or not predictions:
        raise ValueError(f"{dataset}: {len(predictions)} predictions for {len(answers)} answer lists")
    total = sum(
        score_example(dataset, p, a, all_classes, code_sim_backend) for p, a in zip(predictions, answers, strict=True)
    )
    return round(100 * total / len(predictions), 2)


def score_by_length(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    lengths: Sequence[int],
    all_classes=None,
    code_sim_backend: str = "difflib",
) -> dict[str, float]:
    """LongBench-E (the official ``scorer_e``): ``round(100 * np.mean(scores), 2)`` per
    ``length`` bucket ``0-4k``, ``4-8k``, ``8k+``; a bucket with no example is NaN."""
    buckets: dict[str, list[float]] = {"0-4k": [], "4-8k": [], "8k+": []}
    for p, a, n in zip(predictions, answers, lengths, strict=True):
        key = "0-4k" if n < 4000 else "4-8k" if n < 8000 else "8k+"
        buckets[key].append(score_example(dataset, p, a, all_classes, code_sim_backend))
    # np.mean (pairwise summation) can differ from sum / len in the last digit after rounding,
    # and numpy rounds a float64 its own way (scale, rint, unscale): both kept for parity
    return {k: float(round(100 * np.mean(v), 2)) if v else float("nan") for k, v in buckets.items()}
