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
        assert held_stages((1,) * (p * v), p, 0, range(1, 64)) >= held_stages((1,) * (p * v), p, 0, range(p, p + 1))


@pytest.mark.slow  # ~20 s: the claim HELD_LIMIT's docstring makes
def test_the_most_is_reached_by_128_micro_batches():
    from sparsebalance.batching.interleaved import HELD_LIMIT

    for p, v in [(4, 3), (6, 2), (6, 3), (8, 2), (8, 4)]:
        split = (1,) * (p * v)
        for s in (0, p // 2):
            assert held_stages(split, p, s, range(1, 301)) == held_stages(split, p, s)
        assert HELD_LIMIT == 128
