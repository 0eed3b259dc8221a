"""Measured gloo point-to-point links (two processes) and their round trip through a profile."""

from __future__ import annotations

import pytest

from sparsebalance.latency.context import Links, links_from_profile


@pytest.mark.distributed
def test_measure_p2p_gives_positive_links():
    from sparsebalance.latency.links import measure_p2p

    links = measure_p2p(sizes=(4096, 1 << 20), repeats=2)
    assert links.intra_bytes_per_s > 0 and links.inter_bytes_per_s == links.intra_bytes_per_s
    assert links.source == "measured gloo" and links.latency_s >= 0


def test_links_round_trip_through_profile_meta():
    class P:
        def __init__(self):
            self.meta = {"links": Links(1e9, 1e8, 4, 1e-5, "measured gloo").to_dict()}

    assert links_from_profile(P()) == Links(1e9, 1e8, 4, 1e-5, "measured gloo")
    assert links_from_profile(type("Q", (), {"meta": {}})()) is None
    with pytest.raises(ValueError, match="ranks_per_node"):
        Links(1e9, 1e9, 0)
    with pytest.raises(ValueError, match="sizes"):
        from sparsebalance.latency.links import measure_p2p

        measure_p2p(sizes=(8,))
