"""``TaskExample`` (one prompt/answer pair) and the length fitting every task shares.

A task draws all its random content first (keys, values, needle depths), then describes its prompt
as a function ``render(n)`` of one integer, the number of *units* of padding (haystack sentences,
or key-value pairs). :func:`fit_length` searches ``n`` so that the prompt, measured with the
caller's ``encode``, is as close as possible to the requested token count: the result is within
half a unit of it (a haystack sentence is 4-5 Qwen2 tokens, a key-value pair about 16).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from .vocab import FILLER_SENTENCES

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class TaskExample:
    """One synthetic (or LongBench) example: the model reads ``prompt`` and must produce ``answer``.

    ``prompt + answer`` is the full training text; the answer starts with the separating space,
    so with Qwen2's tokenizer ``encode(prompt) + encode(answer) == encode(prompt + answer)``.
    """

    task: str
    """Task name: ``"passkey"``, ``"niah"``, ``"vt"`` or ``"kv"``."""
    prompt: str
    """Context and question, ending right before the answer."""
    answer: str
    """The exact expected continuation (leading space included)."""
    num_tokens: int
    """Tokens of ``prompt + answer`` under the ``encode`` the example was generated with."""
    depth: float | None
    """Where the queried needle sits, as a fraction of the context in [0, 1] (None: no needle)."""
    split: str
    """``"train"`` or ``"eval"``: keys and values never cross splits."""

    @property
    def text(self) -> str:
        """``prompt + answer``: the document a trainer packs."""
        return self.prompt + self.answer

    def to_dict(self) -> dict:
        """JSON-ready fields."""
        return asdict(self)


def haystack(num_sentences: int, inserts: Sequence[tuple[float, str]] = ()) -> str:
    """``num_sentences`` noise sentences with each ``(depth, text)`` of ``inserts`` placed after
    ``round(depth * num_sentences)`` of them. Inserts at the same place keep their given order.
    """
    slots: dict[int, list[str]] = {}
    for depth, text in inserts:
        slots.setdefault(round(depth * num_sentences), []).append(text)
    parts: list[str] = []
    for i in range(num_sentences + 1):
        parts.extend(slots.get(i, ()))
        if i < num_sentences:
            parts.append(FILLER_SENTENCES[i % len(FILLER_SENTENCES)])
    return " ".join(parts)


def fit_length(
    render: Callable[[int], str], target: int, encode: Encode, task: str, max_iter: int = 8
) -> tuple[int, str, int]:
    """The ``n >= 0`` whose ``render(n)`` encodes closest to ``target`` tokens.

    Returns ``(n, text, num_tokens)``. Raises ``ValueError`` when even ``render(0)`` (the task's
    fixed text: instructions, needles, question) is longer than ``target``.
    """
    text0 = render(0)
    base = len(encode(text0))
    if base > target:
        raise ValueError(
            f"lengths: {target} tokens is too short for task {task!r}: its fixed text (needles, "
            f"instructions, question) alone is {base} tokens"
        )
    best = (0, text0, base)
    if base == target:
        return best
    # secant steps on the (nearly linear) tokens-per-unit slope, starting from a 5-token guess
    n, slope = max(1, round((target - base) / 5)), 5.0
    tried = {0}
    for _ in range(max_iter):
        text = render(n)
        length = len(encode(text))
        tried.add(n)
        if abs(length - target) < abs(best[2] - target):
            best = (n, text, length)
        if length == target:
            break
        slope = max((length - base) / n, 1e-3)
        nxt = max(0, n + round((target - length) / slope))
        if nxt in tried:  # oscillating between neighbours: also try the other side once
            nxt = n + (1 if length < target else -1)
            if nxt in tried or nxt < 0:
                break
        n = nxt
    return best


def task_length(lengths: Sequence[int] | int, index: int) -> int:
    """The requested prompt length of example ``index`` (``lengths`` cycles)."""
    if isinstance(lengths, int):
        return lengths
    return int(lengths[index % len(lengths)])


def finish_example(
    task: str,
    render: Callable[[int], str],
    length: int,
    encode: Encode,
    answer: str,
    depth: float | None,
    split: str,
) -> TaskExample:
    """Fit ``render`` to ``length`` tokens and wrap the result with its answer."""
    _, prompt, _ = fit_length(render, length, encode, task)
    return TaskExample(
        task=task,
        prompt=prompt,
        answer=answer,
        num_tokens=len(encode(prompt + answer)),
        depth=depth,
        split=split,
    )
