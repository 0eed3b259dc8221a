"""Accuracy under sparsity: synthetic-task exact match by length and depth, perplexity, and
LongBench v1 (local jsonl, official prompts' meaning, middle truncation, official metrics).

Evaluators take a :class:`ModelRunner` (logits / token NLL of packed documents under one attention
setting); :class:`HFRunner` implements it for the package's Hugging Face models.
"""

from .longbench import (
    MAX_NEW_TOKENS,
    TRUNCATIONS,
    LongBenchRecord,
    LongBenchResult,
    build_prompt,
    evaluate_longbench,
    load_templates,
    read_dir,
    read_jsonl,
    truncate_middle,
    truncate_prompt,
)
from .metrics import (
    CODE_SIM_BACKENDS,
    DATASET_METRIC,
    METRICS,
    dataset_metric,
    score_by_length,
    score_dataset,
)
from .perplexity import perplexity, read_texts
from .runner import HFRunner, ModelRunner
from .synthetic import ExampleScore, evaluate_task, plot_heatmap, score_examples, summarize

__all__ = [
    "CODE_SIM_BACKENDS",
    "DATASET_METRIC",
    "MAX_NEW_TOKENS",
    "METRICS",
    "TRUNCATIONS",
    "ExampleScore",
    "HFRunner",
    "LongBenchRecord",
    "LongBenchResult",
    "ModelRunner",
    "build_prompt",
    "dataset_metric",
    "evaluate_longbench",
    "evaluate_task",
    "load_templates",
    "perplexity",
    "plot_heatmap",
    "read_dir",
    "read_jsonl",
    "read_texts",
    "score_by_length",
    "score_dataset",
    "score_examples",
    "summarize",
    "truncate_middle",
    "truncate_prompt",
]
