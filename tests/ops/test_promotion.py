"""Documents promoted to the dense kernel (issue 36, item 4): a top-k document whose density
reaches the latency profile's crossover (``dense_from``) keeps every causal block and is marked
dense, whatever the gate says; covered documents stay as they were; a pack of promoted or
covered documents selects nothing. In a training run the profile's crossover reaches every
layer's context (the trainer and the integrations alike)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsebalance.ops import Budget, block_sparse_attention, select_blocks, topk_density
from sparsebalance.ops.pack_index import PackIndex
from tests.conftest import cu_from_lengths, make_qkv

LENGTHS = (1536, 320, 4992, 704)  # whole blocks: no block is shared by two documents
BLOCK = 64


def test_documents_from_the_crossover_keep_every_causal_block():
    cu = cu_from_lengths(LENGTHS)
    q, k, v = make_qkv(sum(LENGTHS), 4, 2, 16, requires_grad=False, seed=3)
    budget = Budget(top_k=4)
    density = topk_density(np.asarray(LENGTHS), 4, BLOCK, budget.anchor_blocks)
    crossover = float(np.sort(density)[1]) + 1e-9  # promotes the two densest but one
    pack = PackIndex.build(cu, BLOCK)
    plain = select_blocks(q, k, cu, budget, BLOCK, pack=pack)
    promoted = select_blocks(q, k, cu, budget, BLOCK, pack=pack, dense_from=crossover)
    want = tuple(bool(x) for x in density >= crossover)
    assert promoted.dense_docs == want and any(want) and not all(want)
    per_doc, before = promoted.document_density(), plain.document_density()
    covered = budget.dense_documents(pack)
    assert any(w and not c for w, c in zip(want, covered, strict=True))  # a real promotion
    for d, dense in enumerate(want):
        if dense:
            assert float(per_doc[d]) == 1.0
            assert covered[d] or float(before[d]) < 1.0
        else:  # the others are untouched by the promotion
            assert float(per_doc[d]) == float(before[d])
    # exact attention on the promoted documents, the budget's elsewhere
    ref = block_sparse_attention(q, k, v, promoted, cu, backend="reference")
    full = select_blocks(q, k, cu, Budget(gamma=1.0), BLOCK, pack=pack)
    exact = block_sparse_attention(q, k, v, full, cu, backend="reference")
    for d, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        if want[d]:
            torch.testing.assert_close(ref[s:e], exact[s:e])
    assert plain.density() < promoted.density() < 1.0


def test_a_pack_promoted_whole_selects_nothing(monkeypatch):
    from sparsebalance.ops import select as select_module

    monkeypatch.setattr(select_module, "estimate_block_mass", lambda *a, **k: pytest.fail("estimated"))
    cu = cu_from_lengths(LENGTHS)
    q, k, _ = make_qkv(sum(LENGTHS), 4, 2, 16, requires_grad=False)
    layout = select_blocks(q, k, cu, Budget(top_k=4), BLOCK, dense_from=0.01)
    assert all(layout.dense_docs) and layout.density() == 1.0


def test_gamma_budgets_are_never_promoted():
    pack = PackIndex.build(cu_from_lengths(LENGTHS), BLOCK)
    assert Budget(gamma=0.5).dense_documents(pack, dense_from=0.01) == (False,) * 4
    assert Budget(top_k=4, max_density=0.5).dense_documents(pack, dense_from=0.01) == (False,) * 4


@pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")
def test_a_training_run_promotes_from_its_profiles_crossover(tmp_path):
    import json

    from sparsebalance.engine.runtime import Runtime
    from sparsebalance.latency import analytic_profile
    from sparsebalance.models import load_shapes
    from sparsebalance.train import Trainer
    from sparsebalance.tuning import DSTConfig
    from tests.train.harness import base_config

    profile = analytic_profile(load_shapes("tiny"), "h100", block_size=32)
    profile.dense_from = 0.2  # as a CUDA profile would measure it
    path = tmp_path / "crossover.json"
    profile.save(path)
    dst = DSTConfig(mode="off", budget="top-k", budget_tokens=64)
    trainer = Trainer(base_config(tmp_path, steps=1, profile=str(path), dst=dst), Runtime(0, 1, torch.device("cpu")))
    assert trainer.engine.latency.profile.dense_from == 0.2
    result = trainer.run_step()
    lines = [mb for rec in result.records for mb in rec.microbatches]
    densities = np.asarray([x for mb in lines for layer in mb.layer_densities for x in layer])
    lengths = np.asarray([n for mb in lines for _ in mb.layer_densities for n in mb.lengths])
    expect = topk_density(lengths, 2, 32, 2) >= 0.2  # 64 tokens = 2 blocks of 32
    assert expect.any() and np.all(densities[expect] == 1.0)
    assert json.dumps(trainer.latency.profile.to_json())  # the crossover travels with the run
