"""The budget rules on the gate's scores of one batch of documents: which segment pairs a
budget keeps (top-k or gamma, anchors, floor, cap) and the estimated mass they cover.

Everything here is fixed-shape device work on ``(H_layout, n, s, s)`` scores: sorts, prefix
sums, comparisons; no read back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .budget import Budget


def _sort_rows(prob: torch.Tensor):
    """Per row: descending order, the mass ranked above each entry, each entry's rank."""
    sorted_p, order = torch.sort(prob, dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(-1) - sorted_p
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return before, rank, order


def _keep_by_mass(prob, allowed, anchors, budget: Budget, sorted_rows) -> torch.Tensor:
    """The gamma rule on ``prob (H, n, s, s)``: bool keep mask (anchors included)."""
    if budget.is_dense:
        return allowed.expand_as(prob)
    before, rank, order = sorted_rows
    n_allowed = allowed.sum(-1, keepdim=True)
    if budget.floor is not None:  # gamma = max(gamma, floor), on the device
        gamma = budget.floor.to(before.device, before.dtype).clamp(min=budget.gamma)
        keep_n = torch.where(gamma < 1.0, (before < gamma).sum(-1, keepdim=True), n_allowed)
    elif budget.gamma < 1.0:
        keep_n = (before < budget.gamma).sum(-1, keepdim=True)
    else:
        keep_n = n_allowed
    floor_n = torch.clamp(n_allowed, max=budget.min_blocks)
    keep = (rank < torch.maximum(keep_n, floor_n)) & allowed
    return _cap(keep, anchors & allowed, n_allowed, floor_n, budget, order)


def _top_k_rows(prob, allowed, anchors):
    """Per row, each non-anchor causal segment's rank by estimated mass (0 = highest; anchors
    and non-causal segments rank last) and the descending order."""
    candidate = allowed & ~anchors
    key = prob.masked_fill(~candidate, -1.0)  # masses are >= 0: non-candidates sort last
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return rank, order


def _keep_top_k(allowed, anchors, budget: Budget, rows) -> torch.Tensor:
    """The top-k rule: the anchors plus the ``top_k`` best non-anchor causal segments."""
    rank, order = rows
    anchors = anchors & allowed
    n_allowed = allowed.sum(-1, keepdim=True)
    floor_n = torch.clamp(n_allowed, max=budget.min_blocks)
    extra_n = torch.clamp(floor_n - anchors.sum(-1, keepdim=True), min=budget.top_k)
    if budget.floor is not None:  # k = max(top_k, floor), on the device
        extra_n = torch.maximum(extra_n, budget.floor.to(extra_n.device, extra_n.dtype))
    keep = (rank < extra_n) & allowed & ~anchors
    return _cap(keep | anchors, anchors, n_allowed, floor_n, budget, order)


def _cap(keep, anchors, n_allowed, floor_n, budget: Budget, order) -> torch.Tensor:
    """``max_density``: the cap counts every kept block, anchors included; the floors (anchors,
    ``min_blocks``) win. ``order``: the rows' preference order for what the cap keeps."""
    if budget.max_density is None:
        return keep | anchors
    limit = torch.maximum(torch.floor(n_allowed * budget.max_density + 1e-9).long(), floor_n)
    quota = (limit - anchors.sum(-1, keepdim=True)).clamp_min(0)
    extra = keep & ~anchors
    extra_sorted = extra.gather(-1, order).long()
    extra_rank = torch.empty_like(order).scatter_(-1, order, extra_sorted.cumsum(-1) - extra_sorted)
    return anchors | (extra & (extra_rank < quota))


@dataclass(frozen=True)
class DocumentBatch:
    """The segments of documents with similar segment counts, padded to ``s`` per document."""

    prob: torch.Tensor
    """``(H_layout, n, s, s)``: estimated mass of key segment j for query segment i of a document
    (rows sum to 1; padded rows are 0)."""
    allowed: torch.Tensor
    """bool ``(n, s, s)``: key segment j is causal for query segment i (j <= i, both real)."""
    seg_block: torch.Tensor
    """int64 ``(n, s)``: block of each segment (padding repeats the first)."""
    non_finite: torch.Tensor
    """bool ``(H_layout, n, s, 1)``: the row's estimate is NaN/inf (keeps every causal block)."""
    seg_tokens: torch.Tensor
    """float ``(n, s)``: tokens of each segment (0 for padding): a query row's weight."""
    docs: torch.Tensor
    """int64 ``(n,)``: the pack's index of each document of the batch."""
    pair_index: torch.Tensor
    """int64 ``(n, s, s)``: flat ``query block * nb + key block`` of each segment pair."""

    def anchors(self, budget: Budget) -> torch.Tensor:
        """Bool ``(n, s, s)``: the anchor segments (sink, local) of every query segment."""
        sb = self.seg_block
        return (sb - sb[:, :1] < budget.sink_blocks)[:, None, :] | (
            sb[:, :, None] - sb[:, None, :] < budget.local_blocks
        )

    def keep(self, budget: Budget, cache: dict) -> torch.Tensor:
        """Bool ``(H_layout, n, s, s)``: the kept segment pairs under ``budget``."""
        anchors = self.anchors(budget)
        if budget.top_k is not None:
            key = ("top-k", budget.sink_blocks, budget.local_blocks)
            if key not in cache:  # the ranking depends on the anchors only, not on k
                cache[key] = _top_k_rows(self.prob, self.allowed, anchors)
            keep = _keep_top_k(self.allowed, anchors, budget, cache[key])
        else:
            if "rows" not in cache and not budget.is_dense:
                cache["rows"] = _sort_rows(self.prob)  # shared by every later budget
            keep = _keep_by_mass(self.prob, self.allowed, anchors, budget, cache.get("rows"))
        return torch.where(self.non_finite, self.allowed, keep)

    def topk_covered(self, budget: Budget, cache: dict, ks: torch.Tensor | None = None) -> torch.Tensor:
        """float64 ``(n,)``: :meth:`covered` of the top-k rule without a cap, read off one sorted
        cumulative sum per row (cached per anchor setting): what any k keeps of a row is its
        anchors' mass plus its ``k`` largest other masses. With ``ks`` (int64 ``(K,)``): the
        same for every k at once, ``(K, n)``."""
        key = ("top-k coverage", budget.sink_blocks, budget.local_blocks)
        if key not in cache:
            anchors = self.anchors(budget) & self.allowed
            prob = torch.nan_to_num(self.prob.double(), nan=0.0)
            base = (prob * anchors).sum(-1)  # (H, n, s)
            cand = prob.masked_fill(~(self.allowed & ~anchors), 0.0)
            cums = torch.sort(cand, dim=-1, descending=True).values.cumsum(-1)  # (H, n, s, s)
            cums = torch.cat([torch.zeros_like(cums[..., :1]), cums], -1)
            cache[key] = (base, cums)
        base, cums = cache[key]
        if ks is None:
            k = min(int(budget.top_k), cums.shape[-1] - 1)
            mass = torch.where(self.non_finite[..., 0], 1.0, base + cums[..., k])
            return (mass * self.seg_tokens.double()[None]).sum((0, 2))
        kept = cums[..., ks.clamp(max=cums.shape[-1] - 1)]  # (H, n, s, K)
        mass = torch.where(self.non_finite, 1.0, base[..., None] + kept)
        return torch.einsum("hnsk,ns->kn", mass, self.seg_tokens.double())

    def gamma_covered(self, budget: Budget, cache: dict, gammas: torch.Tensor) -> torch.Tensor:
        """float64 ``(K,)``: :meth:`covered` of the gamma rule without a cap at every gamma of
        ``gammas`` (float64 ``(K,)``), summed over the batch's documents, in fixed-shape device
        work: per row the kept count is the sorted masses' exclusive prefix searched for gamma
        (at least ``min_blocks``), its mass the sorted prefix sum there plus the anchors' mass
        outside it (a second prefix sum of the anchors' masses in the same order)."""
        key = ("gamma coverage", budget.sink_blocks, budget.local_blocks)
        if key not in cache:
            if "rows" not in cache:
                cache["rows"] = _sort_rows(self.prob)
            before, _, order = cache["rows"]
            anchors = self.anchors(budget) & self.allowed
            prob = torch.nan_to_num(self.prob.double(), nan=0.0)
            anchor_mass = (prob * anchors).expand_as(prob)
            zero = prob.new_zeros(*prob.shape[:-1], 1)
            kept = torch.cat([zero, prob.gather(-1, order).cumsum(-1)], -1)  # (H, n, s, s + 1)
            anchors_in = torch.cat([zero, anchor_mass.gather(-1, order).cumsum(-1)], -1)
            floor_n = torch.clamp(self.allowed.sum(-1), max=budget.min_blocks)  # (n, s)
            cache[key] = (before.double().contiguous(), kept, anchors_in, anchor_mass.sum(-1), floor_n)
        before, kept, anchors_in, anchor_total, floor_n = cache[key]
        k = gammas.numel()
        count = torch.searchsorted(before, gammas.to(before.device).expand(*before.shape[:-1], k).contiguous())
        count = torch.maximum(count, floor_n[None, :, :, None])  # (H, n, s, K)
        mass = kept.gather(-1, count) + anchor_total[..., None] - anchors_in.gather(-1, count)
        mass = torch.where(self.non_finite, 1.0, mass)
        return torch.einsum("hnsk,ns->k", mass, self.seg_tokens.double())

    def covered(self, keep: torch.Tensor) -> torch.Tensor:
        """float64 ``(n,)``: per document, the estimated mass the kept pairs cover, summed over
        layout heads and query tokens (divide by heads x tokens for the mean coverage)."""
        mass = torch.nan_to_num((self.prob * keep).sum(-1), nan=1.0)  # (H, n, s)
        return (mass.double() * self.seg_tokens.double()[None]).sum((0, 2))
