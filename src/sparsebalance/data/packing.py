"""Packing: documents -> one sequence with ``cu_seqlens``, per-document positions and labels."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..transfer import upload_many

IGNORE = -100


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # int64 (1, T)
    labels: torch.Tensor  # int64 (1, T): next token inside the document, IGNORE at its end
    position_ids: torch.Tensor  # int64 (1, T): restart at 0 for every document
    cu_seqlens: torch.Tensor  # int32 (N + 1,)
    loss_weights: torch.Tensor  # float32 (1, T): per-token weight (LongAlign-style option)
    lengths: tuple[int, ...] = ()  # the documents' lengths, on the host (cu_seqlens' diffs)

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())


def pack(docs: list[np.ndarray], device: torch.device | str = "cpu", per_doc_weighting: bool = False) -> PackedBatch:
    """Pack token arrays (each ``(L_i,)``, ``L_i >= 1``) into one micro-batch.

    ``per_doc_weighting`` (LongAlign): every document's tokens share the same total weight, so a
    long document does not drown short ones; off, every token weighs 1.
    """
    if not docs:
        raise ValueError("cannot pack an empty micro-batch")
    lengths = [len(d) for d in docs]
    if min(lengths) < 1:
        raise ValueError("documents must have at least one token")
    ids = np.concatenate(docs).astype(np.int64)
    labels = np.full_like(ids, IGNORE)
    weights = np.zeros(len(ids), dtype=np.float32)
    pos = np.concatenate([np.arange(n) for n in lengths])
    start = 0
    for n in lengths:
        labels[start : start + n - 1] = ids[start + 1 : start + n]
        if n > 1:
            weights[start : start + n - 1] = 1.0 / (n - 1) if per_doc_weighting else 1.0
        start += n
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    # one pinned, non-blocking copy on CUDA (the host does not wait for the device)
    ids_t, labels_t, pos_t, cu_t, weights_t = upload_many(
        [ids, labels, pos.astype(np.int64), cu, weights], torch.device(device)
    )
    return PackedBatch(ids_t[None], labels_t[None], pos_t[None], cu_t, weights_t[None], tuple(lengths))
