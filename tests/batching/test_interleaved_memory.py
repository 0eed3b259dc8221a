"""Issue 54: the activations an interleaved 1F1B rank keeps in flight (``held_stages``), which
``--capacity auto`` sizes micro-batches for with ``--pp-virtual``."""

from __future__ import annotations

import pytest

from sparsebalance.batching.interleaved import group_size, held_stages


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_one_chunk_is_plain_1f1b(p):
    for s in range(p):
        assert held_stages((2,) * p, p, s, range(1, 3 * p)) == p - s


@pytest.mark.parametrize("p, v", [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_equal_chunks_at_g_p_keep_megatrons_warm_up(p, v):
    """With M a multiple of P (G = P): rank s runs ``2 (P - s - 1) + (V - 1) P`` warm-up forwards,
    then one more before the first backward; rank 0 keeps ``P (1 + (P - 1) / (P V))`` stages."""
    m = 2 * p
    assert group_size(p, v, m) == p
    for s in range(p):
        chunks = 2 * (p - s - 1) + (v - 1) * p + 1
        assert held_stages((3,) * (p * v), p, s, range(m, m + 1)) == pytest.approx(chunks / v)
    assert held_stages((1,) * (p * v), p, 0, range(m, m + 1)) == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_uneven_chunks_weigh_their_layers():
    """Rank 0 of P = 2, V = 2 holds virtual stages 0 and 2; with 3 and 1 layers its forwards of
    chunk 0 weigh three times those of chunk 1."""
    split = (3, 2, 1, 2)  # rank 0: chunks of 3 and 1 layers (4 in all); rank 1: 2 and 2
    m = 2  # all four forwards run before a backward (warm-up min(2 (P - 1) + (V - 1) G, M V) = 4)
    assert held_stages(split, 2, 0, range(m, m + 1)) == pytest.approx((3 + 3 + 1 + 1) / 4)


def test_more_micro_batches_than_p_never_keep_less_than_p():
    for p, v in [(4, 3), (6, 2)]:
        at_p = held_stages((1,) * (p * v), p, 0, range(p, p + 1))
        for m in range(p + 1, 48):
            assert held_stages((1,) * (p * v), p, 0, range(m, m + 1)) >= at_p, m


def test_no_micro_batch_count_keeps_plain_1f1bs():
    assert held_stages((1, 1, 1, 1), 2, 0, range(0)) == 2.0


@pytest.mark.slow  # ~15 s: the deadlock sweep of 512 micro-batch counts
def test_the_default_range_finds_a_late_peak():
    """P = 7, V = 3 first keeps its most (11 2/3 stages) at M = 281, where the group G is 11: a
    range of 128 micro-batches found 11 (issue 54's review)."""
    from sparsebalance.batching.interleaved import HELD_LIMIT

    assert HELD_LIMIT >= 281 and group_size(7, 3, 281) == 11
    assert held_stages((1,) * 21, 7, 0, range(1, 129)) == pytest.approx(11.0)
    assert held_stages((1,) * 21, 7, 0) == pytest.approx(35 / 3)
