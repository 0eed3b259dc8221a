"""Exact-match accuracy on the synthetic tasks, by context length and needle depth.

Scoring is **teacher-forced greedy exact match**: the prompt and the answer are run in one
forward, and an example is correct when the argmax of the logits at every answer position equals
the answer's next token. This is exactly "greedy decoding reproduces the answer's tokens" (greedy
decoding would emit the same tokens one by one, each conditioned on the correct prefix up to the
first mistake), without a decode loop: one forward per pack of examples. Tokens *after* the answer
are not checked (a greedy decoder might continue with more text; the synthetic answers are
followed by nothing). ``token_accuracy`` (share of answer tokens right) is reported alongside.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ..tasks import TaskExample, generate
from .runner import ModelRunner


@dataclass(frozen=True)
class ExampleScore:
    """How the model did on one example."""

    task: str
    length: int
    """The requested prompt length (the group the example is reported in)."""
    num_tokens: int
    depth: float | None
    correct: bool
    token_accuracy: float

    def to_dict(self) -> dict:
        return asdict(self)


def score_examples(
    runner: ModelRunner,
    examples: Sequence[TaskExample],
    encode: Callable[[str], list[int]],
    lengths: Sequence[int] | None = None,
    pack_tokens: int = 16384,
    progress: Callable[[int], None] | None = None,
) -> list[ExampleScore]:
    """Teacher-forced exact match of every example (see module docstring).

    ``lengths[i]``: the requested length example ``i`` is grouped under (default: its prompt
    length). Examples are packed into forwards of about ``pack_tokens`` tokens (an example longer
    than that runs alone). ``progress(n)`` is called with the number of examples just scored.
    """
    encoded = []
    for ex in examples:
        prompt, answer = encode(ex.prompt), encode(ex.answer)
        if not prompt or not answer:
            raise ValueError(f"{ex.task}: empty prompt or answer after encoding")
        encoded.append((prompt, answer))
    out: list[ExampleScore] = []
    for batch in _packs([len(p) + len(a) for p, a in encoded], pack_tokens):
        docs = [encoded[i][0] + encoded[i][1] for i in batch]
        # logits at position t predict token t + 1: the answer's tokens are predicted from
        # positions len(prompt) - 1 ... len(prompt) + len(answer) - 2
        positions = [range(len(encoded[i][0]) - 1, len(encoded[i][0]) + len(encoded[i][1]) - 1) for i in batch]
        logits = runner.logits(docs, positions)
        for i, lg in zip(batch, logits, strict=True):
            answer = encoded[i][1]
            hits = [int(t) == a for t, a in zip(lg.argmax(-1).tolist(), answer, strict=True)]
            ex = examples[i]
            out.append(
                ExampleScore(
                    task=ex.task,
                    length=int(lengths[i]) if lengths is not None else len(encoded[i][0]),
                    num_tokens=len(encoded[i][0]) + len(answer),
                    depth=ex.depth,
                    correct=all(hits),
                    token_accuracy=sum(hits) / len(hits),
                )
            )
        if progress is not None:
            progress(len(batch))
    return out  # packs are consecutive, so this is the input order


def _packs(sizes: Sequence[int], budget: int) -> Iterable[list[int]]:
    """Consecutive index groups whose sizes sum to at most ``budget`` (oversized ones alone)."""
    group: list[int] = []
    used = 0
    for i, n in enumerate(sizes):
        if group and used + n > budget:
            yield group
            group, used = [], 0
        group.append(i)
        used += n
    if group:
        yield group


def evaluate_task(
    runner: ModelRunner,
    task: str,
    lengths: Sequence[int],
    encode: Callable[[str], list[int]],
    num_examples: int = 20,
    depths: Sequence[float] | None = None,
    seed: int = 0,
    pack_tokens: int = 16384,
    progress: Callable[[int], None] | None = None,
) -> list[ExampleScore]:
    """Generate ``num_examples`` eval-split examples per length (per length and depth when
    ``depths`` is given; else depths are drawn uniformly) and score them."""
    examples: list[TaskExample] = []
    groups: list[int] = []
    for n in lengths:
        for d in depths if depths is not None else [None]:
            batch = generate(task, num_examples, n, encode, seed=seed, split="eval", depth=d)
            examples += batch
            groups += [n] * len(batch)
    return score_examples(runner, examples, encode, groups, pack_tokens, progress)


def depth_bin(depth: float, num_bins: int = 5) -> float:
    """Lower edge of ``depth``'s bin among ``num_bins`` equal bins of [0, 1] (1.0 -> last bin)."""
    k = min(int(depth * num_bins), num_bins - 1)
    return round(k / num_bins, 4)


def summarize(scores: Sequence[ExampleScore], num_depth_bins: int | None = 5) -> dict:
    """Accuracy per task: overall, by length, by depth bin, and by (length, depth bin).

    ``num_depth_bins``: equal-width depth bins (for random depths); ``None`` groups by the exact
    depth (for a depth grid).

    Returns ``{task: {"accuracy", "token_accuracy", "count", "by_length": {L: {...}},
    "by_depth": {d: {...}}, "grid": {L: {d: accuracy}}}}`` (keys are strings, JSON-ready).
    """
    by_task: dict[str, list[ExampleScore]] = defaultdict(list)
    for s in scores:
        by_task[s.task].append(s)
    out = {}
    for task, items in by_task.items():
        by_len: dict[str, list[ExampleScore]] = defaultdict(list)
        by_depth: dict[str, list[ExampleScore]] = defaultdict(list)
        grid: dict[str, dict[str, list[ExampleScore]]] = defaultdict(lambda: defaultdict(list))
        for s in items:
            by_len[str(s.length)].append(s)
            if s.depth is not None:
                d = str(round(s.depth, 4) if num_depth_bins is None else depth_bin(s.depth, num_depth_bins))
                by_depth[d].append(s)
                grid[str(s.length)][d].append(s)
        out[task] = {
            **_stats(items),
            "by_length": {k: _stats(v) for k, v in sorted(by_len.items(), key=_num_key)},
            "by_depth": {k: _stats(v) for k, v in sorted(by_depth.items(), key=_num_key)},
            "grid": {
                k: {d: _stats(v)["accuracy"] for d, v in sorted(row.items(), key=_num_key)}
                for k, row in sorted(grid.items(), key=_num_key)
            },
        }
    return out


def _num_key(item) -> float:
    return float(item[0])


def _stats(items: Sequence[ExampleScore]) -> dict:
    n = len(items)
    return {
        "accuracy": sum(s.correct for s in items) / n,
        "token_accuracy": sum(s.token_accuracy for s in items) / n,
        "count": n,
    }


def plot_heatmap(summary_task: dict, path: str | Path, title: str = "") -> Path:
    """Accuracy heatmap (rows: depth bin, columns: context length) of one task's
    :func:`summarize` entry, written as a PNG. Needs matplotlib (the ``plot`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = summary_task["grid"]
    if not grid:
        raise ValueError("no depth information to plot (examples without a needle depth)")
    lengths = list(grid)
    depths = sorted({d for row in grid.values() for d in row}, key=float)
    acc = np.full((len(depths), len(lengths)), np.nan)
    for j, n in enumerate(lengths):
        for i, d in enumerate(depths):
            acc[i, j] = grid[n].get(d, np.nan)
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.0 + 0.5 * len(depths)))
    im = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), lengths)
    ax.set_yticks(range(len(depths)), [f"{float(d):.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not np.isnan(acc[i, j]):
                ax.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="exact match")
    ax.set_title(title or "accuracy by length and depth")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
