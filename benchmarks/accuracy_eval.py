"""Evaluation for ``benchmarks/accuracy.py``: one model under one attention setting.

A setting is dense attention, one :class:`~sparsebalance.ops.Budget` (top-k K, or gamma), or a
budget per document length (DST's final per-length-bin k: :func:`bin_budget`). Each evaluation
reports, on held-out examples (eval split: keys and values never trained on):

- teacher-forced exact match and per-token answer accuracy per task, by prompt length and by
  needle depth (``examples`` per task, length and depth; :data:`DEPTHS`);
- the realized attention density of the evaluation forwards (length²-weighted over the pack);
- attention recall per layer (the share of the dense softmax mass the kept blocks hold);
- perplexity of held-out task text at the longest length.

Seeds (fixed, disjoint from every training stream, which uses the train split): test examples
:data:`TEST_SEED`, dev examples (checkpoint choice only) :data:`DEV_SEED`, perplexity text
:data:`PPL_SEED`, recall documents :data:`RECALL_SEED`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from sparsebalance.data.tokenizer import make_codec
from sparsebalance.evaluation import HFRunner, evaluate_task, perplexity, summarize
from sparsebalance.evaluation.recall import layer_recall
from sparsebalance.ops import Budget, topk_density
from sparsebalance.tasks import generate

TASKS = ("passkey", "niah1", "mqar")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
TEST_SEED = 1000
DEV_SEED = 5000
PPL_SEED = 2000
RECALL_SEED = 3000
DENSE = Budget(gamma=1.0)

BudgetSpec = Budget | Callable[[int], Budget]


def bin_of(length: int) -> int:
    """The power-of-two length bin of SAB's budget EMA (``BudgetEMAEstimator.bin_of``)."""
    return int(np.floor(np.log2(max(length, 1))))


class BinBudget:
    """``length -> Budget(top_k=round(k))`` from a run's final per-length-bin k (``bins``: bin ->
    averaged k, as ``BudgetEMAEstimator.bins``); a bin the run never saw gets ``base``."""

    def __init__(self, bins: dict[str, float], base: int) -> None:
        self.table = {int(b): float(k) for b, k in bins.items()}
        self.base = int(base)

    def __call__(self, length: int) -> Budget:
        return Budget(top_k=round(self.table.get(bin_of(length), float(self.base))))


def describe(spec: BudgetSpec) -> str:
    """One line naming the setting (for tables)."""
    if isinstance(spec, Budget):
        return "dense" if spec.is_dense else f"{spec.kind} {spec.value:g}"
    table = getattr(spec, "table", {})
    return "per-bin k " + ", ".join(f"2^{b}: {k:.2f}" for b, k in sorted(table.items()))


def scores(
    model,
    vocab_map: dict[int, int],
    tokenizer,
    spec: BudgetSpec,
    lengths: Sequence[int],
    examples: int,
    seed: int,
    block_size: int = 64,
) -> dict:
    """Exact match / token accuracy per task (overall, by length, by depth) of ``examples``
    held-out examples per task, length and depth at ``spec``; the mean EM over tasks in
    ``"mean_em"`` and the evaluation's realized density in ``"eval_density"``."""
    vocab = model.get_input_embeddings().num_embeddings
    encode, _, _ = make_codec(tokenizer, vocab_map, vocab)
    runner = HFRunner(model, block_size=block_size, backend="torch", budget=spec)
    per_depth = max(1, examples // len(DEPTHS))
    found = []
    for task in TASKS:
        found += evaluate_task(runner, task, lengths, encode, per_depth, DEPTHS, seed=seed, pack_tokens=8192)
    summary = summarize(found, num_depth_bins=None)
    out: dict = {"eval_density": float(np.mean(runner.densities)), "budget": describe(spec)}
    for task, s in summary.items():
        out[task] = {
            "exact": s["accuracy"],
            "token_acc": s["token_accuracy"],
            "count": s["count"],
            "by_length": {k: x["accuracy"] for k, x in s["by_length"].items()},
            "by_depth": {k: x["accuracy"] for k, x in s["by_depth"].items()},
            "grid": s["grid"],
        }
    out["mean_em"] = float(np.mean([out[t]["exact"] for t in TASKS]))
    model.train()
    return out


def evaluate(model, vocab_map, tokenizer, spec: BudgetSpec, lengths, examples: int, args) -> dict:
    """:func:`scores` on the test examples plus perplexity and recall per layer."""
    out = scores(model, vocab_map, tokenizer, spec, lengths, examples, TEST_SEED, args.block_size)
    vocab = model.get_input_embeddings().num_embeddings
    encode, _, eos = make_codec(tokenizer, vocab_map, vocab)
    runner = HFRunner(model, block_size=args.block_size, backend="torch", budget=spec)
    n = max(lengths)
    held = [ex.text for t in TASKS for ex in generate(t, args.ppl_docs, n, encode, PPL_SEED, "eval")]
    out["ppl"] = perplexity(runner, held, encode, [n], eos, len(held), 8192)[str(n)]["ppl"]
    docs = [
        encode(ex.text)
        for t in TASKS
        for n in lengths
        for ex in generate(t, args.recall_docs, n, encode, RECALL_SEED, "eval")
    ]
    recall = layer_recall(model, docs, 1.0, args.block_size, budget=spec)
    out["recall"] = {str(k): v for k, v in recall.items()}
    model.train()
    return out


def analytic_density(spec: BudgetSpec, lengths: Sequence[int], block_size: int) -> float | None:
    """Length²-weighted top-k density of documents of ``lengths`` at ``spec`` (None for gamma):
    what a top-k budget keeps, from the lengths alone (``topk_density``)."""
    budgets = [spec if isinstance(spec, Budget) else spec(n) for n in lengths]
    if any(b.kind != "top-k" for b in budgets):
        return None
    w = np.asarray(lengths, dtype=np.float64) ** 2
    d = [float(topk_density(n, b.top_k, block_size, b.anchor_blocks)) for n, b in zip(lengths, budgets, strict=True)]
    return float(np.dot(w, d) / w.sum())
