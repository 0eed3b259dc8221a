"""Whether a model's lm-head is its embedding is read from the weights (no config probe): a
transformers 5 config of the family may leave ``tie_word_embeddings`` out."""

from __future__ import annotations

import torch

from sparsebalance.models.head import tied_head
from sparsebalance.models.hf import build_model


def test_the_weights_say_whether_the_head_is_tied():
    model = build_model("tiny", "cpu", torch.float32, seed=0)  # tie_word_embeddings: true
    assert tied_head(model)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied
    assert not tied_head(model)
