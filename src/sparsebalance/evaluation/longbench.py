"""LongBench v1 data: jsonl records, per-dataset prompts, middle truncation, generation lengths.

Data and weights are read only from local paths. A record file is one JSON object per line with
the official fields ``input, context, answers, length, dataset, language, all_classes, _id``;
the dataset name comes from the record (``dataset``) or, when absent, from the file name
(``hotpotqa.jsonl`` -> ``hotpotqa``).

Prompts: ``templates/longbench_prompts.json`` (``{context}``/``{input}`` per dataset; see its
``_comment``), or any file of the official ``dataset2prompt.json`` format.

Middle truncation (:data:`TRUNCATIONS`) of a prompt longer than ``max_length`` tokens keeps the
instructions and the question at its two ends. ``text`` (default, the official ``pred.py``):
decode the first and the last ``max_length // 2`` tokens, join the two texts and tokenize the
result again, so tokens that merge across the join (and the re-tokenized length, which may differ
from ``max_length`` by a few tokens) are as in published runs. ``tokens``: keep exactly those
token ids (no decode / re-encode round trip). Every truncation is counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

_PLACEHOLDER = re.compile(r"\{(context|input)\}")
TRUNCATIONS = ("text", "tokens")
"""Middle-truncation modes (see the module docstring); the first is the default."""
TEMPLATES_PATH = Path(__file__).with_name("templates") / "longbench_prompts.json"

MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}
"""Generation budget per dataset (the official ``dataset2maxlen``)."""


@dataclass(frozen=True)
class LongBenchRecord:
    """One LongBench example (official field names; ``_id`` is ``id`` here)."""

    id: str
    dataset: str
    input: str
    context: str
    answers: list[str]
    length: int
    """Words (English) or characters (Chinese) of the context, as LongBench reports it."""
    language: str = "en"
    all_classes: list[str] | None = field(default=None)

    @property
    def base_dataset(self) -> str:
        """The v1 dataset name without LongBench-E's ``_e`` suffix."""
        return self.dataset[:-2] if self.dataset.endswith("_e") else self.dataset


def read_jsonl(path: str | Path) -> list[LongBenchRecord]:
    """Records of one LongBench jsonl file; ``ValueError`` names the file and line on bad input.

    Records are split on ``"\\n"`` only: U+2028, U+2029, U+0085 (and other characters that
    ``str.splitlines`` breaks on) may stand raw inside a JSON string (``ensure_ascii=False``).
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError as err:
        raise ValueError(f"--data {path}: cannot read ({err.strerror})") from None
    default_dataset = path.stem
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            answers = raw["answers"]
            if isinstance(answers, str):
                answers = [answers]
            out.append(
                LongBenchRecord(
                    id=str(raw.get("_id", f"{default_dataset}-{i}")),
                    dataset=raw.get("dataset") or default_dataset,
                    input=raw.get("input") or "",
                    context=raw["context"],
                    answers=[str(a) for a in answers],
                    length=int(raw.get("length") or 0),
                    language=raw.get("language") or "en",
                    all_classes=raw.get("all_classes"),
                )
            )
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"--data {path}:{i}: not a LongBench record ({err!r})") from None
    if not out:
        raise ValueError(f"--data {path}: no records")
    return out


def read_dir(path: str | Path) -> list[LongBenchRecord]:
    """All ``*.jsonl`` files of a directory (sorted), or one file."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"--data {path}: no *.jsonl files")
    return [rec for f in files for rec in read_jsonl(f)]


def load_templates(path: str | Path | None = None) -> dict[str, str]:
    """Dataset -> prompt template (ours by default; keys starting with ``_`` are comments)."""
    path = TEMPLATES_PATH if path is None else Path(path)
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--prompts {path}: not a readable JSON object ({err})") from None
    return {k: v for k, v in raw.items() if not k.startswith("_")}


def build_prompt(record: LongBenchRecord, templates: dict[str, str]) -> str:
    """The filled template of the record's dataset (untruncated)."""
    if record.base_dataset not in templates:
        raise ValueError(f"no prompt template for dataset {record.dataset!r}")
    # one pass over the template only (like the official str.format), but without format's
    # brace parsing: a context with "{...}" (code, JSON, even "{input}") is inserted verbatim
    fields = {"context": record.context, "input": record.input}
    return _PLACEHOLDER.sub(lambda m: fields[m.group(1)], templates[record.base_dataset])


