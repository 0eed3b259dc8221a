"""Weighted mixtures: ``--data a:0.7,b:0.3`` and the seeded sampler that draws global batches.

Each global batch draws a component for every slot (seeded by the batch number, with the mixture
weights as probabilities), then takes that many documents from each component's own seeded
per-epoch order. A component whose epoch has fewer documents left than the batch needs starts its
next epoch (the tail is dropped, so a batch never holds a document twice). The sampler's whole
state is a few integers (:meth:`MixtureSampler.state_dict`): a resumed run draws exactly the
batches the uninterrupted run would have drawn.

With one component the order is the plain seeded permutation per epoch, ``default_rng([seed,
epoch])``, as before mixtures existed.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

_MIX_STREAM = 0x6D6978  # separates the component draws from the per-epoch orders


def parse_mixture(spec: str, flag: str = "--data") -> list[tuple[str, float]]:
    """``"a:0.7,b:0.3"`` -> ``[("a", 0.7), ("b", 0.3)]`` (weights normalised to sum 1);
    ``"a"`` -> ``[("a", 1.0)]``. A spec that exists as a path is one path, commas and all."""
    if Path(spec).exists():
        return [(spec, 1.0)]
    parts = [p.strip() for p in spec.split(",")]
    if any(not p for p in parts):
        raise ValueError(f"{flag} {spec!r}: empty entry (expected PATH or PATH:WEIGHT,...)")
    out: list[tuple[str, float | None]] = []
    for part in parts:
        path, sep, w = part.rpartition(":")
        weight = None
        if sep:
            try:
                weight = float(w)
            except ValueError:
                path, weight = part, None  # a ':' inside the path
        out.append((path if weight is not None else part, weight))
    given = [w is not None for _, w in out]
    if len(out) > 1 and not all(given):
        raise ValueError(f"{flag} {spec!r}: give a weight to every entry (PATH:WEIGHT,...)")
    for path, w in out:
        if w is not None and (not math.isfinite(w) or w <= 0):
            raise ValueError(f"{flag} {spec!r}: weight of {path!r} must be > 0, got {w}")
    names = [p for p, _ in out]
    if len(set(names)) < len(names):
        raise ValueError(f"{flag} {spec!r}: an entry appears twice")
    total = sum(w or 1.0 for _, w in out)
    return [(p, (w or 1.0) / total) for p, w in out]


def epoch_permutation(seed: int, epoch: int, n: int, component: int, num_components: int):
    """The order of a component's documents in one epoch: int64 ``(n,)`` positions."""
    key = [seed, epoch] if num_components == 1 else [seed, epoch, component]
    return np.random.default_rng(key).permutation(n)


class MixtureSampler:
    """Draws global batches of ``(component, local document index)`` from weighted components.

    ``pools[c]``: int64 ``(n_c,)``, the usable documents of component ``c`` (after the length
    filter); every ``n_c`` must be at least ``global_batch``.
    """

    def __init__(
        self,
        pools: list[np.ndarray],
        weights: list[float],
        seed: int,
        global_batch: int,
        names: list[str] | None = None,
    ) -> None:
        if len(pools) != len(weights) or not pools:
            raise ValueError(f"{len(pools)} components but {len(weights)} weights")
        self.names = names or [str(i) for i in range(len(pools))]
        for name, pool in zip(self.names, pools, strict=True):
            if len(pool) < global_batch:
                raise ValueError(
                    f"--data {name}: {len(pool)} usable documents, fewer than --global-batch "
                    f"{global_batch} (after the --min-len / --max-len filter)"
                )
        w = np.asarray(weights, np.float64)
        self.pools = [np.asarray(p, np.int64) for p in pools]
        self.weights = w / w.sum()
        self.seed, self.global_batch = seed, global_batch
        self.batches = 0
        self.epochs = [0] * len(pools)
        self.cursors = [0] * len(pools)
        self.drawn = [0] * len(pools)  # documents drawn per component so far
        self._orders: dict[int, tuple[int, np.ndarray]] = {}

    def _order(self, c: int) -> np.ndarray:
        epoch = self.epochs[c]
        cached = self._orders.get(c)
        if cached is None or cached[0] != epoch:
            perm = epoch_permutation(self.seed, epoch, len(self.pools[c]), c, len(self.pools))
            cached = self._orders[c] = (epoch, self.pools[c][perm])
        return cached[1]

    def components_of(self, batch: int) -> np.ndarray:
        """The component of each slot of global batch number ``batch``: int64 ``(G,)``."""
        if len(self.pools) == 1:
            return np.zeros(self.global_batch, np.int64)
        rng = np.random.default_rng([self.seed, _MIX_STREAM, batch])
        return rng.choice(len(self.pools), self.global_batch, p=self.weights)

    def next_batch(self) -> list[tuple[int, int]]:
        """The next global batch: ``global_batch`` pairs ``(component, local index)``."""
        comps = self.components_of(self.batches)
        need = np.bincount(comps, minlength=len(self.pools))
        taken: dict[int, list[int]] = {}
        for c, k in enumerate(need.tolist()):
            if k == 0:
                continue
            if self.cursors[c] + k > len(self.pools[c]):
                self.epochs[c] += 1
                self.cursors[c] = 0
            a = self.cursors[c]
            taken[c] = self._order(c)[a : a + k].tolist()
            self.cursors[c] += k
            self.drawn[c] += k
        self.batches += 1
        pos = dict.fromkeys(taken, 0)
        out = []
        for c in comps.tolist():
            out.append((c, taken[c][pos[c]]))
            pos[c] += 1
        return out

    @property
    def epoch(self) -> int:
        """Epochs completed by the first component (the only one without a mixture)."""
        return self.epochs[0]

    def state_dict(self) -> dict:
        return {
            "batches": self.batches,
            "epochs": list(self.epochs),
            "cursors": list(self.cursors),
            "drawn": list(self.drawn),
            "weights": self.weights.tolist(),
            "sizes": [len(p) for p in self.pools],
            "seed": self.seed,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("sizes", "seed", "global_batch"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"--resume: the checkpoint's data sampler has {key} {state[key]}, this run "
                    f"{mine[key]}: the data, --seed or --global-batch differ"
                )
        if not np.allclose(state["weights"], mine["weights"]):
            raise ValueError(
                f"--resume: the checkpoint's mixture weights {state['weights']} differ from --data's {mine['weights']}"
            )
        self.batches = int(state["batches"])
        self.epochs = [int(e) for e in state["epochs"]]
        self.cursors = [int(c) for c in state["cursors"]]
        self.drawn = [int(d) for d in state["drawn"]]
