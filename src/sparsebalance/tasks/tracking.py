"""Variable tracking (RULER's ``vt``): follow a chain of assignments through a noise haystack.

``VAR X1234 = 56789.`` starts a chain, ``VAR X2345 = VAR X1234.`` continues it, for
:data:`VT_NUM_HOPS` hops; a second, distractor chain carries another value. The question names the
value; the answer is every variable of its chain in assignment order, space-separated
(`` X1234 X2345 X3456 X4567``). The chain's first statement sits at ``depth``, the rest at sorted
random depths after it; the distractor chain is spread over the whole context.
"""

from __future__ import annotations

import numpy as np

from .example import Encode, TaskExample, finish_example, haystack
from .vocab import draw_distinct, draw_number

VT_NUM_HOPS = 3
"""Assignments after the first in each chain (so a chain has ``VT_NUM_HOPS + 1`` variables)."""
VT_NUM_CHAINS = 2
"""The queried chain plus one distractor chain."""

VT_PREFIX = "Memorize and track the chain of variable assignments hidden in the following text.\n\n"


def make_vt(rng: np.random.Generator, length: int, encode: Encode, split: str, depth: float) -> TaskExample:
    """A variable-tracking example (see module docstring); needs about 180 Qwen2 tokens."""
    size = VT_NUM_HOPS + 1
    names = draw_distinct(lambda: "X" + draw_number(rng, 4, split), size * VT_NUM_CHAINS, set())
    values = draw_distinct(lambda: draw_number(rng, 5, split), VT_NUM_CHAINS, set())
    inserts: list[tuple[float, str]] = []
    for c in range(VT_NUM_CHAINS):
        chain = names[c * size : (c + 1) * size]
        if c == 0:
            rest = np.sort(rng.uniform(depth, 1.0, VT_NUM_HOPS))
            where = [depth, *(float(d) for d in rest)]
        else:
            where = [float(d) for d in np.sort(rng.uniform(0.0, 1.0, size))]
        statements = [f"VAR {chain[0]} = {values[c]}."]
        statements += [f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, size)]
        inserts.extend(zip(where, statements, strict=True))
    # a stable sort keeps each chain in order where two statements share a slot
    inserts.sort(key=lambda item: item[0])
    question = (
        f"\n\nQuestion: Find all variables that are assigned the value {values[0]} in the text "
        f"above. Answer: According to the chain of variable assignments in the text above, "
        f"{size} variables are assigned the value {values[0]}, they are:"
    )

    def render(n: int) -> str:
        return VT_PREFIX + haystack(n, inserts) + question

    answer = " " + " ".join(names[:size])
    return finish_example("vt", render, length, encode, answer, depth, split)
