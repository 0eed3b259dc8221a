"""The trainer's data position: global batches drawn from a corpus by the mixture sampler, what a
checkpoint records about the data, and the refusal to resume on different data.

:class:`BatchSource` turns the sampler's ``(component, local index)`` pairs into
:class:`~sparsebalance.workload.Sample` s with global document ids, counts the documents drawn
per component (the per-source counts in the metrics), and saves / restores the sampler's
position together with the data's identity (store content hashes, tokenizer, mixture weights,
length filter, compact vocabulary) so that a resumed run draws exactly the batches the
uninterrupted run would have drawn, or refuses with the differences named.
"""

from __future__ import annotations

import numpy as np

from ..workload import Sample
from .dataset import TokenizedCorpus
from .mixture import MixtureSampler


class BatchSource:
    """Seeded global batches of ``global_batch`` documents from ``corpus`` (same on every rank)."""

    def __init__(self, corpus: TokenizedCorpus, seed: int, global_batch: int) -> None:
        self.corpus = corpus
        self.lengths = corpus.lengths()
        self.sampler = MixtureSampler(corpus.pools(), corpus.weights, seed, global_batch, names=corpus.names)
        self.last_counts: dict[str, int] = {}

    def sample(self, index: int) -> Sample:
        """Document ``index`` (global id) as a :class:`Sample`; its length from the offsets."""
        return Sample(int(index), int(self.lengths[index]), self.corpus.sources[index])

    def next_batch(self) -> list[Sample]:
        pairs = self.sampler.next_batch()
        counts = np.bincount([c for c, _ in pairs], minlength=len(self.corpus.names))
        self.last_counts = dict(zip(self.corpus.names, counts.tolist(), strict=True))
        return [self.sample(self.corpus.global_id(c, j)) for c, j in pairs]

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def metrics(self) -> dict:
        """The last batch's documents per component and the totals drawn so far."""
        return {
            "documents": dict(self.last_counts),
            "drawn": dict(zip(self.corpus.names, self.sampler.drawn, strict=True)),
            "epochs": dict(zip(self.corpus.names, self.sampler.epochs, strict=True)),
        }

    def describe(self) -> dict:
        """Per component: store, documents, tokens, documents usable after the length filter and
        what the filter removed (``data.json`` in the run folder)."""
        c = self.corpus
        return {
            "identity": c.identity(),
            "components": [
                {
                    "name": src.name,
                    "store": src.store,
                    "weight": src.weight,
                    "documents": len(st),
                    "tokens": st.num_tokens,
                    "usable": len(pool),
                    "filtered": c.filtered[src.name],
                }
                for src, st, pool in zip(c.data_sources, c.stores, c.pools(), strict=True)
            ],
        }

    def state_dict(self) -> dict:
        return {
            "identity": {**self.corpus.identity(), "vocab_map_size": _map_size(self.corpus)},
            "sampler": self.sampler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; ``ValueError`` naming every difference when the checkpoint was
        made on other data (store contents, tokenizer, mixture, filter)."""
        check_same_data(state["identity"], self.state_dict()["identity"])
        self.sampler.load_state_dict(state["sampler"])


def _map_size(corpus: TokenizedCorpus) -> int | None:
    return None if corpus.vocab_map is None else len(corpus.vocab_map)


def check_same_data(saved: dict, current: dict) -> None:
    """Refuse (``ValueError``) when the checkpoint's data identity differs from this run's."""
    problems = []
    if saved.get("tokenizer") != current.get("tokenizer"):
        problems.append(f"tokenizer: checkpoint {saved.get('tokenizer')}, now {current.get('tokenizer')} (--tokenizer)")
    old, new = saved.get("components", []), current.get("components", [])
    if [c["name"] for c in old] != [c["name"] for c in new]:
        problems.append(f"--data components: checkpoint {[c['name'] for c in old]}, now {[c['name'] for c in new]}")
    else:
        for a, b in zip(old, new, strict=True):
            if a["content_hash"] != b["content_hash"]:
                problems.append(
                    f"--data {a['name']}: content changed (store hash {a['content_hash']} -> {b['content_hash']})"
                )
            if abs(a["weight"] - b["weight"]) > 1e-9:
                problems.append(f"--data {a['name']}: mixture weight {a['weight']} -> {b['weight']}")
    for key, flag in (("min_len", "--min-len"), ("max_len", "--max-len")):
        if saved.get(key) != current.get(key):
            problems.append(f"{flag}: checkpoint {saved.get(key)}, now {current.get(key)}")
    if saved.get("vocab_map_size") != current.get("vocab_map_size"):
        problems.append(
            f"compact vocabulary: checkpoint {saved.get('vocab_map_size')} ids, now "
            f"{current.get('vocab_map_size')} (another model vocabulary?)"
        )
    if problems:
        raise ValueError("--resume: the checkpoint was trained on other data: " + "; ".join(problems))