def truncate_middle(ids: Sequence[int], max_length: int) -> tuple[list[int], bool]:
    """First and last ``max_length // 2`` ids when ``len(ids) > max_length``; and whether it cut."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    if len(ids) <= max_length:
        return list(ids), False
    half = max_length // 2
    return [*ids[:half], *ids[len(ids) - half :]], True


def truncate_prompt(
    prompt: str,
    max_length: int,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    mode: str = "text",
) -> tuple[list[int], bool]:
    """The prompt's token ids after middle truncation to ``max_length`` (``mode``: one of
    :data:`TRUNCATIONS`, see the module docstring); and whether it cut."""
    if mode not in TRUNCATIONS:
        raise ValueError(f"--truncation must be one of {', '.join(TRUNCATIONS)}, got {mode!r}")
    kept, cut = truncate_middle(encode(prompt), max_length)
    if not cut or mode == "tokens":
        return kept, cut
    half = max_length // 2
    return encode(decode(kept[:half]) + decode(kept[half:])), True


@dataclass
class LongBenchResult:
    """Per-dataset scores of one evaluation."""

    scores: dict[str, float]
    """Dataset -> official score (0..100)."""
    by_length: dict[str, dict[str, float]]
    """Dataset -> LongBench-E bucket -> score."""
    num_examples: dict[str, int]
    num_truncated: int
    predictions: list[dict]
    num_without_answers: int = 0
    """Examples with an empty gold answer list (scored 0, as officially)."""

    @property
    def average(self) -> float:
        """Unweighted mean over datasets (LongBench's headline number)."""
        return round(sum(self.scores.values()) / max(1, len(self.scores)), 2)

    def to_dict(self) -> dict:
        return {
            "average": self.average,
            "scores": self.scores,
            "by_length": self.by_length,
            "num_examples": self.num_examples,
            "num_truncated": self.num_truncated,
            "num_without_answers": self.num_without_answers,
        }


def evaluate_longbench(
    records: Sequence[LongBenchRecord],
    generate: Callable[[list[int], int], list[int]],
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    max_length: int,
    templates: dict[str, str] | None = None,
    progress: Callable | None = None,
    truncation: str = "text",
    code_sim_backend: str = "difflib",
) -> LongBenchResult:
    """Prompt, truncate to ``max_length`` tokens, ``generate(prompt_ids, max_new_tokens)``, score.

    ``generate`` returns the new token ids only (greedy decoding in the official setup).
    ``truncation``: one of :data:`TRUNCATIONS`; ``code_sim_backend``: one of
    :data:`~sparsebalance.evaluation.metrics.CODE_SIM_BACKENDS` (lcc, repobench-p).
    """
    from .metrics import fuzz_ratio, score_by_length, score_dataset

    if truncation not in TRUNCATIONS:  # bad choices fail before any generation
        allowed = ", ".join(TRUNCATIONS)
        raise ValueError(f"--truncation must be one of {allowed}, got {truncation!r}")
    fuzz_ratio("", "", code_sim_backend)  # raises on an unknown backend
    templates = load_templates() if templates is None else templates
    per: dict[str, list[tuple[LongBenchRecord, str]]] = {}
    truncated = 0
    rows = []
    iterator = progress(records) if progress is not None else records
    for rec in iterator:
        ids, cut = truncate_prompt(build_prompt(rec, templates), max_length, encode, decode, truncation)
        truncated += cut
        new = generate(ids, MAX_NEW_TOKENS.get(rec.base_dataset, 64))
        pred = decode(new)
        per.setdefault(rec.dataset, []).append((rec, pred))
        rows.append({"_id": rec.id, "dataset": rec.dataset, "pred": pred, "answers": rec.answers})
    scores, by_length, counts = {}, {}, {}
    for name, items in per.items():
        preds = [p for _, p in items]
        golds = [r.answers for r, _ in items]
        classes = items[0][0].all_classes
        lengths = [r.length for r, _ in items]
        scores[name] = score_dataset(name, preds, golds, classes, code_sim_backend)
        by_length[name] = score_by_length(name, preds, golds, lengths, classes, code_sim_backend)
        counts[name] = len(items)
    no_answers = sum(not r.answers for r in records)
    return LongBenchResult(scores, by_length, counts, truncated, rows, no_answers)
