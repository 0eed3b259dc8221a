"""``generate`` (one task at given lengths) and ``synthetic_mix`` (the trainer's default data).

Determinism: example ``i`` is drawn from its own generator seeded with
``(seed, task, split, i)``, so it does not depend on how many examples are asked for, and a
different seed, task or split gives different content.

The mix's length distribution (:func:`sample_lengths`) is log-normal, clipped to
``[min_len, max_len]``: median ``m = min_len * (max_len / min_len) ** 0.25`` and log-space
standard deviation ``s = ln(max_len / min_len) / 3.5``. For the defaults (128, 8192): median
~362 tokens, mean ~740, ~8% of examples above 2048, ~0.4% at the 8192 cap. Many short documents
and a few very long ones, as in real long-context mixes, so the attention cost (quadratic in
length) is dominated by a few samples and data-parallel ranks are imbalanced.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from .associative import make_mqar
from .example import Encode, TaskExample, task_length
from .retrieval import make_kv, make_niah, make_niah_single, make_passkey
from .tracking import make_vt
from .vocab import SPLITS, check_split

Builder = Callable[[np.random.Generator, int, Encode, str, float], TaskExample]

TASKS: dict[str, Builder] = {
    "passkey": make_passkey,
    "niah": make_niah,
    "vt": make_vt,
    "kv": make_kv,
    "niah1": make_niah_single,
    "mqar": make_mqar,
}
"""Task name -> builder ``(rng, length, encode, split, depth) -> TaskExample``."""

# Random-stream ids, fixed forever: a task added later takes new ids so every existing task's and
# mix's examples stay the same for a given seed.
_TASK_IDS = {"passkey": 0, "niah": 1, "vt": 2, "kv": 3, "niah1": 6, "mqar": 7}
_MIX_ID = 4  # and _MIX_ID + 1 = 5: the mix's length stream


def _rng(seed: int, stream: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, SPLITS.index(split), index])


def _check_common(num_examples: int, seed: int, split: str) -> None:
    if isinstance(num_examples, bool) or not isinstance(num_examples, int) or num_examples < 0:
        raise ValueError(f"num_examples must be an integer >= 0, got {num_examples!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    check_split(split)


def generate(
    task: str,
    num_examples: int,
    lengths: Sequence[int] | int,
    encode: Callable[[str], list[int]],
    seed: int,
    split: str = "train",
    depth: float | None = None,
) -> list[TaskExample]:
    """``num_examples`` examples of ``task`` whose prompts are ``lengths`` tokens long.

    ``lengths``: one prompt length, or a sequence that example ``i`` takes ``lengths[i % len]``
    from. The prompt (context + question) is fitted to the length measured with ``encode``
    (within half a padding unit: ~3 tokens, ~8 for ``kv``); ``num_tokens`` counts the answer too.
    ``depth``: the queried needle's position in [0, 1]; ``None`` draws it uniformly per example.
    Raises ``ValueError`` for an unknown task or split, a bad depth, or a length too short for the
    task's fixed text.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {tuple(TASKS)}, got {task!r}")
    _check_common(num_examples, seed, split)
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1] or None, got {depth!r}")
    lengths_seq = [lengths] if isinstance(lengths, int) else list(lengths)
    if not lengths_seq or any(
        isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0 for n in lengths_seq
    ):
        raise ValueError(f"lengths must be a positive integer or a non-empty list of them, got {lengths!r}")
    out = []
    for i in range(num_examples):
        rng = _rng(seed, _TASK_IDS[task], split, i)
        d = float(rng.uniform(0.0, 1.0)) if depth is None else float(depth)
        out.append(TASKS[task](rng, task_length(lengths_seq, i), encode, split, d))
    return out


def sample_lengths(num_examples: int, rng: np.random.Generator, min_len: int = 128, max_len: int = 8192) -> np.ndarray:
    """Heavy-tailed prompt lengths, int64 ``(num_examples,)``: clipped log-normal (module doc)."""
    if not 0 < min_len <= max_len:
        raise ValueError(f"need 0 < min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if min_len == max_len:
        return np.full(num_examples, min_len, dtype=np.int64)
    span = math.log(max_len / min_len)
    draws = rng.lognormal(math.log(min_len) + 0.25 * span, span / 3.5, num_examples)
    return np.clip(np.rint(draws), min_len, max_len).astype(np.int64)


def synthetic_mix(
    num_examples: int,
    encode: Callable[[str], list[int]],
    seed: int,
    min_len: int = 128,
    max_len: int = 8192,
    tasks: Sequence[str] = ("passkey", "niah", "kv"),
    split: str = "train",
) -> list[TaskExample]:
    """A shuffled mix of ``tasks`` (uniform) with heavy-tailed lengths (:func:`sample_lengths`)
    and uniform needle depths. ``vt`` needs ``min_len`` of about 180 Qwen2 tokens.
    """
    _check_common(num_examples, seed, split)
    tasks = tuple(tasks)
    if not tasks or any(t not in TASKS for t in tasks):
        raise ValueError(f"tasks must be a non-empty subset of {tuple(TASKS)}, got {tasks!r}")
    lengths = sample_lengths(num_examples, _rng(seed, _MIX_ID + 1, split, 0), min_len, max_len)
    out = []
    for i in range(num_examples):
        rng = _rng(seed, _MIX_ID, split, i)
        task = tasks[int(rng.integers(len(tasks)))]
        depth = float(rng.uniform(0.0, 1.0))
        out.append(TASKS[task](rng, int(lengths[i]), encode, split, depth))
    return out
