"""Packing documents into one micro-batch (``data/packing.py``): labels stay inside documents,
positions restart per document, ``cu_seqlens`` offsets, loss weights."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from sparsebalance.data import pack
from sparsebalance.data.packing import IGNORE


def test_packing_labels_stay_inside_documents():
    batch = pack([torch.arange(3).numpy(), torch.arange(10, 12).numpy()])
    assert batch.labels.tolist() == [[1, 2, -100, 11, -100]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert batch.cu_seqlens.tolist() == [0, 3, 5]
    weighted = pack([torch.arange(3).numpy(), torch.arange(10, 12).numpy()], per_doc_weighting=True)
    assert weighted.loss_weights.tolist() == [[0.5, 0.5, 0.0, 1.0, 0.0]]


def test_shapes_dtypes_and_one_token_documents():
    docs = [np.array([5]), np.array([7, 8, 9, 10]), np.array([3])]
    batch = pack(docs)
    assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (1, 6)
    assert batch.input_ids.dtype == batch.labels.dtype == torch.int64
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens.tolist() == [0, 1, 5, 6]
    assert batch.loss_weights.dtype == torch.float32
    assert batch.input_ids.tolist() == [[5, 7, 8, 9, 10, 3]]
    assert batch.labels.tolist() == [[IGNORE, 8, 9, 10, IGNORE, IGNORE]]  # a 1-token doc: no label
    assert batch.position_ids.tolist() == [[0, 0, 1, 2, 3, 0]]
    assert batch.num_label_tokens == 3
    assert batch.loss_weights.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0, 0.0]]


def test_per_document_weighting_gives_every_document_equal_weight():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100, n) for n in (2, 17, 300)]
    w = pack(docs, per_doc_weighting=True).loss_weights[0]
    cu = np.cumsum([0, 2, 17, 300])
    for lo, hi in itertools.pairwise(cu):
        assert float(w[lo:hi].sum()) == pytest.approx(1.0)
        assert float(w[hi - 1]) == 0.0  # the last token predicts nothing
    plain = pack(docs).loss_weights[0]
    assert float(plain.sum()) == sum(n - 1 for n in (2, 17, 300))


def test_bad_packs_refused():
    with pytest.raises(ValueError, match="empty"):
        pack([])
    with pytest.raises(ValueError, match="at least one token"):
        pack([np.array([1, 2]), np.array([], dtype=np.int64)])
