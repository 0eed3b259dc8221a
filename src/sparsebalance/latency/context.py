"""Cost of a document split over a context-parallel (CP) unit of k ranks.

A CP unit runs one document of L tokens (density d) on k ranks, each holding a *striped* shard of
L / k tokens (``sparsebalance.parallel.make_placement("striped", ...)``). Per rank, forward +
backward:

``t(L, d, k) = c0 + rest(L) / k + layers * (ring_fwd + ring_bwd + select)``

- ``c0``: the base model's fixed micro-batch overhead (every rank pays it once, in parallel);
- ``rest(L)``: the token-proportional part of the micro-batch (projections, MLP, head), ``/ k``;
- ring attention per layer: the rank's attention work ``a = attn(L, d) * imbalance / k`` runs in k
  ring steps of ``c = a / k`` each; a step's key/value transfer (the next shard, ``L / k`` tokens)
  overlaps the step's compute, so ``ring = c + (k - 1) max(c, x)``. The forward moves K and V
  (``x``), the backward K, V and their gradients (``2 x``); compute splits 1 : 2.5 between the
  two (the analytic profile's attention FLOP ratio, the backward recomputes the scores);
- hierarchical ring (``G`` ranks per node, ``O = k / G`` groups): the inner ring runs on the
  intra-node link, the outer transfer (inter-node link) overlaps a whole inner ring:
  ``ring = T_in + (O - 1) max(T_in, x_out)`` with ``T_in = c + (G - 1) max(c, x_in)``; a flat ring
  that spans nodes moves every step at the inter-node bandwidth;
- ``select``: the distributed selection's all-gather of pooled block means
  (``ceil(L / B) * Hq * D`` values per layer, ``(k - 1) / k`` of them received per rank);
- ``imbalance >= 1``: the striped placement's ring time over perfect balance. Default 1.04 flat
  and 1.11 hierarchical: the worst striped cases of ``benchmarks/results/2026-11-22-ring-balance-
  cpu.md`` (computed from ``ring_work`` on vertical-slash layouts), a calibrated constant; or
  :func:`sparsebalance.parallel.imbalance.estimate_ring_imbalance` on an estimated layout.

At k = 1, ``t`` is exactly ``base.predict_many([[L]], [[d]])`` (today's micro-batch cost).
Memory: a rank holds ``ceil(L / k)`` tokens, so ``k >= ceil(L / capacity)`` (:func:`min_degree`).

The crossover: with ``x`` fixed per token and ``c`` falling as ``1 / k^2``, communication is hidden
while ``attn(L, d) / k^2 >= kv_bytes(L / k) / bandwidth``, i.e. ``k <= attn(L, d) * bw /
(kv_bytes_per_token * L)``: sparser or shorter documents stop gaining at smaller k
(:meth:`ContextCost.crossover`).

Link bandwidths (:class:`Links`): analytic NVLink / InfiniBand per-GPU figures of
``latency.analytic.ACCELERATORS`` (:func:`analytic_links`), or a measured point-to-point figure
stored in a profile's ``meta["links"]`` (:func:`links_from_profile`, written by
:mod:`sparsebalance.latency.links`).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, replace

import numpy as np

from ..workload import CostModel, PreparedCost
from .analytic import ACCELERATORS
from .ring_calibration import RingCalibration, UnitTiming

RING_KINDS = ("auto", "flat", "hierarchical")
# Attention backward / forward time (FLOPs 2.5 : 1 in the analytic profile).
_FWD_SHARE = 1.0 / 3.5


@dataclass(frozen=True)
class Links:
    """Point-to-point link speeds seen by one rank (bytes per second, one direction)."""

    intra_bytes_per_s: float
    """Inside a node (NVLink, or a measured gloo P2P figure on one machine)."""
    inter_bytes_per_s: float
    """Across nodes (InfiniBand, per GPU)."""
    ranks_per_node: int
    """G: ranks sharing the fast link; a unit of k <= G contiguous ranks stays inside one node."""
    latency_s: float = 10e-6
    """Per-message latency."""
    source: str = "analytic"
    """Where the figures come from (``analytic <device>`` or ``measured gloo``)."""

    def __post_init__(self) -> None:
        if not (self.intra_bytes_per_s > 0 and self.inter_bytes_per_s > 0):
            raise ValueError("link bandwidths must be > 0")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")

    def to_dict(self) -> dict:
        return asdict(self)


def analytic_links(device: str) -> Links:
    """NVLink inside an 8-GPU node, InfiniBand across nodes, from :data:`ACCELERATORS`."""
    if device not in ACCELERATORS:
        raise ValueError(f"--analytic must be one of {sorted(ACCELERATORS)}, got {device!r}")
    acc = ACCELERATORS[device]
    return Links(acc.p2p_intra_bytes_per_s, acc.inter_node_bytes_per_s, acc.gpus_per_node, source=f"analytic {device}")


def links_from_profile(profile) -> Links | None:
    """The measured links stored in ``profile.meta["links"]`` (None when the profile has none)."""
    data = profile.meta.get("links")
    return None if not data else Links(**data)


def min_degree(lengths: np.ndarray, capacity: int | None) -> np.ndarray:
    """``(N,)`` smallest CP degree that fits each document in memory: ``ceil(L / capacity)``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if capacity is None:
        return np.ones_like(lengths)
    return -(-lengths // int(capacity))


def ring_kind(k: int, links: Links, ring: str = "auto") -> tuple[str, int]:
    """``(kind, inner size)`` of a unit of k contiguous, node-aligned ranks.

    ``auto``: ``none`` for k = 1, ``flat`` inside a node, ``hierarchical`` (inner = G) when k > G
    is a multiple of G, else ``flat`` across nodes. ``flat`` / ``hierarchical`` force the kind
    where it exists (hierarchical needs G < k, k % G == 0)."""
    g = links.ranks_per_node
    if k <= 1:
        return "none", 1
    can_hier = k > g and k % g == 0
    if ring == "flat" or (ring == "auto" and not can_hier):
        return "flat", k
    if ring == "hierarchical" and not can_hier:
        return "flat", k
    return "hierarchical", g


class ContextCost:
    """Per-rank seconds of CP units over a base :class:`~sparsebalance.workload.CostModel`.

    It is itself a ``CostModel`` (every protocol method is the base's), so any planner strategy
    and the tuner accept it; ``sab-cp`` also calls :meth:`table` / :meth:`unit_seconds`.

    Args:
        base: the per-device cost model (a ``LatencyModel``).
        links: link bandwidths.
        kv_bytes_per_token: one layer's K + V bytes per token (``2 * Hkv * D * elem_bytes``).
        query_bytes_per_block: one layer's pooled-query bytes per block (``Hq * D * elem_bytes``),
            what the selection all-gathers.
        block_size: B.
        imbalance_flat / imbalance_hier: striped ring time over perfect balance (>= 1).
        ring: ``auto``, ``flat`` or ``hierarchical`` (see :func:`ring_kind`).
        memory: a :class:`~sparsebalance.latency.memory_bound.MemoryBound` (``--capacity auto``): the
            memory model then sets each document's minimum degree (:meth:`min_degree`).
    """

    def __init__(
        self,
        base: CostModel,
        links: Links,
        kv_bytes_per_token: float,
        query_bytes_per_block: float,
        block_size: int,
        imbalance_flat: float = 1.04,
        imbalance_hier: float = 1.11,
        ring: str = "auto",
        memory=None,
    ) -> None:
        if ring not in RING_KINDS:
            raise ValueError(f"--ring must be one of {', '.join(RING_KINDS)}, got {ring!r}")
        if imbalance_flat < 1.0 or imbalance_hier < 1.0:
            raise ValueError("ring imbalance factors must be >= 1")
        if kv_bytes_per_token < 0 or query_bytes_per_block < 0 or block_size < 1:
            raise ValueError("kv/query bytes must be >= 0 and block_size >= 1")
        self.base, self.links = base, links
        self.kv_bytes_per_token = float(kv_bytes_per_token)
        self.query_bytes_per_block = float(query_bytes_per_block)
        self.block_size = int(block_size)
        self.imbalance = {"flat": float(imbalance_flat), "hierarchical": float(imbalance_hier)}
        self.ring = ring
        self.num_layers = base.num_layers
        self.compute_scale = 1.0
        """Measured / modelled compute of a CP shard (c0, rest / k and the ring's attention)."""
        self.comm_scale = 1.0
        """Measured / modelled transfer time (ring K/V steps and the selection all-gather)."""
        self.calibration = RingCalibration()
        """Online recalibration of ``compute_scale``, ``comm_scale`` and ``imbalance`` from
        measured CP units (:meth:`update`)."""
        self.memory = memory

    def min_degree(self, lengths: np.ndarray, capacity: int | None, max_degree: int) -> np.ndarray:
        """``(N,)`` smallest CP degree each document fits in memory with: ``ceil(L / capacity)``
        (:func:`min_degree`), and with a memory bound at least the memory model's minimum
        (``max_degree + 1`` where no degree up to ``max_degree`` fits)."""
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        k = min_degree(lengths, capacity)
        if self.memory is not None:
            # Documents within C fit whole (C is the bound's capacity); only longer ones can
            # need more than ceil(L / C).
            over = k > 1 if capacity is not None else np.ones(k.shape, dtype=bool)
            if over.any():
                k[over] = np.maximum(k[over], self.memory.min_degree(lengths[over], max_degree))
        return k

    @classmethod
    def for_shapes(cls, base: CostModel, shapes, links: Links, elem_bytes: int = 2, *, block_size: int, **kw):
        """From :class:`~sparsebalance.models.ModelShapes` (bf16 by default)."""
        kv = 2 * shapes.num_kv_heads * shapes.head_dim * elem_bytes
        q = shapes.num_heads * shapes.head_dim * elem_bytes
        return cls(base, links, kv, q, block_size, **kw)

    def on_nodes(self, ranks_per_node: int) -> ContextCost:
        """This cost on nodes of ``ranks_per_node`` ranks (the run's topology, ``G``): the same
        link speeds, base model and calibration (its current scales; the calibration object is
        shared); units of k <= G stay on the in-node link, wider ones cross nodes
        (:func:`ring_kind`)."""
        if ranks_per_node == self.links.ranks_per_node:
            return self
        out = copy.copy(self)
        out.links = replace(self.links, ranks_per_node=ranks_per_node)
        return out

    def describe(self) -> dict:
        return {
            "links": self.links.to_dict(),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "ring": self.ring,
            "imbalance": self.imbalance,
            "compute_scale": self.compute_scale,
            "comm_scale": self.comm_scale,
        }

    def ring_of(self, degree: int) -> tuple[str, int]:
        """``(kind, inner size)`` of this cost's ring for a unit of ``degree`` ranks."""
        return ring_kind(degree, self.links, self.ring)

    def update(self, timing: UnitTiming) -> dict:
        """Fold one measured CP unit into ``compute_scale``, ``imbalance`` and ``comm_scale``
        (:class:`~sparsebalance.latency.ring_calibration.RingCalibration`); returns the targets
        the measurement implied. Units of one rank are the base model's business."""
        return self.calibration.update(self, timing)

    def state_dict(self) -> dict:
        return self.calibration.state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        self.calibration.load_state_dict(self, state)

    def unit_seconds(
        self, lengths: np.ndarray, densities: np.ndarray, degrees: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per-rank seconds of single-document units and their exposed communication.

        Args:
            lengths: int ``(N,)`` document tokens; densities: ``(N,)`` in (0, 1];
            degrees: int ``(N,)`` CP degree k of each unit (>= 1).
        Returns:
            ``(seconds (N,), comm (N,))``: forward + backward seconds of every rank of the unit
            (the ring couples them: all finish together), and the part of it spent waiting for
            transfers and the selection all-gather (0 for k = 1).
        """
        lengths = np.asarray(lengths, dtype=np.float64).reshape(-1)
        dens = np.broadcast_to(np.asarray(densities, dtype=np.float64), lengths.shape)
        k = np.broadcast_to(np.asarray(degrees, dtype=np.int64), lengths.shape)
        if np.any(k < 1):
            raise ValueError("CP degrees must be >= 1")
        full = np.asarray(self.base.predict_many(lengths[:, None], dens[:, None]), np.float64)
        out, comm = full.copy(), np.zeros_like(full)
        split = k > 1
        if split.any():
            attn = self.base.layer_attention_seconds(lengths[split], dens[split])
            out[split], comm[split] = self._split(lengths[split], np.asarray(attn, np.float64), k[split], full[split])
        return out, comm

    def table(self, lengths: np.ndarray, densities: np.ndarray, degrees: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``unit_seconds`` of every document (``(N,)``) at every degree (``(K,)``): two
        ``(N, K)`` arrays; the base model is queried once per document."""
        lengths = np.asarray(lengths, dtype=np.float64).reshape(-1)
        dens = np.broadcast_to(np.asarray(densities, dtype=np.float64), lengths.shape)
        k = np.asarray(degrees, dtype=np.int64).reshape(-1)
        if np.any(k < 1):
            raise ValueError("CP degrees must be >= 1")
        full = np.asarray(self.base.predict_many(lengths[:, None], dens[:, None]), np.float64)
        attn = np.asarray(self.base.layer_attention_seconds(lengths, dens), np.float64)
        t, c = self._split(lengths[:, None], attn[:, None], k[None, :], full[:, None])
        one = k == 1
        t[:, one], c[:, one] = full[:, None], 0.0
        return t, c

    def _split(self, lengths, attn, k, full, comm_scale=None, imbalance=None):
        """Broadcastable ``lengths``, one layer's ``attn`` seconds, degrees ``k`` (>= 2 where
        used), the k = 1 time ``full`` -> (seconds, exposed comm) per rank. ``comm_scale`` /
        ``imbalance`` (broadcastable) replace the calibrated ones (the calibration's probes)."""
        layers = self.num_layers
        k = np.asarray(k)
        cs = self.compute_scale
        xs = self.comm_scale if comm_scale is None else np.asarray(comm_scale, np.float64)
        c0 = float(self.base.microbatch_overhead())
        rest = np.maximum(full - c0 - layers * attn, 0.0)
        uniq, inv = np.unique(k, return_inverse=True)
        kinds = [ring_kind(int(x), self.links, self.ring) for x in uniq.tolist()]
        hier = np.array([kd == "hierarchical" for kd, _ in kinds])[inv].reshape(k.shape)
        inner = np.array([g for _, g in kinds], dtype=np.float64)[inv].reshape(k.shape)
        kf = k.astype(np.float64)
        if imbalance is None:
            imb = np.where(hier, self.imbalance["hierarchical"], self.imbalance["flat"])
        else:
            imb = np.asarray(imbalance, np.float64)
        a = cs * attn * imb / kf  # one layer's attention per rank
        step = a / kf
        lk = self.links
        shard = self.kv_bytes_per_token * np.ceil(lengths / kf)
        spans = kf > lk.ranks_per_node
        bw_flat = np.where(spans, lk.inter_bytes_per_s, lk.intra_bytes_per_s)
        ring = 0.0
        for share, mult in ((_FWD_SHARE, 1.0), (1.0 - _FWD_SHARE, 2.0)):
            c = step * share
            x_flat = xs * (mult * shard / bw_flat + lk.latency_s)
            flat = c + (kf - 1) * np.maximum(c, x_flat)
            x_in = xs * (mult * shard / lk.intra_bytes_per_s + lk.latency_s)
            x_out = xs * (mult * shard / lk.inter_bytes_per_s + lk.latency_s)
            t_in = c + (inner - 1) * np.maximum(c, x_in)
            outer = np.maximum(kf / inner, 1.0)
            hier_t = t_in + (outer - 1) * np.maximum(t_in, x_out)
            ring = ring + np.where(hier, hier_t, flat)
        gathered = self.query_bytes_per_block * np.ceil(lengths / self.block_size)
        select = xs * ((kf - 1) / kf * gathered / bw_flat + np.log2(kf) * lk.latency_s)
        per_layer = ring + select
        seconds = cs * (c0 + rest / kf) + layers * per_layer
        return seconds, layers * (per_layer - a)

    def unit_terms(self, length: int, density: float, degree: int) -> tuple[float, float]:
        """``(fixed, attention)`` per-rank seconds of one document on ``degree`` ranks as
        modelled at ``compute_scale`` 1 and perfect balance: ``c0 + rest(L) / k`` and
        ``layers * attn(L, d) / k`` (what the calibration compares measured compute with)."""
        lengths, dens = np.array([float(length)]), np.array([float(density)])
        full = float(np.asarray(self.base.predict_many(lengths[:, None], dens[:, None]))[0])
        attn = float(np.asarray(self.base.layer_attention_seconds(lengths, dens))[0])
        c0 = float(self.base.microbatch_overhead())
        layers = self.num_layers
        rest = max(full - c0 - layers * attn, 0.0)
        return c0 + rest / degree, layers * attn / degree

    def probe(
        self, length: int, density: float, degree: int, comm_scales: np.ndarray, imbalance: float | None = None
    ) -> np.ndarray:
        """``(S,)`` per-rank seconds of one document on ``degree`` >= 2 ranks at each of
        ``comm_scales`` (``(S,)``), the other terms as calibrated (``imbalance`` replaces the
        ring kind's factor when given)."""
        lengths, dens = np.array([float(length)]), np.array([float(density)])
        full = np.asarray(self.base.predict_many(lengths[:, None], dens[:, None]), np.float64)
        attn = np.asarray(self.base.layer_attention_seconds(lengths, dens), np.float64)
        xs = np.asarray(comm_scales, np.float64)
        k = np.full(xs.shape, int(degree))
        seconds, _ = self._split(lengths, attn, k, full, comm_scale=xs, imbalance=imbalance)
        return seconds

    # ------------------------------------------------------------------ CostModel (the base's)
    def predict(self, lengths, densities) -> float:
        return float(self.base.predict(lengths, densities))

    def predict_many(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        return self.base.predict_many(lengths, densities)

    def doc_seconds(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        return self.base.doc_seconds(lengths, densities)

    def microbatch_overhead(self) -> float:
        return float(self.base.microbatch_overhead())

    def layer_attention_seconds(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        return self.base.layer_attention_seconds(lengths, densities)

    def layer_other_seconds(self, num_tokens: int) -> float:
        return float(self.base.layer_other_seconds(num_tokens))

    def prepare(self, lengths: np.ndarray) -> PreparedCost | None:
        # The base's (DST's bisection), so wrapping a LatencyModel costs no speed.
        return self.base.prepare(lengths)

    def crossover(self, length: int, density: float, max_degree: int) -> int:
        """The k in ``1..max_degree`` with the lowest per-rank time for this document: beyond it
        communication (or the fixed overhead) dominates and more ranks stop helping."""
        ks = np.arange(1, max(1, int(max_degree)) + 1)
        t, _ = self.unit_seconds(np.full(ks.size, length), np.full(ks.size, density), ks)
        return int(ks[int(np.argmin(t))])


def context_cost(model, accelerator: str = "h100", shapes=None, **kwargs) -> ContextCost:
    """A :class:`ContextCost` over a ``LatencyModel``: links measured in its profile
    (``meta["links"]``) or the analytic ones of ``accelerator``; K/V sizes from ``shapes`` or the
    profile's fingerprint; element size from its dtype (4 bytes for fp32, else 2)."""
    from ..models import ModelShapes

    fp = model.profile.fingerprint
    links = links_from_profile(model.profile) or analytic_links(accelerator)
    if shapes is None:
        if not isinstance(fp.get("shapes"), dict):
            raise ValueError("context_cost: the profile has no model shapes; pass shapes=")
        shapes = ModelShapes(name="profile", **fp["shapes"])
    elem = 4 if fp.get("dtype") == "fp32" else 2
    kwargs.setdefault("block_size", int(fp.get("block_size", 128)))
    return ContextCost.for_shapes(model, shapes, links, elem_bytes=elem, **kwargs)
