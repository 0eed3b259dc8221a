"""A CP unit's shard of a pack (labels shifted globally, global positions, inert padding), the
pass schedule that keeps a unit's ranks in the same pass, and the plan-agreement check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsebalance.batching import Unit
from sparsebalance.data.packing import IGNORE, pack
from sparsebalance.engine.cp_unit import pass_schedule, shard_batch, unit_batch
from sparsebalance.engine.engine import check_plan_agreement
from sparsebalance.parallel import make_placement

BLOCK = 16


def _docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 1000, n) for n in lengths]


@pytest.mark.parametrize("lengths,k", [((203,), 3), ((50, 1, 79, 73), 4), ((33,), 2)])
def test_shards_partition_the_pack_with_global_labels_and_positions(lengths, k):
    docs = _docs(lengths)
    whole = pack(docs, per_doc_weighting=True)
    total = sum(lengths)
    placement = make_placement("striped", total, BLOCK, k)
    seen = torch.zeros(total, dtype=torch.long)
    weight = 0.0
    for pos in range(k):
        part = shard_batch(whole, placement, pos)
        idx = placement.token_index(pos)
        real = idx < total
        assert part.input_ids.shape == (1, placement.local_len)
        assert torch.equal(part.cu_seqlens, whole.cu_seqlens)  # the global pack's
        for name in ("input_ids", "labels", "position_ids", "loss_weights"):
            got, want = getattr(part, name)[0], getattr(whole, name)[0]
            assert torch.equal(got[real], want[idx[real]]), name
        # padding: no label, no weight
        assert bool((part.labels[0][~real] == IGNORE).all())
        assert bool((part.loss_weights[0][~real] == 0).all())
        seen[idx[real]] += 1
        weight += float(part.loss_weights.sum())
    assert bool((seen == 1).all())  # every token on exactly one rank
    assert weight == pytest.approx(float(whole.loss_weights.sum()), rel=1e-6)


def test_a_label_lives_on_the_next_ranks_shard():
    """Token 15 is the last of block 0 (rank 0); its label is token 16, held by rank 1."""
    docs = _docs((100,))
    whole = pack(docs)
    placement = make_placement("striped", 100, BLOCK, 2)
    part0 = shard_batch(whole, placement, 0)
    part1 = shard_batch(whole, placement, 1)
    assert int(part0.labels[0, BLOCK - 1]) == int(docs[0][BLOCK])
    assert int(part1.input_ids[0, 0]) == int(docs[0][BLOCK])
    assert int(part1.position_ids[0, 0]) == BLOCK  # global position, not 0
    # the document's last token has no label, wherever it lies
    last = 99 // BLOCK % 2
    shard = (part0, part1)[last]
    idx = placement.token_index(last)
    assert int(shard.labels[0, int((idx == 99).nonzero())]) == IGNORE


def test_unit_batch_refuses_a_rank_outside_the_unit():
    unit = Unit(0, (1, 2), "striped", "flat", 2, (0,), (0,), (40,), (0.5,), 1.0)
    with pytest.raises(ValueError, match="rank 0 is not in the unit"):
        unit_batch(unit, 0, _docs((40,)), BLOCK, torch.device("cpu"))
    batch, ring = unit_batch(unit, 2, _docs((40,)), BLOCK, torch.device("cpu"))
    assert ring.group.ranks == (1, 2) and ring.placement.world_size == 2
    assert batch.input_ids.shape[1] == ring.placement.local_len


def _unit(slot, ranks):
    k = len(ranks)
    kind = ("striped", "flat") if k > 1 else ("whole", "none")
    return Unit(slot, tuple(ranks), kind[0], kind[1], k, (slot,), (0,), (10,), (0.5,), 1.0)


def test_pass_schedule_aligns_each_unit_on_its_ranks():
    # unit 0 on ranks 0-2, unit 1 on ranks 2-3: rank 3 waits one round (a gap) for rank 2
    units = [_unit(0, (0, 1, 2)), _unit(1, (2, 3)), _unit(2, (0,)), _unit(3, (1,)), _unit(4, (1,)), _unit(5, (3,))]
    rank_units = [(0, 2), (0, 3, 4), (0, 1), (1, 5)]
    rounds = pass_schedule(units, rank_units)
    assert rounds == ((0, 2, None), (0, 3, 4), (0, 1, None), (None, 1, 5))
    for u, unit in enumerate(units):
        at = {row.index(u) for r, row in enumerate(rounds) if r in unit.ranks}
        assert len(at) == 1, f"unit {u} runs at rounds {at}"


def test_pass_schedule_without_cp_units_is_the_plan_order():
    units = [_unit(i, (r,)) for i, r in enumerate((0, 0, 1, 2, 2, 2))]
    rounds = pass_schedule(units, [(0, 1), (2,), (3, 4, 5)])
    assert rounds == ((0, 1, None), (2, None, None), (3, 4, 5))


class _Plan:
    units = (_unit(0, (0, 1, 2)), _unit(1, (3,)))


def test_plan_disagreement_names_the_ranks_and_their_units():
    check_plan_agreement(["a", "a", "a", "a"], _Plan())
    with pytest.raises(RuntimeError, match=r"ranks \[2\] derived a different plan.*unit 0 \(ranks"):
        check_plan_agreement(["a", "a", "b", "a"], _Plan())
